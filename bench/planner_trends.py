"""The seeds' published trends, on paper: the simulator (`planner/simulator.py`) over analytic costs
(`planner/analytic.py`) with H100 figures (`planner/devices.py` PRESETS["h100"]), no run.

    .venv/bin/python bench/planner_trends.py          # three tables (~2 s)
    .venv/bin/python bench/planner_trends.py --json   # then one JSON object as the last line

1. HybridFlow: a 7B PPO job (actor, critic, reference and reward models all 7B) on 8 to 128 GPUs,
   *colocate* (every model on every GPU, taking turns) against *split* (actor, its rollout and the
   reference on one half, critic and reward model on the other), on-policy (sync).
2. ReaLHF: a 7B actor with a 34B critic and reward model on 32 GPUs: the *sequential* schedule
   (every call on every GPU in turn) against placements that overlap calls: split by model
   (on-policy, the two halves' forwards and trainings at once) and separated rollout / training
   with generation of iteration i+1 overlapping training of i (stream, overlap_depth 1).
3. Seed 004: the 7B PPO job on 4 GPUs whose model states do not fit at once: *conventional*
   (colocated, everything resident), *full offload* (one device group; a member's states move
   out and the next's in when it takes the device) and *pipelined offload* (the next member's
   onload overlaps the current member's compute: `SimStage.prefetch`).

Workload (HybridFlow's): 1024 prompts per iteration, generated together (one mini-batch), prompt
and response 1024 tokens each, one PPO epoch of 4 optimizer steps. Iteration time: the
simulated run's steady-state window over the iterations in it (`Prediction.iteration_s`). Queues
hold two iterations (`queue_capacity`): a forward waits for its trainer to take the iteration
two before, so critic training, which gates no other stage, cannot fall behind without bound.
A model's states are sharded over its stage's devices (FSDP / tensor parallel): a trainer 16
bytes a weight (bf16 weights and gradients, fp32 master weights and Adam's moments), a forward or
rollout 2; a device keeps RESERVE_GB for activations and the KV cache. Links: NVLink (450 GB/s)
within 8 GPUs, 50 GB/s per GPU (InfiniBand) beyond. Rollout on n GPUs splits a mini-batch's rows
(a decode step is bound by the larger of its FLOPs and reading the weights, so it stops getting
faster once memory-bound). An offload moves the leaving member's states out and the next one's
in over PCIe (2 x its GB / 55 GB/s).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from stream_rlhf.planner.analytic import ModelShape, Workload, forward_s, rollout_s, train_s, weight_bytes
from stream_rlhf.planner.devices import PRESETS, DeviceFigures
from stream_rlhf.planner.graph import SimGraph, SimStage
from stream_rlhf.planner.simulator import simulate

LLAMA_7B = ModelShape(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, head_dim=128, vocab=32000,
                      tied=False)
CODELLAMA_34B = ModelShape(hidden=8192, intermediate=22016, layers=48, heads=64, kv_heads=8, head_dim=128,
                           vocab=32000, tied=False)
WORK = Workload(rows=1024, prompt_tokens=1024, response_tokens=1024, minibatches=1, ppo_epochs=1, train_minibatches=4)
TRAIN_BYTES = 16
RESERVE_GB = 20.0
ITERATIONS = 12
PPO = {"prompts": (), "rollout": ("prompts",), "actor_forward": ("rollout",), "ref_forward": ("rollout",),
       "reward_forward": ("rollout",), "critic_forward": ("rollout",),
       "actor_train": ("actor_forward", "ref_forward", "reward_forward", "critic_forward"),
       "critic_train": ("actor_forward", "ref_forward", "reward_forward", "critic_forward")}
"""Stage -> inputs. actor_forward and critic_forward use the trainers' weights (no memory of their own)."""


def h100(devices: int) -> DeviceFigures:
    return replace(PRESETS["h100"], link_bandwidth=450e9 if devices <= 8 else 50e9)


def cost_and_memory(stage: str, shape: ModelShape, n: int) -> tuple[float | tuple[float, ...], float]:
    """(step_s, GB per device) of `stage` on n GPUs."""
    device = h100(n)
    state_gb = shape.params / n / 1e9
    if stage == "prompts":
        return 0.0, 0.0
    if stage == "rollout":
        return rollout_s(shape, replace(WORK, rows=WORK.rows / n), device), 2 * state_gb
    if stage.endswith("_train"):
        return (0.0,) * (WORK.minibatches - 1) + (train_s(shape, WORK, device, n),), TRAIN_BYTES * state_gb
    own = stage in ("ref_forward", "reward_forward")  # the others use the trainers' weights
    return forward_s(shape, WORK.tokens, device, n), 2 * state_gb if own else 0.0


def graph(shapes: dict[str, ModelShape], sets: dict[str, tuple[str, int]], schedule: str = "sync",
          offload: str = "", rollout_side: frozenset[str] = frozenset({"prompts", "rollout"})) -> SimGraph:
    """The PPO job with each stage's model shape, on `sets` (stage -> (device set, its GPUs));
    `offload`: "" (resident), "full" or "pipelined" (every stage of a set in one device group)."""
    stages = []
    for name, inputs in PPO.items():
        device, n = sets[name]
        step_s, memory_gb = cost_and_memory(name, shapes[name], n)
        load_s = 2 * memory_gb * 1e9 / h100(n).host_bandwidth  # the leaving member out, this one in
        stages.append(SimStage(name, step_s, inputs=inputs, side="rollout" if name in rollout_side else "train",
                               device=device, barrier=schedule == "sync" and name not in rollout_side,
                               memory_gb=memory_gb, offload=bool(offload), load_s=load_s if offload else 0.0,
                               prefetch=offload == "pipelined", process=device if offload else ""))
    publish = weight_bytes(shapes["actor_train"], h100(8)) / h100(sets["actor_train"][1]).link_bandwidth
    return SimGraph(stages=tuple(stages), iterations=ITERATIONS, minibatches=WORK.minibatches,
                    overlap_depth=1 if schedule == "stream" else 0, publish_s=publish,
                    queue_capacity=2 * WORK.minibatches)


