"""megatron-core's GPTModel built from a Hugging Face config, on this rank's share of the stage group.

    parallel = join_megatron(group, MegatronConfig(tp=2), seed=0)    # once per process
    model = build_model(hf_model.config, parallel, critic=False)      # this rank's tp/pp shard (bf16=True: autocast)
    out = model(ids, positions, mask)   # (3, B, S) positions, (B, 1, S, S) mask: (B, S, H) hidden or (B, S) values

The model is megatron's local layer spec (no transformer-engine): RMSNorm, rotary positions (M-RoPE
for every model, so that packed rows' positions restart per sequence: `mrope_section`),
grouped-query attention (under cp > 1 our own core attention, `cp_attention.py`), SwiGLU, a fused
QKV (with Qwen2's bias; Qwen3's per-head query and key norms after it) and fused gate/up. Its last
pipeline stage returns the final-norm hidden states (the fused log-prob kernel reads the output
layer's weight itself: logits are never formed) or, for a critic, per-position values from a value
head in place of the output layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from stream_rlhf.backends.megatron.arch_llama import LLAMA
from stream_rlhf.backends.megatron.arch_qwen2 import QWEN2
from stream_rlhf.backends.megatron.arch_qwen2_vl import QWEN2_VL, QWEN2_VL_CRITIC
from stream_rlhf.backends.megatron.arch_qwen3 import QWEN3
from stream_rlhf.backends.megatron.config import MegatronConfig
from stream_rlhf.backends.megatron.shim import apply_shims, seed_model_parallel
from stream_rlhf.backends.megatron.weights import Architecture, Dims
from stream_rlhf.distributed import RankGroup

apply_shims()  # before megatron's modules allocate anything

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from stream_rlhf.backends.megatron.cp_attention import with_cp_attention  # noqa: E402

ARCHITECTURES: dict[str, Architecture] = {"qwen2": QWEN2, "qwen3": QWEN3, "llama": LLAMA,
                                          "qwen2_vl_text": QWEN2_VL, "qwen2_5_vl_text": QWEN2_VL}
"""HF language-model `model_type` -> its weight mapping."""
NOT_MAPPED: dict[str, str] = {
    "qwen3_vl_text": "Qwen3-VL adds deepstack image features to the hidden states of its first decoder layers, "
                     "which megatron-core's GPTModel takes no input for (use the torch backend)",
}
"""HF language-model `model_type`s known not to map, and why."""


@dataclass(frozen=True)
class Parallel:
    """Where this rank stands: its tensor-, pipeline-, context- and data-parallel rank and sizes."""

    config: MegatronConfig
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    dp: int

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.config.pp - 1


def join_megatron(group: RankGroup, parallel: MegatronConfig, seed: int) -> Parallel:
    """Megatron's process groups over this stage group's ranks (a one-rank group gets a one-rank
    world of its own: gloo, plus NCCL for CUDA tensors, whose gradient sync gloo refuses). Once per
    process; a second call must ask for the same sizes."""
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if group.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != group.world_size:
        raise ValueError(f"megatron: the process group has {dist.get_world_size()} ranks, the stage group "
                         f"{group.world_size}")
    if ps.model_parallel_is_initialized():
        held = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size())
        if held != (parallel.tp, parallel.pp, parallel.cp):
            raise ValueError(f"megatron: this process already has tp, pp, cp = {held}, not "
                             f"{parallel.tp, parallel.pp, parallel.cp}")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
                                     context_parallel_size=parallel.cp)
        seed_model_parallel(seed)
    return Parallel(parallel, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                    ps.get_context_parallel_rank(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())


def text_config(hf_config):
    """The language model's config (a vision-language config holds it as `text_config`)."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def architecture(hf_config, critic: bool = False) -> Architecture:
    """The weight mapping of `hf_config`'s language model; a vision-language critic's own (its
    language model is not under `model.`)."""
    kind = text_config(hf_config).model_type
    if kind in NOT_MAPPED:
        raise ValueError(f"megatron backend: model_type {kind!r} is not mapped: {NOT_MAPPED[kind]}")
    if kind not in ARCHITECTURES:
        raise ValueError(f"megatron backend: model_type {kind!r} has no weight mapping "
                         f"(mapped: {', '.join(ARCHITECTURES)})")
    return QWEN2_VL_CRITIC if critic and ARCHITECTURES[kind] is QWEN2_VL else ARCHITECTURES[kind]


