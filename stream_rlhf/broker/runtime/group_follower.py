"""A stage instance's ranks other than the leader: they run the same stage logic on the handles
their leader shares, and talk to no broker.

    GroupFollower(stage, "actor_train", "actor_train-0", group, ShmTransport(serve=False)).run()

The leader (`runner.py`) shares GroupSetup after its handshake, then GroupBatch for each handle it
fetched (this rank fetches the payload itself from the producer, and a barrier tells the leader it
has), GroupWeights for each weights_ready, and GroupStop when the instance stops. Outputs are the
leader's to publish: a follower drops what its steps return, and its `send_control` does
nothing. If the leader dies, the next collective fails and so does this rank. Each fetch and
step goes to this rank's own track of the trace (`telemetry/trace.py`; the barrier between them
is the wait for the slowest rank's fetch, not part of the step).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from stream_rlhf.broker.control.messages import GroupBatch, GroupMessage, GroupSetup, GroupStop, GroupWeights, Handle
from stream_rlhf.broker.payload.transport import PayloadTransport
from stream_rlhf.broker.runtime.in_flight import inputs_in_flight
from stream_rlhf.distributed import RankGroup
from stream_rlhf.stage import Batch, Stage, StageContext
from stream_rlhf.telemetry import trace

log = logging.getLogger(__name__)


class LeaderProtocolError(RuntimeError):
    """The leader shared something out of order (a bug, never bad input from outside)."""


class GroupFollower:
    def __init__(self, stage: Stage, stage_name: str, instance_id: str, group: RankGroup, transport: PayloadTransport,
                 step_context: Callable[[Batch | None], AbstractContextManager[None]] = nullcontext,
                 setup_context: Callable[[], AbstractContextManager[None]] = nullcontext):
        """`step_context` and `setup_context` wrap steps and setup as on the leader (`runner.py`)."""
        if group.is_leader:
            raise ValueError(f"{instance_id}: rank 0 is the leader, which runs StageRunner")
        self.stage = stage
        self.stage_name = stage_name
        self.instance_id = instance_id
        self.group = group
        self.transport = transport
        self.step_context = step_context
        self.setup_context = setup_context
        self.steps = 0
        self.log = logging.LoggerAdapter(log, {"stage": f"{instance_id} rank {group.rank}"})

    def run(self) -> int:
        """Until the leader says stop; returns the number of steps taken."""
        self.log.info("%s rank %d of %d (pid %d) follows its leader on %s", self.instance_id, self.group.rank,
                      self.group.world_size, os.getpid(), self.group.device)
        try:
            setup = self._receive()
            if isinstance(setup, GroupStop):
                self.log.info("%s rank %d: the leader stopped before setup (%s)", self.instance_id, self.group.rank,
                              setup.reason)
                return 0
            if not isinstance(setup, GroupSetup):
                raise LeaderProtocolError(f"{self.instance_id}: expected GroupSetup first, got {type(setup).__name__}")
            with self.setup_context():
                self.stage.setup(StageContext(self.stage_name, self.instance_id, list(setup.inputs),
                                              list(setup.outputs), lambda op, version=-1: None, self.log,
                                              threading.Event(), self.group))
            inputs_in_flight(self.stage, self.stage_name, self.group.world_size)  # one, or refused
            self._follow()
        finally:
            self.transport.close()
        return self.steps

    def _follow(self) -> None:
        try:
            while not isinstance(message := self._receive(), GroupStop):
                if isinstance(message, GroupBatch):
                    self._step(message.handle)
                elif isinstance(message, GroupWeights):
                    self.stage.on_weights(message.version)
                else:
                    raise LeaderProtocolError(f"{self.instance_id}: unexpected {type(message).__name__}")
            self.group.stopped_together = True
        finally:
            self.stage.close()

    def _step(self, handle: Handle) -> None:
        """Fetch this rank's copy of the handle's payload and run the step; traced like the leader's
        steps (`host.py`), on this rank's own track."""
        started = trace.now_ns()
        tensors = self.transport.get(handle)
        fetched = trace.now_ns()
        trace.complete("fetch", "payload", started, fetched, topic=handle.topic, producer=handle.producer)
        self.group.barrier()
        stepping = trace.now_ns()
        batch = Batch(handle, tensors)
        self.stage.await_inputs(batch)
        with self.step_context(batch):
            self.stage.step(batch)
        self.steps += 1
        trace.complete(f"{self.stage_name} {handle.topic}", "step", stepping, trace.now_ns(), stage=self.stage_name,
                       topic=handle.topic, iteration=handle.iteration, minibatch=handle.minibatch,
                       policy_version=handle.policy_version, samples=handle.num_samples, rank=self.group.rank)

    def _receive(self) -> GroupMessage:
        message = self.group.share(None)
        assert message is not None  # share returns the leader's message on a follower
        return message
