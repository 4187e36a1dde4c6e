"""The torch train engine on one rank and on two (FSDP2 over gloo): same weights, same log-probs.

Each case runs in fresh processes (torch.distributed is per process): `_run_ranks` spawns the
ranks, each writes what it computed to a file, and the test compares the files of a 1-rank and a
2-rank run fed the same samples.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stream_rlhf.algos.aggregation import row_weights
from stream_rlhf.algos.losses import policy_loss, value_loss
from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.distributed import RankGroup, RankSpec
from stream_rlhf.experience import Experience
from stream_rlhf.models.lora import add_lora
from stream_rlhf.models.lora_config import LoRAConfig
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.weights.shm_store import WeightStore
from tests.tiny_models import seeded_qwen2_critic, seeded_qwen2_policy

VOCAB = 40


LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])


def _model(lora: LoRAConfig | None = None) -> torch.nn.Module:
    """The tiny policy; with `lora`, its adapters (`models/lora.py`), which alone train."""
    model = seeded_qwen2_policy(VOCAB)
    if lora is not None:
        add_lora(model, lora, seed=0)
    return model


def _critic() -> torch.nn.Module:
    return seeded_qwen2_critic(VOCAB)


def _experience(n: int = 6) -> Experience:
    """`n` samples of uneven lengths (so the ranks' token counts differ)."""
    g = torch.Generator().manual_seed(1)
    prompt_lens = torch.randint(2, 5, (n,), generator=g)
    response_lens = torch.randint(1, 7, (n,), generator=g)
    sequences = [torch.randint(1, VOCAB, (int(p + r),), generator=g) for p, r in zip(prompt_lens, response_lens)]
    width = int(response_lens.max())
    mask = (torch.arange(width)[None] < response_lens[:, None]).float()
    behavior = -torch.rand(n, width, generator=g) * 3 * mask
    return Experience(sequences=sequences, prompt_lens=prompt_lens, mask=mask, behavior_logp=behavior,
                      old_logp=behavior.clone(), ref_logp=behavior.clone(), values=None,
                      scores=torch.rand(n, generator=g), group_ids=torch.arange(n), policy_versions=torch.zeros(n))


def _loss(engine: TorchTrainEngine):
    def loss_fn(part: Experience, per_sample: dict[str, torch.Tensor]):
        logp, _ = engine.response_logprobs(part, 1.0)
        return policy_loss(logp, part.old_logp, per_sample["advantages"], part.mask, 0.2, 0.2,
                           row_weights=per_sample.get("row_weights"))
    return loss_fn


def _rank_main(rank: int, world: int, init_file: str, out: str, case: str) -> None:
    torch.set_num_threads(1)
    group = RankGroup.join(RankSpec(rank, world, f"file://{init_file}" if world > 1 else None))
    try:
        exp = _experience()
        if case in ("train", "lora", "micro"):  # the whole model, LoRA adapters (exports merge them), micro-batches
            lora = LORA if case == "lora" else None
            micro = 9 if case == "micro" else None  # tokens: runs of 1 or 2 samples of 3-10 tokens
            engine = TorchTrainEngine(_model(lora), group, OptimizerConfig(lr=1e-3, max_grad_norm=0.5,
                                                                           micro_batch_tokens=micro))
            advantages = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()
            metrics = []
            # the last step a sequence mean (algorithm.loss_aggregation): each rank's share is weighted
            # by its tokens, and the row weights, made over the whole step, still give one rank's gradient
            weighted = {"advantages": advantages, "row_weights": row_weights(exp.mask, "sequence_mean", 8)}
            for per_sample in ({"advantages": advantages},) * 2 + (weighted,):
                # a no-grad forward between training steps, as a proximal recompute does
                proximal = engine.forward_response_logprobs(exp, 1.0)
                metrics.append(engine.train_step(exp, _loss(engine), per_sample))
                metrics[-1]["proximal_sum"] = float(proximal.sum())
            weights = engine.export_weights()
            engine.save(Path(out + ".checkpoint"), build_tokenizer())
            group.barrier()  # the leader has written it
            for reloaded in (TorchTrainEngine(_model(lora), group, OptimizerConfig()),  # sharded like this one
                             TorchTrainEngine(_model(lora), RankGroup.single())):
                reloaded.load(Path(out + ".checkpoint"))
                again = reloaded.export_weights()
                assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)
            _assert_resumes_exactly(engine,
                                    lambda: TorchTrainEngine(_model(lora), group, OptimizerConfig(
                                        lr=1e-3, max_grad_norm=0.5, micro_batch_tokens=micro)),
                                    Path(out + ".state"), exp, advantages)
            weights = engine.export_weights()
            if group.is_leader:
                save_file({k: v.contiguous() for k, v in weights.items() if k != "lm_head.weight"}, out)
                torch.save(metrics, out + ".metrics")
        elif case == "critic":
            engine = TorchTrainEngine(_critic(), group, OptimizerConfig(lr=1e-3))
            returns = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()
            exp.values = torch.zeros_like(exp.mask)

            def loss_fn(part: Experience, per_sample: dict[str, torch.Tensor]):
                values = engine.response_values(part)
                return value_loss(values, part.values, per_sample["returns"], part.mask, 10.0)

            metrics = [engine.train_step(exp.select(torch.arange(i % 2, 6, 2)), loss_fn,
                                         {"returns": returns[i % 2::2]}) for i in range(4)]
            weights = engine.export_weights()
            if group.is_leader:
                save_file({k: v.contiguous() for k, v in weights.items()}, out)
                torch.save(metrics, out + ".metrics")
        else:
            engine = TorchTrainEngine(_model(), group)
            logp = engine.forward_logprobs(exp.sequences, 0.7)
            save_file({f"{rank}.{i}": t for i, t in enumerate(logp)}, out + f".rank{rank}")
    finally:
        group.close()
    os._exit(0)  # no interpreter teardown: it aborts now and then once FSDP2 ran over gloo (bench/scaling.py)


