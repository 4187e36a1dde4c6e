"""A job's weight sync from actor_train to its rollout instances, for every `weights.transport`.

    sender = open_sender(job)                       # actor_train; None for shm
    sender.publish(trained_parameters(model), version)

    weights = RolloutWeights(job, "rollout-0")      # a rollout instance
    weights.join_model(model) / weights.join_engine(engine)
    held = weights.refresh_model(model, held)       # torch backend, between mini-batches
    update = weights.engine_update(held)            # vLLM backend: the Update to send, or None

The trainer always publishes every version to the shared-memory store (the actor forward reads
it there, and its `LATEST` file is how a rollout instance on the same host learns a version
exists, also announced by the broker's weights_ready control); `broadcast` and `cuda_ipc` add a
sender with one group per rollout instance, named after it (`rollout-0`, ...), which each
instance joins at setup and asks for the newest version when it is ready for it. Only trained
parameters travel there: a vision-language model's frozen vision tower never changes. A broadcast
group meets through the launcher's address book when it names one (ranks on several hosts:
`weights/address_book.py`), else through a folder beside the store; a rollout on another host than
the trainer learns of new versions from the broker's announcement (its host's store is empty).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from stream_rlhf.backends.vllm_client import VllmClient
from stream_rlhf.backends.vllm_protocol import Update
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.telemetry import trace
from stream_rlhf.weights.address_book import book_of, sender_host
from stream_rlhf.weights.broadcast import BroadcastReceiver, BroadcastSender
from stream_rlhf.weights.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from stream_rlhf.weights.shm_store import WeightStore

Sender = BroadcastSender | CudaIpcSender


def sync_folder(job: JobContext) -> Path | str:
    """Where the trainer's groups publish their addresses (`weights/address_book.py`): a folder
    beside the weight store, or the store the launcher names for groups across hosts."""
    return book_of(group_folder(job))


def group_folder(job: JobContext) -> Path:
    """The folder beside the weight store (CUDA IPC, one host's by nature, always meets there)."""
    return Path(job.weights_root) / "groups"


def group_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def rollout_ranks(job: JobContext) -> int:
    """Receiver ranks per rollout instance: its vLLM workers (tensor parallel), or the stage itself."""
    rollout = job.config.rollout
    return rollout.vllm.tensor_parallel_size if rollout.backend == "vllm" else 1


def trained_parameters(model: nn.Module) -> list[tuple[str, Tensor]]:
    """What changes in training, named as in the checkpoint (tied weights once)."""
    return [(name, p.detach()) for name, p in model.named_parameters() if p.requires_grad]


def open_sender(job: JobContext) -> Sender | None:
    cfg = job.config.weights
    names = [f"rollout-{i}" for i in range(job.config.rollout.instances)]
    bucket_bytes = cfg.bucket_mb << 20
    if cfg.transport == "broadcast":
        groups = {name: 1 + rollout_ranks(job) for name in names}
        book = sync_folder(job)
        return BroadcastSender(book, groups, group_backend(), bucket_bytes, cfg.timeout_s, host=sender_host(book))
    if cfg.transport == "cuda_ipc":
        return CudaIpcSender(group_folder(job), names, bucket_bytes, cfg.timeout_s)
    return None


class RolloutWeights:
    """A rollout instance's view of the policy versions: which is the newest, and loading it."""

    def __init__(self, job: JobContext, instance_id: str):
        self.job = job
        self.cfg = job.config.weights
        self.instance_id = instance_id
        self.store = WeightStore(job.weights_root, "actor")
        self.announced = 0
        self._receiver: BroadcastReceiver | CudaIpcReceiver | None = None

    def newest(self) -> int:
        """The newest version published: the store's, or a newer one the broker announced."""
        return max(self.announced, self.store.latest_version())

    def join_model(self, model: nn.Module) -> None:
        """Join the trainer's group with the torch backend's model (no-op for shm)."""
        device = next(model.parameters()).device
        if self.cfg.transport == "broadcast":
            self._receiver = BroadcastReceiver.join(sync_folder(self.job), self.instance_id, 1,
                                                    1 + rollout_ranks(self.job), group_backend(), self.cfg.timeout_s,
                                                    device=device)
        elif self.cfg.transport == "cuda_ipc":
            self._receiver = CudaIpcReceiver.join(group_folder(self.job), self.instance_id, self.cfg.timeout_s, device)

    def refresh_model(self, model: nn.Module, held: int) -> int:
        """Load the newest version into `model` if it is newer than `held`; the version held now."""
        if self._receiver is None:
            return self.store.refresh(model, held)
        newest = self.newest()
        if newest <= held:
            return held
        version, named = self._receiver.receive(newest)
        with trace.span("weights load", "weights", version=version, transport=self.cfg.transport):
            _load_named(model, named, self.instance_id)
        return version

    def join_engine(self, engine: VllmClient) -> None:
        """Have the vLLM engine's workers join the trainer's group (no-op for shm)."""
        if self.cfg.transport == "broadcast":
            engine.call("srl_join_broadcast", str(sync_folder(self.job)), self.instance_id, 1 + rollout_ranks(self.job),
                        group_backend(), self.cfg.timeout_s)
        elif self.cfg.transport == "cuda_ipc":
            engine.call("srl_join_cuda_ipc", str(group_folder(self.job)), self.instance_id, self.cfg.timeout_s)

    def engine_update(self, held: int) -> Update | None:
        """The update that brings a vLLM engine holding `held` to the newest version, or None."""
        newest = self.newest()
        if newest <= held:
            return None
        if self.cfg.transport in ("broadcast", "cuda_ipc"):
            return Update(newest, "srl_receive", [newest])
        return Update(newest, "srl_load_file", [str(self.store.path(newest))])

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()


def _load_named(model: nn.Module, named: Iterable[tuple[str, Tensor]], who: str) -> None:
    result = model.load_state_dict(dict(named), strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{who}: received weights the model does not have: {result.unexpected_keys[:5]}")
