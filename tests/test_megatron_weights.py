"""The HF <-> megatron weight splits as pure tensor functions (no process group): every tensor of
a stage's entries split over tp ranks and merged back is bit-identical, and the parallel-size
checks name the key and the numbers."""

from __future__ import annotations

import re

import pytest
import torch

from stream_rlhf.backends.megatron.arch_llama import LLAMA
from stream_rlhf.backends.megatron.arch_qwen2 import QWEN2
from stream_rlhf.backends.megatron.arch_qwen3 import QWEN3
from stream_rlhf.backends.megatron.config import MegatronConfig, check_parallel
from stream_rlhf.backends.megatron.weights import Architecture, Dims, stage_entries, to_hf, to_megatron
from stream_rlhf.config import ConfigError


def _hf_state(arch: Architecture, critic: bool) -> dict[str, torch.Tensor]:
    """A 4-layer model's tensors: 4 heads, 2 key/value groups, head_dim 8, hidden 32, vocab 37."""
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (37, 32), "model.norm.weight": (32,), "lm_head.weight": (37, 32)}
    for i in range(4):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (32,), f"{p}.post_attention_layernorm.weight": (32,),
                       f"{p}.self_attn.q_proj.weight": (32, 32), f"{p}.self_attn.k_proj.weight": (16, 32),
                       f"{p}.self_attn.v_proj.weight": (16, 32), f"{p}.self_attn.o_proj.weight": (32, 32),
                       f"{p}.mlp.gate_proj.weight": (48, 32), f"{p}.mlp.up_proj.weight": (48, 32),
                       f"{p}.mlp.down_proj.weight": (32, 48)})
        if arch.qk_norm:
            shapes.update({f"{p}.self_attn.q_norm.weight": (8,), f"{p}.self_attn.k_norm.weight": (8,)})
        if arch.qkv_bias:
            shapes.update({f"{p}.self_attn.q_proj.bias": (32,), f"{p}.self_attn.k_proj.bias": (16,),
                           f"{p}.self_attn.v_proj.bias": (16,)})
    if critic:
        shapes.update({"score.weight": (1, 32), "score.bias": (1,)})
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