def _assert_resumes_exactly(engine: TorchTrainEngine, fresh, path: Path, exp: Experience,
                            advantages: torch.Tensor) -> None:
    """`engine`'s state snapshot, written only after `engine` trained one more step (as the
    background writer does), loaded into a `fresh()` engine trains that step to the very same
    weights as `engine` itself."""
    snapshot = engine.snapshot_state()
    engine.train_step(exp, _loss(engine), {"advantages": advantages})  # training goes on meanwhile
    if snapshot is not None:
        torch.save(snapshot, path)
    engine.group.barrier()  # the leader has written it
    resumed = fresh()
    resumed.load_state(path)
    resumed.train_step(exp, _loss(resumed), {"advantages": advantages})
    a, b = engine.export_weights(), resumed.export_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _run_ranks(world: int, tmp_path: Path, case: str) -> str:
    out = str(tmp_path / f"{case}-{world}.safetensors")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, world, str(tmp_path / f"init-{case}-{world}"), out, case))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    assert [p.exitcode for p in procs] == [0] * world
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", ["train", "lora"])
def test_two_fsdp2_ranks_train_to_the_same_weights_as_one(tmp_path, case):
    one = load_file(_run_ranks(1, tmp_path, case))
    two = load_file(_run_ranks(2, tmp_path, case))
    start = _model().state_dict()
    assert one.keys() == two.keys()
    moved = max((one[k] - start[k]).abs().max().item() for k in one)
    assert moved > (1e-3 if case == "train" else 1e-5)  # the steps changed the weights: the comparison means something
    if case == "lora":  # merged exports: what the adapters change, and nothing else
        assert {k for k in one if not torch.equal(one[k], start[k])} == {
            f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("q_proj", "v_proj")}
    _assert_trained_alike(tmp_path, f"{case}-1", f"{case}-2", ("loss", "grad_norm", "clipfrac", "approx_kl"))


@pytest.mark.slow
def test_micro_batches_on_two_fsdp2_ranks_train_to_the_weights_of_one_pass_on_one(tmp_path):
    """actor.micro_batch_tokens: each rank's samples in runs of at most 9 tokens (the ranks need
    different numbers of runs: the one with fewer takes part in the others' with nothing), the
    gradient reduced once; the same weights and metrics as one rank in one pass."""
    _run_ranks(1, tmp_path, "train")
    _run_ranks(2, tmp_path, "micro")  # the sharded proximal forward passes in runs too
    _assert_trained_alike(tmp_path, "train-1", "micro-2", ("loss", "grad_norm", "clipfrac", "approx_kl", "ratio_max"))


