"""What a stage is, as seen by its author: plain logic over tensors, no sockets.

    class Doubler(Stage):
        def step(self, batch: Batch | None) -> list[Output] | None:
            return [Output("doubled", {"x": batch.tensors["x"] * 2}, batch.num_samples)]

A stage that consumes topics gets one `Batch` per delivered handle, in one of two ways. By default
`step(batch)` works on it start to end, and the host acks the input after the step. A stage that
works on several inputs at once (`inputs_in_flight()` > 1: a rollout whose episodes wait for tools
while it decodes the next mini-batch) gets each input through `begin(batch)`, also while earlier
ones are in progress, and is driven by `advance()` calls that return the inputs that ended, each
with its outputs; the host acks each input as it ends. A *source* (a stage with no
input topics, e.g. the prompt dataset) is called with `batch=None` whenever every output topic has
credit, and returns None once it is exhausted. Outputs inherit iteration, minibatch and
policy_version from the input batch unless they set them. The runner (`broker/runtime/runner.py`,
processes and sockets) and the in-process bus (`broker/runtime/inprocess.py`, tests) call stages
through this same interface.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from stream_rlhf.broker.control.messages import ControlOp, Handle, MetadataValue
from stream_rlhf.distributed import RankGroup


@dataclass(frozen=True)
class Batch:
    """One delivered mini-batch: the handle's routing fields plus its tensors."""

    handle: Handle
    tensors: dict[str, torch.Tensor]

    @property
    def topic(self) -> str:
        return self.handle.topic

    @property
    def iteration(self) -> int:
        return self.handle.iteration

    @property
    def minibatch(self) -> int:
        return self.handle.minibatch

    @property
    def policy_version(self) -> int:
        return self.handle.policy_version

    @property
    def num_samples(self) -> int:
        return self.handle.num_samples

    @property
    def metadata(self) -> dict[str, MetadataValue]:
        return self.handle.metadata


@dataclass
class Output:
    """One mini-batch to publish. None fields are inherited from the input batch (sources must
    set iteration and minibatch; policy_version defaults to -1 for them)."""

    topic: str
    tensors: dict[str, torch.Tensor]
    num_samples: int
    iteration: int | None = None
    minibatch: int | None = None
    policy_version: int | None = None
    metadata: dict[str, MetadataValue] = field(default_factory=dict)


@dataclass(frozen=True)
class StageContext:
    """Given to `Stage.setup`: who this instance is and how it reaches the control plane."""

    stage: str
    instance_id: str
    inputs: list[str]
    outputs: list[str]
    send_control: Callable[[ControlOp, int], None]
    """send_control("weights_ready", version) announces new weights to every stage."""
    log: logging.LoggerAdapter
    stopping: threading.Event
    """Set when the instance must stop now (the broker's shutdown, a second signal, the broker
    gone while draining): a step that waits on something outside, an engine process say, gives
    up its input by raising StepAborted."""
    group: RankGroup = field(default_factory=RankGroup.single)
    """This instance's ranks and this rank's device. Every rank runs the stage's logic on every
    handle; only the leader's outputs are published and only its `send_control` reaches the broker
    (on the others it does nothing). Work that must happen once (files, metrics) checks
    `group.is_leader`."""


class DeviceState(Protocol):
    """What holds a stage's model state on its device (a train engine): moved off and back by
    offload policies and device groups (`weights/device_turns.py`). Both return the bytes moved."""

    def offload(self, what: set[str]) -> int: ...

    def onload(self, what: set[str]) -> int: ...


class StepAborted(RuntimeError):
    """A step gave up its input because the instance is stopping (`StageContext.stopping`). The
    input goes back to the broker, and the runner stops cleanly instead of failing."""


class Stage:
    """Base class of stage logic. Override `step` (or, for a stage with several inputs in flight,
    `inputs_in_flight`, `begin` and `advance`); `setup` and `on_weights` are optional."""

    def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx

    def step(self, batch: Batch | None) -> list[Output] | None:
        raise NotImplementedError(f"{type(self).__name__}.step")

    def inputs_in_flight(self) -> int:
        """How many delivered inputs the stage works on at once (asked once, after setup). 1, the default:
        one `step` per input. Above 1 the host hands each input to `begin`, also while earlier ones are still
        in progress, and calls `advance` until they have all ended; `step` is then not called for inputs.
        Not supported for an instance of several ranks (`StageContext.group`)."""
        return 1

    def begin(self, batch: Batch) -> None:
        """Start work on `batch` (only when inputs_in_flight() > 1); return quickly."""
        raise NotImplementedError(f"{type(self).__name__}.begin (inputs_in_flight() > 1 needs begin and advance)")

    def advance(self) -> list[tuple[Batch, list[Output]]]:
        """Some work on the inputs begun (a fraction of a second at most: the host takes new deliveries and
        controls between calls); returns the inputs that ended, each with its outputs (possibly none)."""
        raise NotImplementedError(f"{type(self).__name__}.advance (inputs_in_flight() > 1 needs begin and advance)")

    def on_weights(self, version: int) -> None:
        """Weights of `version` are ready (rollout loads them between mini-batches; a stage with several
        inputs in flight hears of them between `advance` calls)."""

    def await_inputs(self, batch: Batch) -> None:
        """Before the step on `batch` (or its `begin`), outside its device turn: wait for what the step needs from
        other stages beyond the batch (newer weights, say), so that a stage sharing the device is
        not kept from producing them. Nothing by default."""

    def device_state(self) -> list[DeviceState]:
        """The engines that hold this stage's model state on its device (after setup); none by default."""
        return []

    def uses_device(self, batch: Batch | None) -> bool:
        """Whether stepping on `batch` computes on the model (a trainer that only buffers a
        mini-batch does not, so its state stays off the device)."""
        return True

    def close(self) -> None:
        """Called once when the instance stops."""
