"""Packing: packed forwards equal separate forwards (logits and gradients); log-probs from logits."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForCausalLM, Qwen2ForTokenClassification

from stream_rlhf.models.packing import Packed, pack, pack_shared, packed_forward, sequence_logprobs, unpack
from stream_rlhf.samples import pad_right
from tests.tiny_models import tiny_qwen2_config

VOCAB = 48
LENGTHS = [5, 1, 9, 3, 7, 2, 9]


def spans(packed: Packed) -> list[tuple[int, int, int]]:
    """(row, start, length) of each packed sequence, in input order (`pack`: a sequence's tokens are
    contiguous)."""
    width = packed.input_ids.shape[1]
    runs = packed.positions.split(packed.lengths)
    return [(int(run[0]) // width, int(run[0]) % width, len(run)) for run in runs]


@pytest.fixture(scope="module")
def lm() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(VOCAB)).eval()


@pytest.fixture(scope="module")
def value_model() -> Qwen2ForTokenClassification:
    torch.manual_seed(1)
    return Qwen2ForTokenClassification(tiny_qwen2_config(VOCAB, num_labels=1)).eval()


@pytest.fixture
def sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]


def test_pack_layout(sequences):
    packed = pack(sequences, capacity=10, pad_id=0)
    n_rows, width = packed.input_ids.shape
    assert width <= 10 and n_rows < len(sequences)  # short sequences share rows
    assert [length for _, _, length in spans(packed)] == LENGTHS
    for seq, ids, pos in zip(sequences, unpack(packed.input_ids, packed), unpack(packed.position_ids, packed)):
        assert torch.equal(ids, seq) and torch.equal(pos, torch.arange(seq.numel()))
    used = torch.zeros(n_rows, width, dtype=torch.int)
    for row, start, length in spans(packed):
        used[row, start : start + length] += 1
    assert used.max() == 1
    assert packed.attention_mask.shape == (n_rows, 1, width, width)
    # a token attends exactly to itself and the earlier tokens of its own sequence
    row, start, length = spans(packed)[2]
    last = packed.attention_mask[row, 0, start + length - 1]
    expected = torch.zeros(width, dtype=torch.bool)
    expected[start : start + length] = True
    assert torch.equal(last, expected)


def test_pack_default_capacity_is_longest(sequences):
    packed = pack(sequences)
    assert packed.input_ids.shape[1] == max(LENGTHS)


def test_pack_rejects_bad_input(sequences):
    with pytest.raises(ValueError, match="capacity=4"):
        pack(sequences, capacity=4)
    with pytest.raises(ValueError, match="length 0"):
        pack([torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)])


@pytest.mark.parametrize("capacity", [None, 10, 30])
def test_packed_logits_equal_separate_forwards(lm, sequences, capacity):
    with torch.no_grad():
        packed = packed_forward(lm, sequences, capacity)
        for seq, logits in zip(sequences, packed):
            assert logits.shape == (seq.numel(), VOCAB)
            torch.testing.assert_close(logits, lm(seq[None]).logits[0], atol=1e-5, rtol=0)


def test_packed_value_head(value_model, sequences):
    with torch.no_grad():
        for seq, values in zip(sequences, packed_forward(value_model, sequences, capacity=10)):
            assert values.shape == (seq.numel(), 1)
            torch.testing.assert_close(values, value_model(seq[None]).logits[0], atol=1e-5, rtol=0)


def test_packed_gradients_equal_separate(lm, sequences):
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(n, VOCAB, generator=g) for n in LENGTHS]
    params = [p for p in lm.parameters() if p.requires_grad]

    lm.zero_grad()
    sum((w * out).sum() for w, out in zip(weights, packed_forward(lm, sequences, capacity=10))).backward()
    packed_grads = [p.grad.clone() for p in params]

    lm.zero_grad()
    sum((w * lm(s[None]).logits[0]).sum() for w, s in zip(weights, sequences)).backward()
    for p, packed_grad in zip(params, packed_grads):
        torch.testing.assert_close(packed_grad, p.grad, atol=1e-4, rtol=1e-4)
    lm.zero_grad()


def test_sequence_logprobs_match_manual(lm, sequences):
    with torch.no_grad():
        logp, entropy = sequence_logprobs(lm, sequences, temperature=0.7, with_entropy=True, capacity=10)
        for seq, lp, ent in zip(sequences, logp, entropy):
            full = torch.log_softmax(lm(seq[None]).logits[0, :-1] / 0.7, dim=-1)  # (L - 1, V)
            assert lp.shape == ent.shape == (seq.numel() - 1,)
            torch.testing.assert_close(lp, full.gather(-1, seq[1:, None]).squeeze(-1), atol=1e-5, rtol=0)
            torch.testing.assert_close(ent, -(full.exp() * full).sum(-1), atol=1e-5, rtol=0)
        assert sequence_logprobs(lm, sequences, temperature=1.0)[1] is None


@pytest.fixture
def groups() -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three prompts (lengths 4, 6, 1) sampled 3, 2 and 1 times, then a prompt of its own whose
    response is empty, interleaved as a mini-batch may be: responses of uneven lengths."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (4, 6, 1, 3)]
    plan = [(0, 3), (1, 2), (0, 1), (2, 5), (0, 4), (1, 1), (3, 0)]  # (prompt, response length)
    sequences = [torch.cat([prompts[k], torch.randint(1, VOCAB, (n,), generator=g)]) for k, n in plan]
    return sequences, torch.tensor([len(prompts[k]) for k, _ in plan])


def test_shared_prompts_are_in_the_rows_once(groups):
    sequences, prompt_lens = groups
    packed = pack_shared(sequences, prompt_lens)
    assert int((packed.input_ids != 0).sum()) == sum(len(s) for s in sequences) - 2 * 4 - 1 * 6  # two copies saved
    for seq, ids, pos in zip(sequences, unpack(packed.input_ids, packed), unpack(packed.position_ids, packed)):
        assert torch.equal(ids, seq) and torch.equal(pos, torch.arange(seq.numel()))
    # the last token of sample 2 sees its prompt and its own response, nothing of its siblings'
    index = packed.positions.split(packed.lengths)[2]
    width = packed.input_ids.shape[1]
    row = int(index[-1]) // width
    seen = packed.attention_mask[row, 0, int(index[-1]) % width].nonzero().flatten()
    assert torch.equal(row * width + seen, index)
    small = pack_shared(sequences, prompt_lens, capacity=10)  # a group splits where a row would overflow
    assert small.input_ids.shape[1] <= 10
    assert [torch.equal(a, b) for a, b in zip(unpack(small.input_ids, small), sequences)] == [True] * len(sequences)
    with pytest.raises(ValueError, match="prefix_lens: 2 entries for 7 sequences"):
        pack_shared(sequences, prompt_lens[:2])


def test_shared_prompts_give_the_log_probs_values_and_gradients_of_separate_forwards(lm, value_model, groups):
    sequences, prompt_lens = groups
    with torch.no_grad():
        for seq, values in zip(sequences, packed_forward(value_model, sequences, prompt_lens=prompt_lens)):
            torch.testing.assert_close(values, value_model(seq[None]).logits[0], atol=1e-5, rtol=0)
    params = [p for p in lm.parameters() if p.requires_grad]
    lm.zero_grad()
    logp, entropy = sequence_logprobs(lm, sequences, 0.7, with_entropy=True, prompt_lens=prompt_lens)
    sum(lp.sum() + 0.5 * ent.sum() for lp, ent in zip(logp, entropy)).backward()
    shared_grads = [p.grad.clone() for p in params]
    lm.zero_grad()
    logp_sep, entropy_sep = sequence_logprobs(lm, sequences, 0.7, with_entropy=True)
    sum(lp.sum() + 0.5 * ent.sum() for lp, ent in zip(logp_sep, entropy_sep)).backward()
    for a, b, c, d in zip(logp, logp_sep, entropy, entropy_sep):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        torch.testing.assert_close(c, d, atol=1e-5, rtol=0)
    for p, shared in zip(params, shared_grads):
        torch.testing.assert_close(shared, p.grad, atol=1e-4, rtol=1e-4)
    lm.zero_grad()


def test_pad_right():
    padded = pad_right([torch.ones(2, 3), torch.ones(4, 3)], value=-1.0)
    assert padded.shape == (2, 4, 3)
    assert (padded[0, 2:] == -1).all() and (padded[1] == 1).all()