@pytest.mark.parametrize("arch", [QWEN2, QWEN3, LLAMA], ids=["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)])
@pytest.mark.parametrize("tied,critic", [(True, False), (False, False), (False, True)])
def test_split_and_merge_give_back_every_hf_tensor_bit_for_bit(arch, tp, pp, tied, critic):
    hf = _hf_state(arch, critic)
    dims = Dims(heads=4, kv_heads=2, head_dim=8, vocab=37, padded_vocab=-(-37 // tp) * tp)
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        for entry in stage_entries(arch, 4, tied, stage, pp, critic):
            shards = [to_megatron(entry, hf, dims, tp, rank) for rank in range(tp)]
            assert len({s.shape for s in shards}) == 1  # every tp rank holds an equal part
            back.update(to_hf(entry, shards, dims))
    expected = {n for n in hf if not (n == "lm_head.weight" and (tied or critic))}
    assert set(back) == expected
    for name in expected:
        assert torch.equal(back[name], hf[name]), name


def test_fused_qkv_puts_each_key_value_group_with_its_query_heads():
    dims = Dims(heads=4, kv_heads=2, head_dim=1, vocab=8, padded_vocab=8)
    hf = {"q": torch.tensor([[0.0], [1], [2], [3]]), "k": torch.tensor([[10.0], [11]]),
          "v": torch.tensor([[20.0], [21]])}
    from stream_rlhf.backends.megatron.weights import Entry

    entry = Entry("qkv", ("q", "k", "v"), "qkv")
    assert to_megatron(entry, hf, dims, 1, 0).flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert to_megatron(entry, hf, dims, 2, 1).flatten().tolist() == [2, 3, 11, 21]


def test_parallel_sizes_that_do_not_fit_are_refused_naming_the_key_and_numbers():
    key = "placement.stages.actor_train.megatron"
    with pytest.raises(ConfigError,
                       match=r"actor_train.megatron: tp x pp x cp = 2 x 2 x 1 = 4 does not divide .*ranks=2"):
        check_parallel(MegatronConfig(tp=2, pp=2), 2, 4, 2, 2, key)
    with pytest.raises(ConfigError,
                       match=r"megatron.tp=2: does not divide the model's 2 attention heads and 1 key/value"):
        check_parallel(MegatronConfig(tp=2), 2, 2, 1, 2, key)
    with pytest.raises(ConfigError, match=r"megatron.pp=2: does not divide the model's 3 layers"):
        check_parallel(MegatronConfig(pp=2), 2, 4, 2, 3, key)
    with pytest.raises(ConfigError, match="tp=0: must be >= 1"):
        MegatronConfig(tp=0)
    with pytest.raises(ConfigError, match=r"tp x pp x cp = 1 x 1 x 2 = 2 does not divide the stage's ranks=3"):
        check_parallel(MegatronConfig(cp=2), 3, 4, 2, 2, key)
    with pytest.raises(ConfigError, match="cp=0: must be >= 1"):
        MegatronConfig(cp=0)
    check_parallel(MegatronConfig(tp=2, cp=2), 8, 4, 2, 2, key)  # dp 2
    check_parallel(MegatronConfig(tp=2), 4, 4, 2, 2, key)  # dp 2
    assert MegatronConfig(tp=2).data_parallel(4) == 2


def test_job_configs_place_megatron_only_where_it_fits():
    from stream_rlhf.config import build
    from stream_rlhf.rl.config import RLJobConfig

    def job(stages: dict, **extra) -> RLJobConfig:
        return build(RLJobConfig, {"name": "m", "placement": {"stages": stages}, **extra})

    ok = job({"actor_train": {"ranks": 2, "backend": "megatron", "megatron": {"tp": 2}}})
    assert ok.placement.stages["actor_train"].megatron.data_parallel(2) == 1
    ok = job({"actor_train": {"ranks": 4, "backend": "megatron", "megatron": {"cp": 2}}})
    assert ok.placement.stages["actor_train"].megatron.data_parallel(4) == 2
    refused = [
        ({"actor_train": {"ranks": 2, "backend": "megatron", "megatron": {"tp": 4}}},
         "placement.stages.actor_train.megatron: tp x pp x cp = 4 x 1 x 1 = 4 does not divide the stage's ranks=2"),
        ({"actor_train": {"ranks": 3, "backend": "megatron", "megatron": {"cp": 2}}},
         "placement.stages.actor_train.megatron: tp x pp x cp = 1 x 1 x 2 = 2 does not divide the stage's ranks=3"),
        ({"actor_train": {"ranks": 4, "backend": "megatron", "megatron": {"tp": 4}}},
         "placement.stages.actor_train.megatron.tp=4: does not divide the model's 4 attention heads and 2 key/value"),
        ({"actor_train": {"ranks": 4, "backend": "megatron", "megatron": {"pp": 4}}},
         "placement.stages.actor_train.megatron.pp=4: does not divide the model's 2 layers"),
        ({"actor_train": {"ranks": 2, "megatron": {"tp": 2}}}, "backend=torch ignores it"),
        ({"rollout": {"backend": "megatron"}}, "placement.stages.rollout.backend=megatron: only ref_forward"),
        ({"critic_train": {"backend": "mega"}}, "placement.stages.critic_train.backend='mega': must be one of"),
    ]
    for stages, message in refused:
        with pytest.raises(ConfigError, match=re.escape(message)):
            job(stages, rollout_batch={"prompts_per_minibatch": 16})
    vision = {"task": {"name": "shapes"}, "model": {"tiny": {"vision": {}}}}
    assert job({"actor_train": {"backend": "megatron"}}, **vision).placement.stages["actor_train"].backend == "megatron"
    critic_train = job({"critic_train": {"backend": "megatron"}}, **vision).placement.stages["critic_train"]
    assert critic_train.backend == "megatron"
