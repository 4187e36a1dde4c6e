"""Weight-sync benchmark: one full policy update from the trainer to a rollout process, per
transport, against the baseline of reloading a checkpoint file from disk, side by side.

Each figure is the time from the trainer holding its weights (a model's named parameters) to a
second process (spawned, like a rollout) holding them copied into its own model of the same
architecture, and the rate in GB/s (the weights' bytes, tied ones once, / that time):

    disk_reload  baseline: the trainer saves a safetensors file under runs/ (a real disk, not
                 /dev/shm), the receiver loads it into its model; a warm-cache read (the page
                 cache cannot be dropped without root), so a lower bound for a real reload.
                 `disk_reload_load_s` is the load alone.
    shm          WeightStore.publish into /dev/shm, then load_into the receiver's model (what the
                 forward stages and torch rollout do)
    gloo         BroadcastSender.publish (packs the snapshot) -> BroadcastReceiver.receive over a
                 gloo group on loopback -> load (the receiver asked first, as a rollout does)
    cuda_ipc     CudaIpcSender / CudaIpcReceiver, both models on the GPU (only with CUDA;
                 otherwise reported as unavailable, null in the JSON)

`speedup` columns are disk_reload s / transport s. Medians over REPEATS runs after one warm-up
(which also takes the page faults of fresh buffers). Each process runs torch on one thread (the
machine the figures in bench/RESULTS.md come from has 2 cores).

Models: `tiny`, the project's default tiny Qwen2 (`build_tiny(TinyModelConfig())`), and
`qwen2-0.5b`, a Qwen2 with Qwen2-0.5B's shapes (494M parameters, fp32, tied embeddings, random
weights: no download). Memory: the trainer's model and snapshot plus the receiver's model and
receive buffers, four copies (~8 GB) during the gloo run, three during the others.

Run from the repository root:

    .venv/bin/python bench/weight_sync.py            # both models (~2 minutes)
    .venv/bin/python bench/weight_sync.py --quick    # the tiny model only (a smoke run)
    .venv/bin/python bench/weight_sync.py --json     # the table, then one JSON object as the last line

JSON: the top-level keys are for the largest model measured (`qwen2-0.5b`; with --quick the tiny
one), named by "model": params, bytes, <transport>_s, <transport>_gbps, <transport>_speedup
for shm, gloo and cuda_ipc (null when unavailable), disk_reload_s, disk_reload_gbps,
disk_reload_load_s; a full run adds the tiny model's figures under "tiny".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from stream_rlhf.weights.broadcast import BroadcastReceiver, BroadcastSender
from stream_rlhf.weights.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from stream_rlhf.weights.shm_store import SHM_ROOT, WeightStore

REPO = Path(__file__).resolve().parents[1]
RUNS_DIR = REPO / "runs"
QWEN2_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
REPEATS = {"tiny": 7, "qwen2-0.5b": 5}
TRANSPORTS = ("disk_reload", "shm", "gloo", "cuda_ipc")
BUCKET_BYTES = 64 << 20
TIMEOUT_S = 120.0
SETTLE_S = 0.05
"""How long the trainer lets the receiver's request reach the sender before it publishes."""


def tiny_config() -> Qwen2Config:
    from stream_rlhf.models.checkpoint import build_tiny
    from stream_rlhf.models.model_config import TinyModelConfig
    from stream_rlhf.models.tokenizer import build_tokenizer

    return build_tiny(TinyModelConfig(), build_tokenizer(), seed=0).config


def empty_model(config: Qwen2Config, device: str) -> PreTrainedModel:
    """The architecture with uninitialised weights (the receiver's: they are overwritten)."""
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model.to_empty(device=device)
    model.tie_weights()
    return model


def random_model(config: Qwen2Config, device: str) -> PreTrainedModel:
    model = empty_model(config, device)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    return model


def load_named(model: PreTrainedModel, named) -> None:
    """Copy (name, tensor) pairs into `model`'s weights (a tied weight's either name)."""
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in (named.items() if isinstance(named, dict) else named):
            state[name].copy_(tensor)


