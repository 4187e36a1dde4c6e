"""Cores that follow the work: while one side of a separated placement waits, the other side's
running stage computes on its cores too.

    placement: {mode: separated, rollout_cores: [0], train_cores: [1], lend_idle_cores: true}

Rollout (core 0) and training (core 1) each hold one core, yet in a streaming run one side is
often idle: rollout once it has generated what admission lets it, training while it waits for
an iteration's experience. Each stage instance owns one byte of a small board file that every
stage process maps (`core_board.py`), set while the instance is in a step. At every module
forward, before every module's backward and before every optimizer step, a stage sets its CPU
affinity and torch threads to its own cores plus the other side's when it is the only stage
instance in a step, and back to its own cores otherwise (`ThreadGovernor`): a stage
running alone runs on every core; as soon as another starts, each is back on its own cores
within one module. (Only alone: several OpenMP processes of several threads each on the same
cores slow each other down far more than one thread each; three tiny-model forwards of a sync
phase ran 4x slower when each took two threads.)

    governor = ThreadGovernor(lending, instance_index=0, own_cores=[1])
    with governor.busy():          # the launcher wraps every step of the instance
        stage.step(batch)          # torch threads follow the board from module to module
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from stream_rlhf.launch.core_board import CoreBoard, CoreLending


class ThreadGovernor:
    """Sets this process's torch threads from the board at every module forward, before every
    module's backward and before every optimizer step (process-wide hooks, installed by `install`)."""

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
        self.borrowed = 0
        """How often threads went up to the lender's cores (a count the tests read)."""
        self._hooks: list[object] = []

    def install(self) -> None:
        """Hook every module and optimizer of the process (this thread runs on its own cores)."""
        os.sched_setaffinity(0, self.own_cores)
        torch.set_num_threads(self.own_threads)
        self._hooks = [nn.modules.module.register_module_forward_pre_hook(self._before_forward),
                       nn.modules.module.register_module_forward_hook(self._after_forward),
                       register_optimizer_step_pre_hook(self._before_optimizer_step)]

    def adjust(self) -> None:
        threads = self.own_threads if self.board.any_busy(self.others) else self.all_threads
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
        # a module's backward starts when its output's gradient is ready
        if isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(self._before_backward)

    def _before_backward(self, grad: Tensor) -> None:
        self.adjust()

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        self.adjust()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.board.set(self.slot, False)
        self.board.close()
