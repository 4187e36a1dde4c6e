"""The megatron train engine under context parallelism (cp = 2, gloo) against the torch one.

Each layout (cp 2 alone; with dp 2, tp 2 or pp 2) runs `_rank_main` in fresh spawned processes
(megatron's parallel state is per process), each rank holding half of every sequence in megatron's
load-balanced layout, and checks itself against a one-rank `TorchTrainEngine` built from the same
Hugging Face models (`test_megatron_engine.py`):
- forward log-probs (text and vision-language, M-RoPE positions and image features), log-probs with
  entropy (outside a training step: pp 1 only) and the critic's values equal the torch engine's to
  1e-5 (fp32), on sequences whose longest length is not a multiple of 2 x cp (the engine pads);
- one optimizer step of the actor, the critic and the vision-language actor gives the torch engine's
  loss, gradient norm and weights (1e-5, 1e-5 and 1e-4).
The split itself (`ContextSplit`) is checked without processes. Needs the `megatron` extra.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install -e '.[megatron]'")

from tests.test_megatron_engine import (_finish, _max_diff, _models, _run_ranks, _value_loss,  # noqa: E402
                                        _vlm_experience, _vlm_loss, _vlm_train_experience)

LAYOUTS = [(2, 1, 1), (4, 1, 1), (4, 2, 1), (4, 1, 2)]  # (ranks, tp, pp) at cp 2: dp = ranks / (tp x pp x cp)


def test_the_split_pads_to_2cp_and_takes_megatrons_load_balanced_chunks():
    from stream_rlhf.backends.megatron.context import ContextSplit

    assert [ContextSplit(2, 0).width(n) for n in (7, 8, 9)] == [8, 8, 12]
    assert ContextSplit(1, 0).width(7) == 7
    ids = torch.arange(10, 18)[None]  # (1, 8): chunks [10 11] [12 13] [14 15] [16 17]
    assert ContextSplit(2, 0).take(ids, 1).tolist() == [[10, 11, 16, 17]]
    assert ContextSplit(2, 1).take(ids, 1).tolist() == [[12, 13, 14, 15]]
    assert ContextSplit(2, 0).labels(ids).tolist() == [[11, 12, 17, 17]]  # the last position: a placeholder
    mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)[None, None]
    rows = ContextSplit(2, 1).take(mask, 2)  # (1, 1, 4, 8): positions 2..5 against all 8 keys
    assert rows.shape == (1, 1, 4, 8) and rows[0, 0].sum(1).tolist() == [5, 4, 3, 2]


def _rank_main(rank: int, world: int, tp: int, pp: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    from stream_rlhf.backends.megatron.config import MegatronConfig
    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine
    from stream_rlhf.backends.optimizer_config import OptimizerConfig
    from stream_rlhf.backends.torch_engine import TorchTrainEngine
    from stream_rlhf.broker.rank_group import RankGroup, RankSpec
    from tests.test_torch_engine import _experience, _loss

    group = RankGroup.join(RankSpec(rank, world, f"file://{init_file}"))
    parallel = MegatronConfig(tp=tp, pp=pp, cp=2)
    exp = _experience()
    vlm_sequences, vlm_images = _vlm_experience()
    found: dict[str, float | bool | int] = {"longest": max(len(s) for s in exp.sequences),
                                            "vlm_longest": max(len(s) for s in vlm_sequences)}
    engine = MegatronTrainEngine(_models()["qwen2"], group, parallel=parallel)
    reference = TorchTrainEngine(_models()["qwen2"], RankGroup.single())
    found["qwen2.logprobs"] = _max_diff(engine.forward_logprobs(exp.sequences, 0.7),
                                        reference.forward_logprobs(exp.sequences, 0.7))
    if pp == 1:
        (logp, entropy), (logp_ref, entropy_ref) = (e.logprobs(exp.sequences, 0.7, with_entropy=True)
                                                     for e in (engine, reference))
        found["qwen2.entropy"] = max(_max_diff(logp, logp_ref), _max_diff(entropy, entropy_ref))
    engine = MegatronTrainEngine(_models()["critic"], group, parallel=parallel)
    reference = TorchTrainEngine(_models()["critic"], RankGroup.single())
    found["critic.values"] = _max_diff(engine.forward_values(exp.sequences), reference.forward_values(exp.sequences))
    engine = MegatronTrainEngine(_models()["vlm"], group, parallel=parallel)
    reference = TorchTrainEngine(_models()["vlm"], RankGroup.single())
    found["vlm.logprobs"] = _max_diff(engine.forward_logprobs(vlm_sequences, 0.7, images=vlm_images),
                                      reference.forward_logprobs(vlm_sequences, 0.7, images=vlm_images))

    exp.values = torch.zeros_like(exp.mask)
    targets = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()
    vlm_exp, advantages = _vlm_train_experience(vlm_sequences, vlm_images)
    optimizer = OptimizerConfig(lr=1e-2, max_grad_norm=0.5)
    for name, loss_of, part, per_sample in (("qwen2", _loss, exp, {"advantages": targets}),
                                            ("critic", _value_loss, exp, {"returns": targets}),
                                            ("vlm", _vlm_loss, vlm_exp, {"advantages": advantages})):
        engine = MegatronTrainEngine(_models()[name], group, optimizer, parallel)
        reference = TorchTrainEngine(_models()[name], RankGroup.single(), optimizer)
        mine = engine.train_step(part, loss_of(engine), per_sample)
        theirs = reference.train_step(part, loss_of(reference), per_sample)
        for metric in ("loss", "grad_norm"):
            found[f"{name}.train.{metric}"] = abs(mine[metric] - theirs[metric])
        a, b = engine.export_weights(), reference.export_weights()
        found[f"{name}.train.weights"] = max((a[k] - b[k]).abs().max().item() for k in b)
        found[f"{name}.train.moved"] = max((b[k] - _models()[name].state_dict()[k]).abs().max().item() for k in b)
    _finish(group, found, out)


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,pp", LAYOUTS, ids=[f"ranks{w}-tp{t}-pp{p}-cp2" for w, t, p in LAYOUTS])
def test_megatron_engine_at_cp2_matches_the_torch_engine(tmp_path, world, tp, pp):
    found = _run_ranks(tmp_path, _rank_main, world, tp, pp)
    assert found["longest"] % 4 and found["vlm_longest"] % 4  # the engine padded both to a multiple of 2 x cp
    assert found["qwen2.logprobs"] < 1e-5
    if pp == 1:
        assert found["qwen2.entropy"] < 1e-5
    assert found["critic.values"] < 1e-5 and found["vlm.logprobs"] < 1e-5
    for name in ("qwen2", "critic", "vlm"):
        assert found[f"{name}.train.moved"] > 1e-3, name  # training moved the weights: the comparison means something
        assert found[f"{name}.train.weights"] < 1e-4, name
        assert found[f"{name}.train.loss"] < 1e-5 and found[f"{name}.train.grad_norm"] < 1e-5, name