def _assert_trained_alike(tmp_path: Path, one: str, two: str, keys: tuple[str, ...]) -> None:
    """Runs `one` and `two` of `_run_ranks` (case-world) ended at the same weights (1e-5), each
    step's metrics `keys` agree (1e-5) and so does the proximal forward's sum (a float32 sum of
    ~140: 1e-6 relative)."""
    first, second = (load_file(str(tmp_path / f"{run}.safetensors")) for run in (one, two))
    for name in first:
        torch.testing.assert_close(second[name], first[name], atol=1e-5, rtol=0, msg=name)
    m1, m2 = (torch.load(str(tmp_path / f"{run}.safetensors.metrics")) for run in (one, two))
    for a, b in zip(m1, m2, strict=True):
        for key in keys:
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
        assert b["proximal_sum"] == pytest.approx(a["proximal_sum"], rel=1e-6)


@pytest.mark.slow
def test_two_fsdp2_critic_ranks_train_to_the_same_weights_as_one(tmp_path):
    one = load_file(_run_ranks(1, tmp_path, "critic"))
    two = load_file(_run_ranks(2, tmp_path, "critic"))
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-5, rtol=0, msg=name)
    m1 = torch.load(str(tmp_path / "critic-1.safetensors.metrics"))
    m2 = torch.load(str(tmp_path / "critic-2.safetensors.metrics"))
    assert [b["grad_norm"] for b in m2] == pytest.approx([a["grad_norm"] for a in m1], abs=1e-5)


@pytest.mark.slow
def test_two_forward_ranks_give_the_log_probs_of_one(tmp_path):
    one = load_file(_run_ranks(1, tmp_path, "forward") + ".rank0")
    two_ranks = _run_ranks(2, tmp_path, "forward")
    for rank in (0, 1):
        two = load_file(two_ranks + f".rank{rank}")
        assert len(two) == len(one) == 6
        for i in range(6):
            torch.testing.assert_close(two[f"{rank}.{i}"], one[f"0.{i}"], atol=1e-6, rtol=0)


def test_refresh_loads_a_published_version_and_export_round_trips(tmp_path):
    trainer = TorchTrainEngine(_model(), RankGroup.single(), OptimizerConfig(lr=1e-2))
    exp = _experience()
    advantages = torch.ones_like(exp.mask)
    trainer.train_step(exp, _loss(trainer), {"advantages": advantages})
    store = WeightStore(tmp_path / "weights", "actor")
    store.publish(trainer.export_weights(), 1)
    reader = TorchTrainEngine(_model(), RankGroup.single())
    assert reader.refresh(store, 0) == 1
    assert reader.refresh(store, 1) == 1
    for name, tensor in reader.export_weights().items():
        torch.testing.assert_close(tensor, trainer.export_weights()[name])
    tied = reader.export_weights()
    assert tied["lm_head.weight"] is tied["model.embed_tokens.weight"]


def test_saved_state_resumes_training_exactly_where_weights_alone_do_not(tmp_path):
    exp = _experience()
    advantages = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()
    engine = TorchTrainEngine(_model(), RankGroup.single(), OptimizerConfig(lr=1e-2))
    for _ in range(2):
        engine.train_step(exp, _loss(engine), {"advantages": advantages})
    weights_only = TorchTrainEngine(_model(), RankGroup.single(), OptimizerConfig(lr=1e-2))
    weights_only.model.load_state_dict(engine.export_weights())
    weights_only.train_step(exp, _loss(weights_only), {"advantages": advantages})
    _assert_resumes_exactly(engine, lambda: TorchTrainEngine(_model(), RankGroup.single(), OptimizerConfig(lr=1e-2)),
                            tmp_path / "state.pt", exp, advantages)
    a, b = engine.export_weights(), weights_only.export_weights()
    assert any(not torch.equal(a[k], b[k]) for k in a)  # Adam's moments matter: the test above can fail
    forward_only = TorchTrainEngine(_model(), RankGroup.single())
    forward_only.load_state(tmp_path / "state.pt")  # a trainer's state: its weights, no optimizer needed
    saved = torch.load(tmp_path / "state.pt", weights_only=True)["model"]
    assert all(torch.equal(forward_only.export_weights()[k], saved[k]) for k in saved)


