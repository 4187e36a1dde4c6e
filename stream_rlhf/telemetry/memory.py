"""Peak memory of a job's processes (Linux): a daemon thread reads /proc/<pid>/smaps_rollup of each
named process every PERIOD_S and keeps the peaks.

    sampler = MemorySampler(job.pids)      # a callable: {process name: pid}, read at every sample
    with sampler:                          # samples from here...
        job.wait(...)                      # ...to here (and once more on the way out)
    sampler.summary()  -> {"peak_pss_mb": ..., "peak_rss_mb": ..., "peak_uss_mb": ..., "processes": 10,
                           "samples": 84, "per_process": {"rollout-0": {"peak_pss_mb": ..., ...}, ...}}

Three figures per process, from the kernel's own accounting of its pages:
    RSS   resident pages, shared ones counted in full in every process that maps them (the torch
          libraries every stage process loads count once per process).
    PSS   resident pages, each shared page divided among the processes that map it: the PSS of a
          set of processes sums to the memory they use together. The job's figure.
    USS   Private_Clean + Private_Dirty: the pages only this process maps, what its exit frees.
Per process: the largest value any sample saw, by name, so an instance restarted under a new pid
keeps one peak. The job: the largest sum over the processes of one sample (not the sum of the
per-process peaks, which may not coincide). A process that exited, or whose file cannot be read,
is left out of that sample. MB here is 2**20 bytes.

Sampling misses a peak shorter than PERIOD_S. GPU memory cannot be read from outside the process:
a stage that uses CUDA reports its own peak with `cuda_peak_mb()` under CUDA_PEAK in its stage
counts' details (`StageCounts.set_details`), and `device_peaks` collects them for the summary.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stream_rlhf.telemetry.stage_counts import read_stage_details

log = logging.getLogger(__name__)
PERIOD_S = 0.5
CUDA_PEAK = "cuda_peak_allocated_mb"
"""The stage counts' details key of a stage's torch.cuda.max_memory_allocated, in MB."""
_FIELDS = {"Rss:": "rss", "Pss:": "pss", "Private_Clean:": "uss", "Private_Dirty:": "uss"}


@dataclass(frozen=True)
class Usage:
    """Memory of one process, or of several summed, in kB (smaps_rollup's unit)."""

    rss_kb: int = 0
    pss_kb: int = 0
    uss_kb: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.rss_kb + other.rss_kb, self.pss_kb + other.pss_kb, self.uss_kb + other.uss_kb)

    def peak(self, other: Usage) -> Usage:
        """Field by field, the larger of the two."""
        return Usage(max(self.rss_kb, other.rss_kb), max(self.pss_kb, other.pss_kb), max(self.uss_kb, other.uss_kb))

    def as_mb(self) -> dict[str, float]:
        return {"peak_pss_mb": _mb(self.pss_kb), "peak_uss_mb": _mb(self.uss_kb), "peak_rss_mb": _mb(self.rss_kb)}


def read_usage(pid: int) -> Usage | None:
    """The process's memory now; None when it has exited, is a zombie (no pages) or cannot be read."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:  # gone, or not ours to read
        return None
    kb = {"rss": 0, "pss": 0, "uss": 0}
    seen = False
    for line in text.splitlines():
        label, _, rest = line.partition(" ")
        if label in _FIELDS:
            kb[_FIELDS[label]] += int(rest.split()[0])
            seen = True
    return Usage(kb["rss"], kb["pss"], kb["uss"]) if seen else None


class MemorySampler:
    """Samples the processes `pids()` names, every `period_s`, in a daemon thread (module docstring)."""

    def __init__(self, pids: Callable[[], Mapping[str, int]], period_s: float = PERIOD_S):
        self.pids = pids
        self.period_s = period_s
        self.per_process: dict[str, Usage] = {}
        """Peak by process name, over every sample that found it."""
        self.job_peak = Usage()
        """Field by field, the largest sum over the processes of one sample."""
        self.samples = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def __enter__(self) -> MemorySampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after one last sample."""
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a figure must never stop the job it measures
                log.exception("memory sampling failed; no more samples")
                return
            if self._stop.wait(self.period_s):
                return

    def sample(self) -> None:
        """Read every named process once and update the peaks."""
        usages = {name: usage for name, pid in dict(self.pids()).items() if (usage := read_usage(pid)) is not None}
        with self._lock:
            for name, usage in usages.items():
                self.per_process[name] = self.per_process.get(name, Usage()).peak(usage)
            self.job_peak = self.job_peak.peak(sum(usages.values(), Usage()))
            self.samples += 1

    def summary(self, device_peaks: Mapping[str, float] | None = None) -> dict[str, Any]:
        """The `memory` block of summary.json; `device_peaks` (stage -> MB, from `device_peaks`) is
        added as CUDA_PEAK when any stage reported one."""
        with self._lock:
            figures: dict[str, Any] = {
                **self.job_peak.as_mb(), "processes": len(self.per_process), "samples": self.samples,
                "per_process": {name: usage.as_mb() for name, usage in sorted(self.per_process.items())},
            }
        if device_peaks:
            figures[CUDA_PEAK] = dict(device_peaks)
        return figures


def describe(summary: Mapping[str, Any]) -> str:
    """One line for the log and the summary table."""
    if not summary["processes"]:
        return "not sampled"
    per = summary["per_process"]
    largest = max(per, key=lambda name: per[name]["peak_pss_mb"])
    return (f"peak PSS {summary['peak_pss_mb']:,.0f} MB (RSS {summary['peak_rss_mb']:,.0f} MB) over "
            f"{summary['processes']} processes; largest {largest} {per[largest]['peak_pss_mb']:,.0f} MB")


def cuda_peak_mb() -> float | None:
    """This process's torch.cuda.max_memory_allocated in MB (None without CUDA in use): what a stage
    reports under CUDA_PEAK."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return _mb(torch.cuda.max_memory_allocated() // 1024)


def device_peaks(run_dir: Path, stages: Iterable[str]) -> dict[str, float]:
    """The largest CUDA_PEAK each stage's processes reported (stages that reported none left out)."""
    peaks: dict[str, float] = {}
    for stage in stages:
        reported = [float(d[CUDA_PEAK]) for d in read_stage_details(run_dir, stage) if CUDA_PEAK in d]
        if reported:
            peaks[stage] = max(reported)
    return peaks


def _mb(kb: int) -> float:
    return round(kb / 1024, 1)
