"""stream-rlhf against TRL's GRPOTrainer: same checkpoint, task, batch shape and step count.

Each row runs `stream-rlhf run configs/text_grpo.yaml` (this environment) and bench/trl_grpo.py
(TRL's environment) one after the other, on the same warm-started tiny Qwen2 checkpoint
(runs/.cache, made by our run first), the arithmetic task, 16 prompts x 4 samples per step, one
optimizer step per step, no KL (TRL's default beta=0), temperature 1, learning rate 2e-4:

    row                model                                     answers
    0.4M eos           the config's tiny model                   end at <eos> (at most 5 tokens)
    12M eos            hidden 512, 4 layers (12.7M parameters)   end at <eos> (at most 5 tokens)
    12M fixed48        the same                                  48 tokens (ours: no stop token;
                                                                 TRL: min_new_tokens=48)
    12M fixed48 bf16   the same, bf16 mixed precision on both sides (ours: `precision: bf16`;
                       TRL: `bf16=True`, autocast)
    12M fixed48 lora   the same in fp32, training LoRA adapters (rank 8, alpha 16, on the 7
                       projections of every layer) on both sides (ours: `actor.lora`; TRL: a PEFT
                       LoraConfig); not a default row, nor 0.4M_eos_lora (the same at 0.4M) nor
                       358M_fixed64_bf16_lora (the GPU row with LoRA, --device cuda)
    90M fixed64        hidden 1024, 8 layers (90.2M parameters)  64 tokens, fp32    (GPU rows, issue 32:
    358M fixed64 bf16  Qwen2-0.5B's layer shapes (358M)          64 tokens, bf16     --device cuda)

Every other row computes in fp32 on both sides (`precision=fp32` set on ours: its default, `auto`,
is bf16 on CUDA). (TRL's GRPOConfig defaults to bf16 mixed
precision, on the CPU too: rows measured before 2026-11-26 ran TRL in bf16 against our fp32.)

Figures per side, over the steps after the first SKIP (start-up, first compilation of shapes):

    s/step      mean wall time of a step (TRL: on_step_begin to on_step_end; ours: the trainer's
                `iteration_s`, end of one iteration's training to the end of the next's, which
                is the pipeline's throughput with generation overlapped)
    tokens/s    prompt + completion tokens of those steps / their time
    peak MB     the largest resident memory of the run's whole process tree, sampled every 0.2 s
    reward      mean reward over the first and the last quarter of the steps (the same samples
                per step on both sides; the curve itself is printed below the table)

TRL is not a dependency of this project. Set up its environment once, pinned to this torch
(`scripts/setup_trl.sh` does the same):

    python3 -m venv .venv-trl && .venv-trl/bin/pip install -c constraints/cpu.txt torch trl==1.16.0 peft==0.21.0

Run from the repository root (our side runs in this interpreter's environment):

    .venv/bin/python bench/vs_trl.py                 # the four rows (~7 minutes once warm-started)
    .venv/bin/python bench/vs_trl.py --rows 0.4M_eos --steps 10
    .venv/bin/python bench/vs_trl.py --trl-python PATH   # TRL in another environment
    python3 bench/vs_trl.py --device cuda --trl-python python3   # the GPU rows, both sides on cuda:0

`--device cuda` runs every stage of ours on cuda:0 (`placement.device=cuda`) and TRL with
`use_cpu=False`; its default rows are the two GPU rows. On a GPU machine without TRL, carry its
wheels (trl, datasets, accelerate and what they need) in .whl/ (`scripts/gpu_checks.sh` installs them).

Without a Python that imports trl it says how to make one and exits with code 2. Target on a
2-core CPU machine: ours / TRL tokens/s >= 1.0 in every row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from process_tree import process_table, tree  # bench/, beside this script

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/text_grpo.yaml"
SKIP = 2
TARGET = 1.0
GPU_WARM_START = ["model.warm_start.steps=100"]
"""--device cuda: a shorter warm start (trained on the GPU): the answers have a fixed length, so how
well the policy sums does not change the work a step does, and device time is scarce."""
TRL_SETUP = ("python3 -m venv .venv-trl && .venv-trl/bin/pip install -c constraints/cpu.txt torch trl==1.16.0 "
             "peft==0.21.0")
LORA_RANK = 8
"""The LoRA rows' adapters: this rank, alpha twice it, every projection (both sides' defaults)."""
MODEL_12M = ["model.tiny.hidden_size=512", "model.tiny.intermediate_size=1376", "model.tiny.num_hidden_layers=4",
             "model.tiny.num_attention_heads=8", "model.tiny.num_key_value_heads=8", "model.tiny.head_dim=64"]
SHAPE = ["rollout_batch.prompts_per_minibatch=16", "rollout_batch.minibatches=1", "rollout_batch.samples_per_prompt=4",
         "algorithm.ppo_epochs=1", "algorithm.train_minibatches=1", "algorithm.kl.coef=0", "actor.lr=2.0e-4",
         "rollout.temperature=1.0", "rollout.top_p=1.0"]
MODEL_90M = ["model.tiny.hidden_size=1024", "model.tiny.intermediate_size=2304", "model.tiny.num_hidden_layers=8",
             "model.tiny.num_attention_heads=16", "model.tiny.num_key_value_heads=16", "model.tiny.head_dim=64",
             "model.tiny.max_position_embeddings=128"]
MODEL_358M = ["model.tiny.hidden_size=896", "model.tiny.intermediate_size=4864", "model.tiny.num_hidden_layers=24",
              "model.tiny.num_attention_heads=14", "model.tiny.num_key_value_heads=2", "model.tiny.head_dim=64",
              "model.tiny.max_position_embeddings=128"]
"""Qwen2-0.5B's layer shapes with the project's own small vocabulary (bench/weight_sync.py has its full config)."""


@dataclass(frozen=True)
class Row:
    name: str
    model: list[str]
    """--set overrides of our run that choose the model."""
    max_new_tokens: int
    fixed: bool
    """Answers of exactly max_new_tokens tokens."""
    bf16: bool = False
    """bf16 mixed precision on both sides; fp32 otherwise."""
    lora: bool = False
    """LoRA adapters (rank LORA_RANK) train on both sides instead of the whole policy."""


ROWS = {
    "0.4M_eos": Row("0.4M_eos", [], 5, False),
    "12M_eos": Row("12M_eos", MODEL_12M, 5, False),
    "12M_fixed48": Row("12M_fixed48", MODEL_12M, 48, True),
    "12M_fixed48_bf16": Row("12M_fixed48_bf16", MODEL_12M, 48, True, bf16=True),
    "0.4M_eos_lora": Row("0.4M_eos_lora", [], 5, False, lora=True),
    "12M_fixed48_lora": Row("12M_fixed48_lora", MODEL_12M, 48, True, lora=True),
    "90M_fixed64": Row("90M_fixed64", MODEL_90M, 64, True),
    "358M_fixed64_bf16": Row("358M_fixed64_bf16", MODEL_358M, 64, True, bf16=True),
    "358M_fixed64_bf16_lora": Row("358M_fixed64_bf16_lora", MODEL_358M, 64, True, bf16=True, lora=True),
}
DEFAULT_ROWS = {"cpu": ["0.4M_eos", "12M_eos", "12M_fixed48", "12M_fixed48_bf16"],
                "cuda": ["90M_fixed64", "358M_fixed64_bf16"]}


class PeakMemory:
    """The largest sum of VmRSS over a process and its descendants, sampled in a thread."""

    PERIOD_S = 0.2

    def __init__(self, root_pid: int):
        self.root_pid = root_pid
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> float:
        """Stops sampling; the peak in MB."""
        self._stop.set()
        self._thread.join()
        return self.peak_kb / 1024

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            self.peak_kb = max(self.peak_kb, sum(_rss_kb(pid) for pid in tree(self.root_pid, process_table())))


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def run_watched(command: list[str], log_path: Path, timeout_s: float) -> float:
    """Runs `command` from the repository root, output to `log_path`; its peak memory in MB."""
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        memory = PeakMemory(process.pid)
        try:
            code = process.wait(timeout_s)
        finally:
            peak = memory.stop()
            if process.poll() is None:
                process.terminate()
                process.wait(60)
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(command)}: exit code {code}; the end of {log_path}:\n{tail}")
    return peak


def run_ours(row: Row, steps: int, device: str) -> tuple[dict, str]:
    """Our side of `row`: its figures and the warm-started checkpoint it started from."""
    name = f"bench_vs_trl_{row.name}" + ("_cuda" if device == "cuda" else "")
    overrides = [f"name={name}", f"iterations={steps}", f"rollout.max_new_tokens={row.max_new_tokens}",
                 *(["rollout.stop=[]"] if row.fixed else []), f"precision={'bf16' if row.bf16 else 'fp32'}",
                 *([f"placement.device={device}", *GPU_WARM_START] if device != "cpu" else []), *SHAPE, *row.model,
                 *([f"actor.lora={{rank: {LORA_RANK}, alpha: {2 * LORA_RANK}}}"] if row.lora else [])]
    command = [sys.executable, "-m", "stream_rlhf.cli", "run", CONFIG, *(f"--set={o}" for o in overrides)]
    peak = run_watched(command, REPO / "runs" / f"{name}.log", 1800)
    run_dir = REPO / "runs" / name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checkpoint = json.loads((run_dir / "summary.json").read_text())["start_checkpoint"]
    figures = side_figures([r["iteration_s"] for r in records], [r["tokens"] for r in records],
                           [r["reward"] for r in records], [r["response_len"] for r in records], peak)
    return figures, checkpoint


def run_trl(trl_python: str, row: Row, steps: int, checkpoint: str, device: str) -> dict:
    out = REPO / "runs" / f"bench_vs_trl_{row.name}_trl.json"
    command = [trl_python, "bench/trl_grpo.py", "--checkpoint", checkpoint, "--steps", str(steps),
               "--max-new-tokens", str(row.max_new_tokens), "--out", str(out), "--device", device,
               *(["--min-new-tokens", str(row.max_new_tokens)] if row.fixed else []), *(["--bf16"] if row.bf16 else []),
               *(["--lora-rank", str(LORA_RANK)] if row.lora else [])]
    peak = run_watched(command, REPO / "runs" / f"bench_vs_trl_{row.name}_trl.log", 1800)
    r = json.loads(out.read_text())
    return side_figures(r["step_s"], r["tokens"], r["reward"], r["completion_len"], peak)


def side_figures(step_s: list[float], tokens: list[int], reward: list[float], length: list[float],
                 peak_mb: float) -> dict:
    if len(step_s) <= SKIP:
        raise ValueError(f"{len(step_s)} steps: need more than SKIP={SKIP}")
    window_s, window_tokens = step_s[SKIP:], tokens[SKIP:]
    quarter = max(1, len(reward) // 4)
    return {
        "s_per_step": sum(window_s) / len(window_s),
        "tokens_per_s": sum(window_tokens) / sum(window_s),
        "peak_mb": peak_mb,
        "reward_first": sum(reward[:quarter]) / quarter,
        "reward_last": sum(reward[-quarter:]) / quarter,
        "reward_curve": reward,
        "completion_len": sum(length) / len(length),
    }


def format_row(name: str, ours: dict, trl: dict) -> list[str]:
    ratio = ours["tokens_per_s"] / trl["tokens_per_s"]
    verdict = "PASS" if ratio >= TARGET else "FAIL"
    lines = [f"{name}  (ours / TRL tokens/s = {ratio:.2f}x, target >= {TARGET}: {verdict})",
             f"  {'':14s}{'s/step':>9s}{'tokens/s':>10s}{'peak MB':>9s}{'reward first':>14s}{'last':>7s}{'len':>6s}"]
    for side, f in (("stream-rlhf", ours), ("TRL", trl)):
        lines.append(f"  {side:14s}{f['s_per_step']:9.3f}{f['tokens_per_s']:10.0f}{f['peak_mb']:9.0f}"
                     f"{f['reward_first']:14.3f}{f['reward_last']:7.3f}{f['completion_len']:6.2f}")
    for side, f in (("stream-rlhf", ours), ("TRL", trl)):
        lines.append(f"  reward curve {side:12s} " + " ".join(f"{r:.2f}" for r in f["reward_curve"]))
    return lines


def torch_device_name() -> str:
    """The CUDA device both sides run on, as torch names it."""
    import torch

    return torch.cuda.get_device_name(0)


def trl_python_or_exit(path: str) -> str:
    probe = subprocess.run([path, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True,
                           check=False) if Path(path).exists() or "/" not in path else None
    if probe is None or probe.returncode != 0:
        print(f"{path}: no Python that imports trl. Set one up (once):\n    {TRL_SETUP}", file=sys.stderr)
        sys.exit(2)
    return probe.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", default=str(REPO / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both sides run")
    parser.add_argument("--rows", default="", help=f"comma-separated, of {', '.join(ROWS)} (default: the "
                        "device's rows: " + "; ".join(f"{d}: {', '.join(r)}" for d, r in DEFAULT_ROWS.items()) + ")")
    parser.add_argument("--steps", type=int, default=0, help="steps per side (default: 30, 12 for fixed48)")
    parser.add_argument("--json", action="store_true", help="last line: every figure as JSON")
    args = parser.parse_args()
    names = args.rows.split(",") if args.rows else DEFAULT_ROWS[args.device]
    if unknown := [name for name in names if name not in ROWS]:
        parser.error(f"--rows: unknown {', '.join(unknown)} (rows: {', '.join(ROWS)})")
    rows = [ROWS[name] for name in names]
    version = trl_python_or_exit(args.trl_python)
    when = time.strftime("%Y-%m-%d %H:%M")
    where = f"{os.cpu_count()} CPUs" if args.device == "cpu" else f"{torch_device_name()}, {os.cpu_count()} CPUs"
    print(f"TRL {version} ({args.trl_python}) against stream-rlhf on {where}, {when}", flush=True)
    results = {}
    for row in rows:
        steps = args.steps or (12 if row.fixed else 30)
        print(f"{row.name}: stream-rlhf, {steps} steps ...", file=sys.stderr, flush=True)
        ours, checkpoint = run_ours(row, steps, args.device)
        print(f"{row.name}: TRL, {steps} steps ...", file=sys.stderr, flush=True)
        trl = run_trl(args.trl_python, row, steps, checkpoint, args.device)
        results[row.name] = {"ours": ours, "trl": trl, "ratio": ours["tokens_per_s"] / trl["tokens_per_s"]}
        print("\n".join(format_row(row.name, ours, trl)), flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
