"""A job's weight sync from actor_train to its rollout instances: which version to ask for, and when.

    sender = open_sender(job)                       # actor_train's leader
    sender.publish(trained_parameters(model), version)

    weights = RolloutWeights(job, "rollout-0")      # a rollout instance
    weights.join_model(model) / weights.join_engine(engine)
    held = weights.refresh_model(model, held)       # torch backend, between mini-batches
    update = weights.engine_update(held)            # vLLM backend: the Update to send, or None

How a version travels is `weights.transport`'s: one protocol and one table for shm, broadcast and
cuda_ipc (`weights/transport.py`). The trainer always publishes every version to the shared-memory
store too (the actor forward reads it there, and its `LATEST` file is how a rollout instance on
the same host learns a version exists, also announced by the broker's weights_ready control). Each
rollout instance is a group of its own (`rollout-0`, ...: the trainer and the instance's receiver
ranks, its vLLM workers or itself), which it joins at setup; it asks for the newest version when
it is ready for one. Only trained parameters are sent: a vision-language model's frozen vision
tower never changes. A broadcast group meets through the launcher's address book when it names one
(ranks on several hosts: `weights/address_book.py`), else through a folder beside the store; a
rollout on another host than the trainer learns of new versions from the broker's announcement
(its host's store is empty).
"""

from __future__ import annotations

from torch import Tensor, nn

from stream_rlhf.backends.torch_rollout import load_weights
from stream_rlhf.backends.vllm_client import VllmClient
from stream_rlhf.backends.vllm_protocol import Update, receive_update
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.telemetry import trace
from stream_rlhf.weights.transport import TRANSPORTS, Link, WeightReceiver, WeightSender

POLICY = "actor"
"""The store (and link) of the policy's versions."""


def rollout_ranks(job: JobContext) -> int:
    """Receiver ranks per rollout instance: its vLLM workers (tensor parallel), or the stage itself."""
    rollout = job.config.rollout
    return rollout.vllm.tensor_parallel_size if rollout.backend == "vllm" else 1


def trained_parameters(model: nn.Module) -> list[tuple[str, Tensor]]:
    """What changes in training, named as in the checkpoint (tied weights once)."""
    return [(name, p.detach()) for name, p in model.named_parameters() if p.requires_grad]


def open_sender(job: JobContext) -> WeightSender:
    """actor_train's end of `weights.transport`, one group per rollout instance."""
    groups = {f"rollout-{i}": 1 + rollout_ranks(job) for i in range(job.config.rollout.instances)}
    return TRANSPORTS[job.config.weights.transport].open_sender(Link.of(job.weights_root, POLICY, job.config.weights),
                                                                groups)


class RolloutWeights:
    """A rollout instance's view of the policy versions: which is the newest, and loading it."""

    def __init__(self, job: JobContext, instance_id: str):
        self.job = job
        self.transport = job.config.weights.transport
        self.instance_id = instance_id
        self.link = Link.of(job.weights_root, POLICY, job.config.weights)
        self.store = self.link.store()
        self.announced = job.start_version  # a resumed run's: this host's store may not have it (another host's)
        self._receiver: WeightReceiver | None = None

    def newest(self) -> int:
        """The newest version published: the store's, or a newer one the broker announced."""
        return max(self.announced, self.store.latest_version())

    def join_model(self, model: nn.Module) -> None:
        """Join the trainer's transport as this instance's one receiver rank, on `model`'s device."""
        self._receiver = TRANSPORTS[self.transport].join(self.link, self.instance_id, 1, 1 + rollout_ranks(self.job),
                                                         next(model.parameters()).device)

    def refresh_model(self, model: nn.Module, held: int) -> int:
        """Load the newest version into `model` if it is newer than `held`; the version held now."""
        newest = self.newest()
        if newest <= held:
            return held
        if self._receiver is None:
            raise RuntimeError(f"{self.instance_id}: refresh_model before join_model")
        with trace.span("weights load", "weights", version=newest, transport=self.transport):
            received = self._receiver.receive(newest)
            if received is None:  # not in this host's store yet
                return held
            version, named = received
            load_weights(model, named, self.instance_id)
        return version

    def join_engine(self, engine: VllmClient) -> None:
        """Have the vLLM engine's workers join the trainer's transport."""
        engine.join_weights(self.transport, self.link, self.instance_id, 1 + rollout_ranks(self.job))

    def engine_update(self, held: int) -> Update | None:
        """The update that brings a vLLM engine holding `held` to the newest version, or None."""
        newest = self.newest()
        return receive_update(newest) if newest > held else None

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
