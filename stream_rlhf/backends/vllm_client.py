"""A rollout instance's handle on its vLLM engine process.

    engine = VllmClient(checkpoint, VllmOptions(max_model_len=64), python=".venv-vllm/bin/python")
    gen = engine.generate(prompts, params, seeds)          # a VllmGeneration, as torch_rollout's
    gen = engine.generate(prompts, params, seeds, images=images)   # a VLM: one SampleImages per prompt
    engine.submit_turns(ids, contexts, params, seeds, budgets)   # multi-turn: one request per turn
    ids, gen, cached = engine.poll_turns(0.02)             # the turns that ended
    engine.join_weights("broadcast", link, "rollout-0", world_size=2)   # the trainer's transport
    engine.update(3, wire.RECEIVE, 3)                      # receive version >= 3 through it, load it
    engine.close()

The engine runs in a process of its own (`vllm_server.py`) started with `python`, which may be
another environment's interpreter: vLLM pins its own torch and transformers, and the CPU wheel
needs its CUDA-linked torchvision removed. This package is put on that process's PYTHONPATH, so
the environment needs vLLM only (`engine_env`). When that Python has no torchvision (vLLM's CPU
environment; a GPU install has one), the import shim `vllm_shim/sitecustomize.py` goes on its
PYTHONPATH too, or vLLM cannot import its Qwen2-VL model. What decides is torchvision, not the
device, since torchvision is what the shim stands in for; a torchvision that is installed but
broken must be removed (`scripts/setup_vllm_cpu.sh` does). Client and engine talk over one ZeroMQ
PAIR socket on an ipc:// path (`vllm_protocol.py`). If the engine process dies, the next call
raises `VllmEngineError`; its own log (on stderr, vLLM's INFO lines filtered to warnings unless
VLLM_LOGGING_LEVEL is set) says why.

The engine process leads a process group of its own, which vLLM's processes (engine core,
workers) join: killing the engine kills the group, since those outlive a killed parent.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import zmq

import stream_rlhf
from stream_rlhf.backends import vllm_protocol as wire
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.backends.vllm_rollout import VllmGeneration, VllmOptions
from stream_rlhf.config import ConfigError
from stream_rlhf.samples import SampleImages
from stream_rlhf.weights.transport import Link

log = logging.getLogger(__name__)
POLL_S = 0.05
SHIM = Path(__file__).resolve().parent / "vllm_shim"
"""A PYTHONPATH entry holding `sitecustomize.py`: lets vLLM import Qwen2-VL without torchvision."""
InFlight = Callable[[], wire.Update | None]
"""Asked as a generate starts and after every POLL_S without a reply from the engine: the update
to apply between engine steps now, or None."""


class VllmEngineError(RuntimeError):
    """The engine process failed a request or exited; the message (and its log) says why."""


class GenerateAbandoned(RuntimeError):
    """A generate gave up waiting because its caller is stopping; the engine is still busy with it,
    so the next `close` kills the engine process instead of asking it to exit."""


def check_engine_python(python: str | None) -> None:
    """Fail before anything starts when the engine's Python (None: this one) has no vLLM."""
    python = python or sys.executable
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if subprocess.run([python, "-c", probe], capture_output=True, timeout=120, check=False).returncode != 0:
        raise ConfigError(f"rollout.vllm.python={python!r}: vllm is not installed there (on a CPU machine run "
                          "scripts/setup_vllm_cpu.sh and set rollout.vllm.python: .venv-vllm/bin/python; on a "
                          "GPU machine install the `vllm` extra)")


def engine_env(python: str) -> dict[str, str]:
    """This process's environment for an engine process run by `python`: this package on its
    PYTHONPATH, and the import shim before it when `python` has no torchvision."""
    paths = [str(Path(stream_rlhf.__file__).resolve().parent.parent)]
    if not _has_torchvision(python):
        paths.insert(0, str(SHIM))
        log.info("%s has no torchvision: the engine imports with %s", python, SHIM / "sitecustomize.py")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, env.get("PYTHONPATH")]))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("PYTHONUNBUFFERED", "1")  # its log lines when they happen, even into a file or pipe
    return env


