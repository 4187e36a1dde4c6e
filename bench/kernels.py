"""Kernels benchmark: fused token log-probs vs eager log_softmax + gather, time and peak memory.

Two forms, each as the fused entry point of `stream_rlhf.kernels.logprob` against the eager code
it replaces (temperature 1, no entropy; labels uniform in [0, V)):

    logits   (T, V) logits given      naive: torch.log_softmax(logits.float(), -1).gather(-1, labels)
                                      fused: logprobs_from_logits(logits, labels)
    hidden   (T, H) hidden states and naive: logits = hidden @ weight.T, then as above
             the (V, H) LM head       fused: logprobs_from_hidden(hidden, weight, labels), which never
                                             holds more than a chunk of tokens' logits

at T in {2048, 8192} tokens, V in {32000, 152064} (Llama-2, Qwen2) and H = 1024. CUDA: bf16
inputs, the best backend the dispatcher picks (Triton); CPU: fp32 and the torch backend, whose
hidden form is chunked over V and whose logits form walks slices of rows through two reused
buffers (neither holds a (T, V) intermediate).

Every (form, variant, size) runs in a fresh subprocess, so that peak memory is that variant's alone:

    time       CUDA: cuda events, mean of 5 calls after one warm-up call.
               CPU: wall clock after a warm-up call on the first 256 tokens; one call at the
               benchmark's sizes (seconds each), the mean of 5 at --quick's.
    peak mem   memory the call needs beyond its inputs: CUDA torch.cuda.max_memory_allocated minus
               what was allocated before the call; CPU the process's peak RSS
               (getrusage ru_maxrss) after the call minus the peak before it (inputs allocated and
               warm-up done). Large CPU tensors are mmap'd and unmapped when freed, so the peak RSS
               tracks the largest set of live tensors.
    ratios     speedup = naive time / fused time; mem ratio = fused peak / naive peak.

Each worker also prints the mean log-prob; naive and fused must agree (else the row says so and the
run exits 1). A size whose naive variant would not fit in the memory available now is skipped, and
the table says so.

GPU targets (not reachable on CPU): at T = 8192, V = 152064, fused >= 2x faster than eager and
<= 1/8 of its peak memory.

Run from the repository root:

    .venv/bin/python bench/kernels.py            # full run (2 cores, fp32: ~3 minutes, ~11 GiB peak)
    .venv/bin/python bench/kernels.py --quick    # smoke run: T = 256, V = 4096, H = 256 (~8 s)
    .venv/bin/python bench/kernels.py --json     # the table, then one JSON object as the last line

JSON: device, dtype, backend, peak_mem_ratio and speedup (hidden form at the largest size run),
peak_mem_ratio_logits and speedup_logits (the same for the logits form), rows (every figure of every
size run) and skipped.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

FULL = {"tokens": (2048, 8192), "vocab": (32000, 152064), "hidden": 1024}
QUICK = {"tokens": (256,), "vocab": (4096,), "hidden": 256}
FORMS = ("logits", "hidden")
CPU_WARMUP_TOKENS = 256
CUDA_REPS = 5
CPU_ONE_REP_ELEMENTS = 2**26  # a CPU call over more (T * V) logits than this is timed once
CPU_SMALL_REPS = 5
WORKER_TIMEOUT_S = 600


@dataclass(frozen=True)
class Measure:
    """One variant at one size, as a worker reports it."""

    ms: float
    peak_bytes: int
    mean_logp: float


@dataclass(frozen=True)
class Row:
    """Naive and fused side by side at one size of one form."""

    form: str
    tokens: int
    vocab: int
    hidden: int
    naive_ms: float
    fused_ms: float
    speedup: float
    naive_peak_mb: float
    fused_peak_mb: float
    peak_mem_ratio: float
    agree: bool


def _device_dtype() -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def _variant(form: str, variant: str, tokens: int, vocab: int, hidden: int):
    """Inputs of one size and a function of a token count n that runs the variant on the first n tokens."""
    from stream_rlhf.kernels.logprob import logprobs_from_hidden, logprobs_from_logits

    device, dtype = _device_dtype()
    torch.manual_seed(0)
    labels = torch.randint(0, vocab, (tokens,), device=device)  # (T,)
    if form == "logits":
        logits = torch.randn(tokens, vocab, device=device, dtype=dtype)  # (T, V)
        if variant == "fused":
            return lambda n: logprobs_from_logits(logits[:n], labels[:n])[0]
        return lambda n: torch.log_softmax(logits[:n].float(), dim=-1).gather(-1, labels[:n, None]).squeeze(-1)
    states = torch.randn(tokens, hidden, device=device, dtype=dtype)  # (T, H)
    weight = torch.randn(vocab, hidden, device=device, dtype=dtype).mul_(hidden**-0.5)  # (V, H), in place: no
    # transient copy, which would raise the CPU peak RSS the measurement starts from
    if variant == "fused":
        return lambda n: logprobs_from_hidden(states[:n], weight, labels[:n])[0]
    return lambda n: torch.log_softmax((states[:n] @ weight.T).float(), dim=-1).gather(-1, labels[:n, None]).squeeze(-1)


def measure(form: str, variant: str, tokens: int, vocab: int, hidden: int) -> Measure:
    """Time and peak extra memory of one call, in this process (run it in a fresh one)."""
    run = _variant(form, variant, tokens, vocab, hidden)
    with torch.no_grad():
        if torch.cuda.is_available():
            run(tokens)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CUDA_REPS):
                logp = run(tokens)
            end.record()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
            return Measure(start.elapsed_time(end) / CUDA_REPS, peak, logp.float().mean().item())
        run(min(tokens, CPU_WARMUP_TOKENS))
        reps = 1 if tokens * vocab > CPU_ONE_REP_ELEMENTS else CPU_SMALL_REPS
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        start_s = time.perf_counter()
        for _ in range(reps):
            logp = run(tokens)
        ms = (time.perf_counter() - start_s) * 1e3 / reps
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        return Measure(ms, peak * 1024, logp.mean().item())


def _needed_bytes(form: str, tokens: int, vocab: int, hidden: int) -> int:
    """Inputs plus the naive variant's fp32 intermediates (the fused variant needs less)."""
    element = torch.finfo(_device_dtype()[1]).bits // 8
    upcast_and_log_softmax = tokens * vocab * (4 if element < 4 else 0) + tokens * vocab * 4
    if form == "logits":
        return tokens * vocab * element + upcast_and_log_softmax
    return (tokens + vocab) * hidden * element + tokens * vocab * element + upcast_and_log_softmax


