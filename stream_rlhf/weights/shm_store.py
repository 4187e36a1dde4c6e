"""Versioned weights in shared memory on one host: the CPU transport of weight sync.

    store = WeightStore(root, "actor")
    store.publish(model, version=3)              # trainer, after an iteration's optimizer steps
    loaded = store.refresh(model, loaded)        # rollout / forward, between mini-batches
    version, tensors = store.read_version()      # the newest version's tensors, {name: tensor}

Each version is one safetensors file under `root/<model>/` (root lies in /dev/shm, i.e. memory);
`LATEST` names the newest and is replaced atomically, so a reader sees a complete version or the
previous one, never a half-written file. Tied weights (embeddings shared with the LM head) are
stored once. Old versions are unlinked after `keep` newer ones exist; a reader that opened one
keeps reading it (POSIX unlink semantics). A later transport (NCCL groups, CUDA IPC) offers the
same publish / latest_version / load_into calls.
"""

from __future__ import annotations

import os
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_model
from torch import Tensor, nn

SHM_ROOT = Path("/dev/shm")


def weights_root(shm_prefix: str, job_name: str) -> Path:
    """The folder of a job's weight versions (removed by the launcher when the job ends)."""
    base = SHM_ROOT if SHM_ROOT.is_dir() else Path("/tmp")
    return base / f"{shm_prefix}-{job_name}-weights"


class WeightStore:
    def __init__(self, root: Path, model_name: str, keep: int = 2):
        self.folder = Path(root) / model_name
        self.keep = keep

    def publish(self, model: nn.Module, version: int, metadata: dict[str, str] | None = None) -> None:
        """Publish `model`'s weights as `version` (versions must increase), with optional string
        metadata that readers get from `metadata(version)`."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"v{version}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_model(model, str(tmp), metadata=metadata)
        os.replace(tmp, path)
        latest_tmp = self.folder / "LATEST.tmp"
        latest_tmp.write_text(str(version))
        os.replace(latest_tmp, self.folder / "LATEST")
        for old in self.folder.glob("v*.safetensors"):
            if int(old.stem[1:]) <= version - self.keep:
                old.unlink(missing_ok=True)

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
            load_model(model, str(self.folder / f"v{version}.safetensors"))
        except FileNotFoundError:  # unlinked between reading LATEST and opening: a newer one exists
            return self.load_into(model)
        return version

    def read_version(self, version: int | None = None) -> tuple[int, dict[str, Tensor]]:
        """The tensors of `version` (None: the newest) as {name: tensor}, loaded into memory."""
        if version is None:
            newest = self.latest_version()
            if newest < 0:
                raise FileNotFoundError(f"no weights published in {self.folder}")
            try:
                return newest, load_file(str(self.folder / f"v{newest}.safetensors"))
            except FileNotFoundError:  # unlinked between reading LATEST and opening: a newer one exists
                return self.read_version()
        try:
            return version, load_file(str(self.folder / f"v{version}.safetensors"))
        except FileNotFoundError:
            raise FileNotFoundError(f"version {version} is not in {self.folder} (unlinked once {self.keep} newer "
                                    f"exist, or never published); the newest is {self.latest_version()}") from None

    def path(self, version: int) -> Path:
        """The file of `version` (a reader that opens it after `keep` newer versions finds it gone)."""
        return self.folder / f"v{version}.safetensors"

    def metadata(self, version: int) -> dict[str, str]:
        """The metadata published with `version` (raises FileNotFoundError once it is replaced)."""
        with safe_open(str(self.folder / f"v{version}.safetensors"), framework="pt") as f:
            return f.metadata() or {}

    def refresh(self, model: nn.Module, loaded_version: int) -> int:
        """Load the newest version if it is newer than `loaded_version`; returns the version held."""
        if self.latest_version() > loaded_version:
            return self.load_into(model)
        return loaded_version
