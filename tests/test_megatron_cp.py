"""The megatron train engine under context parallelism (cp = 2, gloo) against the torch one.

Each layout (cp 2 alone; with dp 2, tp 2 or pp 2) runs `_rank_main` in fresh spawned processes
(megatron's parallel state is per process), each rank holding half of every packed row in
megatron's load-balanced layout, and checks itself against a one-rank `TorchTrainEngine` built from
the same Hugging Face models (`test_megatron_engine.py`), both engines packing the sequences:
- forward log-probs (text and vision-language, M-RoPE positions and image features), log-probs with
  entropy (outside a training step: pp 1 only), the critic's and the VLM critic's values equal the
  torch engine's to 1e-5 (fp32), on rows whose length is not a multiple of 2 x cp (the engine
  pads); text ones also with `prompt_lens` (a prompt's samples sharing its forward, so that some
  (position, next token) pairs are not neighbours in the row), and of one two-token sequence (a cp
  rank with no position to score);
- one optimizer step of the actor, the critic and the actor on the two-token sequence gives the
  torch engine's loss, gradient norm and weights (1e-5, 1e-5 and 1e-4), and so does one of the
  actor on shared prompts, the VLM actor and the VLM critic (`_one_step_each`).
The split itself (`ContextSplit`) is checked without processes. Needs the `megatron` extra.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install -e '.[megatron]'")

from tests.test_megatron_engine import (  # noqa: E402
    _assert_one_step_each,
    _finish,
    _max_diff,
    _models,
    _one_step_each,
    _run_ranks,
    _shared_experience,
    _train_once,
    _value_loss,
    _vlm_experience,
)

LAYOUTS = [(2, 1, 1), (4, 1, 1), (4, 2, 1), (4, 1, 2)]  # (ranks, tp, pp) at cp 2: dp = ranks / (tp x pp x cp)


def test_the_split_pads_to_2cp_and_takes_megatrons_load_balanced_chunks():
    from stream_rlhf.backends.megatron.context import ContextSplit

    assert [ContextSplit(2, 0).width(n) for n in (7, 8, 9)] == [8, 8, 12]
    assert ContextSplit(1, 0).width(7) == 7
    ids = torch.arange(10, 18)[None]  # (1, 8): chunks [10 11] [12 13] [14 15] [16 17]
    assert ContextSplit(2, 0).take(ids, 1).tolist() == [[10, 11, 16, 17]]
    assert ContextSplit(2, 1).take(ids, 1).tolist() == [[12, 13, 14, 15]]
    owner, slot = ContextSplit(2, 0).locate(8)  # where each position lives: rank, index in its part
    assert owner.tolist() == [0, 0, 1, 1, 1, 1, 0, 0] and slot.tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)[None, None]
    rows = ContextSplit(2, 1).take(mask, 2)  # (1, 1, 4, 8): positions 2..5 against all 8 keys
    assert rows.shape == (1, 1, 4, 8) and rows[0, 0].sum(1).tolist() == [5, 4, 3, 2]


def _nll_loss(engine):
    """The mean negative log-likelihood of the part's tokens (a gradient however few they are)."""
    def loss_fn(part, per_sample):
        logp, _ = engine.logprobs(part.sequences, 1.0)
        return -torch.cat(logp).mean(), {}
    return loss_fn


