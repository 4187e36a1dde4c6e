"""The megatron engine's packed micro-batch (`backends/megatron/batch.py`), without processes.

- The batch is `models/packing.py`'s layout: its mask inverted (megatron's True = masked out), rows
  padded to a multiple of 2 x cp with padding that sees itself only, positions as three equal rows.
- A pipeline step's micro-batches are padded to one shape (rows and width), the padding again
  seeing itself only, and read back as before.
- Log-probs and values read out of the rows equal `sequence_logprobs` / `packed_forward` with
  shared prompts, on hidden states a Hugging Face model computes on the batch's own inputs.
Needs the `megatron` extra (the batch module imports megatron's parallel state).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForCausalLM, Qwen2ForTokenClassification

pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install -e '.[megatron]'")

from stream_rlhf.backends.megatron.batch import (  # noqa: E402
    common_shape,
    packed_batch,
    run_of,
    token_logprobs,
    token_values,
)
from stream_rlhf.backends.megatron.context import ContextSplit  # noqa: E402
from stream_rlhf.models.packing import pack_shared, packed_forward, sequence_logprobs  # noqa: E402
from tests.test_megatron_engine import VOCAB, _shared_experience  # noqa: E402
from tests.tiny_models import tiny_qwen2_config  # noqa: E402


def test_the_batch_is_the_packed_layout_padded_for_cp():
    shared = _shared_experience()
    splits = [ContextSplit(2, rank) for rank in range(2)]
    run = run_of(shared.sequences, None, shared.prompt_lens, None)
    batch, other = (packed_batch(run, split, None, torch.device("cpu")) for split in splits)
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


def test_a_pipeline_step_pads_its_micro_batches_to_one_shape():
    """Under pp > 1 every micro-batch of a step takes the largest one's rows and width (a multiple
    of 2 x cp); the rows and columns added attend to themselves only."""
    shared = _shared_experience()
    runs = [run_of(shared.sequences[:2], None, shared.prompt_lens[:2], None),
            run_of(shared.sequences[2:], None, None, None)]
    shape = common_shape(runs, ContextSplit(2, 0))
    assert [tuple(r.layout.input_ids.shape) for r in runs] == [(1, 9), (4, 8)]
    assert shape == (4, 12)  # the most rows, and the widest padded to a multiple of 2 x cp
    small = packed_batch(runs[0], ContextSplit(1, 0), None, torch.device("cpu"), shape)
    rows, width = runs[0].layout.input_ids.shape
    assert small.ids.shape == shape and small.positions.shape == (3, *shape)
    assert small.mask.shape == (shape[0], 1, 12, 12)
    assert torch.equal(small.ids[:rows, :width], runs[0].layout.input_ids) and not small.ids[rows:].any()
    assert torch.equal(~small.mask[:rows, :, :width, :width], runs[0].layout.attention_mask)
    assert torch.equal(~small.mask[rows:, 0], torch.eye(12, dtype=torch.bool).expand(shape[0] - rows, -1, -1))


@pytest.mark.parametrize("padded", [False, True], ids=["own-shape", "padded"])
def test_logprobs_and_values_read_from_the_rows_equal_the_packed_forwards(padded):
    """Also from a batch padded to a larger shape, as a pipeline step's micro-batches are."""
    shared = _shared_experience()
    run = run_of(shared.sequences, None, shared.prompt_lens, None)
    shape = (run.layout.input_ids.shape[0] + 2, run.layout.input_ids.shape[1] + 5) if padded else None
    batch = packed_batch(run, ContextSplit(1, 0), None, torch.device("cpu"), shape)
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