def test_train_step_needs_an_optimizer():
    engine = TorchTrainEngine(_model(), RankGroup.single())
    with pytest.raises(RuntimeError, match="without an optimizer"):
        engine.train_step(_experience(), _loss(engine), {})


def test_offload_on_a_cpu_device_leaves_the_engine_as_it_was():
    engine = TorchTrainEngine(_model(), RankGroup.single(), OptimizerConfig(lr=1e-3))
    exp = _experience()
    engine.train_step(exp, _loss(engine), {"advantages": torch.ones_like(exp.mask)})
    before = {k: v.clone() for k, v in engine.export_weights().items()}
    engine.offload({"params", "grads", "optimizer"})
    engine.onload({"params", "grads", "optimizer"})
    for name, tensor in engine.export_weights().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="moves a CUDA engine's state to host memory and back")
def test_offload_round_trip_on_cuda_keeps_training_exact():
    def trained(offload: bool) -> dict[str, torch.Tensor]:
        engine = TorchTrainEngine(_model(), RankGroup.single("cuda:0"), OptimizerConfig(lr=1e-3))
        exp = _experience()
        advantages = torch.ones_like(exp.mask)
        engine.train_step(exp, _loss(engine), {"advantages": advantages})
        if offload:
            engine.offload({"params", "grads", "optimizer"})
            assert all(p.device.type == "cpu" and p.is_pinned() for p in engine.model.parameters())
            state = [v for s in engine.optimizer.state.values() for v in s.values() if v.dim() > 0]
            assert state and all(v.device.type == "cpu" for v in state)
            engine.onload({"params", "grads", "optimizer"})
            assert all(p.device.type == "cuda" for p in engine.model.parameters())
        engine.train_step(exp, _loss(engine), {"advantages": advantages})
        return engine.export_weights()

    plain, round_trip = trained(False), trained(True)
    for name in plain:
        assert torch.equal(round_trip[name], plain[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="snapshots a CUDA engine's state into pinned host memory "
                    "(backends/host_snapshot.py); runs under -m gpu on a machine with CUDA")
def test_a_cuda_engine_snapshot_is_in_pinned_host_memory_and_resumes_training_exactly(tmp_path):
    exp = _experience()
    advantages = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()
    engine = TorchTrainEngine(_model(), RankGroup.single("cuda:0"), OptimizerConfig(lr=1e-2))
    engine.train_step(exp, _loss(engine), {"advantages": advantages})
    engine.reserve_snapshot()  # what a trainer does after its first iteration: the pinned buffers, ahead
    engine._snapshots._join_reserve()
    reserved = {t.data_ptr() for t in engine._snapshots._buffers}
    snapshot = engine.snapshot_state()
    moments = [v for s in snapshot["optimizer"]["state"].values() for v in s.values() if v.dim() > 0]
    assert moments and all(t.device.type == "cpu" and t.is_pinned() for t in [*snapshot["model"].values(), *moments])
    assert {t.data_ptr() for t in [*snapshot["model"].values(), *moments]} <= reserved
    _assert_resumes_exactly(engine, lambda: TorchTrainEngine(_model(), RankGroup.single("cuda:0"),
                                                             OptimizerConfig(lr=1e-2)),
                            tmp_path / "state.pt", exp, advantages)


def test_bf16_precision_computes_in_bf16_and_keeps_weights_and_log_probs_fp32():
    exp = _experience()
    advantages = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()
    full, mixed = (TorchTrainEngine(_model(), RankGroup.single(), OptimizerConfig(lr=1e-2), precision=p)
                   for p in ("fp32", "bf16"))
    logp = [torch.cat(engine.logprobs(exp.sequences, 1.0)[0]) for engine in (full, mixed)]
    assert logp[1].dtype == torch.float32
    assert 0 < (logp[0] - logp[1]).abs().max() < 0.1  # bf16 matmuls: rounded, not the fp32 values
    steps = [engine.train_step(exp, _loss(engine), {"advantages": advantages}) for engine in (full, mixed)]
    for name in ("loss", "grad_norm"):  # the same step, up to bf16 rounding
        assert steps[1][name] == pytest.approx(steps[0][name], rel=0.05)
    assert all(t.dtype == torch.float32 for t in mixed.export_weights().values())
    values = TorchTrainEngine(_critic(), RankGroup.single(), precision="bf16").values(exp.sequences)
    assert all(v.dtype == torch.float32 for v in values)
