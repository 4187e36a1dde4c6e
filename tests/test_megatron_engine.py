"""The megatron train engine against the torch one, on real gloo groups of 1 and 2 ranks.

Each layout (ranks, tp, pp) runs in fresh spawned processes (megatron's parallel state is per
process), checks itself against a one-rank `TorchTrainEngine` built from the same Hugging Face
models, and writes what it measured for the test to assert:
- HF -> megatron -> HF is bit-identical (Qwen2 with tied embeddings and qkv bias, Qwen3 with its
  per-head query and key norms, Llama untied,
  a Qwen2 critic with its value head, a Qwen2.5-VL whose frozen vision tower stays out of megatron,
  and the Qwen2.5-VL critic: its language model and value head);
- forward log-probs and values equal the torch engine's to 1e-5 (fp32), both engines packing the
  sequences (several per row), the VLM's and its critic's with image features at the image tokens
  and M-RoPE positions; with `prompt_lens`, the samples of a prompt sharing its forward
  (`pack_shared`) on both;
- two optimizer steps of the actor and of the critic give the torch engine's losses, gradient
  norms and weights (1e-5 and 1e-4); one step of the VLM actor, of the VLM critic and of the actor
  on shared prompts likewise; saved state resumes training exactly; a saved HF folder loads back;
- with `micro_batch_tokens` a step passes in several micro-batches of megatron's schedule (1F1B
  under pp 2, padded to one shape) and gives the torch engine's one pass, and forwards in
  micro-batches give its log-probs and values.
Needs the `megatron` extra.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from stream_rlhf.algos.aggregation import row_weights

pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install -e '.[megatron]'")

VOCAB = 40
LAYOUTS = [(1, 1, 1), (2, 2, 1), (2, 1, 2), (2, 1, 1)]  # (ranks, tp, pp); the last is dp = 2
MICRO_TOKENS = 12
"""`micro_batch_tokens` of the micro-batch cases: `_shared_experience`'s samples of 5, 7, 8, 6, 6 and
4 tokens pass in 4 micro-batches on one replica, 2 on each of two."""


def _models():
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2ForCausalLM,
        Qwen2ForTokenClassification,
        Qwen3ForCausalLM,
    )

    from stream_rlhf.models.vision_language import VisionLanguageCritic
    from tests.tiny_models import tiny_qwen2_5_vl, tiny_qwen2_config, tiny_qwen3_config

    heads = {"num_attention_heads": 4, "num_key_value_heads": 2}  # tp 2 splits both
    torch.manual_seed(0)
    qwen2 = Qwen2ForCausalLM(tiny_qwen2_config(VOCAB, **heads))
    torch.manual_seed(1)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         head_dim=32, max_position_embeddings=128, tie_word_embeddings=False, **heads))
    torch.manual_seed(2)
    critic = Qwen2ForTokenClassification(tiny_qwen2_config(VOCAB, num_labels=1, **heads))
    critic.dropout.p = 0.0
    base = tiny_qwen2_5_vl()
    base.config.text_config.num_key_value_heads = 2  # tp 2 splits them
    torch.manual_seed(3)
    vlm = type(base)(base.config)
    vlm_critic = VisionLanguageCritic(vlm.config, vlm.model.language_model)  # the VLM's own language model
    torch.manual_seed(4)
    torch.nn.init.normal_(vlm_critic.score.weight, std=0.1)  # not the zero head a new critic gets: values vary
    torch.manual_seed(5)
    qwen3 = Qwen3ForCausalLM(tiny_qwen3_config(VOCAB, **heads))
    with torch.no_grad():  # norms that are not all ones: the mapping of q_norm and k_norm shows
        for layer in qwen3.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return {"qwen2": qwen2, "qwen3": qwen3, "llama": llama, "critic": critic, "vlm": vlm, "vlm_critic": vlm_critic}


def _shared_experience():
    """Three prompts with two samples each (GRPO's groups), so that a forward with `prompt_lens`
    runs each prompt once; responses of 1 to 4 tokens."""
    from stream_rlhf.experience import Experience

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (3, 5, 2)]
    response_lens = torch.tensor([2, 4, 3, 1, 4, 2])
    sequences = [torch.cat([prompts[i // 2], torch.randint(1, VOCAB, (int(n),), generator=g)])
                 for i, n in enumerate(response_lens)]
    mask = (torch.arange(4)[None] < response_lens[:, None]).float()
    behavior = -torch.rand(6, 4, generator=g) * 3 * mask
    return Experience(sequences=sequences, prompt_lens=torch.tensor([len(prompts[i // 2]) for i in range(6)]),
                      mask=mask, behavior_logp=behavior, old_logp=behavior.clone(), ref_logp=None,
                      values=torch.zeros(6, 4), scores=torch.zeros(6), group_ids=torch.arange(6) // 2,
                      policy_versions=torch.zeros(6))


def _vlm_experience():
    """Three samples of the VLM: one image, none, two images; features from its vision tower."""
    from tests.test_vision_language import encode, make_sample

    g = torch.Generator().manual_seed(4)
    model = _models()["vlm"].eval()
    samples = [make_sample(g, [3, 4], [(2, 4, 4)]), make_sample(g, [5], []),
               make_sample(g, [2, 2, 3], [(2, 4, 8), (2, 4, 4)])]
    return [s.input_ids for s in samples], [encode(model, s) for s in samples]


def _vlm_train_experience(sequences: list[torch.Tensor], images: list) -> tuple:
    """The VLM's samples as an Experience with three response tokens each, and their advantages
    (or a critic's returns)."""
    from stream_rlhf.experience import Experience

    exp = Experience(sequences=sequences, prompt_lens=torch.tensor([len(q) - 3 for q in sequences]),
                     mask=torch.ones(3, 3), behavior_logp=-torch.ones(3, 3), old_logp=-torch.ones(3, 3),
                     ref_logp=None, values=torch.zeros(3, 3), scores=torch.zeros(3), group_ids=torch.arange(3),
                     policy_versions=torch.zeros(3), images=images)
    return exp, torch.tensor([[1.0], [-0.5], [0.25]]).expand(3, 3).contiguous()


def _value_loss(engine):
    """The critic stage's value loss: values of the part's sequences (images, shared prompts) as asked."""
    from stream_rlhf.algos.losses import value_loss

    def loss_fn(part, per_sample):
        values = engine.response_values(part)
        return value_loss(values, part.values, per_sample["returns"], part.mask, 10.0)
    return loss_fn


def _policy_loss(engine):
    """The actor stage's policy loss: log-probs with images and shared prompts as the stage asks."""
    from stream_rlhf.algos.losses import policy_loss

    def loss_fn(part, per_sample):
        logp, _ = engine.response_logprobs(part, 1.0)
        return policy_loss(logp, part.old_logp, per_sample["advantages"], part.mask, 0.2, 0.2,
                           row_weights=per_sample.get("row_weights"))
    return loss_fn


def _run_ranks(tmp_path: Path, target, world: int, *args) -> dict:
    """`target(rank, world, *args, init_file, out)` in `world` spawned processes; what the leader
    wrote to `out` (`_finish`)."""
    out = str(tmp_path / "found.json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, *args, str(tmp_path / "init"), out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * world
    return json.loads(Path(out).read_text())


def _finish(group, found: dict, out: str) -> None:
    """The leader writes `found` for the test; every rank leaves without tearing megatron down."""
    if group.is_leader:
        Path(out).write_text(json.dumps(found))
    group.close()
    os._exit(0)  # no interpreter teardown of megatron's groups


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _rank_main(rank: int, world: int, tp: int, pp: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    from stream_rlhf.backends.megatron.config import MegatronConfig
    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine
    from stream_rlhf.backends.optimizer_config import OptimizerConfig
    from stream_rlhf.backends.torch_engine import TorchTrainEngine
    from stream_rlhf.distributed import RankGroup, RankSpec
    from stream_rlhf.models.tokenizer import build_tokenizer
    from tests.test_torch_engine import _experience, _loss

    group = RankGroup.join(RankSpec(rank, world, f"file://{init_file}" if world > 1 else None))
    parallel = MegatronConfig(tp=tp, pp=pp)
    found: dict[str, float | bool] = {}
    exp = _experience()
    shared = _shared_experience()
    vlm_sequences, vlm_images = _vlm_experience()
    for name in ("qwen2", "qwen3", "llama", "critic", "vlm", "vlm_critic"):
        original = _models()[name].state_dict()
        engine = MegatronTrainEngine(_models()[name], group, parallel=parallel)
        exported = engine.export_weights()
        found[f"{name}.round_trip"] = exported.keys() == original.keys() and all(
            torch.equal(exported[k], original[k]) for k in original)
        reference = TorchTrainEngine(_models()[name], RankGroup.single())
        found[f"{name}.parameter_counts"] = engine.parameter_counts() == reference.parameter_counts()
        if name == "vlm":
            found[f"{name}.logprobs"] = _max_diff(engine.forward_logprobs(vlm_sequences, 0.7, images=vlm_images),
                                                  reference.forward_logprobs(vlm_sequences, 0.7, images=vlm_images))
        elif name == "vlm_critic":
            found[f"{name}.values"] = _max_diff(engine.forward_values(vlm_sequences, vlm_images),
                                                reference.forward_values(vlm_sequences, vlm_images))
        elif name == "critic":
            found[f"{name}.values"] = _max_diff(engine.forward_values(exp.sequences),
                                                reference.forward_values(exp.sequences))
            runs = MegatronTrainEngine(_models()[name], group, parallel=parallel, micro_batch_tokens=MICRO_TOKENS)
            found[f"{name}.micro.values"] = _max_diff(
                runs.forward_values(shared.sequences, prompt_lens=shared.prompt_lens),
                reference.forward_values(shared.sequences, prompt_lens=shared.prompt_lens))
            found[f"{name}.shared.values"] = _max_diff(
                engine.forward_values(shared.sequences, prompt_lens=shared.prompt_lens),
                reference.forward_values(shared.sequences, prompt_lens=shared.prompt_lens))
        else:
            found[f"{name}.logprobs"] = _max_diff(engine.forward_logprobs(exp.sequences, 0.7),
                                                  reference.forward_logprobs(exp.sequences, 0.7))
            found[f"{name}.shared.logprobs"] = _max_diff(
                engine.forward_logprobs(shared.sequences, 0.7, prompt_lens=shared.prompt_lens),
                reference.forward_logprobs(shared.sequences, 0.7, prompt_lens=shared.prompt_lens))
            runs = MegatronTrainEngine(_models()[name], group, parallel=parallel, micro_batch_tokens=MICRO_TOKENS)
            found[f"{name}.micro.logprobs"] = _max_diff(
                runs.forward_logprobs(shared.sequences, 0.7, prompt_lens=shared.prompt_lens),
                reference.forward_logprobs(shared.sequences, 0.7, prompt_lens=shared.prompt_lens))
    found.update(_rows(engine, exp, shared))

    exp.values = torch.zeros_like(exp.mask)
    targets = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()
    optimizer = OptimizerConfig(lr=1e-2, max_grad_norm=0.5)
    for name, loss_of, key in (("qwen2", _loss, "advantages"), ("critic", _value_loss, "returns")):
        engine = MegatronTrainEngine(_models()[name], group, optimizer, parallel)
        reference = TorchTrainEngine(_models()[name], RankGroup.single(), optimizer)
        for step in range(2):
            mine = engine.train_step(exp, loss_of(engine), {key: targets})
            theirs = reference.train_step(exp, loss_of(reference), {key: targets})
            for metric in ("loss", "grad_norm"):
                found[f"{name}.train.{metric}.{step}"] = abs(mine[metric] - theirs[metric])
        a, b = engine.export_weights(), reference.export_weights()
        found[f"{name}.train.weights"] = max((a[k] - b[k]).abs().max().item() for k in b)
        found[f"{name}.train.moved"] = max((b[k] - _models()[name].state_dict()[k]).abs().max().item() for k in b)
        state = Path(out + f".{name}.state")
        snapshot = engine.snapshot_state()
        weights, exported = engine.snapshot_weights(), engine.export_weights()
        exported = {k: v.clone() for k, v in exported.items()}
        engine.train_step(exp, loss_of(engine), {key: targets})  # training goes on before the write
        found[f"{name}.weights_snapshot_kept"] = all(torch.equal(weights[k], exported[k]) for k in exported)
        if snapshot is not None:
            torch.save(snapshot, state)
        group.barrier()  # the leader wrote it
        resumed = MegatronTrainEngine(_models()[name], group, optimizer, parallel)
        resumed.load_state(state)
        resumed.train_step(exp, loss_of(resumed), {key: targets})
        a, b = engine.export_weights(), resumed.export_weights()
        found[f"{name}.resumes_exactly"] = all(torch.equal(a[k], b[k]) for k in a)
    found.update(_one_step_each(group, parallel, shared, vlm_sequences, vlm_images))
    folder = Path(out + ".checkpoint")
    engine = MegatronTrainEngine(_models()["qwen2"], group, optimizer, parallel)
    engine.train_step(exp, _loss(engine), {"advantages": targets})
    engine.save(folder, build_tokenizer())
    group.barrier()
    loaded = MegatronTrainEngine(_models()["qwen2"], group, parallel=parallel)
    loaded.load(folder)
    a, b = engine.export_weights(), loaded.export_weights()
    found["save_load"] = all(torch.equal(a[k], b[k]) for k in a)
    _finish(group, found, out)


def _rows(engine, exp, shared) -> dict[str, int | bool]:
    """How the engine packed: its rows for `exp` and for `shared` with and without `prompt_lens`."""
    unshared = engine._batch(shared.sequences, None, None)
    with_prompts = engine._batch(shared.sequences, None, shared.prompt_lens)
    mixed = exp.sequences + [s[:2] for s in exp.sequences]  # short ones fill the rows' tails
    return {"rows": engine._batch(mixed, None, None).ids.shape[0], "samples": len(mixed),
            "shared.tokens": int(with_prompts.ids.ne(0).sum()), "unshared.tokens": int(unshared.ids.ne(0).sum()),
            "shared.shares": with_prompts.layout.shares_prefixes}


def _train_once(group, parallel, optimizer, cases, micro_batch_tokens: int | None = None) -> dict[str, float]:
    """One optimizer step of each case (case, model name, loss, part, per-sample tensors) on the
    megatron engine (in micro-batches of `micro_batch_tokens`) and on a one-rank torch engine (one
    pass): the differences of their loss, gradient norm and weights, and how far the torch
    engine's weights moved."""
    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine
    from stream_rlhf.backends.torch_engine import TorchTrainEngine
    from stream_rlhf.distributed import RankGroup

    found = {}
    for case, name, loss_of, part, per_sample in cases:
        engine = MegatronTrainEngine(_models()[name], group,
                                     dataclasses.replace(optimizer, micro_batch_tokens=micro_batch_tokens), parallel)
        reference = TorchTrainEngine(_models()[name], RankGroup.single(), optimizer)
        layers = [m for n, m in engine.model.named_modules() if n.rsplit(".", 1)[-1].isdigit() and ".layers." in n]
        calls = []
        hooks = [layer.register_forward_hook(lambda *_, calls=calls: calls.append(1)) for layer in layers]
        mine = engine.train_step(part, loss_of(engine), per_sample)
        for hook in hooks:
            hook.remove()
        found[f"{case}.forwards_per_layer"] = len(calls) / max(len(layers), 1)  # x2 with recompute, per micro-batch
        theirs = reference.train_step(part, loss_of(reference), per_sample)
        for metric in ("loss", "grad_norm"):
            found[f"{case}.train.{metric}"] = abs(mine[metric] - theirs[metric])
        a, b = engine.export_weights(), reference.export_weights()
        found[f"{case}.train.weights"] = max((a[k] - b[k]).abs().max().item() for k in b)
        found[f"{case}.train.moved"] = max((b[k] - _models()[name].state_dict()[k]).abs().max().item() for k in b)
    return found


def _one_step_each(group, parallel, shared, vlm_sequences, vlm_images) -> dict[str, float]:
    """`_train_once` of the actor on shared prompts (also with activation recompute, and in
    micro-batches), the VLM actor and the VLM critic. At a learning
    rate of 1e-3: Adam's first step moves a weight by about the learning rate whatever its
    gradient, so one whose gradient is float noise (~1e-9, near Adam's eps) moves differently on the
    two engines by a fraction of it."""
    from stream_rlhf.backends.optimizer_config import OptimizerConfig

    vlm_exp, advantages = _vlm_train_experience(vlm_sequences, vlm_images)
    shared_advantages = torch.linspace(-1, 1, shared.num_samples)[:, None].expand_as(shared.mask).contiguous()
    optimizer = OptimizerConfig(lr=1e-3, max_grad_norm=0.5)
    # the shared case a sequence mean (algorithm.loss_aggregation): its row weights, made over the whole
    # step, give each data-parallel replica's share the gradient of one
    weighted = {"advantages": shared_advantages, "row_weights": row_weights(shared.mask, "sequence_mean", 8)}
    return {**_train_once(group, parallel, optimizer, [
        ("shared", "qwen2", _policy_loss, shared, weighted),
        ("vlm", "vlm", _policy_loss, vlm_exp, {"advantages": advantages}),
        ("vlm_critic", "vlm_critic", _value_loss, vlm_exp, {"returns": advantages})]),
        **_train_once(group, dataclasses.replace(parallel, recompute=True), optimizer, [
            ("recompute", "qwen2", _policy_loss, shared, {"advantages": shared_advantages})]),
        **_train_once(group, parallel, optimizer, [
            ("micro", "qwen2", _policy_loss, shared, weighted),
            ("micro_critic", "critic", _value_loss, shared, {"returns": shared_advantages})], MICRO_TOKENS)}


def _assert_one_step_each(found: dict) -> None:
    assert found["shared.forwards_per_layer"] >= 1  # the hooks saw the layers
    assert found["recompute.forwards_per_layer"] == 2 * found["shared.forwards_per_layer"]  # it did recompute
    assert found["micro.forwards_per_layer"] == found["micro_critic.forwards_per_layer"] >= 2  # several micro-batches
    for case in ("shared", "vlm", "vlm_critic", "recompute", "micro", "micro_critic"):
        assert found[f"{case}.train.moved"] > 5e-4, case  # training moved the weights: the comparison means something
        assert found[f"{case}.train.weights"] < 1e-4, case
        assert found[f"{case}.train.loss"] < 1e-5 and found[f"{case}.train.grad_norm"] < 1e-5, case


def _assert_packed(found: dict) -> None:
    """Several sequences shared a row; with `prompt_lens` each prompt was in the rows once."""
    assert found["rows"] < found["samples"]
    assert found["shared.shares"] is True
    assert found["unshared.tokens"] - found["shared.tokens"] == 3 + 5 + 2  # one copy of each prompt fewer


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,pp", LAYOUTS, ids=[f"ranks{w}-tp{t}-pp{p}" for w, t, p in LAYOUTS])
def test_megatron_engine_matches_the_torch_engine(tmp_path, world, tp, pp):
    found = _run_ranks(tmp_path, _rank_main, world, tp, pp)
    for name in ("qwen2", "qwen3", "llama", "critic", "vlm", "vlm_critic"):
        assert found[f"{name}.round_trip"] is True, name
        assert found[f"{name}.parameter_counts"] is True, name  # the run summary's actor_parameters
    for name in ("qwen2", "qwen3", "llama"):
        assert found[f"{name}.logprobs"] < 1e-5 and found[f"{name}.shared.logprobs"] < 1e-5, name
    assert found["vlm.logprobs"] < 1e-5
    assert found["critic.values"] < 1e-5 and found["critic.shared.values"] < 1e-5 and found["vlm_critic.values"] < 1e-5
    for name in ("qwen2", "qwen3", "llama"):  # forwards in micro-batches
        assert found[f"{name}.micro.logprobs"] < 1e-5, name
    assert found["critic.micro.values"] < 1e-5
    _assert_packed(found)
    for name in ("qwen2", "critic"):
        assert found[f"{name}.train.moved"] > 1e-3  # training moved the weights: the comparison means something
        assert found[f"{name}.train.weights"] < 1e-4, name
        for step in range(2):
            assert found[f"{name}.train.loss.{step}"] < 1e-5 and found[f"{name}.train.grad_norm.{step}"] < 1e-5
        assert found[f"{name}.resumes_exactly"] is True, name
        assert found[f"{name}.weights_snapshot_kept"] is True, name  # a background publish writes it as it was
    _assert_one_step_each(found)
    assert found["save_load"] is True


def _bf16_main(rank: int, world: int, tp: int, pp: int, init_file: str, out: str) -> None:
    """`precision` bf16 against fp32 on the same layout: forwards, an actor step (also with
    recompute, and in micro-batches) and a critic step."""
    torch.set_num_threads(1)
    from stream_rlhf.backends.megatron.config import MegatronConfig
    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine
    from stream_rlhf.backends.optimizer_config import OptimizerConfig
    from stream_rlhf.distributed import RankGroup, RankSpec

    group = RankGroup.join(RankSpec(rank, world, f"file://{init_file}" if world > 1 else None))
    parallel = MegatronConfig(tp=tp, pp=pp)
    shared = _shared_experience()
    advantages = torch.linspace(-1, 1, shared.num_samples)[:, None].expand_as(shared.mask).contiguous()
    found: dict[str, float | bool | str] = {}
    logps = {}
    for precision in ("fp32", "bf16"):
        engine = MegatronTrainEngine(_models()["qwen2"], group, parallel=parallel, precision=precision)
        seen = []
        hooks = [m.register_forward_hook(lambda _m, _i, o, seen=seen: seen.append(str(o[0].dtype)))
                 for name, m in engine.model.named_modules() if name.endswith("linear_fc1")]
        logps[precision] = engine.forward_logprobs(shared.sequences, 0.7, prompt_lens=shared.prompt_lens)
        for hook in hooks:
            hook.remove()
        found[f"{precision}.matmul_dtypes"] = sorted(set(seen))
    found["logprobs.diff"] = _max_diff(logps["fp32"], logps["bf16"])
    found["logprobs.dtype"] = str(logps["bf16"][0].dtype)
    optimizer = OptimizerConfig(lr=1e-3, max_grad_norm=0.5)
    steps = {}
    start = _models()["qwen2"].state_dict()
    recompute = dataclasses.replace(parallel, recompute=True)
    for case, precision, config, tokens in (("fp32", "fp32", parallel, None), ("bf16", "bf16", parallel, None),
                                            ("bf16_recompute", "bf16", recompute, None),
                                            ("bf16_micro", "bf16", parallel, MICRO_TOKENS)):
        engine = MegatronTrainEngine(_models()["qwen2"], group,
                                     dataclasses.replace(optimizer, micro_batch_tokens=tokens), config,
                                     precision=precision)
        metrics = engine.train_step(shared, _policy_loss(engine), {"advantages": advantages})
        steps[case] = (metrics, engine.export_weights())
    for case in ("bf16", "bf16_recompute", "bf16_micro"):
        for metric in ("loss", "grad_norm"):
            found[f"{case}.{metric}.rel"] = abs(steps[case][0][metric] / steps["fp32"][0][metric] - 1)
        found[f"{case}.update_cosine"] = _update_cosine(start, steps[case][1], steps["fp32"][1])
    found["weights.dtypes"] = sorted({str(t.dtype) for t in steps["bf16"][1].values()})
    plain, recomputed = steps["bf16"][1], steps["bf16_recompute"][1]
    found["recompute.same"] = all(torch.equal(plain[k], recomputed[k]) for k in plain)
    critic = MegatronTrainEngine(_models()["critic"], group, optimizer, parallel, precision="bf16")
    values = critic.forward_values(shared.sequences, prompt_lens=shared.prompt_lens)
    found["critic.values.dtype"] = str(values[0].dtype)
    found["critic.loss"] = critic.train_step(shared, _value_loss(critic), {"returns": advantages})["loss"]
    _finish(group, found, out)


def _update_cosine(start: dict[str, torch.Tensor], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The cosine of two optimizer steps' updates from `start`, over every weight."""
    first = torch.cat([(a[k] - start[k]).flatten() for k in start])
    second = torch.cat([(b[k] - start[k]).flatten() for k in start])
    return torch.nn.functional.cosine_similarity(first, second, dim=0).item()


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,pp", LAYOUTS[:3], ids=[f"ranks{w}-tp{t}-pp{p}" for w, t, p in LAYOUTS[:3]])
def test_megatron_bf16_computes_in_bf16_and_keeps_weights_and_log_probs_fp32(tmp_path, world, tp, pp):
    """`precision: bf16` on megatron is the torch engine's mixed precision: matmuls in bf16 under
    autocast (the activations between pipeline stages bf16, as megatron's residual stream is),
    weights, gradients, optimizer state and log-probs fp32; a step lands within bf16 rounding of
    the fp32 one, and recompute (run under the same autocast) changes nothing."""
    found = _run_ranks(tmp_path, _bf16_main, world, tp, pp)
    assert found["fp32.matmul_dtypes"] == ["torch.float32"] and found["bf16.matmul_dtypes"] == ["torch.bfloat16"]
    assert found["logprobs.dtype"] == "torch.float32" and 0 < found["logprobs.diff"] < 0.05
    assert found["weights.dtypes"] == ["torch.float32"]
    for case in ("bf16", "bf16_recompute", "bf16_micro"):
        assert found[f"{case}.loss.rel"] < 1e-2 and found[f"{case}.grad_norm.rel"] < 2e-2, case
        # Adam's first step moves every weight by about lr, whatever its gradient: the updates' direction tells
        assert found[f"{case}.update_cosine"] > 0.98, case
    assert found["recompute.same"] is True
    assert found["critic.values.dtype"] == "torch.float32" and found["critic.loss"] > 0
