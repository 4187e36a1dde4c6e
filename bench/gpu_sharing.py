"""One GPU, many stages (issue 32, item 5): the main job with every stage on cuda:0, three ways of
sharing the device, side by side (a GPU machine only):

    separate   every stage its own process, each with a CUDA context of its own (the default);
               the baseline
    groups     the model stages in two device groups (bench/offload.py's `forwards` and
               `trainers`), nothing offloaded: two processes hold the models' contexts instead
               of one each, and the stages of a group take turns in its process
    mps        separate, under a CUDA MPS server started for the run (`nvidia-cuda-mps-control -d`
               with pipe and log folders of its own, stopped after): the processes' kernels share
               the device at once instead of time-slicing it

Each column is one `stream-rlhf run configs/mllm_ppo.yaml --set placement.device=cuda` subprocess
(runs/bench_gpu_sharing_<column>/). Figures:

    iteration s      mean `iteration_s`, the first SKIP iterations left out
    device MB        what nvidia-smi counts on GPU 0 (`memory.used`: contexts, caches and the MPS
                     server included), its peak over the run less its reading before the run
    processes        the job's processes (the broker included)
    tokens/s         summary.json `tokens_per_s`

and each against separate. The last lines name the fastest column and the one with the least
device memory: the evidence for the default on a machine with fewer GPUs than GPU stages. When
MPS cannot start (no nvidia-cuda-mps-control, or no right to run it: root in most containers) the
mps column says why and the others still run.

    python bench/gpu_sharing.py --json                    # ~3 minutes on an H100
    python bench/gpu_sharing.py --iterations 6 --json     # scripts/gpu_checks.sh sharing
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import offload  # bench/, beside this script: the device groups
from pipeline import mean_iteration_s, progress

from stream_rlhf.config import load_config
from stream_rlhf.rl.config import RLJobConfig

REPO = offload.REPO
CONFIG = offload.CONFIG
COLUMNS = ("separate", "groups", "mps")
SKIP = 2
SAMPLE_S = 0.5
"""How often nvidia-smi is read during a run."""


class MpsUnavailable(RuntimeError):
    """The MPS server could not start here; the message says why."""


def column_overrides(column: str, iterations: int, prefix: str) -> list[str]:
    """Every `--set` of the column's run (mps runs separate's job under the MPS server)."""
    if column not in COLUMNS:
        raise ValueError(f"column {column!r}: one of {', '.join(COLUMNS)}")
    own = [f"name=bench_gpu_sharing_{column}", f"iterations={iterations}", f"broker.shm_prefix={prefix}{column[:2]}",
           "placement.device=cuda"]
    if column == "groups":
        stages = offload.model_stages(load_config(RLJobConfig, REPO / CONFIG, own))
        own += [o for o in offload.group_overrides(stages) if ".offload=" not in o]
    load_config(RLJobConfig, REPO / CONFIG, own)  # a bad key or value is a ConfigError before anything runs
    return own


def memory_used_mb(text: str) -> float:
    """GPU 0's `memory.used` from `nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits`."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    try:
        return float(first)
    except ValueError:
        raise RuntimeError(f"nvidia-smi memory.used: cannot read {text!r}") from None


def read_memory_used_mb() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, timeout=30, check=True)
    return memory_used_mb(out.stdout)


class DeviceMemoryPeak:
    """nvidia-smi's memory.used on GPU 0, every SAMPLE_S in a thread while a run lasts: its peak
    over the reading taken before the run."""

    def __init__(self, read: Callable[[], float] = read_memory_used_mb):
        self.read = read
        self.before_mb = read()
        self.peak_mb = self.before_mb
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, pid: int) -> Callable[[], None]:
        """run_logged's hook: sample from now until the returned function is called."""
        self._thread = threading.Thread(target=self._sample, name="nvidia-smi", daemon=True)
        self._thread.start()
        return self.stop

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak_mb = max(self.peak_mb, self.read())

    @property
    def job_mb(self) -> float:
        return self.peak_mb - self.before_mb


