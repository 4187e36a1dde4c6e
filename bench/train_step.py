"""Train-step benchmark: a loss's per-token inputs gathered at once against the per-sequence path.

The trainers' losses read (n, R) log-probs, entropies and values at the response tokens. The
per-sequence path (the engine's `logprobs` / `values` lists, then `response_slices` and
`Experience.padded`) spends a few tensor operations per sample in the forward and as many autograd
nodes in the backward: on a GPU each is a kernel launch. The gathered path (`response_logprobs`,
`response_values`: `models/response_outputs.py` `padded_responses`) is one gather whatever the number of
samples. Both run here, interleaved, on the main job's model (`configs/mllm_ppo.yaml`'s tiny
Qwen2-VL: an actor step of policy loss + entropy, and a critic step of value loss) and on samples
shaped like its shapes task (one 4-token image per prompt, 1-7 response tokens):

    ms/step    median wall time of one optimizer step (loss, backward, clip, AdamW), after 2 warm-up
               steps; CUDA: synchronised at each step's end
    ops/step   aten operations dispatched in one step (`TorchDispatchMode`), forward and backward
    nodes      autograd nodes the loss's backward runs
    speedup    per-sequence ms / gathered ms; ops ratio = gathered / per-sequence

Precision `auto`, as the jobs: bf16 autocast on CUDA, fp32 on the CPU. Both paths give the same
loss (checked each run; a difference above 1e-5 is reported and the run
exits 1). On 2 CPU cores the model's own arithmetic dominates the step at this size; on a GPU the
step is launch-bound, and the op count is what it pays for.

    .venv/bin/python bench/train_step.py                     # 128 samples, 10 steps a path (~1 minute)
    .venv/bin/python bench/train_step.py --device cuda --json
    .venv/bin/python bench/train_step.py --quick             # 32 samples, 3 steps

JSON (last line): device, samples, and per stage (actor, critic): ms, ops, nodes of each path, speedup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stream_rlhf.algos.losses import entropy_loss, policy_loss, value_loss  # noqa: E402
from stream_rlhf.backends.optimizer_config import OptimizerConfig  # noqa: E402
from stream_rlhf.backends.torch_engine import HOST_FIELDS, TorchTrainEngine  # noqa: E402
from stream_rlhf.config import load_config  # noqa: E402
from stream_rlhf.distributed import RankGroup  # noqa: E402
from stream_rlhf.experience import Experience  # noqa: E402
from stream_rlhf.models.checkpoint import build_tiny, load_critic  # noqa: E402
from stream_rlhf.models.tokenizer import VISION_TOKENS, build_tokenizer  # noqa: E402
from stream_rlhf.models.vision_language import image_feature_width  # noqa: E402
from stream_rlhf.rl.config import RLJobConfig  # noqa: E402
from stream_rlhf.samples import SampleImages, response_slices  # noqa: E402

MAIN_JOB = Path(__file__).resolve().parent.parent / "configs" / "mllm_ppo.yaml"
GRID = (1, 4, 4)  # a 32x32 image in 8-pixel patches: 4 tokens after the 2x2 merge


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _experience(n: int, tokenizer, width_h: int, g: torch.Generator) -> Experience:
    start, image, end = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    sequences, prompt_lens, images = [], [], []
    for _ in range(n):
        before = torch.randint(4, start, (int(torch.randint(6, 13, (1,), generator=g)),), generator=g)
        after = torch.randint(4, start, (8,), generator=g)
        prompt = torch.cat([before, torch.tensor([start, image, image, image, image, end]), after])
        response = torch.randint(4, start, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g)
        sequences.append(torch.cat([prompt, response]))
        prompt_lens.append(len(prompt))
        images.append(SampleImages(torch.randn(4, width_h, generator=g), torch.tensor([GRID])))
    prompt_lens = torch.tensor(prompt_lens)
    response_lens = torch.tensor([len(s) for s in sequences]) - prompt_lens
    width = int(response_lens.max())
    mask = (torch.arange(width)[None] < response_lens[:, None]).float()
    behavior = -torch.rand(n, width, generator=g) * 3 * mask
    return Experience(sequences=sequences, prompt_lens=prompt_lens, mask=mask, behavior_logp=behavior,
                      old_logp=behavior.clone(), ref_logp=None, values=torch.zeros(n, width),
                      scores=torch.rand(n, generator=g), group_ids=torch.arange(n), policy_versions=torch.zeros(n),
                      images=images)


def _actor_loss(engine: TorchTrainEngine, gathered: bool):
    def loss_fn(part: Experience, per_sample: dict[str, torch.Tensor]):
        if gathered:
            logp, entropy = engine.response_logprobs(part, 1.0, with_entropy=True)
        else:
            logp, entropy = engine.logprobs(part.sequences, 1.0, with_entropy=True, images=part.images,
                                            prompt_lens=part.prompt_lens)
            logp = part.padded(response_slices(logp, part.prompt_lens))
            entropy = part.padded(response_slices(entropy, part.prompt_lens))
        loss, metrics = policy_loss(logp, part.old_logp, per_sample["advantages"], part.mask, 0.2, 0.2)
        ent_term, _ = entropy_loss(entropy, part.mask)
        return loss + 0.01 * ent_term, metrics
    return loss_fn


def _critic_loss(engine: TorchTrainEngine, gathered: bool):
    def loss_fn(part: Experience, per_sample: dict[str, torch.Tensor]):
        if gathered:
            values = engine.response_values(part)
        else:
            values = part.padded(response_slices(engine.values(part.sequences, part.images, part.prompt_lens),
                                                 part.prompt_lens))
        return value_loss(values, part.values, per_sample["targets"], part.mask, 0.2)
    return loss_fn


def _nodes(engine: TorchTrainEngine, loss_fn: Callable, exp: Experience, per_sample: dict[str, torch.Tensor]) -> int:
    """Autograd nodes of the loss as `train_step` computes it (the samples on the engine's device)."""
    part = exp.to(engine.device, keep_on_host=HOST_FIELDS)
    loss, _ = loss_fn(part, {name: t.to(engine.device) for name, t in per_sample.items()})
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)