def _available_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _run_worker(form: str, variant: str, tokens: int, vocab: int, hidden: int) -> Measure:
    argv = [sys.executable, __file__, "--worker", form, variant, str(tokens), str(vocab), str(hidden)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=WORKER_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{form}/{variant} T={tokens} V={vocab} failed:\n{done.stderr[-3000:]}")
    return Measure(**json.loads(done.stdout.strip().splitlines()[-1]))


def _row(form: str, tokens: int, vocab: int, hidden: int) -> Row:
    naive = _run_worker(form, "naive", tokens, vocab, hidden)
    fused = _run_worker(form, "fused", tokens, vocab, hidden)
    agree = abs(naive.mean_logp - fused.mean_logp) <= 1e-3 * abs(naive.mean_logp) + 1e-3
    return Row(
        form, tokens, vocab, hidden, round(naive.ms, 2), round(fused.ms, 2), round(naive.ms / fused.ms, 3),
        round(naive.peak_bytes / 2**20, 1), round(fused.peak_bytes / 2**20, 1),
        round(fused.peak_bytes / max(naive.peak_bytes, 1), 4), agree,
    )


def _backend() -> str:
    from stream_rlhf.kernels.dispatch import backend_for

    return backend_for(torch.empty(0, device=_device_dtype()[0]))


def _table(rows: list[Row], skipped: list[str]) -> str:
    head = f"{'form':<7}{'T':>6}{'V':>8}{'naive ms':>11}{'fused ms':>11}{'speedup':>9}"
    head += f"{'naive MB':>11}{'fused MB':>11}{'mem ratio':>11}  check"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.form:<7}{r.tokens:>6}{r.vocab:>8}{r.naive_ms:>11.1f}{r.fused_ms:>11.1f}{r.speedup:>9.2f}"
            f"{r.naive_peak_mb:>11.1f}{r.fused_peak_mb:>11.1f}{r.peak_mem_ratio:>11.4f}"
            f"  {'ok' if r.agree else 'MISMATCH'}"
        )
    lines += [f"skipped: {s}" for s in skipped]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small size, for a smoke test")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--worker", nargs=5, metavar=("FORM", "VARIANT", "T", "V", "H"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        form, variant, *size = args.worker
        print(json.dumps(asdict(measure(form, variant, *map(int, size)))))
        return 0

    sizes = QUICK if args.quick else FULL
    device, dtype = _device_dtype()
    print(f"device {device}, {dtype}, fused backend {_backend()}; peak mem = memory beyond the inputs", flush=True)
    rows: list[Row] = []
    skipped: list[str] = []
    for form in FORMS:
        for tokens in sizes["tokens"]:
            for vocab in sizes["vocab"]:
                needed, available = _needed_bytes(form, tokens, vocab, sizes["hidden"]), _available_bytes()
                if needed > 0.9 * available:
                    skipped.append(
                        f"{form} T={tokens} V={vocab}: needs ~{needed / 2**30:.1f} GiB, "
                        f"{available / 2**30:.1f} GiB available"
                    )
                    continue
                rows.append(_row(form, tokens, vocab, sizes["hidden"]))
    print(_table(rows, skipped))
    print("GPU targets at T=8192, V=152064: speedup >= 2, mem ratio <= 0.125 (hidden form)")
    if args.json and rows:
        largest = {form: max((r for r in rows if r.form == form), key=lambda r: r.tokens * r.vocab) for form in FORMS}
        print(json.dumps({
            "device": str(device), "dtype": str(dtype), "backend": _backend(),
            "peak_mem_ratio": largest["hidden"].peak_mem_ratio, "speedup": largest["hidden"].speedup,
            "peak_mem_ratio_logits": largest["logits"].peak_mem_ratio, "speedup_logits": largest["logits"].speedup,
            "rows": [asdict(r) for r in rows], "skipped": skipped,
        }))
    return 0 if rows and all(r.agree for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