def _rank_main(rank: int, world: int, tp: int, pp: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    from stream_rlhf.backends.megatron.config import MegatronConfig
    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine
    from stream_rlhf.backends.optimizer_config import OptimizerConfig
    from stream_rlhf.backends.torch_engine import TorchTrainEngine
    from stream_rlhf.distributed import RankGroup, RankSpec
    from tests.test_torch_engine import _experience, _loss

    group = RankGroup.join(RankSpec(rank, world, f"file://{init_file}"))
    parallel = MegatronConfig(tp=tp, pp=pp, cp=2)
    exp = _experience()
    vlm_sequences, vlm_images = _vlm_experience()
    found: dict[str, float | bool | int] = {"longest": max(len(s) for s in exp.sequences),
                                            "vlm_longest": max(len(s) for s in vlm_sequences)}
    shared = _shared_experience()
    engine = MegatronTrainEngine(_models()["qwen2"], group, parallel=parallel)
    reference = TorchTrainEngine(_models()["qwen2"], RankGroup.single())
    found["qwen2.logprobs"] = _max_diff(engine.forward_logprobs(exp.sequences, 0.7),
                                        reference.forward_logprobs(exp.sequences, 0.7))
    found["qwen2.shared.logprobs"] = _max_diff(
        engine.forward_logprobs(shared.sequences, 0.7, prompt_lens=shared.prompt_lens),
        reference.forward_logprobs(shared.sequences, 0.7, prompt_lens=shared.prompt_lens))
    tiny = [exp.sequences[0][:2]]  # one pair, at position 0: cp rank 1 scores none
    found["qwen2.tiny.logprobs"] = _max_diff(engine.forward_logprobs(tiny, 0.7), reference.forward_logprobs(tiny, 0.7))
    if pp == 1:
        for case, lens in (("", None), (".shared", shared.prompt_lens)):
            sequences = exp.sequences if lens is None else shared.sequences
            (logp, entropy), (logp_ref, entropy_ref) = (e.logprobs(sequences, 0.7, with_entropy=True, prompt_lens=lens)
                                                         for e in (engine, reference))
            found[f"qwen2{case}.entropy"] = max(_max_diff(logp, logp_ref), _max_diff(entropy, entropy_ref))
    engine = MegatronTrainEngine(_models()["critic"], group, parallel=parallel)
    reference = TorchTrainEngine(_models()["critic"], RankGroup.single())
    found["critic.values"] = _max_diff(engine.forward_values(exp.sequences), reference.forward_values(exp.sequences))
    found["critic.shared.values"] = _max_diff(
        engine.forward_values(shared.sequences, prompt_lens=shared.prompt_lens),
        reference.forward_values(shared.sequences, prompt_lens=shared.prompt_lens))
    engine = MegatronTrainEngine(_models()["vlm"], group, parallel=parallel)
    reference = TorchTrainEngine(_models()["vlm"], RankGroup.single())
    found["vlm.logprobs"] = _max_diff(engine.forward_logprobs(vlm_sequences, 0.7, images=vlm_images),
                                      reference.forward_logprobs(vlm_sequences, 0.7, images=vlm_images))
    engine = MegatronTrainEngine(_models()["vlm_critic"], group, parallel=parallel)
    reference = TorchTrainEngine(_models()["vlm_critic"], RankGroup.single())
    found["vlm_critic.values"] = _max_diff(engine.forward_values(vlm_sequences, vlm_images),
                                           reference.forward_values(vlm_sequences, vlm_images))
    packed = engine._batch(shared.sequences, None, shared.prompt_lens)
    found["rows_width"], found["padded_width"] = packed.layout.input_ids.shape[1], packed.ids.shape[1]

    exp.values = torch.zeros_like(exp.mask)
    targets = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()
    tiny_exp = dataclasses.replace(exp.select(torch.tensor([0])), sequences=tiny, prompt_lens=torch.tensor([1]),
                                   mask=(torch.arange(exp.mask.shape[1]) < 1).float()[None])
    found.update(_train_once(group, parallel, OptimizerConfig(lr=1e-2, max_grad_norm=0.5), [
        ("qwen2", "qwen2", _loss, exp, {"advantages": targets}),
        ("critic", "critic", _value_loss, exp, {"returns": targets}),
        ("tiny", "qwen2", _nll_loss, tiny_exp, {})]))
    found.update(_one_step_each(group, parallel, shared, vlm_sequences, vlm_images))
    _finish(group, found, out)


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,pp", LAYOUTS, ids=[f"ranks{w}-tp{t}-pp{p}-cp2" for w, t, p in LAYOUTS])
def test_megatron_engine_at_cp2_matches_the_torch_engine(tmp_path, world, tp, pp):
    found = _run_ranks(tmp_path, _rank_main, world, tp, pp)
    assert found["longest"] % 4 and found["vlm_longest"] % 4 and found["rows_width"] % 4  # rows that need padding...
    assert found["padded_width"] % 4 == 0  # ...and the engine padded them to a multiple of 2 x cp
    keys = ("qwen2.logprobs", "qwen2.shared.logprobs", "qwen2.tiny.logprobs", "critic.values", "critic.shared.values",
            "vlm.logprobs", "vlm_critic.values")
    for key in keys + (("qwen2.entropy", "qwen2.shared.entropy") if pp == 1 else ()):
        assert found[key] < 1e-5, key
    for name in ("qwen2", "critic", "tiny"):
        assert found[f"{name}.train.moved"] > 1e-3, name  # training moved the weights: the comparison means something
        assert found[f"{name}.train.weights"] < 1e-4, name
        assert found[f"{name}.train.loss"] < 1e-5 and found[f"{name}.train.grad_norm"] < 1e-5, name
    _assert_one_step_each(found)
