"""A loss's per-token inputs come out of the packed forward as one gather (`padded_responses`):
the same numbers and gradients as the per-sequence path (`response_slices` then `padded`), and an
autograd graph whose size does not grow with the number of samples (on a GPU, each node of the old
per-sequence path was a kernel launch or more, in the forward and again in the backward)."""

from __future__ import annotations

import pytest
import torch

from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.distributed import RankGroup
from stream_rlhf.experience import Experience
from stream_rlhf.models.response_outputs import padded_responses
from stream_rlhf.samples import response_slices
from tests.test_vision_language import LAYOUTS, build_model, encode, make_sample
from tests.tiny_models import seeded_qwen2_critic, seeded_qwen2_policy

VOCAB = 40


def _text_experience(prompts: int, per_prompt: int = 4, seed: int = 1) -> Experience:
    """GRPO-like groups: `per_prompt` samples of each prompt (a shared prefix), uneven responses."""
    g = torch.Generator().manual_seed(seed)
    sequences, prompt_lens = [], []
    for _ in range(prompts):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        for _ in range(per_prompt):
            response = torch.randint(1, VOCAB, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g)
            sequences.append(torch.cat([prompt, response]))
            prompt_lens.append(len(prompt))
    return _experience(sequences, torch.tensor(prompt_lens), g)


def _experience(sequences: list[torch.Tensor], prompt_lens: torch.Tensor, g: torch.Generator,
                images=None) -> Experience:
    response_lens = torch.tensor([len(s) for s in sequences]) - prompt_lens
    width = int(response_lens.max()) + 2  # wider than the longest response, as a mini-batch of an iteration can be
    mask = (torch.arange(width)[None] < response_lens[:, None]).float()
    n = len(sequences)
    return Experience(sequences=sequences, prompt_lens=prompt_lens, mask=mask, behavior_logp=torch.zeros(n, width),
                      old_logp=None, ref_logp=None, values=torch.zeros(n, width), scores=torch.rand(n, generator=g),
                      group_ids=torch.arange(n), policy_versions=torch.zeros(n), images=images)


def vlm_experience() -> tuple[torch.nn.Module, Experience]:
    """A tiny Qwen2-VL and 10 samples of one to two images each, 1-3 response tokens."""
    model = build_model("qwen2_vl")
    g = torch.Generator().manual_seed(2)
    samples = [make_sample(g, texts, grids) for texts, grids in LAYOUTS * 2]
    prompt_lens = torch.tensor([len(s.input_ids) - 1 - i % 3 for i, s in enumerate(samples)])
    with torch.no_grad():
        images = [encode(model, s) for s in samples]
    return model, _experience([s.input_ids for s in samples], prompt_lens, g, images)


def _per_sequence_logprobs(engine: TorchTrainEngine, part: Experience, temperature: float):
    logp, entropy = engine.logprobs(part.sequences, temperature, with_entropy=True, images=part.images,
                                    prompt_lens=part.prompt_lens)
    return part.padded(response_slices(logp, part.prompt_lens)), part.padded(response_slices(entropy, part.prompt_lens))