def colocated(devices: int) -> dict[str, tuple[str, int]]:
    return {stage: ("all", devices) for stage in PPO}


def split(actor_side: int, devices: int) -> dict[str, tuple[str, int]]:
    """Actor, its rollout and the reference on `actor_side` GPUs; critic and reward on the rest."""
    critic = ("critic_forward", "critic_train", "reward_forward")
    return {stage: ("critic set", devices - actor_side) if stage in critic else ("actor set", actor_side)
            for stage in PPO}


def separated(rollout_side: int, devices: int) -> dict[str, tuple[str, int]]:
    return {stage: ("rollout set", rollout_side) if stage in ("prompts", "rollout") else
            ("train set", devices - rollout_side) for stage in PPO}


def figures(sim: SimGraph, devices: int) -> dict[str, object]:
    """Iteration seconds, and the most any device holds (`simulator.peak_memory`: a pipelined
    onload holds the two largest members)."""
    prediction = simulate(sim)
    iteration_s = prediction.iteration_s
    peak = max(prediction.peak_memory_gb.values())
    fits = peak <= PRESETS["h100"].memory_gb - RESERVE_GB
    return {"iteration_s": round(iteration_s, 2), "peak_gb": round(peak, 1), "fits": fits,
            "gpu_s": round(iteration_s * devices, 1)}


def hybridflow() -> list[dict[str, object]]:
    shapes = {stage: LLAMA_7B for stage in PPO}
    rows = []
    for devices in (8, 16, 32, 64, 128):
        row: dict[str, object] = {"gpus": devices, "colocate": figures(graph(shapes, colocated(devices)), devices)}
        row["split"] = figures(graph(shapes, split(devices // 2, devices)), devices)
        row["best"] = min(("colocate", "split"), key=lambda name: row[name]["iteration_s"])  # type: ignore[index]
        rows.append(row)
    return rows


def realhf(devices: int = 32) -> dict[str, object]:
    shapes = {stage: CODELLAMA_34B if stage in ("critic_forward", "critic_train", "reward_forward") else LLAMA_7B
              for stage in PPO}
    out: dict[str, object] = {"gpus": devices, "sequential": figures(graph(shapes, colocated(devices)), devices)}
    sides = [n for n in (4, 8, 12, 16, 20, 24, 28) if n < devices]
    for name, sets, schedule in (("split by model, sync", split, "sync"),
                                 ("separated, sync", separated, "sync"),
                                 ("separated, stream k=1", separated, "stream")):
        tried = {n: figures(graph(shapes, sets(n, devices), schedule), devices) for n in sides}
        best = min(tried, key=lambda n: tried[n]["iteration_s"])  # type: ignore[return-value]
        out[name] = {**tried[best], "first_set_gpus": best}
    return out


def seed004(devices: int = 4) -> dict[str, object]:
    shapes = {stage: LLAMA_7B for stage in PPO}
    return {"gpus": devices,
            "conventional": figures(graph(shapes, colocated(devices)), devices),
            "conventional on 2x the GPUs": figures(graph(shapes, colocated(2 * devices)), 2 * devices),
            "full offload": figures(graph(shapes, colocated(devices), offload="full"), devices),
            "pipelined offload": figures(graph(shapes, colocated(devices), offload="pipelined"), devices)}


def cell(f: dict[str, object]) -> str:
    return f"{f['iteration_s']:>8.2f} s {f['peak_gb']:>6.1f} GB{'' if f['fits'] else ' (over)'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    budget = PRESETS["h100"].memory_gb - RESERVE_GB
    print(f"H100 figures: {PRESETS['h100'].describe()}; model states within {budget:g} GB a GPU\n")
    flow = hybridflow()
    print("1. HybridFlow, 7B PPO, sync: iteration s, most GB a GPU holds")
    for row in flow:
        print(f"  {row['gpus']:>4} GPUs  colocate {cell(row['colocate'])}   split {cell(row['split'])}   "
              f"best: {row['best']}")
    real = realhf()
    print(f"\n2. ReaLHF, 7B actor + 34B critic and reward, {real['gpus']} GPUs")
    for name, f in real.items():
        if isinstance(f, dict):
            where = f" (first set {f['first_set_gpus']} GPUs)" if "first_set_gpus" in f else ""
            print(f"  {name:<24}{cell(f)}{where}")
    seed = seed004()
    print(f"\n3. Seed 004, 7B PPO, colocated on {seed['gpus']} GPUs")
    for name, f in seed.items():
        if isinstance(f, dict):
            print(f"  {name:<28}{cell(f)}  {f['gpu_s']:>8.1f} GPU-s")
    if args.json:
        print(json.dumps({"hybridflow": flow, "realhf": real, "seed004": seed}))


if __name__ == "__main__":
    main()