def checksum(model: PreTrainedModel) -> float:
    with torch.no_grad():
        return float(sum(p.sum(dtype=torch.float64) for p in model.parameters()))


def _receiver_main(conn: Connection, config: dict, device: str) -> None:
    """The rollout side: commands from the trainer over `conn`, the time each update ended back."""
    torch.set_num_threads(1)
    model = empty_model(Qwen2Config(**config), device)
    receiver = None
    conn.send("ready")
    while (command := conn.recv()) is not None:
        kind, arg = command
        if kind == "disk_reload":
            start = time.perf_counter()
            load_model(model, arg)
            conn.send((start, time.perf_counter()))
        elif kind == "shm":
            root, version = arg
            assert WeightStore(root, "actor").load_into(model) == version
            conn.send((None, time.perf_counter()))
        elif kind in ("join_gloo", "join_cuda_ipc"):
            folder, name = arg
            receiver = (BroadcastReceiver.join(folder, name, 1, 2, "gloo", TIMEOUT_S) if kind == "join_gloo"
                        else CudaIpcReceiver.join(folder, name, TIMEOUT_S, device=device))
            conn.send("joined")
        elif kind == "receive":
            conn.send("asking")
            load_named(model, receiver.receive(min_version=arg)[1])
            if device != "cpu":
                torch.cuda.synchronize()
            conn.send((None, time.perf_counter()))
        elif kind == "leave":
            receiver.close()
            receiver = None
            conn.send("left")
        elif kind == "checksum":
            conn.send(checksum(model))


class Receiver:
    """The spawned rollout-side process."""

    def __init__(self, config: Qwen2Config, device: str):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_receiver_main, args=(child, config.to_dict(), device), daemon=True)
        self.process.start()
        self.expect("ready")

    def call(self, kind: str, arg=None):
        self.conn.send((kind, arg))
        return self.reply()

    def reply(self):
        if not self.conn.poll(TIMEOUT_S):
            raise TimeoutError(f"the receiver process said nothing for {TIMEOUT_S}s (alive: {self.process.is_alive()})")
        return self.conn.recv()

    def expect(self, what: str) -> None:
        got = self.reply()
        if got != what:
            raise RuntimeError(f"the receiver process answered {got!r}, expected {what!r}")

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def timed(update: Callable[[int], tuple[float, float | None, float]], repeats: int) -> tuple[float, float | None]:
    """Median (total s, part s) over `repeats` runs of update(version) after one warm-up."""
    runs = [update(version) for version in range(1, repeats + 2)][1:]
    totals = [end - start for start, _, end in runs]
    parts = [end - part for _, part, end in runs if part is not None]
    return statistics.median(totals), statistics.median(parts) if parts else None


def run_disk_reload(model, receiver: Receiver, workdir: Path, repeats: int) -> dict:
    def update(version: int):
        path = workdir / f"v{version}.safetensors"
        start = time.perf_counter()
        save_model(model, str(path))
        load_start, end = receiver.call("disk_reload", str(path))
        path.unlink()
        return start, load_start, end

    total, load = timed(update, repeats)
    return {"disk_reload_s": total, "disk_reload_load_s": load}