def _has_torchvision(python: str) -> bool:
    """Whether `python` finds torchvision; True for a Python that cannot run (starting the engine
    with it reports that)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=120, check=False).returncode == 0
    except OSError:
        return True


class VllmClient:
    def __init__(self, checkpoint: str, options: VllmOptions, python: str | None = None,
                 start_timeout_s: float = 600.0):
        self.python = python or sys.executable
        self.version = 0
        self._abandoned = False
        env = engine_env(self.python)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PAIR)
        self._ipc_path = Path(tempfile.gettempdir()) / f"srl-vllm-{uuid.uuid4().hex[:12]}.sock"
        self._socket.bind(f"ipc://{self._ipc_path}")
        command = [self.python, "-m", "stream_rlhf.backends.vllm_server", f"ipc://{self._ipc_path}", checkpoint,
                   json.dumps(asdict(options))]
        try:
            self.process = subprocess.Popen(command, env=env, start_new_session=True)
        except OSError as exc:
            self._close_socket()
            raise VllmEngineError(f"rollout.vllm.python={self.python!r}: cannot start it: {exc}") from None
        started = time.monotonic()
        reply = self._receive("start", start_timeout_s)
        if not isinstance(reply, wire.Ready):
            raise VllmEngineError(f"engine start: expected Ready, got {type(reply).__name__}")
        log.info("vLLM engine ready in %.1fs (pid %d, %s)", time.monotonic() - started, reply.pid, self.python)

    def generate(self, prompts: list[torch.Tensor], params: SamplingParams, seeds: list[int],
                 in_flight: InFlight | None = None, images: list[SampleImages] | None = None,
                 stopping: threading.Event | None = None) -> VllmGeneration:
        """One response per prompt; `in_flight` is asked as the request goes out and while the
        engine works, and an update it returns is applied between engine steps (one asked at the
        start lands after the first step, however fast the engine; `self.version` follows). A
        vision-language model takes the image features of each prompt (`images`, one per prompt,
        as the torch backend).
        Raises GenerateAbandoned within POLL_S once `stopping` is set."""
        lens = [len(p) for p in prompts]
        flat = torch.cat(prompts).to(torch.int32).numpy() if prompts else np.empty(0, "<i4")
        self._send(wire.Generate(flat.astype("<i4").tobytes(), lens, list(seeds), params.temperature,
                                 params.top_p, params.max_new_tokens, list(params.stop_token_ids),
                                 None if images is None else [_prompt_images(i) for i in images]), "generate")
        pending = self._send_in_flight(in_flight)  # updates sent and not yet answered
        generated: wire.Generated | None = None
        while generated is None or pending:
            reply = self._receive("generate", timeout_s=None, poll_s=POLL_S)
            if reply is None and stopping is not None and stopping.is_set():
                self._abandoned = True
                raise GenerateAbandoned(f"generate of {len(prompts)} prompts abandoned: the rollout is stopping")
            if reply is None:
                if generated is None and not pending:
                    pending += self._send_in_flight(in_flight)
            elif isinstance(reply, wire.Done):
                self.version, pending = reply.version, pending - 1
            elif isinstance(reply, wire.Generated):
                generated = reply
            else:
                raise VllmEngineError(f"generate: unexpected {type(reply).__name__}")
        return _generation(generated)

    def _send_in_flight(self, in_flight: InFlight | None) -> int:
        """Ask `in_flight` for an update and send it to the engine; how many were sent (0 or 1)."""
        update = in_flight() if in_flight is not None else None
        if update is None:
            return 0
        self._send(update, "update")
        return 1

    def submit_turns(self, request_ids: list[str], contexts: list[torch.Tensor], params: SamplingParams,
                     seeds: list[int], max_new_tokens: list[int],
                     images: list[SampleImages | None] | None = None) -> None:
        """Start one request per policy turn (its episode's context (L,), its budget); the engine
        generates them while it waits for the next request (`vllm_turns.py`). A vision-language
        model takes each turn's prompt images (None: a turn without)."""
        flat = torch.cat(contexts).to(torch.int32).numpy() if contexts else np.empty(0, "<i4")
        self._request(wire.SubmitTurns(
            list(request_ids), flat.astype("<i4").tobytes(), [len(c) for c in contexts], list(seeds),
            list(max_new_tokens), params.temperature, params.top_p, list(params.stop_token_ids),
            None if images is None else [NO_IMAGES if i is None else _prompt_images(i) for i in images],
            list(params.stop_strings),
        ), "submit_turns")

    def poll_turns(self, timeout_s: float,
                   stopping: threading.Event | None = None) -> tuple[list[str], VllmGeneration, list[int]]:
        """The turns that ended (request ids, responses, context tokens of each found in the prefix
        cache), waiting up to about `timeout_s` for one (an engine step may overrun it); at once
        when none runs.
        Raises GenerateAbandoned within POLL_S once `stopping` is set."""
        self._send(wire.PollTurns(timeout_s), "poll_turns")
        while (reply := self._receive("poll_turns", timeout_s=None, poll_s=POLL_S)) is None:
            if stopping is not None and stopping.is_set():
                self._abandoned = True
                raise GenerateAbandoned("poll of multi-turn requests abandoned: the rollout is stopping")
        if not isinstance(reply, wire.TurnsDone):
            raise VllmEngineError(f"poll_turns: expected TurnsDone, got {type(reply).__name__}")
        return list(reply.request_ids), _generation(reply.generated), list(reply.cached_tokens)

    def abort_turns(self, request_ids: list[str]) -> None:
        """Drop these turns in the engine, running or ended and not yet polled."""
        self._request(wire.AbortTurns(list(request_ids)), "abort_turns")

    def join_weights(self, transport: str, link: Link, group: str, world_size: int) -> None:
        """Have the engine's workers join the trainer's `transport` (`weights/transport.py`) as
        ranks 1 .. world_size - 1 of `group`; each `wire.receive_update` then loads a version from it."""
        self.call(wire.JOIN, transport, link.to_json(), group, world_size)

    def update(self, version: int, method: str, *args: wire.Arg) -> None:
        """Load weights `version` by `method(*args)` of the engine's workers (`vllm_worker.py`)."""
        self._request(wire.Update(version, method, list(args)), "update")

    def call(self, method: str, *args: wire.Arg) -> None:
        """Call a method of the engine's workers that loads no weights (joining a group)."""
        self._request(wire.Call(method, list(args)), method)

    def sleep(self) -> None:
        self._request(wire.Sleep(), "sleep")

    def wake_up(self, update: wire.Update | None = None) -> None:
        self._request(wire.WakeUp(update), "wake_up")

    def close(self, timeout_s: float = 60.0) -> None:
        """Shut the engine down and wait for its process; kill it if it does not exit, or at once
        after an abandoned generate (the engine would only read Close once that one is done)."""
        if self._abandoned and self.process.poll() is None:
            log.warning("vLLM engine process %d is busy with an abandoned generate: killing it", self.process.pid)
        elif self.process.poll() is None:
            try:
                self._request(wire.Close(), "close", timeout_s)
            except VllmEngineError as exc:
                log.warning("vLLM engine close: %s", exc)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("vLLM engine process %d did not exit: killing it", self.process.pid)
        self._kill()  # the engine if it still runs, and anything vLLM left in its group
        self._close_socket()

    def _kill(self) -> None:
        """SIGKILL the engine's process group (a no-op once it is empty) and reap the engine."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def _request(self, request: wire.Request, what: str, timeout_s: float | None = None) -> None:
        self._send(request, what)
        reply = self._receive(what, timeout_s)
        if not isinstance(reply, wire.Done):
            raise VllmEngineError(f"{what}: expected Done, got {type(reply).__name__}")
        self.version = reply.version

    @property
    def alive(self) -> bool:
        """Whether the engine process still runs (a call to a dead one raises VllmEngineError)."""
        return self.process.poll() is None

    def _send(self, request: wire.Request, what: str) -> None:
        """Send once the socket takes it; raises if the engine process has exited (a send to a
        socket whose peer is gone would block for good)."""
        data = wire.encoder.encode(request)
        self._check_alive(what)
        while not self._socket.poll(100, zmq.POLLOUT):
            self._check_alive(what)
        self._socket.send(data)

    def _check_alive(self, what: str) -> None:
        code = self.process.poll()
        if code is not None:
            raise VllmEngineError(f"{what}: the vLLM engine process exited with code {code} (its log is above)")

    def _receive(self, what: str, timeout_s: float | None, poll_s: float | None = None) -> wire.Reply | None:
        """The next reply; None after `poll_s` without one. Raises if the engine process exits,
        answers Failed, or says nothing for `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        polled = time.monotonic()
        while not self._socket.poll(100 if poll_s is None else int(poll_s * 1000)):
            self._check_alive(what)
            if poll_s is not None and time.monotonic() - polled >= poll_s:
                return None
            if deadline is not None and time.monotonic() > deadline:
                self._kill()
                raise VllmEngineError(f"{what}: no answer from the vLLM engine in {timeout_s:.0f}s: killed it")
        reply = wire.reply_decoder.decode(self._socket.recv())
        if isinstance(reply, wire.Failed):
            raise VllmEngineError(f"{what} failed in the vLLM engine process: {reply.message}")
        return reply

    def _close_socket(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
        self._ipc_path.unlink(missing_ok=True)


NO_IMAGES = wire.PromptImages(b"", 0, 0, [])
"""A turn without images in a vision-language model's SubmitTurns."""


def _prompt_images(images: SampleImages) -> wire.PromptImages:
    features = images.features.detach().to("cpu", torch.float32).numpy().astype("<f4")
    return wire.PromptImages(features.tobytes(), *features.shape, images.grid_thw.tolist())


def _generation(reply: wire.Generated) -> VllmGeneration:
    def split(data: bytes, dtype: str, torch_dtype: torch.dtype) -> list[torch.Tensor]:
        flat = torch.from_numpy(np.frombuffer(data, dtype=dtype).copy()).to(torch_dtype)
        return list(torch.split(flat, reply.response_lens))

    return VllmGeneration(
        response_ids=split(reply.response_ids, "<i4", torch.long),
        response_logp=split(reply.response_logp, "<f4", torch.float32),
        finish_reasons=list(reply.finish_reasons),
        token_versions=split(reply.token_versions, "<i4", torch.int32),
    )
