"""The one place sockets are made: the broker's ROUTER, stages' DEALERs, payload servers and
their fetch sockets, and CURVE keys.

Binding beyond loopback requires CURVE: the broker loads `broker.key_secret` from the key folder
and admits only clients whose public key is in `authorized_clients/`; clients load
`client.key_secret` and the broker's public key from the same folder. `stream-rlhf keys DIR`
writes such a folder. A job across hosts (`JobPlan.spans_hosts`) has its driver generate the keys
(`CurveKeys.generate`), hand them to each rank in its arguments, and each rank writes them to a
private folder of its own on its host (`private_key_dir`). Payload servers are CURVE servers with
the broker's key pair and admit the same clients: a rank holds both key pairs.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from stream_rlhf.broker.control.topology import needs_curve
from stream_rlhf.config import ConfigError

ENVELOPE_BYTES = 256
"""What CURVE adds to a frame on the wire (33 bytes today), with room to spare."""
KEY_FILES = ("broker.key", "broker.key_secret", "client.key", "client.key_secret")
"""The files of a key folder, besides authorized_clients/ (the client's public key there)."""


def generate_keys(key_dir: str | Path) -> Path:
    """Write broker and client key pairs; the client's public key is authorized."""
    key_dir = Path(key_dir)
    authorized = key_dir / "authorized_clients"
    authorized.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(key_dir, "broker")
    public, _ = zmq.auth.create_certificates(key_dir, "client")
    shutil.copy(public, authorized / "client.key")
    return key_dir


@dataclass(frozen=True)
class CurveKeys:
    """A key folder's files in memory (what the driver hands to the ranks of a job across hosts).
    Never printed: the secrets stay out of repr, logs and plan.json."""

    files: dict[str, bytes] = field(repr=False)
    """File name (`KEY_FILES`) -> its content, as `generate_keys` wrote it."""

    @classmethod
    def generate(cls) -> CurveKeys:
        """Fresh broker and client key pairs (`generate_keys` in a folder removed at once)."""
        with tempfile.TemporaryDirectory(prefix="srlhf-keys-") as folder:
            return cls.read(generate_keys(folder))

    @classmethod
    def read(cls, key_dir: str | Path) -> CurveKeys:
        """The keys of a folder `stream-rlhf keys` wrote (a missing file is named)."""
        files = {}
        for name in KEY_FILES:
            path = Path(key_dir) / name
            if not path.is_file():
                raise CurveKeyError(f"{path} not found (create keys with `stream-rlhf keys {key_dir}`)")
            files[name] = path.read_bytes()
        return cls(files)

    def write(self, key_dir: str | Path) -> Path:
        """The folder layout `generate_keys` writes, readable by this user only."""
        key_dir = Path(key_dir)
        (key_dir / "authorized_clients").mkdir(parents=True, exist_ok=True, mode=0o700)
        key_dir.chmod(0o700)
        for name, content in self.files.items():
            (key_dir / name).write_bytes(content)
        (key_dir / "authorized_clients" / "client.key").write_bytes(self.files["client.key"])
        return key_dir


@contextmanager
def private_key_dir(keys: CurveKeys | None) -> Iterator[str | None]:
    """A key folder of this process's own for `keys` (None: None), removed on exit."""
    if keys is None:
        yield None
        return
    folder = tempfile.mkdtemp(prefix="srlhf-keys-")
    try:
        yield str(keys.write(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _load(path: Path, what: str) -> tuple[bytes, bytes | None]:
    if not path.exists():
        raise CurveKeyError(f"{what}: {path} not found (create keys with `stream-rlhf keys {path.parent}`)")
    return zmq.auth.load_certificate(path)


class CurveKeyError(ConfigError):
    """A CURVE key file is missing or unreadable; the message names the file. A config error:
    the command line says it in one line (exit 2), without a traceback."""


def interface_towards(address: str) -> str:
    """This host's IP address on the route to `address`'s host ("127.0.0.1" for loopback, ipc and
    inproc, or a folder): where a stage binds its payload server so that the broker's other clients
    reach it, and a weight sender its group's store."""
    parsed = urlparse(address)
    if parsed.scheme != "tcp" or not needs_curve(address):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((parsed.hostname or "", parsed.port or 9))  # UDP: nothing is sent
            return probe.getsockname()[0]
    except OSError as exc:
        raise ConfigError(f"{address}: no route to its host from here ({exc})") from None


def curve_server(context: zmq.Context, sock: zmq.Socket, address: str, key_dir: str | None,
                 what: str) -> ThreadAuthenticator | None:
    """Make `sock` a CURVE server with the broker's key pair admitting the authorized clients (the
    caller stops the returned authenticator after closing it); without keys, refuse an `address`
    beyond loopback. The socket is closed when this raises."""
    if not key_dir:
        if needs_curve(address):
            sock.close()
            raise CurveKeyError(f"{what} address {address} is not loopback: CURVE keys are required")
        return None
    try:
        public, secret = _load(Path(key_dir) / "broker.key_secret", "broker secret key")
    except CurveKeyError:
        sock.close()
        raise
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve(domain="*", location=str(Path(key_dir) / "authorized_clients"))
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    return auth


def curve_client(sock: zmq.Socket, address: str, key_dir: str | None, what: str) -> None:
    """Make `sock` a CURVE client of a server with the broker's key pair; without keys, refuse an
    `address` beyond loopback. The socket is closed when this raises."""
    if key_dir:
        try:
            public, secret = _load(Path(key_dir) / "client.key_secret", "client secret key")
            server_public, _ = _load(Path(key_dir) / "broker.key", "broker public key")
        except CurveKeyError:
            sock.close()
            raise
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = server_public
    elif needs_curve(address):
        sock.close()
        raise CurveKeyError(f"{what} address {address} is not loopback: CURVE keys are required")


def router(context: zmq.Context, address: str, key_dir: str | None,
           max_message_bytes: int) -> tuple[zmq.Socket, ThreadAuthenticator | None]:
    """Bind the broker's ROUTER. Non-loopback addresses without keys are refused."""
    sock = context.socket(zmq.ROUTER)
    sock.linger = 0
    sock.router_handover = 1  # a reconnecting instance with the same id takes over its route
    # libzmq closes the connection of a peer whose frame is over this, without reading it; the
    # broker counts those (connwatch.py). It checks the frame on the wire, which CURVE makes a
    # few bytes longer; a frame within that allowance is rejected (with a reason) by the broker.
    sock.maxmsgsize = max_message_bytes + ENVELOPE_BYTES
    auth = curve_server(context, sock, address, key_dir, "broker")
    sock.bind(address)
    return sock, auth


def dealer(context: zmq.Context, address: str, identity: str, key_dir: str | None) -> zmq.Socket:
    """A stage's (or control client's) DEALER to the broker, routed by its instance id."""
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = 5000  # a send with no connection at all fails (zmq.Again) instead of hanging
    sock.routing_id = identity.encode()
    curve_client(sock, address, key_dir, "broker")
    sock.connect(address)
    return sock
