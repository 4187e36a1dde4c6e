"""Rollout alone: how much of the tool latency the episode engine hides, without the trainer.

`agentic.py` measures whole jobs, where rollout waits for the trainer between iterations (the
broker admits one iteration ahead: `overlap_depth: 1`), so it seldom holds more than one
iteration's mini-batches. This script drives the engine itself (`envs/episode_loop.py` over the
torch turn sampler, `backends/episode_sampler.py`) on configs/text_tool_grpo.yaml's warm-started
policy and prompts, with the calculator sleeping LATENCY_S = 50 ms per call, and always has as
many mini-batches as a column allows in flight (no broker, no trainer):

    lockstep   one mini-batch at a time; a round's tool calls start once the round's generation is
               over, the next round once the slowest call has returned (a synchronous engine);
               the baseline
    stream1    one mini-batch at a time; each episode goes on as soon as its own call returns
    streamK    K mini-batches in flight on one sampler (env.minibatches_in_flight=K); a new one
               joins as soon as one has ended

Every column runs the same MINIBATCHES mini-batches of the config's size (prompts_per_minibatch x
samples_per_prompt episodes) in the same order; the columns take turns, ROUNDS times, and the
figures are totals over the rounds. Figures: episode tokens/s (prompt, policy and observation
tokens of every episode / the wall seconds of the column), seconds per mini-batch, and the ratio
against lockstep.

    .venv/bin/python bench/agentic_rollout.py            # about half a minute on 2 idle cores
    .venv/bin/python bench/agentic_rollout.py --json     # and one JSON line
    .venv/bin/python bench/agentic_rollout.py --quick    # smoke: 2 mini-batches, 1 round, a 40-step warm start
    python bench/agentic_rollout.py --device cuda --json # on a GPU (scripts/gpu_checks.sh agentic)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from pipeline import progress  # bench/, beside this script

from stream_rlhf.backends.decode_attention import use_decode_attention
from stream_rlhf.backends.episode_sampler import CUDA_FREE_POSITIONS, TorchTurnSampler, episode_capacity
from stream_rlhf.backends.static_decode import StaticDecoder, static_decoder
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.config import load_config
from stream_rlhf.data.chat_template import encode_prompt
from stream_rlhf.data.text_tasks import problems
from stream_rlhf.data.tokenizer import load_tokenizer, stop_token_ids
from stream_rlhf.driver.warm_start import warm_start
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.environment import Environment, EpisodeStart
from stream_rlhf.envs.episode_loop import EpisodeLoop
from stream_rlhf.envs.stepper import EnvStepper
from stream_rlhf.models.checkpoint import load_policy
from stream_rlhf.rl.config import RLJobConfig

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/text_tool_grpo.yaml"
LATENCY_S = 0.05
MINIBATCHES = 8
ROUNDS = 3
QUICK_SETS = ["model.warm_start.steps=40"]
"""--quick: a warm start of its own, built in seconds (2 mini-batches, 1 round)."""
COLUMNS = {"lockstep": ("lockstep", 1), "stream1": ("stream", 1), "stream2": ("stream", 2), "stream4": ("stream", 4)}
"""column -> (env.schedule, mini-batches in flight)."""
BASELINE = "lockstep"
MiniBatch = tuple[list[EpisodeStart], list[torch.Tensor]]


def minibatches(cfg: RLJobConfig, tokenizer, count: int) -> list[MiniBatch]:
    """`count` mini-batches of the job's training prompts, each prompt samples_per_prompt times."""
    batch = cfg.rollout_batch
    rows = problems(cfg.task, "train", count * batch.prompts_per_minibatch, cfg.task.seed)
    out = []
    for m in range(count):
        chunk = rows[m * batch.prompts_per_minibatch:(m + 1) * batch.prompts_per_minibatch]
        starts = [EpisodeStart(p.prompt, p.answer) for p in chunk for _ in range(batch.samples_per_prompt)]
        prompts = [encode_prompt(tokenizer, p.prompt, [], None) for p in chunk for _ in range(batch.samples_per_prompt)]
        out.append((starts, prompts))
    return out


def run_column(env: EnvConfig, model, tokenizer, params: SamplingParams, work: list[MiniBatch],
               in_flight: int, stepper: EnvStepper, static: StaticDecoder | None = None,
               make: Callable[[], Environment] | None = None) -> tuple[float, int, int]:
    """(wall seconds, episode tokens, environment steps) of `work` in `env` with `in_flight` mini-batches at once, on
    the model's device (`static`: the engine's decoder there, as `rollout.decode: auto` picks it;
    `make`: the environments' maker, as EpisodeLoop takes it)."""
    loop = EpisodeLoop(env, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                       lambda text: tokenizer.encode(text, add_special_tokens=False), params.max_new_tokens,
                       make=make)
    size = len(work[0][1])
    capacity = max(episode_capacity(prompts, params.max_new_tokens, env.max_episode_tokens) for _, prompts in work)
    device = next(model.parameters()).device
    sampler = TorchTurnSampler(model, size * in_flight, capacity, params, (0, "bench"), 0,
                               static, free_positions=CUDA_FREE_POSITIONS if device.type == "cuda" else 0)
    loop.open(sampler, stepper, None, size * in_flight)
    waiting, tokens, calls = deque(work), 0, 0
    started = time.perf_counter()
    while waiting or loop.groups:
        while waiting and loop.free_slots >= size:
            loop.add(len(waiting), *waiting.popleft(), None)
        for _, result in loop.advance():
            tokens += sum(episode.num_tokens for episode in result.episodes)
            calls += sum(result.tool_calls)
    seconds = time.perf_counter() - started
    sampler.close()
    return seconds, tokens, calls


