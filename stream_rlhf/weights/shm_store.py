"""Versioned weights in shared memory on one host: the CPU transport of weight sync.

    store = WeightStore(root, "actor")
    store.publish(model, version=3)              # trainer, after an iteration's optimizer steps
    loaded = store.refresh(model, loaded)        # forward stages, between mini-batches

    ShmSender(store) / ShmReceiver(store)        # the `shm` transport's ends (`transport.py`)

Each version is one safetensors file under `root/<model>/` (root lies in /dev/shm, i.e. memory);
`LATEST` names the newest and is replaced atomically, so a reader sees a complete version or the
previous one, never a half-written file. Tied weights (embeddings shared with the LM head) are
stored once, as `save_model` stores them. A version leaves once `keep` newer ones exist.

Pages are reused: the version that leaves becomes the store's spare file, and the next publish
overwrites the spare in place and renames it, because fresh tmpfs pages cost most of a publish
(2 GB on this project's VM: 1 to 6 s into a new file, 0.3 s over an old one). A reader holds a
shared lock on a version file while it reads (`reading`, also used by the vLLM worker) and checks
that the name still refers to the file it opened, so no file is ever rewritten under a reader: a
version that is being read when it leaves is unlinked instead (the reader keeps its pages).
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import _remove_duplicate_names, load_model
from torch import Tensor, nn

from stream_rlhf.telemetry import trace

SHM_ROOT = Path("/dev/shm")
SPARE = "spare.safetensors"
"""A version file that left the window, kept so that the next publish reuses its pages."""
DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


def weights_root(shm_prefix: str, job_name: str) -> Path:
    """The folder of a job's weight versions (removed by the launcher when the job ends)."""
    base = SHM_ROOT if SHM_ROOT.is_dir() else Path("/tmp")
    return base / f"{shm_prefix}-{job_name}-weights"


class WeightStore:
    def __init__(self, root: Path, model_name: str, keep: int = 2):
        self.folder = Path(root) / model_name
        self.keep = keep

    def publish(self, model: nn.Module | dict[str, Tensor], version: int,
                metadata: dict[str, str] | None = None) -> None:
        """Publish `model`'s weights (or a state dict, e.g. a train engine's `export_weights`) as
        `version` (versions must increase), with optional string metadata that readers get from
        `metadata(version)`."""
        with trace.span("weights publish", "weights", version=version, model=self.folder.name, transport="shm"):
            self._write(model, version, metadata)

    def _write(self, model: nn.Module | dict[str, Tensor], version: int, metadata: dict[str, str] | None) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(version)
        tmp = path.with_suffix(".tmp")
        tensors, metadata = _stored_tensors(model, metadata)
        spare = _lock_exclusive(self.folder / SPARE)
        if spare is None:
            with open(tmp, "wb") as f:
                write_safetensors(f, tensors, metadata)
        else:
            with spare:  # readers that opened it as an old version wait, then find it renamed
                os.rename(self.folder / SPARE, tmp)
                write_safetensors(spare, tensors, metadata)
        os.replace(tmp, path)
        latest_tmp = self.folder / "LATEST.tmp"
        latest_tmp.write_text(str(version))
        os.replace(latest_tmp, self.folder / "LATEST")
        for old in sorted(self.folder.glob("v*.safetensors"), key=lambda p: int(p.stem[1:]), reverse=True):
            if int(old.stem[1:]) <= version - self.keep:
                self._retire(old)

    def _retire(self, old: Path) -> None:
        """Make a version that left the window the spare, or unlink it when there is a spare or a
        reader holds it."""
        held = None if (self.folder / SPARE).exists() else _lock_exclusive(old)
        if held is None:
            old.unlink(missing_ok=True)
            return
        with held:
            os.rename(old, self.folder / SPARE)

    def latest_version(self) -> int:
        """The newest published version, or -1 before the first."""
        try:
            return int((self.folder / "LATEST").read_text())
        except FileNotFoundError:
            return -1

    def load_into(self, model: nn.Module) -> int:
        """Load the newest version into `model` in place; returns its version."""
        version = self.latest_version()
        if version < 0:
            raise FileNotFoundError(f"no weights published in {self.folder}")
        try:
            self.load_version(model, version)
        except FileNotFoundError:  # gone between reading LATEST and opening: a newer one exists
            return self.load_into(model)
        return version

    def load_version(self, model: nn.Module, version: int) -> None:
        """Load `version` into `model` in place (FileNotFoundError once it has left the window)."""
        path = self.path(version)
        with trace.span("weights load", "weights", version=version, model=self.folder.name, transport="shm"), \
                reading(path):
            load_model(model, str(path))

    def load_state(self, version: int) -> dict[str, Tensor]:
        """`version` as a state dict on the CPU, the tied names it stored once restored (FileNotFoundError
        once it has left the window)."""
        with trace.span("weights load", "weights", version=version, model=self.folder.name, transport="shm"):
            state, metadata = self._read(version)
        dropped = {name: kept for name, kept in metadata.items() if kept in state}
        return state | {name: state[kept] for name, kept in dropped.items()}

    def _read(self, version: int) -> tuple[dict[str, Tensor], dict[str, str]]:
        """The tensors `version` stores (tied ones once) and its metadata."""
        path = self.path(version)
        with reading(path), safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}  # noqa: SIM118 - no iteration

    def path(self, version: int) -> Path:
        """The file of `version` (a reader that opens it after `keep` newer versions finds it gone)."""
        return self.folder / f"v{version}.safetensors"

    def metadata(self, version: int) -> dict[str, str]:
        """The metadata published with `version` (raises FileNotFoundError once it is replaced)."""
        path = self.path(version)
        with reading(path), safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}

    def refresh(self, model: nn.Module, loaded_version: int) -> int:
        """Load the newest version if it is newer than `loaded_version`; returns the version held."""
        if self.latest_version() > loaded_version:
            return self.load_into(model)
        return loaded_version


