"""Step-memory benchmark: an actor training step in micro-batches and with activation
checkpointing, against the one pass that keeps every activation.

One optimizer step of the policy loss on a text model of `vs_trl.py`'s 12M shape (hidden 512, 4
layers) and 64 samples of a 7-token prompt and 48 response tokens (the 12M fixed48 row's work),
each column on an engine of its own from the same weights (`backends/step_memory.py`):

    one_pass        the step as one forward and backward (the baseline)
    micro4          actor.micro_batch_tokens at a quarter of the step's tokens: 4 micro-batches
    checkpointing   actor.gradient_checkpointing: each decoder layer recomputed in the backward
    both            the two together

Figures per column:

    kept MB    bytes autograd keeps for the backward, at the largest micro-batch: the activations
               (counted with saved-tensor hooks, the model's own weights left out, so the same on
               any machine)
    cuda MB    (--device cuda) the step's peak CUDA allocation (weights, gradients, Adam and the
               activations), torch.cuda.max_memory_allocated
    ms/step    median wall time of a step, after a warm-up one (CUDA: synchronised)
    grad diff  the largest difference of a gradient from one_pass's (the same step: float noise)

The ratios are each column's over one_pass's.

    .venv/bin/python bench/step_memory.py                  # 5 steps a column (~1 minute on 2 cores)
    .venv/bin/python bench/step_memory.py --device cuda --json
    .venv/bin/python bench/step_memory.py --quick          # 16 samples, 2 steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stream_rlhf.algos.losses import policy_loss  # noqa: E402
from stream_rlhf.backends.optimizer_config import OptimizerConfig  # noqa: E402
from stream_rlhf.backends.torch_engine import TorchTrainEngine  # noqa: E402
from stream_rlhf.distributed import RankGroup  # noqa: E402
from stream_rlhf.experience import Experience  # noqa: E402
from stream_rlhf.models.checkpoint import build_tiny  # noqa: E402
from stream_rlhf.models.model_config import TinyModelConfig  # noqa: E402
from stream_rlhf.models.tokenizer import build_tokenizer  # noqa: E402

MODEL_12M = TinyModelConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=8, head_dim=64, max_position_embeddings=64)
PROMPT, RESPONSE = 7, 48
BASELINE = "one_pass"


def _experience(n: int, vocab: int, g: torch.Generator) -> Experience:
    sequences = [torch.randint(4, vocab, (PROMPT + RESPONSE,), generator=g) for _ in range(n)]
    mask = torch.ones(n, RESPONSE)
    behavior = -torch.rand(n, RESPONSE, generator=g) * 3
    return Experience(sequences=sequences, prompt_lens=torch.full((n,), PROMPT), mask=mask, behavior_logp=behavior,
                      old_logp=behavior.clone(), ref_logp=None, values=None, scores=torch.rand(n, generator=g),
                      group_ids=torch.arange(n), policy_versions=torch.zeros(n))


class KeptBytes:
    """The bytes autograd keeps for a backward, per forward (a loss call), the weights left out;
    the largest is the figure."""

    def __init__(self) -> None:
        self.per_forward: list[int] = []

    def loss(self, engine: TorchTrainEngine):
        weights = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}

        def loss_fn(part: Experience, per_sample: dict[str, torch.Tensor]):
            self.per_forward.append(0)

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                if tensor.untyped_storage().data_ptr() not in weights:
                    self.per_forward[-1] += tensor.numel() * tensor.element_size()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                logp, _ = engine.response_logprobs(part, 1.0)
                return policy_loss(logp, part.old_logp, per_sample["advantages"], part.mask, 0.2, 0.2)
        return loss_fn


def column(name: str, samples: int, steps: int, device: torch.device, exp: Experience,
           advantages: torch.Tensor) -> tuple[dict, TorchTrainEngine]:
    tokens = samples * (PROMPT + RESPONSE)
    optimizer = OptimizerConfig(lr=2e-4, micro_batch_tokens=tokens // 4 if name in ("micro4", "both") else None,
                                gradient_checkpointing=name in ("checkpointing", "both"))
    engine = TorchTrainEngine(build_tiny(MODEL_12M, build_tokenizer(), seed=0), RankGroup.single(device), optimizer)
    kept = KeptBytes()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for step in range(steps + 1):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        kept.per_forward.clear()
        sync()
        began = time.perf_counter()
        engine.train_step(exp, kept.loss(engine), {"advantages": advantages})
        sync()
        if step:  # the first is a warm-up
            times.append(time.perf_counter() - began)
    figures = {"kept_mb": round(max(kept.per_forward) / 2**20, 2), "forwards": len(kept.per_forward),
               "ms": round(1000 * statistics.median(times), 1)}
    if device.type == "cuda":
        figures["cuda_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return figures, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="16 samples, 2 steps")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    samples, steps = (16, 2) if args.quick else (args.samples, args.steps)
    device = torch.device(args.device)
    exp = _experience(samples, len(build_tokenizer()), torch.Generator().manual_seed(0))
    advantages = torch.randn(exp.mask.shape, generator=torch.Generator().manual_seed(1))
    results, engines = {}, {}
    for name in (BASELINE, "micro4", "checkpointing", "both"):
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        results[name], engines[name] = column(name, samples, steps, device, exp, advantages)
    base = engines[BASELINE].model.parameters
    for name, engine in engines.items():  # the last step's gradients, against one_pass's
        results[name]["grad_diff"] = max((a.grad - b.grad).abs().max().item() for a, b in zip(
            base(), engine.model.parameters()))
        results[name]["kept_ratio"] = round(results[name]["kept_mb"] / results[BASELINE]["kept_mb"], 3)
        results[name]["time_ratio"] = round(results[name]["ms"] / results[BASELINE]["ms"], 3)
        if "cuda_mb" in results[name]:
            results[name]["cuda_ratio"] = round(results[name]["cuda_mb"] / results[BASELINE]["cuda_mb"], 3)
    print(f"actor step on {device} ({torch.get_num_threads()} threads), 12M text model, {samples} samples of "
          f"{PROMPT} + {RESPONSE} tokens, median of {steps} steps")
    print(f"{'column':14} {'kept MB':>9} {'/ one':>7} {'cuda MB':>9} {'ms/step':>9} {'/ one':>7} {'grad diff':>10}")
    for name, f in results.items():
        cuda = f"{f['cuda_mb']:9.1f}" if "cuda_mb" in f else f"{'-':>9}"
        print(f"{name:14} {f['kept_mb']:9.2f} {f['kept_ratio']:7.3f} {cuda} {f['ms']:9.1f} {f['time_ratio']:7.3f} "
              f"{f['grad_diff']:10.1e}")
    if args.json:
        print(json.dumps({"device": str(device), "samples": samples, "baseline": BASELINE, "columns": results}))


if __name__ == "__main__":
    main()