def run_shm(model, receiver: Receiver, repeats: int) -> dict:
    root = SHM_ROOT / f"bench-weight-sync-{uuid.uuid4().hex[:8]}"
    store = WeightStore(root, "actor")

    def update(version: int):
        start = time.perf_counter()
        store.publish(model, version)
        _, end = receiver.call("shm", (root, version))
        return start, None, end

    try:
        return {"shm_s": timed(update, repeats)[0]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_pushed(transport: str, model, receiver: Receiver, workdir: Path, repeats: int) -> dict:
    """gloo or cuda_ipc: the receiver asks, the trainer publishes, the receiver loads."""
    folder = workdir / transport
    sender = (BroadcastSender(folder, {"rollout-0": 2}, "gloo", BUCKET_BYTES, TIMEOUT_S) if transport == "gloo"
              else CudaIpcSender(folder, ["rollout-0"], BUCKET_BYTES, TIMEOUT_S))
    named = list(model.named_parameters())

    def update(version: int):
        receiver.conn.send(("receive", version))
        receiver.expect("asking")
        time.sleep(SETTLE_S)
        start = time.perf_counter()
        sender.publish(named, version)
        _, end = receiver.reply()
        return start, None, end

    try:
        receiver.conn.send((f"join_{transport}", (folder, "rollout-0")))
        receiver.expect("joined")
        result = {f"{transport}_s": timed(update, repeats)[0]}
        receiver.call("leave")
        return result
    finally:
        sender.close()


def measure(name: str, config: Qwen2Config, workdir: Path) -> dict:
    repeats = REPEATS[name]
    print(f"{name}: building the models...", file=sys.stderr, flush=True)
    model = random_model(config, "cpu")
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result: dict = {"params": params, "bytes": nbytes}
    receiver = Receiver(config, "cpu")
    try:
        for transport in ("disk_reload", "shm", "gloo"):
            print(f"{name}: {transport} ({repeats} repeats)...", file=sys.stderr, flush=True)
            if transport == "disk_reload":
                result.update(run_disk_reload(model, receiver, workdir, repeats))
            elif transport == "shm":
                result.update(run_shm(model, receiver, repeats))
            else:
                result.update(run_pushed(transport, model, receiver, workdir, repeats))
            if receiver.call("checksum") != checksum(model):
                raise RuntimeError(f"{name}: {transport}: the receiver's weights differ from the trainer's")
    finally:
        receiver.close()
    result["cuda_ipc_s"] = measure_cuda_ipc(name, config, workdir, repeats) if torch.cuda.is_available() else None
    for transport in TRANSPORTS:
        seconds = result[f"{transport}_s"]
        result[f"{transport}_gbps"] = None if seconds is None else round(nbytes / seconds / 1e9, 3)
        if transport != "disk_reload":
            result[f"{transport}_speedup"] = None if seconds is None else round(result["disk_reload_s"] / seconds, 2)
    for key in [k for k in result if k.endswith("_s")]:
        result[key] = None if result[key] is None else round(result[key], 5)
    return result


def measure_cuda_ipc(name: str, config: Qwen2Config, workdir: Path, repeats: int) -> float:
    print(f"{name}: cuda_ipc ({repeats} repeats)...", file=sys.stderr, flush=True)
    model = random_model(config, "cuda")
    receiver = Receiver(config, "cuda")
    try:
        seconds = run_pushed("cuda_ipc", model, receiver, workdir, repeats)["cuda_ipc_s"]
        if abs(receiver.call("checksum") - checksum(model)) > 1e-6 * abs(checksum(model)):
            raise RuntimeError(f"{name}: cuda_ipc: the receiver's weights differ from the trainer's")
        return seconds
    finally:
        receiver.close()


def format_table(results: dict[str, dict]) -> str:
    lines = []
    for name, result in results.items():
        lines.append(f"{name}: {result['params'] / 1e6:.1f}M parameters, {result['bytes'] / 1e6:.1f} MB")
        lines.append(f"  {'transport':14}{'s':>10}{'GB/s':>9}{'speedup':>9}")
        for transport in TRANSPORTS:
            seconds = result[f"{transport}_s"]
            if seconds is None:
                lines.append(f"  {transport:14}{'unavailable (no CUDA device)':>28}")
                continue
            speedup = 1.0 if transport == "disk_reload" else result[f"{transport}_speedup"]
            lines.append(f"  {transport:14}{seconds:>10.4f}{result[f'{transport}_gbps']:>9.2f}{speedup:>9.2f}")
        lines.append(f"  (disk_reload: warm page cache; load alone {result['disk_reload_load_s']:.4f} s)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model only (a smoke run)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = {"tiny": tiny_config()}
    if not args.quick:
        models["qwen2-0.5b"] = Qwen2Config(**QWEN2_05B)
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_", dir=RUNS_DIR) as workdir:
        results = {name: measure(name, config, Path(workdir)) for name, config in models.items()}
    print(format_table(results))
    if args.json:
        largest = list(results)[-1]
        figures = {"model": largest, **results[largest]}
        if largest != "tiny":
            figures["tiny"] = results["tiny"]
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
