"""The torch sampler's decode modes (`rollout.decode`): tokens/s of plain and Medusa decoding over
static caches (and CUDA graphs on CUDA) against the eager sampler, on one thread.

Two random-initialised Qwen2 models of `bench/vs_trl.py`'s shapes (the config's 0.4M tiny model
and the 12M one: hidden 512, 4 layers, 8 heads), a vocabulary of VOCAB tokens, ROWS prompts of 5
to 7 tokens (4 samples of each, as GRPO's groups) decoding TOKENS tokens each with no stop token
(fixed-length answers: the shape of vs_trl.py's fixed48 rows), temperature 1. Medusa drafts with
heads copied from the LM head (`MedusaHeads.from_policy`), so its accept length is low: the
figures compare decode modes, not speculation against plain decoding (bench/medusa.py does).

    column     what decodes
    eager      torch_rollout.generate / speculative.generate_speculative (the baseline)
    static     the same over a slot cache per bucket (static_sampler.py, speculative_static.py)
    graphs     static, each step a CUDA graph replayed (CUDA only)

Each column decodes the same mini-batches PASSES times, interleaved with the other columns (a slow
spell of a shared machine hits all of them); its fastest pass counts, after one warm-up mini-batch
(which captures the graphs). Every column must give the eager tokens (checked; a mismatch is an
error), and the graph column reports how many graphs it captured (none after the warm-up).

    .venv/bin/python bench/decode.py                  # CPU: eager and static
    .venv/bin/python bench/decode.py --device cuda    # adds the graphs column
    .venv/bin/python bench/decode.py --quick --json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from stream_rlhf.backends.decode_attention import use_decode_attention
from stream_rlhf.backends.speculative import generate_speculative
from stream_rlhf.backends.speculative_static import generate_speculative_static
from stream_rlhf.backends.static_decode import StaticDecoder
from stream_rlhf.backends.static_sampler import generate_static
from stream_rlhf.backends.torch_rollout import Generation, SamplingParams, generate
from stream_rlhf.models.medusa import MedusaHeads

VOCAB = 32
ROWS = 64
TOKENS = 48
PASSES = 3
HEADS = 3
SHAPES = {"0.4M": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32),
          "12M": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=64)}


def build(shape: str, device: torch.device) -> tuple[Qwen2ForCausalLM, MedusaHeads]:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=True, **SHAPES[shape])
    model = Qwen2ForCausalLM(config).eval().to(device)
    use_decode_attention(model)
    return model, MedusaHeads.from_policy(model, HEADS).eval().to(device)


def minibatches(count: int, rows: int, device: torch.device) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(count):
        distinct = [torch.randint(1, VOCAB, (int(torch.randint(5, 8, (1,), generator=g)),), generator=g)
                    for _ in range(rows // 4)]
        batches.append([p.to(device) for p in distinct for _ in range(4)])
    return batches


def run(column: str, medusa: bool, model: Qwen2ForCausalLM, heads: MedusaHeads, static: dict[str, StaticDecoder],
        prompts: list[torch.Tensor], params: SamplingParams, seed: int) -> Generation:
    generator = torch.Generator(prompts[0].device).manual_seed(seed)
    if medusa and column == "eager":
        return generate_speculative(model, heads, prompts, params, generator)[0]
    if medusa:
        return generate_speculative_static(model, heads, static[column], prompts, params, generator)[0]
    if column == "eager":
        return generate(model, prompts, params, generator)
    return generate_static(model, static[column], prompts, params, generator)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(shape: str, medusa: bool, columns: list[str], device: torch.device, count: int,
            rows: int, tokens: int) -> dict[str, float]:
    """tokens/s of each column, and the graphs captured after the warm-up."""
    model, heads = build(shape, device)
    static = {column: StaticDecoder(graphs=column == "graphs") for column in columns if column != "eager"}
    params = SamplingParams(temperature=1.0, max_new_tokens=tokens)
    batches = minibatches(count + 1, rows, device)
    best = dict.fromkeys(columns, float("inf"))
    warm_captures = 0
    with torch.inference_mode():
        for attempt in range(PASSES):
            elapsed = dict.fromkeys(columns, 0.0)
            for index, prompts in enumerate(batches):
                reference = None
                for column in columns:
                    synchronize(device)
                    started = time.perf_counter()
                    gen = run(column, medusa, model, heads, static, prompts, params, seed=index)
                    synchronize(device)
                    if index > 0:
                        elapsed[column] += time.perf_counter() - started
                    reference = reference or gen.response_ids
                    if not all(torch.equal(a, b) for a, b in zip(reference, gen.response_ids)):
                        raise RuntimeError(f"{shape} {column}: tokens differ from eager's (mini-batch {index})")
                if attempt == 0 and index == 0 and "graphs" in static:
                    warm_captures = static["graphs"].captures
            best = {column: min(best[column], elapsed[column]) for column in columns}
    figures = {column: count * rows * tokens / best[column] for column in columns}
    if "graphs" in static:
        figures["captures_after_warmup"] = static["graphs"].captures - warm_captures
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="2 mini-batches of 16 rows, 8 tokens")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)  # rollout's placement: one core
    columns = ["eager", "static"] + (["graphs"] if device.type == "cuda" else [])
    count, rows, tokens = (2, 16, 8) if args.quick else (6, ROWS, TOKENS)
    figures: dict[str, float] = {}
    print(f"{rows} rows x {tokens} tokens, {device}, tokens/s (ratio against eager)")
    print(f"{'':16}" + "".join(f"{c:>18}" for c in columns))
    for shape in SHAPES:
        for medusa in (False, True):
            name = f"{shape}_{'medusa' if medusa else 'plain'}"
            result = measure(shape, medusa, columns, device, count, rows, tokens)
            cells = "".join(f"{result[c]:>10.0f} ({result[c] / result['eager']:.2f}x)" for c in columns)
            print(f"{name:16}{cells}" + (f"   graphs captured after warm-up: {result['captures_after_warmup']}"
                                         if "captures_after_warmup" in result else ""))
            figures.update({f"{name}_{key}": round(value, 3) for key, value in result.items()})
            figures.update({f"{name}_{c}_ratio": round(result[c] / result["eager"], 3) for c in columns[1:]})
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
