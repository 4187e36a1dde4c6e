"""Cores that follow the work: while one side of a separated placement waits, the other side's
running stage computes on its cores too.

    placement: {mode: separated, rollout_cores: [0], train_cores: [1], lend_idle_cores: true}

Rollout (core 0) and training (core 1) each hold one core, yet in a streaming run one side is
often idle: rollout once it has generated what admission lets it, training while it waits for
an iteration's experience. Each stage instance owns one byte of a small board file that every
stage process maps (`core_board.py`), set while the instance is in a step. Before every layer's
forward and backward and before every optimizer step, a stage sets its CPU affinity and torch
threads to its own cores plus the other side's when it is the only stage
instance in a step, and back to its own cores otherwise (`ThreadGovernor`): a stage
running alone runs on every core; as soon as another starts, each is back on its own cores
within one layer. (Only alone: several OpenMP processes of several threads each on the same
cores slow each other down far more than one thread each; three tiny-model forwards of a sync
phase ran 4x slower when each took two threads.)

    governor = ThreadGovernor(lending, instance_index=0, own_cores=[1])
    governor.install()             # the launcher, in the stage process
    govern(model)                  # an engine, on each model it builds
    with governor.busy():          # the launcher wraps every step of the instance
        stage.step(batch)          # torch threads follow the board from layer to layer
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from stream_rlhf.backends.core_board import CoreBoard, CoreLending

MIN_PARAMETERS = 4_000_000
"""Smaller models gain nothing from a second thread on the CPU: their ops are too small to split
(the 0.4M-parameter default model decoded and trained slower on two threads than on one)."""
LAYER_CLASS_SUFFIXES = ("DecoderLayer", "Block")
"""The modules a governed model is hooked at: transformers' decoder layers and vision blocks."""


class ThreadGovernor:
    """Sets this process's CPU affinity and torch threads from the board before every layer's
    forward and backward of the models it governs (`govern`) and before every optimizer step.
    Hooks on layers, not on every module: a process-wide module hook takes every module call of
    a small model off its fast path (the tiny model's decoding ran 30% slower)."""

    def __init__(self, lending: CoreLending, instance_index: int, own_cores: list[int]):
        self.lending = lending
        self.slot = lending.first_slot + instance_index
        self.own_cores = set(own_cores)
        self.all_cores = self.own_cores | set(lending.lender_cores)
        self.own_threads = len(self.own_cores)
        self.all_threads = len(self.all_cores)
        self.others = tuple(s for s in range(lending.slots) if s != self.slot)
        self.board = CoreBoard(lending.board, lending.slots)
        self.board.set(self.slot, False)  # a restarted instance may find its crashed run's mark
        self.threads = self.own_threads
        self.may_borrow = False
        """Set once a model big enough to gain from more threads is attached."""
        self.borrowed = 0
        """How often threads went up to the lender's cores (a count the tests read)."""
        self._hooks: list[object] = []

    def install(self) -> None:
        """Make this the process's governor (`govern` attaches models to it) and hook every
        optimizer step; this thread runs on its own cores."""
        global _installed
        os.sched_setaffinity(0, self.own_cores)
        torch.set_num_threads(self.own_threads)
        self._hooks = [register_optimizer_step_pre_hook(self._before_optimizer_step)]
        _installed = self

    def attach(self, model: nn.Module) -> None:
        """Hook the layers of `model` (its decoder layers and vision blocks; the model itself when
        it has neither): before each one's forward and before each one's backward. A model under
        MIN_PARAMETERS is left alone, and a stage with no other model never borrows."""
        if sum(p.numel() for p in model.parameters()) < MIN_PARAMETERS:
            return
        self.may_borrow = True
        layers = [m for m in model.modules() if type(m).__name__.endswith(LAYER_CLASS_SUFFIXES)] or [model]
        for layer in layers:
            self._hooks += [layer.register_forward_pre_hook(self._before_forward),
                            layer.register_forward_hook(self._after_forward)]

    def adjust(self) -> None:
        alone = self.may_borrow and not self.board.any_busy(self.others)
        threads = self.all_threads if alone else self.own_threads
        if threads != self.threads:
            # this thread's affinity follows (torch's worker threads, created while it was wide,
            # idle when not borrowing): never on the lender's cores while another stage steps
            os.sched_setaffinity(0, self.all_cores if threads > self.own_threads else self.own_cores)
            torch.set_num_threads(threads)
            self.borrowed += threads > self.threads
            self.threads = threads

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Marks this instance busy for the duration (one step) and starts it with the right threads."""
        self.board.set(self.slot, True)
        self.adjust()
        try:
            yield
        finally:
            self.board.set(self.slot, False)

    def _before_forward(self, module: nn.Module, args: object) -> None:
        self.adjust()

    def _after_forward(self, module: nn.Module, args: object, output: object) -> None:
        # a layer's backward starts when its output's gradient is ready
        first = output[0] if isinstance(output, tuple) and output else output
        if isinstance(first, Tensor) and first.requires_grad:
            first.register_hook(self._before_backward)

    def _before_backward(self, grad: Tensor) -> None:
        self.adjust()

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        self.adjust()

    def close(self) -> None:
        global _installed
        for hook in self._hooks:
            hook.remove()
        self.board.set(self.slot, False)
        self.board.close()
        if _installed is self:
            _installed = None


_installed: ThreadGovernor | None = None
"""The governor the launcher installed in this stage process, if any."""


def govern(model: nn.Module) -> None:
    """Let this process's thread governor switch threads inside `model`'s forward and backward;
    nothing when core lending is off. Engines call it on the models they build."""
    if _installed is not None:
        _installed.attach(model)
