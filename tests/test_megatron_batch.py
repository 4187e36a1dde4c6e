"""The megatron engine's packed micro-batch (`backends/megatron/batch.py`), without processes.

- The batch is `models/packing.py`'s layout: its mask inverted (megatron's True = masked out), rows
  padded to a multiple of 2 x cp with padding that sees itself only, positions as three equal rows.
- Log-probs and values read out of the rows equal `sequence_logprobs` / `packed_forward` with
  shared prompts, on hidden states a Hugging Face model computes on the batch's own inputs.
Needs the `megatron` extra (the batch module imports megatron's parallel state).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForCausalLM, Qwen2ForTokenClassification

pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install -e '.[megatron]'")

from stream_rlhf.backends.megatron.batch import packed_batch, token_logprobs, token_values  # noqa: E402
from stream_rlhf.backends.megatron.context import ContextSplit  # noqa: E402
from stream_rlhf.models.packing import pack_shared, packed_forward, sequence_logprobs  # noqa: E402
from tests.test_megatron_engine import VOCAB, _shared_experience  # noqa: E402
from tests.tiny_models import tiny_qwen2_config  # noqa: E402


def test_the_batch_is_the_packed_layout_padded_for_cp():
    shared = _shared_experience()
    splits = [ContextSplit(2, rank) for rank in range(2)]
    batch, other = (packed_batch(shared.sequences, None, shared.prompt_lens, split, None, torch.device("cpu"))
                    for split in splits)
    layout = pack_shared(shared.sequences, shared.prompt_lens)
    rows, width = layout.input_ids.shape
    assert batch.ids.shape == (rows, 12) and width == 9  # 9 -> a multiple of 2 x cp
    assert torch.equal(batch.ids[:, :width], layout.input_ids) and not batch.ids[:, width:].any()
    assert batch.mask.shape == (rows, 1, 6, 12)  # each cp rank gets its queries' rows only
    owner, slot = splits[0].locate(12)
    mask = torch.stack([(batch, other)[owner[q]].mask[:, 0, slot[q]] for q in range(12)], 1)[:, None]  # (R, 1, 12, 12)
    assert torch.equal(mask[:, :, :width, :width], ~layout.attention_mask)
    padding = mask[:, 0, width:, :]  # (R, 3, 12): each padding position sees itself only
    assert torch.equal(~padding, torch.eye(12, dtype=torch.bool)[width:].expand(rows, -1, -1))
    assert not (~mask[:, 0, :width, width:]).any()  # and no token sees padding
    assert batch.positions.shape == (3, rows, 12)
    assert all(torch.equal(batch.positions[axis, :, :width], layout.position_ids) for axis in range(3))


def test_logprobs_and_values_read_from_the_rows_equal_the_packed_forwards():
    shared = _shared_experience()
    batch = packed_batch(shared.sequences, None, shared.prompt_lens, ContextSplit(1, 0), None, torch.device("cpu"))
    assert batch.layout.shares_prefixes
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(tiny_qwen2_config(VOCAB)).eval()
    inputs = {"input_ids": batch.ids, "position_ids": batch.positions[0], "attention_mask": ~batch.mask}
    with torch.no_grad():
        hidden = lm.get_decoder()(**inputs).last_hidden_state  # (R, C, H)
        logp, entropy = token_logprobs(hidden, lm.lm_head.weight, batch, shared.sequences, 0.7, True,
                                       ContextSplit(1, 0))
        expected, expected_entropy = sequence_logprobs(lm, shared.sequences, 0.7, True, prompt_lens=shared.prompt_lens)
    assert [len(t) for t in logp] == [len(s) - 1 for s in shared.sequences]
    assert max((a - b).abs().max().item() for a, b in zip(logp + entropy, expected + expected_entropy)) < 1e-6

    torch.manual_seed(1)
    critic = Qwen2ForTokenClassification(tiny_qwen2_config(VOCAB, num_labels=1)).eval()
    with torch.no_grad():
        values = token_values(critic(**inputs).logits[..., 0], batch, ContextSplit(1, 0))  # from (R, C)
        expected = [v[:-1, 0] for v in packed_forward(critic, shared.sequences, prompt_lens=shared.prompt_lens)]
    assert max((a - b).abs().max().item() for a, b in zip(values, expected)) < 1e-6
