"""Environments in worker processes (`env.processes`), over the real episode loop, torch sampler
and stepper: episodes come out as with in-process environments, each environment lives in one
worker process, a call stuck in a thread is cut off by killing its process once its other
episodes are over, a process that dies fails only its own episodes, closes run in the worker, and
the workers die with their parent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from stream_rlhf.backends.episode_sampler import TorchTurnSampler
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.config import ConfigError
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.environment import EpisodeStart
from stream_rlhf.envs.episode_loop import EpisodeLoop, EpisodeResult
from stream_rlhf.envs.process_envs import ProcessEnvs
from stream_rlhf.envs.stepper import EnvStepper
from tests.test_episode_loop import PARAMS, TOKENIZER
from tests.tiny_models import tiny_qwen2_config

ROOT = Path(__file__).resolve().parent.parent
N = 6
"""Episodes per run: references 0, 2, 4, 6, 8, 10; with 2 processes, episodes 0, 2, 4 in the first."""


@pytest.fixture(scope="module")
def lm() -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen2_config(len(TOKENIZER))).eval()


def _run(lm: PreTrainedModel, factory: str, processes: int, options: dict, params: SamplingParams = PARAMS,
         **env: object) -> tuple[EpisodeResult, ProcessEnvs | None, EnvStepper]:
    """N episodes to their ends (the stepper closed: every environment's close has run); the
    pool is left open for the test to look at, and closed by it."""
    cfg = EnvConfig(factory=f"tests.episode_envs:{factory}", options=options, processes=processes,
                    max_episode_tokens=200, **env)  # type: ignore[arg-type]
    pool = ProcessEnvs(cfg, threads=N) if processes else None
    loop = EpisodeLoop(cfg, lambda ids: TOKENIZER.decode(ids, skip_special_tokens=True),
                       lambda text: TOKENIZER.encode(text, add_special_tokens=False), params.max_new_tokens,
                       make=pool.make if pool else None)
    prompts = [torch.tensor(TOKENIZER.encode(f"<bos>{i}+{i}=", add_special_tokens=False)) for i in range(N)]
    sampler = TorchTurnSampler(lm, N, 200, params, (0,), 0)
    stepper = EnvStepper(cfg.step_timeout_s, N)
    try:
        result = loop.run([EpisodeStart(f"{i}+{i}=", str(2 * i)) for i in range(N)], prompts, None, sampler, stepper)
    finally:
        sampler.close()
        stepper.close()
    return result, pool, stepper


def _pids(result: EpisodeResult) -> list[set[int]]:
    """The processes each episode's steps ran in (InProcess's rewards)."""
    return [{int(r) for r in episode.turn_rewards if r} for episode in result.episodes]


def test_episodes_in_processes_are_the_in_process_ones(lm: PreTrainedModel) -> None:
    options, greedy = {"role": None, "turns": 3}, replace(PARAMS, temperature=0.0)  # turns may start in any order
    here, _, _ = _run(lm, "Messages", 0, options, greedy)
    result, pool, _ = _run(lm, "Messages", 2, options, greedy)
    assert pool is not None
    pool.close()
    assert result.ended == here.ended == ["done"] * N
    for a, b in zip(result.episodes, here.episodes):
        assert (a.token_ids, a.loss_mask, a.turn_rewards, a.turn_ends) == (b.token_ids, b.loss_mask, b.turn_rewards,
                                                                            b.turn_ends)


def test_each_episode_lives_in_one_worker_process_and_closes_there(lm: PreTrainedModel, tmp_path: Path) -> None:
    closes = tmp_path / "closes.txt"
    result, pool, _ = _run(lm, "InProcess", 2, {"turns": 3, "closes": str(closes)})
    assert pool is not None
    workers = {w.process.pid for w in pool.workers}
    pool.close()
    assert result.ended == ["done"] * N
    pids = _pids(result)
    assert all(len(p) == 1 for p in pids) and {p for s in pids for p in s} == workers
    assert os.getpid() not in workers and len(workers) == 2
    assert [next(iter(p)) for p in pids].count(min(workers)) == N // 2  # spread evenly
    closed = sorted(line.split() for line in closes.read_text().splitlines())
    assert closed == sorted([str(2 * i), str(next(iter(pids[i])))] for i in range(N))


def test_a_call_stuck_in_a_thread_ends_with_its_process_once_the_others_are_over(lm: PreTrainedModel) -> None:
    result, pool, _ = _run(lm, "InProcess", 2, {"turns": 3, "hang_turn": 2, "hang_digit": "4"}, step_timeout_s=1.0)
    assert pool is not None
    try:
        assert result.ended == ["done", "done", "failed:timeout", "done", "done", "done"]
        stuck = next(iter(_pids(result)[2]))
        worker = next(w for w in pool.workers if w.process.pid == stuck)
        assert worker.dead == "env process 0 was retired"  # no longer offered
        assert worker.process.wait(timeout=10) == -signal.SIGKILL  # killed, with the thread it could not get back
        other = next(w for w in pool.workers if w is not worker)
        assert other.dead is None
        env = pool.make()  # a replacement is started; the other worker takes episodes meanwhile
        assert pool.started == 3 and env.worker is other
        replacement = pool.workers[-1]
        replacement.wait_ready()
        env = pool.make()  # the worker with the fewest episodes
        assert env.worker is replacement and replacement.process.pid not in (stuck, other.process.pid)
        asyncio.run(env.reset(EpisodeStart("1+1=", "2")))
        assert asyncio.run(env.step("x", [1])).reward == env.worker.process.pid
    finally:
        pool.close()


def test_a_dead_worker_fails_only_its_own_episodes(lm: PreTrainedModel) -> None:
    result, pool, _ = _run(lm, "InProcess", 2, {"turns": 3, "die_turn": 2, "hang_digit": "4"})
    assert pool is not None
    try:
        assert result.ended[2] == "failed:raised"
        assert any(f.startswith("episode 2:") and "exited with -9" in f for f in result.failures)
        assert [result.ended[i] for i in (1, 3, 5)] == ["done"] * 3  # the other process's episodes
        assert all(result.ended[i] in ("done", "failed:raised") for i in (0, 4))  # its own: as far as they got
        env = pool.make()
        assert pool.started == 3
        asyncio.run(env.reset(EpisodeStart("1+1=", "2")))
    finally:
        pool.close()


def test_env_processes_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match="processes"):
        EnvConfig(factory="tests.episode_envs:InProcess", processes=-1)


def test_the_workers_die_with_their_parent(tmp_path: Path) -> None:
    parent = textwrap.dedent("""
        import time
        from stream_rlhf.envs.config import EnvConfig
        from stream_rlhf.envs.process_envs import ProcessEnvs
        if __name__ == "__main__":
            pool = ProcessEnvs(EnvConfig(factory="tests.episode_envs:InProcess", processes=2), threads=2)
            print(*[w.process.pid for w in pool.workers], flush=True)
            time.sleep(120)
        """)
    script = tmp_path / "parent.py"
    script.write_text(parent)
    process = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        workers = [int(pid) for pid in process.stdout.readline().split()]
        assert len(workers) == 2
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers):
            assert time.monotonic() < deadline, f"env processes {workers} outlived their parent"
            time.sleep(0.1)
    finally:
        process.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return status != "Z"  # a zombie has exited (its parent, gone, cannot reap it)
