"""Vision benchmark: the multimodal PPO job with the vision stage (prefetch on) and without it
(every stage that needs image features runs the vision tower itself), side by side.

Each column is one `stream-rlhf run configs/mllm_ppo.yaml` subprocess with the WORKLOAD
overrides below and a name of its own (runs/bench_vision_<column>/):

    prefetch      vision.prefetch=true    the vision stage encodes each image once, ahead of rollout
    no_prefetch   vision.prefetch=false   rollout, ref/critic forward and actor/critic training
                                          each encode the images of every mini-batch (the job
                                          has no actor forward: overlap_depth 1)

Figures, from each run's summary.json:

    encoder calls  images through the vision tower, summed over every stage (`images_encoded`)
    iteration s    mean time per training iteration, the first iteration (process start-up) left out
    speedup        iteration s without prefetch / with prefetch

Workload. The shapes task's 32x32 images make 4 image tokens, so little that the vision tower's
cost would be lost in the noise; a real VLM sees hundreds of image tokens per image, and its vision
tower costs about a third of an LM forward over them. The benchmark therefore upscales the same
images to 128x128 (`data.min_pixels`: 256 patches, 64 image tokens per image), with room for the
longer prompts in `model.tiny.max_position_embeddings`. Responses have a fixed length
(`rollout.stop=[]`) so the tokens per iteration do not drift with the policy, and the warm start
is 1 step (its own cache entry): the timing does not depend on the weights.

Run from the repository root:

    .venv/bin/python bench/vision.py            # full run (~4 minutes): the table
    .venv/bin/python bench/vision.py --quick    # smoke run: 3 iterations each
    .venv/bin/python bench/vision.py --json     # the table, then one JSON object as the last line

Each run's output goes to runs/bench_vision_<column>.log.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/mllm_ppo.yaml"
RUNS_DIR = REPO / "runs"
COLUMNS = {"prefetch": True, "no_prefetch": False}
WORKLOAD = [
    "data.min_pixels=16384",
    "data.max_pixels=16384",
    "model.tiny.max_position_embeddings=128",
    "model.warm_start.steps=1",
    "rollout.stop=[]",
    "rollout.max_new_tokens=4",
    "rollout_batch.prompts_per_minibatch=32",
    "rollout_batch.minibatches=4",
    "task.train_prompts=1024",
    "task.eval_prompts=32",
]
RUN_TIMEOUT_S = 900.0


def run_column(column: str, iterations: int, prefix: str) -> dict:
    """One `stream-rlhf run` subprocess; returns its summary.json."""
    name = f"bench_vision_{column}"
    log_path = RUNS_DIR / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    overrides = [f"name={name}", f"iterations={iterations}", f"vision.prefetch={str(COLUMNS[column]).lower()}",
                 f"broker.shm_prefix={prefix}", *WORKLOAD]
    command = [sys.executable, "-m", "stream_rlhf.cli", "run", CONFIG, *(f"--set={o}" for o in overrides)]
    with log_path.open("w") as log:
        code = subprocess.run(command, check=False, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              timeout=RUN_TIMEOUT_S).returncode
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(command)}: exit code {code}; the end of {log_path}:\n{tail}")
    return json.loads((RUNS_DIR / name / "summary.json").read_text())


def figures(summaries: dict[str, dict]) -> dict[str, float]:
    on, off = summaries["prefetch"], summaries["no_prefetch"]
    return {
        "encoder_calls_prefetch": on["images_encoded"],
        "encoder_calls_no_prefetch": off["images_encoded"],
        "iter_s_prefetch": on["iteration_s"],
        "iter_s_no_prefetch": off["iteration_s"],
        "speedup": round(off["iteration_s"] / on["iteration_s"], 3),
        "images_seen": on["images_seen"],
    }


def format_table(summaries: dict[str, dict], result: dict[str, float]) -> str:
    on, off = summaries["prefetch"], summaries["no_prefetch"]
    lines = [
        f"{'':24}{'prefetch':>12}{'no_prefetch':>14}{'ratio':>10}",
        f"{'images seen':24}{on['images_seen']:>12}{off['images_seen']:>14}",
        (f"{'encoder calls (images)':24}{on['images_encoded']:>12}{off['images_encoded']:>14}"
         f"{off['images_encoded'] / max(on['images_encoded'], 1):>10.2f}"),
        f"{'iteration s':24}{on['iteration_s']:>12.3f}{off['iteration_s']:>14.3f}{result['speedup']:>10.2f}",
        (f"{'tokens/s':24}{on['tokens_per_s']:>12.1f}{off['tokens_per_s']:>14.1f}"
         f"{on['tokens_per_s'] / max(off['tokens_per_s'], 1e-9):>10.2f}"),
        "by stage (prefetch):    " + json.dumps(on.get("images_encoded_by_stage", {})),
        "by stage (no_prefetch): " + json.dumps(off.get("images_encoded_by_stage", {})),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 iterations per column (a smoke run)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    iterations = 3 if args.quick else 10
    prefix = f"bv{uuid.uuid4().hex[:6]}"
    summaries = {}
    for column in COLUMNS:
        print(f"running {column} ({iterations} iterations)...", file=sys.stderr, flush=True)
        summaries[column] = run_column(column, iterations, prefix)
    result = figures(summaries)
    print(format_table(summaries, result))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
