"""A verifier that computes in Python: the reward function in the stage's process against
`reward.workers`.

The reward stage scores a mini-batch one sample after another in its own process; with
`reward.workers: N` the function runs in N processes of its own (`rl/reward_pool.py`), N samples
at once. This script scores SAMPLES synthetic (prompt, response, reference) triples with
`verify`, which spends CPU_S of its thread's CPU time in pure Python per sample (a symbolic
checker's cost) and then gives the arithmetic task's reward, in columns that take turns, ROUNDS
times:

    in_process   the stage's own loop (`reward.workers: 0`, the baseline)
    workers1     reward.workers: 1
    workers2     reward.workers: 2

Figures: samples scored per second, and the ratio against in_process. The pools are started
before the clock starts (the stage starts its pool at setup). Every column gives the same scores
(checked). The table says how many cores there were: workers beyond them cannot help.

    .venv/bin/python bench/reward_workers.py            # about 20 s on 2 idle cores
    .venv/bin/python bench/reward_workers.py --json     # and one JSON line
    .venv/bin/python bench/reward_workers.py --quick    # smoke: 32 samples, 1 round
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from stream_rlhf.data.arithmetic import reward
from stream_rlhf.envs.calculator import compute_for
from stream_rlhf.rl.reward_pool import OUTCOME, RewardPool

CPU_S = 0.002
SAMPLES = 512
ROUNDS = 3
FUNCTION = "reward_workers:verify"
"""This file's `verify`, as the workers import it (bench/ is on the path they are given)."""
COLUMNS = {"in_process": 0, "workers1": 1, "workers2": 2}
"""column -> reward.workers."""
BASELINE = "in_process"


def verify(prompt: str, response: str, reference: str) -> float:
    """The arithmetic reward, after CPU_S of pure-Python work (the calculator tool's `cpu_s` work)."""
    compute_for(CPU_S)
    return reward(prompt, response, reference)


def samples(count: int) -> list[tuple[str, str, str, dict]]:
    """Sums with right and wrong answers."""
    rng = random.Random(0)
    out = []
    for _ in range(count):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        answer = a + b + rng.choice([0, 0, 1, -10])
        out.append((f"{a}+{b}=", str(answer), str(a + b), {}))
    return out


def measure(quick: bool) -> dict[str, dict]:
    calls = samples(32 if quick else SAMPLES)
    rounds = 1 if quick else ROUNDS
    pools = {column: RewardPool({OUTCOME: FUNCTION}, workers, timeout_s=30.0, timeout_score=0.0)
             for column, workers in COLUMNS.items() if workers}
    seconds = {column: 0.0 for column in COLUMNS}
    scores: dict[str, list[float]] = {}
    try:
        for _ in range(rounds):
            for column in COLUMNS:
                started = time.perf_counter()
                pool = pools.get(column)
                if pool is None:
                    scores[column] = [float(verify(*call[:3], **call[3])) for call in calls]
                else:
                    scores[column], timeouts = pool.run(OUTCOME, calls)
                    assert not timeouts, timeouts
                seconds[column] += time.perf_counter() - started
    finally:
        for pool in pools.values():
            pool.close()
    assert all(s == scores[BASELINE] for s in scores.values()), "the columns' scores differ"
    return {column: {"samples_per_s": rounds * len(calls) / s} for column, s in seconds.items()}


def format_table(results: dict[str, dict]) -> str:
    base = results[BASELINE]["samples_per_s"]
    header = f"{'':<20}" + "".join(f"{c:>12}" for c in results)
    rate = f"{'samples/s':<20}" + "".join(f"{r['samples_per_s']:>12,.0f}" for r in results.values())
    ratio = f"{'  / ' + BASELINE:<20}" + "".join(f"{r['samples_per_s'] / base:>12.2f}" for r in results.values())
    return "\n".join([header, rate, ratio, "", f"{1000 * CPU_S:.0f} ms of pure Python per sample; "
                      f"{os.cpu_count()} cores"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--quick", action="store_true", help="smoke: 32 samples, 1 round")
    args = parser.parse_args()
    results = measure(args.quick)
    print(format_table(results))
    if args.json:
        base = results[BASELINE]["samples_per_s"]
        print(json.dumps({"baseline": BASELINE, "cpu_s": CPU_S,
                          **{f"{c}_samples_per_s": round(r["samples_per_s"], 1) for c, r in results.items()},
                          **{f"{c}_speedup": round(r["samples_per_s"] / base, 3) for c, r in results.items()}}))


if __name__ == "__main__":
    sys.exit(main())