def dims(hf_config, tp: int) -> Dims:
    cfg = text_config(hf_config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    padded = -(-cfg.vocab_size // tp) * tp
    return Dims(cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, cfg.vocab_size, padded)


def mrope_section(cfg, head_dim: int) -> list[int]:
    """The M-RoPE split of the rotary frequencies over (time, height, width): Qwen2-VL's, or for a
    text model all of them on the first (its three position rows are equal: plain RoPE at the
    given positions, which megatron's `rope` embedding does not take)."""
    section = (getattr(cfg, "rope_parameters", None) or {}).get("mrope_section")
    return list(section) if section is not None else [head_dim // 2, 0, 0]


def rope_theta(cfg) -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"megatron backend: rope_type {rope['rope_type']!r} is not mapped (default RoPE only)")
    return float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def transformer_config(hf_config, parallel: MegatronConfig, bf16: bool = False) -> TransformerConfig:
    """`bf16`: the model runs under bf16 autocast, weights fp32; megatron casts the residual stream to
    its layers' output dtype, so the activations passed between pipeline stages are bf16 too."""
    cfg = text_config(hf_config)
    arch = architecture(hf_config)
    if getattr(cfg, "mlp_bias", False) or (not arch.qkv_bias and getattr(cfg, "attention_bias", False)):
        raise ValueError(f"megatron backend: {arch.name} with attention_bias/mlp_bias is not mapped")
    if cfg.hidden_act != "silu":
        raise ValueError(f"megatron backend: hidden_act {cfg.hidden_act!r} is not mapped (silu only)")
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} \
        if parallel.recompute else {}
    return TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=dims(hf_config, 1).head_dim,
        ffn_hidden_size=cfg.intermediate_size, normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp, use_cpu_initialization=True, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, mrope_section=mrope_section(cfg, dims(hf_config, 1).head_dim),
        **recompute,
        # pipeline p2p as plain isend/irecv: batched p2p ends in torch.cuda.synchronize()
        batch_p2p_comm=torch.cuda.is_available(),
    )


class MegatronGPT(GPTModel):
    """GPTModel whose last stage returns (B, S, H) final-norm hidden states, or (B, S) values from
    `value_head` for a critic; other stages return the (S, B, H) activations they pass on."""

    def __init__(self, config: TransformerConfig, hf_config, critic: bool, pre_process: bool, post_process: bool):
        cfg = text_config(hf_config)
        tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not critic
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=architecture(hf_config).qk_norm)
        super().__init__(config, with_cp_attention(spec) if config.context_parallel_size > 1 else spec,
                         vocab_size=dims(hf_config, config.tensor_model_parallel_size).padded_vocab,
                         max_sequence_length=cfg.max_position_embeddings, pre_process=pre_process,
                         post_process=post_process, share_embeddings_and_output_weights=tied,
                         position_embedding_type="mrope",
                         rotary_base=rope_theta(cfg))
        self.critic = critic
        if critic and post_process:
            self.output_layer = None
            self.value_head = nn.Linear(cfg.hidden_size, 1)

    def _is_in_embd_group(self) -> bool:
        """False: megatron would copy a tied embedding to the last pipeline stage by an all-reduce
        at construction (moving it with `.cuda()`, which fails on a CPU); `state.load_hf_state`
        loads both copies from the HF embedding instead. Gradients of the two copies are still
        summed over the embedding group by `finalize_model_grads`."""
        return False

    def _postprocess(self, hidden_states: Tensor, **_) -> Tensor:
        """fp32 out of the last stage under bf16 autocast too: the fused log-prob kernel takes the
        hidden states in the output layer's dtype, and values are compared with fp32 returns."""
        if not self.post_process:
            return hidden_states  # (S, B, H)
        if self.critic:
            return self.value_head(hidden_states).squeeze(-1).transpose(0, 1).float()  # (B, S)
        return hidden_states.transpose(0, 1).float()  # (B, S, H)


def build_model(hf_config, parallel: Parallel, critic: bool, bf16: bool = False) -> MegatronGPT:
    config = transformer_config(hf_config, parallel.config, bf16)
    return MegatronGPT(config, hf_config, critic, pre_process=parallel.first_stage, post_process=parallel.last_stage)
