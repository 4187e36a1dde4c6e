"""Append-only journal of handles in flight, so a restarted broker recovers its state.

Records (MessagePack, length-prefixed):
    Published(handle, pending)   a handle entered the broker; `pending` lists the consumer
                                 stages and joins that must still acknowledge it
    Acked(handle_id, consumer)   one of those consumers is done with it

Replaying gives every handle that some consumer still owes an acknowledgement, with the consumers
that owe it. In-flight deliveries are not journaled: after a restart they are delivered again
(at-least-once; consumers and the broker deduplicate by handle id). A torn last record (crash
mid-write) is ignored. The file is compacted (rewritten with only live handles) at open and
whenever it has grown past `compact_every` records.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import msgspec

from stream_rlhf.broker.control.messages import Handle

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")


class Published(msgspec.Struct, tag="P", frozen=True):
    handle: Handle
    pending: list[str]


class Acked(msgspec.Struct, tag="A", frozen=True):
    handle_id: str
    consumer: str


Record = Published | Acked
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


class Journal:
    def __init__(self, path: str | Path, fsync: bool = False, compact_every: int = 50_000):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.compact_every = compact_every
        self.live: dict[str, tuple[Handle, list[str]]] = self._replay()
        self._records = 0
        self._file = None
        self._rewrite()

    def _replay(self) -> dict[str, tuple[Handle, list[str]]]:
        live: dict[str, tuple[Handle, list[str]]] = {}
        if not self.path.exists():
            return live
        data = self.path.read_bytes()
        pos = 0
        while pos + _LENGTH.size <= len(data):
            (length,) = _LENGTH.unpack_from(data, pos)
            body = data[pos + _LENGTH.size : pos + _LENGTH.size + length]
            if len(body) < length:
                log.warning("journal %s: torn last record at byte %d ignored", self.path, pos)
                break
            pos += _LENGTH.size + length
            try:
                record = _decoder.decode(body)
            except (msgspec.MsgspecError, ValueError) as exc:
                log.warning("journal %s: unreadable record at byte %d ignored: %s", self.path, pos, exc)
                continue
            if isinstance(record, Published):
                live[record.handle.id] = (record.handle, list(record.pending))
            elif record.handle_id in live:
                pending = live[record.handle_id][1]
                if record.consumer in pending:
                    pending.remove(record.consumer)
                if not pending:
                    del live[record.handle_id]
        return live

    def _rewrite(self) -> None:
        if self._file:
            self._file.close()
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with open(tmp, "wb") as out:
            out.writelines(self._frame(Published(handle, pending)) for handle, pending in self.live.values())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        self._file = open(self.path, "ab")
        self._records = len(self.live)

    @staticmethod
    def _frame(record: Record) -> bytes:
        body = _encoder.encode(record)
        return _LENGTH.pack(len(body)) + body

    def published(self, handle: Handle, pending: list[str]) -> None:
        self.live[handle.id] = (handle, list(pending))
        self._append(Published(handle, pending))

    def acked(self, handle_id: str, consumer: str) -> None:
        entry = self.live.get(handle_id)
        if entry is not None:
            if consumer in entry[1]:
                entry[1].remove(consumer)
            if not entry[1]:
                del self.live[handle_id]
        self._append(Acked(handle_id, consumer))

    def _append(self, record: Record) -> None:
        self._file.write(self._frame(record))
        self._records += 1

    def flush(self) -> None:
        """Called once per broker loop turn: one write syscall for a batch of records."""
        if self._records > self.compact_every and self._records > 4 * len(self.live):
            self._rewrite()
            return
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file:
            self._file.flush()
            self._file.close()
            self._file = None
