"""The memory sampler (`telemetry/memory.py`) on real processes: a child that allocates a known
amount, one that exits, a restart under a new pid; the job's peak as the sum at one instant; the
CUDA peaks stages report in their counts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stream_rlhf.telemetry import memory
from stream_rlhf.telemetry.memory import CUDA_PEAK, MemorySampler, Usage, describe, device_peaks, read_usage
from stream_rlhf.telemetry.stage_counts import StageCounts

ALLOCATE_MB = 200
CHILD = f"""
import sys
print("ready", flush=True)
sys.stdin.readline()
block = b"x" * ({ALLOCATE_MB} * 2**20)  # written, so resident (a zeroed bytearray may not be)
print("allocated", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def child():
    process = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    yield process
    if process.poll() is None:
        process.kill()
        process.wait()


def step(process: subprocess.Popen, expect: str | None) -> None:
    """Let the child go on to its next point (`expect`: the line it prints there; None: it exits)."""
    process.stdin.write("\n")
    process.stdin.flush()
    if expect is None:
        process.stdin.close()
        assert process.wait(timeout=30) == 0
    else:
        assert process.stdout.readline() == expect + "\n"


def test_a_child_allocating_200_mb_raises_its_peak_by_that_much(child):
    sampler = MemorySampler(lambda: {"test": os.getpid(), "child": child.pid})
    sampler.sample()
    before = sampler.per_process["child"]
    step(child, "allocated")
    sampler.sample()
    after = sampler.per_process["child"]
    fields = ("uss_kb", "pss_kb", "rss_kb")
    grown_mb = {field: (getattr(after, field) - getattr(before, field)) / 1024 for field in fields}
    assert all(grown >= 0.9 * ALLOCATE_MB for grown in grown_mb.values()), grown_mb
    assert after.uss_kb <= after.pss_kb <= after.rss_kb  # private pages are part of its share, its share of all
    summary = sampler.summary()
    assert summary["processes"] == 2 and summary["samples"] == 2
    assert summary["per_process"].keys() == {"test", "child"}
    assert summary["peak_pss_mb"] >= summary["per_process"]["child"]["peak_pss_mb"] + 1  # the test process adds to it
    assert summary["per_process"]["child"]["peak_uss_mb"] >= 0.9 * ALLOCATE_MB


def test_a_process_that_exits_keeps_its_peak_and_leaves_the_sum(child):
    sampler = MemorySampler(lambda: {"child": child.pid})
    step(child, "allocated")
    sampler.sample()
    peak = sampler.per_process["child"]
    step(child, None)
    assert read_usage(child.pid) is None  # exited and reaped: no file to read
    sampler.sample()  # the child is skipped, not an error
    assert sampler.per_process == {"child": peak}
    assert sampler.job_peak == peak
    assert sampler.samples == 2


def test_the_thread_samples_until_stopped_and_a_missing_pid_is_skipped(child):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with MemorySampler(lambda: {"child": child.pid, "gone": gone.pid}, period_s=0.01) as sampler:
        step(child, "allocated")  # the thread samples while the child allocates
    samples = sampler.samples
    assert samples >= 2  # the first at start, the last at stop
    assert sampler.per_process.keys() == {"child"}
    assert sampler.per_process["child"].uss_kb / 1024 >= 0.9 * ALLOCATE_MB  # the sample at stop saw the block
    assert sampler.samples == samples  # the thread has stopped


def test_the_job_peak_is_the_largest_sum_of_one_sample_and_a_restart_keeps_one_peak(monkeypatch):
    """a peaks in the first sample, b in the second: the job's peak is neither the sum of their
    peaks nor either sample alone but the larger sum; `a` restarted under pid 3 keeps one entry."""
    usage = {1: Usage(rss_kb=500, pss_kb=300, uss_kb=200), 2: Usage(rss_kb=100, pss_kb=100, uss_kb=50)}
    pids = {"a": 1, "b": 2}
    monkeypatch.setattr(memory, "read_usage", lambda pid: usage.get(pid))
    sampler = MemorySampler(lambda: pids)
    sampler.sample()  # a 300 + b 100 PSS
    usage[1], usage[2] = Usage(100, 100, 100), Usage(400, 250, 200)
    sampler.sample()  # a 100 + b 250
    pids["a"] = 3
    usage[3] = Usage(rss_kb=1024, pss_kb=150, uss_kb=150)
    sampler.sample()  # a restarted: 150 + b 250
    assert sampler.per_process == {"a": Usage(1024, 300, 200), "b": Usage(400, 250, 200)}
    assert sampler.job_peak == Usage(rss_kb=1424, pss_kb=400, uss_kb=350)
    summary = sampler.summary()
    assert summary["processes"] == 2 and summary["samples"] == 3
    assert summary["per_process"]["a"] == {"peak_pss_mb": 0.3, "peak_uss_mb": 0.2, "peak_rss_mb": 1.0}
    assert describe(summary) == "peak PSS 0 MB (RSS 1 MB) over 2 processes; largest a 0 MB"


def test_cuda_peaks_come_from_the_stages_counts(tmp_path):
    for instance, peak in (("actor_train-0", 512.0), ("actor_train-1", 768.5), ("ref_forward-0", 100.0)):
        StageCounts(tmp_path, instance.rpartition("-")[0], instance).set_details(**{CUDA_PEAK: peak})
    StageCounts(tmp_path, "rollout", "rollout-0").add(generated=3)  # reports no CUDA peak
    peaks = device_peaks(tmp_path, ["actor_train", "ref_forward", "rollout"])
    assert peaks == {"actor_train": 768.5, "ref_forward": 100.0}
    summary = MemorySampler(dict).summary(peaks)
    assert summary[CUDA_PEAK] == peaks and summary["processes"] == 0
    assert describe(summary) == "not sampled"
    assert CUDA_PEAK not in MemorySampler(dict).summary({})