class ShmSender:
    """The `shm` transport's trainer end (`transport.py`): each version into the store, unless the
    store holds it already (the trainer's own publish, for its forwards, comes first: written once)."""

    def __init__(self, store: WeightStore):
        self.store = store

    def publish(self, named: Iterable[tuple[str, Tensor]], version: int) -> None:
        if self.store.latest_version() < version:
            self.store.publish(dict(named), version)

    def close(self) -> None:
        """Nothing to stop: the versions stay in the store for its readers."""


class ShmReceiver:
    """The `shm` transport's receiver end (`transport.py`): reads the store's newest version."""

    def __init__(self, store: WeightStore):
        self.store = store

    def receive(self, min_version: int = 0,
                stop: threading.Event | None = None) -> tuple[int, list[tuple[str, Tensor]]] | None:
        """The store's newest version as (version, [(name, tensor)]) on the CPU if it is >= `min_version`,
        else None; nothing here waits (`stop` is for the protocol's sake). Tied tensors come once, as
        the broadcast transport sends them: loading one loads both, with no second copy."""
        while (version := self.store.latest_version()) >= min_version:
            try:
                with trace.span("weights receive", "weights", version=version, model=self.store.folder.name,
                                transport="shm"):
                    return version, list(self.store._read(version)[0].items())
            except FileNotFoundError:  # left the window since LATEST named it: a newer one is there
                continue
        return None

    def close(self) -> None:
        """Nothing held between receives."""

    def __repr__(self) -> str:
        return f"ShmReceiver({self.store.folder})"


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Hold the version file `path` against reuse while the block reads it. FileNotFoundError when
    it is gone, or left the window while this opened it."""
    with open(path, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_SH)  # released when f closes
        try:
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # renamed away by the writer while this waited for the lock
            raise FileNotFoundError(f"{path}: left the window while being opened")
        yield


def write_safetensors(f: BinaryIO, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """Write `tensors` in the safetensors format from the start of `f` (an open file, possibly
    longer: it is cut to size), straight from the tensors' memory, with no serialised copy."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    f.seek(0)
    f.write(struct.pack("<Q", len(encoded)) + encoded)
    for tensor in tensors.values():
        f.write(memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    f.truncate()
    f.flush()


def _stored_tensors(model: nn.Module | dict[str, Tensor],
                    metadata: dict[str, str] | None) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The state dict `save_model` would store: tied tensors once (the dropped names recorded in
    the metadata, as `save_model` records them, so `load_model` restores them)."""
    state = dict(model) if isinstance(model, dict) else model.state_dict()
    for name, tensor in state.items():
        if tensor.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be stored (one of {sorted(DTYPES.values())})")
    metadata = dict(metadata or {})
    for kept, dropped in _remove_duplicate_names(state).items():
        for name in dropped:
            metadata.setdefault(name, kept)
            del state[name]
    return state, metadata


def _lock_exclusive(path: Path) -> BinaryIO | None:
    """`path` opened for rewriting and locked against readers, or None when it does not exist or
    a reader holds it."""
    try:
        f = open(path, "r+b")  # noqa: SIM115 - the caller closes it (and so unlocks)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f
