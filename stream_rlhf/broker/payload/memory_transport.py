"""In-process payloads for stages run without sockets (tests, `inprocess.py`): the PayloadTransport
of `transport.py` over a dict shared by every stage of one process."""

from __future__ import annotations

import torch

from stream_rlhf.broker.control.messages import FieldSpec, Handle, Location
from stream_rlhf.broker.payload.server import PayloadError
from stream_rlhf.broker.payload.transport import Tensors, dtype_name


class MemoryTransport:
    """In-process payloads: tensors stay in a dict shared by every stage of one process.
    A field's location is "{handle id}/{field}", so a joined handle may rename fields."""

    def __init__(self):
        self.counters: dict[str, float] = {}
        self._store: dict[str, torch.Tensor] = {}
        self._keys: dict[str, list[str]] = {}

    def put(self, handle_id: str, tensors: Tensors) -> dict[str, FieldSpec]:
        keys = self._keys.setdefault(handle_id, [])
        fields = {}
        for name, tensor in tensors.items():
            key = f"{handle_id}/{name}"
            self._store[key] = tensor
            keys.append(key)
            nbytes = tensor.numel() * tensor.element_size()
            fields[name] = FieldSpec(dtype_name(tensor.dtype), list(tensor.shape), nbytes, Location("memory", key))
        return fields

    def get(self, handle: Handle) -> Tensors:
        out = {}
        for name, spec in handle.fields.items():
            tensor = self._store.get(spec.location.segment)
            if tensor is None:
                raise PayloadError(f"handle {handle.id} field {name!r}: payload {spec.location.segment} released")
            out[name] = tensor
        return out

    def release(self, handle_id: str) -> None:
        for key in self._keys.pop(handle_id, []):
            del self._store[key]

    def held(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        self._store.clear()
        self._keys.clear()