def _measure(make_engine: Callable[[], TorchTrainEngine], make_loss, exp: Experience,
             per_sample: dict[str, torch.Tensor], steps: int) -> dict[str, dict[str, float]]:
    """Each path on an engine of its own (same start), steps interleaved; ms, ops and nodes per path."""
    engines = {path: make_engine() for path in ("per_sequence", "gathered")}
    losses = {path: make_loss(engine, path == "gathered") for path, engine in engines.items()}
    sync = torch.cuda.synchronize if engines["gathered"].device.type == "cuda" else (lambda: None)
    first = {path: engines[path].train_step(exp, losses[path], per_sample)["loss"] for path in engines}
    if abs(first["per_sequence"] - first["gathered"]) > 1e-5:
        raise SystemExit(f"the paths disagree: loss {first}")
    times: dict[str, list[float]] = {path: [] for path in engines}
    for step in range(steps + 1):
        for path, engine in engines.items():
            sync()
            began = time.perf_counter()
            engine.train_step(exp, losses[path], per_sample)
            sync()
            if step:  # the first is a warm-up
                times[path].append(time.perf_counter() - began)
    out = {}
    for path, engine in engines.items():
        with _OpCount() as count:
            engine.train_step(exp, losses[path], per_sample)
        out[path] = {"ms": round(1000 * statistics.median(times[path]), 2), "ops": count.ops,
                     "nodes": _nodes(engine, losses[path], exp, per_sample)}
    out["speedup"] = round(out["per_sequence"]["ms"] / out["gathered"]["ms"], 3)
    out["ops_ratio"] = round(out["gathered"]["ops"] / out["per_sequence"]["ops"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=128, help="samples per optimizer step (the main job's)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="32 samples, 3 steps")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    samples, steps = (32, 3) if args.quick else (args.samples, args.steps)
    device = torch.device(args.device)
    group = RankGroup.single(device)
    cfg = load_config(RLJobConfig, MAIN_JOB)
    tokenizer = build_tokenizer(vision=True)
    policy = build_tiny(cfg.model.tiny, tokenizer, seed=0)
    exp = _experience(samples, tokenizer, image_feature_width(policy.config), torch.Generator().manual_seed(0))
    per_sample = {"advantages": torch.randn(exp.mask.shape, generator=torch.Generator().manual_seed(1)),
                  "targets": torch.rand(exp.mask.shape, generator=torch.Generator().manual_seed(2))}
    with tempfile.TemporaryDirectory() as folder:
        policy.save_pretrained(folder)
        results = {
            "actor": _measure(lambda: TorchTrainEngine(build_tiny(cfg.model.tiny, tokenizer, seed=0), group,
                                                       OptimizerConfig(lr=2e-4), precision="auto"),
                              _actor_loss, exp, per_sample, steps),
            "critic": _measure(lambda: TorchTrainEngine(load_critic(folder), group, OptimizerConfig(lr=1e-3),
                                                        precision="auto"),
                               _critic_loss, exp, per_sample, steps),
        }
    print(f"train step on {device} ({torch.get_num_threads()} threads), the main job's model, {samples} samples, "
          f"median of {steps} steps")
    print(f"{'stage':8} {'path':13} {'ms/step':>9} {'ops/step':>9} {'nodes':>7}")
    for stage, figures in results.items():
        for path in ("per_sequence", "gathered"):
            f = figures[path]
            print(f"{stage:8} {path:13} {f['ms']:9.2f} {f['ops']:9d} {f['nodes']:7d}")
        print(f"{stage:8} speedup {figures['speedup']:.3f}x, ops ratio {figures['ops_ratio']:.3f}")
    if args.json:
        print(json.dumps({"device": str(device), "samples": samples, **results}))


if __name__ == "__main__":
    main()
