"""Where a weight-sync group's sender announces its store's address and its receivers look it up:
a folder on one host, or a key-value store that ranks on every host reach.

    publish(book, "rollout-0", "10.0.0.5:41234")   # the sender, once its group's store listens
    address, token = lookup(book, "rollout-0", timeout_s)               # each receiver rank
    address, token = lookup(book, "rollout-0", timeout_s, after=token)  # a newer opening of the group
    forget(book, "rollout-0")                       # the sender, when it stops
    host = sender_host(book)                        # the interface the sender binds

`book` is a folder (`<weights root>/groups`: `group.publish_address` files, one host's /dev/shm), or
`tcp://HOST:PORT`: a `TCPStore` that `host_book` serves (the Ray launcher's broker actor, on the
broker's node, when a plan spans hosts), each address under the key `address/<group>`. The
launcher hands the store's address to every rank (`BOOK_ENV`); the sender then binds its
interface on the route to that node instead of 127.0.0.1. `tcp:/HOST:PORT` (what a Path makes of
it) is the same book. Each publish carries a new token (`group.Announcement`), so a restarted
receiver can wait for the group's next opening (`broadcast.py`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from stream_rlhf.broker.sockets import interface_towards
from stream_rlhf.weights.group import (
    Announcement,
    WeightSyncTimeout,
    address_file,
    new_token,
    publish_address,
    wait_for_announcement,
    wait_for_keys,
)

BOOK_ENV = "STREAM_RLHF_WEIGHT_BOOK"
"""Set by the launcher for a rank when its weight-sync groups meet through a store (`tcp://HOST:PORT`)."""
SCHEME = "tcp:"


def launcher_book() -> str | None:
    """The store the launcher named for this rank's groups (`BOOK_ENV`); None on one host."""
    return os.environ.get(BOOK_ENV) or None


def book_of(folder: Path) -> Path | str:
    """The book a rank's groups use: the launcher's store when it named one, else `folder`."""
    return launcher_book() or folder


def _store_address(book: Path | str) -> tuple[str, int] | None:
    text = str(book)
    if not text.startswith(SCHEME):
        return None
    host, _, port = text[len(SCHEME):].lstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"weight-sync address book {text!r}: expected tcp://HOST:PORT")
    return host.strip("[]"), int(port)


def _client(where: tuple[str, int], timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(where[0], where[1], is_master=False, timeout=timedelta(seconds=timeout_s))


def publish(book: Path | str, name: str, address: str) -> None:
    where = _store_address(book)
    if where is None:
        publish_address(Path(book), name, address)
    else:
        _client(where, 60.0).set(f"address/{name}", json.dumps({"address": address, "token": new_token()}))


def lookup(book: Path | str, name: str, timeout_s: float, after: str | None = None) -> Announcement:
    """Group `name`'s address and token once its sender published them (a token other than
    `after`, when given); WeightSyncTimeout after `timeout_s`."""
    where = _store_address(book)
    if where is None:
        return wait_for_announcement(Path(book), name, timeout_s, after)
    store = _client(where, timeout_s)
    deadline = time.monotonic() + timeout_s
    what = (f"weight-sync group {name!r}: its {'new ' if after else ''}address never appeared in the store at {book} "
            f"within {timeout_s}s (is the trainer's sender running?)")
    while True:
        wait_for_keys(store, [f"address/{name}"], what, deadline)
        record = json.loads(store.get(f"address/{name}"))
        if record["token"] != after:
            return Announcement(record["address"], record["token"])
        if time.monotonic() >= deadline:
            raise WeightSyncTimeout(what)
        time.sleep(0.02)


def forget(book: Path | str, name: str) -> None:
    where = _store_address(book)
    if where is None:
        address_file(Path(book), name).unlink(missing_ok=True)
        return
    try:
        _client(where, 5.0).delete_key(f"address/{name}")
    except (RuntimeError, dist.DistError):  # the job's store is gone: nothing left to forget
        pass


def sender_host(book: Path | str) -> str:
    """The interface a sender binds: on the route to the store's host, or 127.0.0.1 for a folder."""
    return interface_towards(str(book))


def host_book(host: str) -> tuple[dist.TCPStore, str]:
    """Serve a book on `host` (any free port, that interface only); keep the store object alive as
    long as the job runs. Returns it and the book's address."""
    listener = socket.create_server((host, 0), backlog=128)
    port = listener.getsockname()[1]
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach())
    return store, f"tcp://{host}:{port}"