def measure(quick: bool, device: torch.device) -> dict[str, dict]:
    sets = [f"env.options.latency_s={LATENCY_S}", *(QUICK_SETS if quick else [])]
    cfg = load_config(RLJobConfig, REPO / CONFIG, sets)
    count, rounds = (2, 1) if quick else (MINIBATCHES, ROUNDS)
    checkpoint = warm_start(cfg)
    torch.manual_seed(cfg.seed)
    model = load_policy(str(checkpoint)).eval().to(device)
    use_decode_attention(model)  # as the rollout engine does
    static = static_decoder("auto", device, model)  # CUDA graphs on a GPU, eager on the CPU
    tokenizer = load_tokenizer(str(checkpoint))
    stops = stop_token_ids(tokenizer, cfg.rollout.stop, cfg.data.chat_template, str(checkpoint))
    params = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens, stops,
                            tokenizer.pad_token_id)
    work = minibatches(cfg, tokenizer, count)
    episodes = cfg.rollout_batch.prompts_per_minibatch * cfg.rollout_batch.samples_per_prompt
    stepper = EnvStepper(cfg.env.step_timeout_s, cfg.env.threads(episodes * 4))  # calls of 4 mini-batches at once
    totals = {column: [0.0, 0] for column in COLUMNS}
    try:
        with torch.inference_mode():
            for round_ in range(rounds):
                for column, (schedule, in_flight) in COLUMNS.items():
                    env = replace(cfg.env, schedule=schedule)
                    seconds, tokens, _ = run_column(env, model, tokenizer, params, work, in_flight, stepper, static)
                    totals[column][0] += seconds
                    totals[column][1] += tokens
                progress(f"round {round_ + 1}/{rounds}: " + ", ".join(
                    f"{c} {t[1] / t[0]:,.0f} tokens/s" for c, t in totals.items()))
    finally:
        stepper.close()
    return {column: {"episode_tokens_per_s": tokens / seconds, "s_per_minibatch": seconds / (rounds * count)}
            for column, (seconds, tokens) in totals.items()}


def table_row(label: str, values: list[str]) -> str:
    return f"{label:<24}" + "".join(f"{v:>12}" for v in values)


def table_rows(results: dict[str, dict], baseline: str) -> list[str]:
    """The columns side by side: episode tokens/s, its ratio against `baseline`, s / mini-batch."""
    base = results[baseline]["episode_tokens_per_s"]
    return [table_row("", list(results)),
            table_row("episode tokens/s", [f"{r['episode_tokens_per_s']:,.0f}" for r in results.values()]),
            table_row(f"  / {baseline}", [f"{r['episode_tokens_per_s'] / base:.2f}" for r in results.values()]),
            table_row("s / mini-batch", [f"{r['s_per_minibatch']:.3f}" for r in results.values()])]


def format_table(results: dict[str, dict]) -> str:
    """The columns side by side, with their ratios against the baseline."""
    note = (f"tool latency {1000 * LATENCY_S:.0f} ms per call; mini-batches of {CONFIG}'s size, its warm-started "
            "policy; no trainer, no broker")
    return "\n".join([*table_rows(results, BASELINE), "", note])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--quick", action="store_true", help="smoke: 2 mini-batches, 1 round, a 40-step warm start")
    parser.add_argument("--device", default="cpu", help="where the policy decodes: cpu (default) or cuda")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a stage process on its one core
    results = measure(args.quick, torch.device(args.device))
    print(format_table(results))
    if args.json:
        print(json.dumps(json_figures(results, BASELINE, latency_s=LATENCY_S)))


def json_figures(results: dict[str, dict], baseline: str, **settings: object) -> dict:
    """The JSON line's figures: `settings`, every column's figures as "<column>_<figure>", and each
    column's "<column>_speedup" in episode tokens/s against `baseline`."""
    base = results[baseline]["episode_tokens_per_s"]
    return {"baseline": baseline, **settings,
            **{f"{c}_{k}": round(v, 3) for c, r in results.items() for k, v in r.items()},
            **{f"{c}_speedup": round(r["episode_tokens_per_s"] / base, 3) for c, r in results.items()}}


if __name__ == "__main__":
    sys.exit(main())