@contextlib.contextmanager
def mps_server(control: str | None = None) -> Iterator[dict[str, str]]:
    """A CUDA MPS server for the block; yields the environment that points CUDA processes at it.
    Raises MpsUnavailable (why) when it cannot start."""
    control = control or shutil.which("nvidia-cuda-mps-control")
    if control is None:
        raise MpsUnavailable("nvidia-cuda-mps-control is not on PATH")
    folder = Path(tempfile.mkdtemp(prefix="srl-mps-"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
    for path in env.values():
        Path(path).mkdir()
    try:
        started = subprocess.run([control, "-d"], env={**os.environ, **env}, capture_output=True, text=True,
                                 timeout=30, check=False)
    except OSError as exc:
        raise MpsUnavailable(f"{control} -d: {exc}") from None
    if started.returncode != 0:
        raise MpsUnavailable(f"{control} -d exited with {started.returncode}: "
                             f"{(started.stderr or started.stdout).strip() or 'no output'}")
    try:
        yield env
    finally:
        subprocess.run([control], input="quit\n", env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=60, check=False)


def run_column(overrides: list[str], prefix: str, env: dict[str, str]) -> dict:
    """One run of a column (bench/offload.py's runner: nothing may be left in /dev/shm): its figures."""
    memory = DeviceMemoryPeak()
    run_dir = offload.run_column(overrides, prefix, env, watch=memory.watch)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"iteration_s": mean_iteration_s(run_dir, SKIP), "device_mb": memory.job_mb,
            "processes": (summary.get("memory") or {}).get("processes", 0), "tokens_per_s": summary["tokens_per_s"]}


def figures(results: dict[str, dict], unavailable: dict[str, str]) -> dict:
    """The JSON line: each column's figures and ratios against separate, the fastest column, the
    one with the least device memory, and why a column could not run."""
    base = results["separate"]
    out: dict = {"baseline": "separate"}
    for column, r in results.items():
        out[f"iter_s_{column}"] = round(r["iteration_s"], 3)
        out[f"device_mb_{column}"] = round(r["device_mb"], 1)
        out[f"processes_{column}"] = r["processes"]
        out[f"iter_s_{column}_over_separate"] = round(r["iteration_s"] / base["iteration_s"], 3)
        if base["device_mb"] > 0:
            out[f"device_mb_{column}_over_separate"] = round(r["device_mb"] / base["device_mb"], 3)
    out["fastest"] = min(results, key=lambda c: results[c]["iteration_s"])
    out["least_device_memory"] = min(results, key=lambda c: results[c]["device_mb"])
    out["unavailable"] = unavailable
    return out


ROWS = (("iteration s (mean)", "iteration_s", ".3f"), ("device MB (nvidia-smi)", "device_mb", ",.0f"),
        ("processes", "processes", "d"), ("tokens/s", "tokens_per_s", ",.0f"))
"""The table's rows: label, figure, format (each but processes followed by its ratio to separate)."""


def format_table(results: dict[str, dict], unavailable: dict[str, str], iterations: int) -> str:
    """The columns side by side with their ratios, then which is fastest and leanest, and why a
    column did not run."""
    base = results["separate"]
    rows = [("", *results)]
    for label, key, fmt in ROWS:
        rows.append((label, *(format(r[key], fmt) for r in results.values())))
        if key != "processes" and base[key] > 0:
            rows.append(("  / separate", *(f"{r[key] / base[key]:.2f}" for r in results.values())))
    lines = [f"{label:<24}" + "".join(f"{v:>12}" for v in values) for label, *values in rows]
    out = figures(results, unavailable)
    notes = [f"fastest: {out['fastest']}; least device memory: {out['least_device_memory']}",
             *(f"{column}: not run: {why}" for column, why in unavailable.items()),
             f"workload: {CONFIG}, placement.device=cuda, {iterations} iterations (the first {SKIP} not timed)"]
    return "\n".join([*lines, "", *notes])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=8, help="iterations of each run (default 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    args = parser.parse_args()
    if args.iterations <= SKIP + 1:
        parser.error(f"--iterations {args.iterations}: more than {SKIP + 1} (the first {SKIP} are not timed)")
    if shutil.which("nvidia-smi") is None:
        sys.exit("bench/gpu_sharing.py: nvidia-smi not found: this benchmark runs on a CUDA machine "
                 "(scripts/gpu_checks.sh sharing)")
    prefix = f"gs{uuid.uuid4().hex[:6]}"
    overrides = {column: column_overrides(column, args.iterations, prefix) for column in COLUMNS}
    results: dict[str, dict] = {}
    unavailable: dict[str, str] = {}
    for column in COLUMNS:
        started = time.monotonic()
        progress(f"{column}: {args.iterations} iterations (runs/bench_gpu_sharing_{column}.log)")
        try:
            with mps_server() if column == "mps" else contextlib.nullcontext({}) as env:
                if env:
                    progress(f"{column}: the MPS server's log goes to {env['CUDA_MPS_LOG_DIRECTORY']} (kept)")
                results[column] = run_column(overrides[column], prefix, env)
        except (MpsUnavailable, RuntimeError) as exc:
            if not isinstance(exc, MpsUnavailable) and column != "mps":
                raise
            # a server that started but whose clients fail (a container's limits) costs the column, not the others
            unavailable[column] = str(exc).splitlines()[0]
            progress(f"{column}: not run: {exc}")
            continue
        progress(f"{column}: {results[column]['iteration_s']:.3f} s/iteration, {results[column]['device_mb']:,.0f} MB "
                 f"on the device ({time.monotonic() - started:.0f} s)")
    print(format_table(results, unavailable, args.iterations))
    if args.json:
        print(json.dumps(figures(results, unavailable)))


if __name__ == "__main__":
    main()