def _gradients(engine: TorchTrainEngine, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    weights = [torch.linspace(-1, 1, out.numel()).view_as(out) for out in outputs]
    grads = torch.autograd.grad(sum((out * w).sum() for out, w in zip(outputs, weights)), engine.trainable)
    return list(grads)


def _assert_same(new: list[torch.Tensor], old: list[torch.Tensor], engine: TorchTrainEngine) -> None:
    for got, want in zip(new, old):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    for got, want in zip(_gradients(engine, new), _gradients(engine, old)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_response_logprobs_equal_the_per_sequence_path_with_shared_prompts():
    engine = TorchTrainEngine(seeded_qwen2_policy(VOCAB), RankGroup.single(), OptimizerConfig())
    part = _text_experience(prompts=5)
    logp, entropy = engine.response_logprobs(part, 0.7, with_entropy=True)
    _assert_same([logp, entropy], list(_per_sequence_logprobs(engine, part, 0.7)), engine)
    assert (logp[part.mask == 0] == 0).all() and (logp[part.mask == 1] < 0).all()


def test_response_logprobs_of_a_vision_language_model_equal_the_per_sequence_path():
    model, part = vlm_experience()
    engine = TorchTrainEngine(model, RankGroup.single(), OptimizerConfig())
    logp, entropy = engine.response_logprobs(part, 1.0, with_entropy=True)
    _assert_same([logp, entropy], list(_per_sequence_logprobs(engine, part, 1.0)), engine)


def test_response_values_equal_the_per_sequence_path():
    engine = TorchTrainEngine(seeded_qwen2_critic(VOCAB), RankGroup.single(), OptimizerConfig())
    part = _text_experience(prompts=4)
    old = part.padded(response_slices(engine.values(part.sequences, prompt_lens=part.prompt_lens), part.prompt_lens))
    _assert_same([engine.response_values(part)], [old], engine)


def test_the_proximal_forward_equals_the_per_sequence_forward():
    engine = TorchTrainEngine(seeded_qwen2_policy(VOCAB), RankGroup.single(), OptimizerConfig())
    exp = _text_experience(prompts=3)
    old = exp.padded(response_slices(engine.forward_logprobs(exp.sequences, 0.7, prompt_lens=exp.prompt_lens),
                                     exp.prompt_lens))
    new = engine.forward_response_logprobs(exp, 0.7)
    assert new.device.type == "cpu" and new.shape == exp.mask.shape
    torch.testing.assert_close(new, old, atol=1e-6, rtol=0)


def _graph_size(output: torch.Tensor) -> int:
    """Autograd nodes the backward of `output` runs."""
    seen, todo = set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)


@pytest.mark.parametrize("what", ["logprobs", "values"])
def test_the_loss_graph_does_not_grow_with_the_samples(what):
    model = seeded_qwen2_policy(VOCAB) if what == "logprobs" else seeded_qwen2_critic(VOCAB)
    engine = TorchTrainEngine(model, RankGroup.single(), OptimizerConfig())

    def size(prompts: int) -> int:
        part = _text_experience(prompts, seed=prompts)
        if what == "logprobs":
            logp, entropy = engine.response_logprobs(part, 1.0, with_entropy=True)
            return _graph_size((logp * part.mask).sum() + entropy.sum())
        return _graph_size((engine.response_values(part) * part.mask).sum())

    assert size(2) == size(16)
    # the per-sequence path, for scale: nodes per sample
    small, large = _text_experience(2), _text_experience(16)
    per_sequence = [_graph_size(_per_sequence_logprobs(engine, p, 1.0)[0].sum()) for p in (small, large)] \
        if what == "logprobs" else []
    assert not per_sequence or per_sequence[1] - per_sequence[0] >= 2 * (large.num_samples - small.num_samples)


def test_padded_responses_left_align_each_response_and_zero_the_rest():
    # three sequences laid end to end: L = 4, 2, 3 -> 3, 1, 2 predicting positions; prompts 2, 1, 3 tokens
    per_position = torch.arange(1.0, 7.0)  # [1 2 3 | 4 | 5 6]
    out = padded_responses(per_position, [3, 1, 2], torch.tensor([2, 1, 3]), width=3)
    assert out.tolist() == [[2.0, 3.0, 0.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]]  # the last has no response token
    wide = padded_responses(per_position[:, None].expand(6, 2), [3, 1, 2], torch.tensor([2, 1, 3]), width=3)
    assert wide.shape == (3, 3, 2) and torch.equal(wide[..., 1], out)
    assert padded_responses(torch.zeros(0), [0, 0], torch.tensor([1, 1]), width=2).tolist() == [[0.0, 0.0]] * 2
