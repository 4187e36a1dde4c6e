"""An offload policy: what of a stage's model state leaves its device, and when.

    placement:
      stages:
        ref_forward: {offload: {what: [params], when: step}}
        actor_train: {offload: {what: [params, grads, optimizer], when: iteration}}
      device_groups:
        forwards: [ref_forward, critic_forward]     # one process, the models take turns on the device

`when`:
    step       after each step that used the model
    iteration  after the step on an iteration's last mini-batch (a trainer's training step)
    switch     only when another stage of its device group takes the device (the default there:
               consecutive steps of one stage move nothing)

`prefetch: true` (device groups) brings a stage's state back while another member still computes.

The stage's engines carry it out (`offload`/`onload`: pinned host memory on CUDA; on a CPU device
parameters and optimizer state already live in host memory, so nothing moves and the stage says so).
`weights/device_turns.py` applies it around each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from stream_rlhf.config import ConfigError

OffloadTarget = Literal["params", "grads", "optimizer"]
TRAINING_STATE: tuple[OffloadTarget, ...] = ("grads", "optimizer")
"""What only a training stage has (a forward stage keeps no gradients or optimizer state)."""


@dataclass(frozen=True)
class OffloadPolicy:
    """What of a stage's model state leaves its device, and when (`placement.stages.<stage>.offload`)."""

    what: list[OffloadTarget] = field(default_factory=lambda: ["params"])
    """What leaves the device: `params`, and for a training stage `grads` and `optimizer` state."""
    when: Literal["step", "iteration", "switch"] = "step"
    """`step`, `iteration` (after an iteration's last mini-batch) or `switch` (when another stage of
    its device group needs the device)."""
    prefetch: bool = False
    """In a device group: once this stage's next mini-batch is ready while another member computes,
    bring its state back on a side CUDA stream during that computation (seed 004's pipelined
    offload), so the turn does not wait for it. Two members' state are on the device meanwhile."""

    def describe(self) -> str:
        """One line for plans and summaries: "params/grads when step, prefetched"."""
        return f"{'/'.join(self.what)} when {self.when}{', prefetched' if self.prefetch else ''}"

    def __post_init__(self) -> None:
        if not self.what:
            raise ConfigError("what=[]: name at least one of params, grads, optimizer (or leave offload out)")
        if len(set(self.what)) != len(self.what):
            raise ConfigError(f"what={self.what}: each listed once")


def default_group_policy(trains: bool) -> OffloadPolicy:
    """A device-group member's policy when the config gives none: everything it holds leaves when
    another member takes the device (so no two models share the device at once)."""
    return OffloadPolicy(["params", *TRAINING_STATE] if trains else ["params"], "switch")
