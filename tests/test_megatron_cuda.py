"""The megatron engine on one CUDA device (tp = pp = dp = 1), against the torch engine on the same GPU.

Two spawned processes (megatron's parallel state is per process) measure, and the tests assert:
- `nccl`: a one-rank `cpu:gloo,cuda:nccl` process group (what `RankGroup.join` gives a CUDA stage
  of several ranks), which `join_megatron` takes over:
  - forward log-probs (Qwen2 tied with qkv bias, Llama untied, Qwen2.5-VL with image features and
    M-RoPE) and a critic's values equal the torch engine's on the same Hugging Face model, both on
    cuda:0 in fp32 with TF32 off, to 1e-5 as on the CPU (`test_megatron_engine.py`);
  - two training steps with megatron's distributed optimizer (the CUDA default; the CPU backend
    cannot build it) give the torch engine's losses and gradient norms (1e-5) and weights (1e-4),
    and the same as megatron's plain FP32Optimizer on CUDA;
  - offload of params, grads (DDP's main_grad buffers) and optimizer state empties their device
    storages and frees at least the bytes it reports; onload brings every byte back, and training
    goes on bit-identically to an engine that never offloaded (both optimizers);
- `single`: no process group of its own, as a one-rank CUDA stage of a job runs: `join_megatron`
  makes its one-rank group; a forward and two training steps still match the torch engine; and
  `precision` bf16 (what `auto` gives on CUDA): matmuls in bf16, log-probs and weights fp32, a
  step (in one pass and in micro-batches) within bf16 rounding of the fp32 one.
Needs CUDA and megatron-core (on the GPU machine carried as a wheel: `scripts/gpu_checks.sh`).
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the megatron engine on cuda:0"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                       reason="needs megatron-core (pip install -e '.[megatron]'; a wheel carried to a GPU machine)"),
]

LOGPROB_TOL = 1e-5  # the CPU parity tests' tolerances (fp32, TF32 off)
WEIGHT_TOL = 1e-4
ALL = {"params", "grads", "optimizer"}


def _fp32_only() -> None:
    """No TF32 anywhere: the comparisons are fp32 against fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.cpu() - y.cpu()).abs().max().item() for x, y in zip(a, b, strict=True))


def _weights_diff(a, b) -> float:
    wa, wb = a.export_weights(), b.export_weights()
    return max((wa[k] - wb[k]).abs().max().item() for k in wb)


def _optimizer_kind(engine) -> str:
    inner = engine.optimizer.optimizer
    return type(getattr(inner, "chained_optimizers", [inner])[0]).__name__


def _plain_engine(group, optimizer):
    """A megatron engine stepped by megatron's FP32Optimizer (the CPU's choice), here on CUDA."""
    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine
    from stream_rlhf.backends.megatron.optimizer import MegatronOptimizer
    from tests.test_megatron_engine import _models

    engine = MegatronTrainEngine(_models()["qwen2"], group)
    engine.optimizer = MegatronOptimizer(engine.model, optimizer, distributed=False)
    engine.model.train(True)
    return engine


def _forward(group, found: dict) -> None:
    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine
    from stream_rlhf.backends.torch_engine import TorchTrainEngine
    from tests.test_megatron_engine import _models, _vlm_experience
    from tests.test_torch_engine import _experience

    sequences = _experience().sequences
    vlm_sequences, vlm_images = _vlm_experience()
    for name in ("qwen2", "llama", "critic", "vlm"):
        engine = MegatronTrainEngine(_models()[name], group)
        reference = TorchTrainEngine(_models()[name], group)
        if name == "critic":
            found[f"forward.{name}"] = _max_diff(engine.forward_values(sequences), reference.forward_values(sequences))
        elif name == "vlm":
            found[f"forward.{name}"] = _max_diff(engine.forward_logprobs(vlm_sequences, 0.7, images=vlm_images),
                                                 reference.forward_logprobs(vlm_sequences, 0.7, images=vlm_images))
        else:
            found[f"forward.{name}"] = _max_diff(engine.forward_logprobs(sequences, 0.7),
                                                 reference.forward_logprobs(sequences, 0.7))


def _train(group, found: dict, optimizer, steps: int = 2) -> dict:
    """`steps` training steps of the distributed-optimizer, plain-optimizer and torch engines on
    the same samples; returns the engines (the offload check continues from them)."""
    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine
    from stream_rlhf.backends.torch_engine import TorchTrainEngine
    from tests.test_megatron_engine import _models
    from tests.test_torch_engine import _experience, _loss

    exp = _experience()
    advantages = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()
    engines = {"distributed": MegatronTrainEngine(_models()["qwen2"], group, optimizer),
               "plain": _plain_engine(group, optimizer),
               "torch": TorchTrainEngine(_models()["qwen2"], group, optimizer)}
    for name in ("distributed", "plain"):
        found[f"optimizer.{name}"] = _optimizer_kind(engines[name])
    metrics = {name: [engine.train_step(exp, _loss(engine), {"advantages": advantages}) for _ in range(steps)]
               for name, engine in engines.items()}
    for mine, theirs in (("distributed", "torch"), ("plain", "torch"), ("distributed", "plain")):
        for step in range(steps):
            for metric in ("loss", "grad_norm"):
                found[f"train.{mine}-{theirs}.{metric}.{step}"] = abs(metrics[mine][step][metric] -
                                                                      metrics[theirs][step][metric])
        found[f"train.{mine}-{theirs}.weights"] = _weights_diff(engines[mine], engines[theirs])
    initial = _models()["qwen2"].state_dict()
    trained = engines["torch"].export_weights()
    found["train.moved"] = max((trained[k] - initial[k]).abs().max().item() for k in trained)
    return engines


def _device_state(engine) -> list[torch.Tensor]:
    """Clones of everything offload moves: parameters, main gradients, optimizer moments."""
    params = list(engine.model.parameters())
    return [t.detach().clone() for t in params + [p.main_grad for p in params] + engine.optimizer.state_tensors()]


def _offload(group, found: dict, optimizer, trained: dict) -> None:
    """Per optimizer: a step, offload + onload of everything, a step; against `trained[name]`,
    which took the same two steps with no round trip."""
    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine
    from tests.test_megatron_engine import _models
    from tests.test_torch_engine import _experience, _loss

    exp = _experience()
    advantages = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()
    for name in ("distributed", "plain"):
        engine = MegatronTrainEngine(_models()["qwen2"], group, optimizer) if name == "distributed" else \
            _plain_engine(group, optimizer)
        engine.train_step(exp, _loss(engine), {"advantages": advantages})
        before = _device_state(engine)
        least = sum(t.numel() * t.element_size() for t in before)  # views into padded buffers: at most this
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        moved = engine.offload(ALL)
        found[f"offload.{name}.freed_ok"] = allocated - torch.cuda.memory_allocated() >= moved >= least
        params = list(engine.model.parameters())
        found[f"offload.{name}.emptied"] = all(t.untyped_storage().nbytes() == 0 for t in
                                               params + [p.main_grad for p in params] +
                                               engine.optimizer.state_tensors())
        found[f"offload.{name}.again_is_noop"] = engine.offload(ALL) == 0
        found[f"offload.{name}.bytes"] = moved
        found[f"offload.{name}.onload_bytes_ok"] = engine.onload(ALL) == moved
        found[f"offload.{name}.state_exact"] = all(torch.equal(a, b) for a, b in zip(before, _device_state(engine),
                                                                                    strict=True))
        engine.train_step(exp, _loss(engine), {"advantages": advantages})
        a, b = engine.export_weights(), trained[name].export_weights()
        found[f"offload.{name}.trains_exactly"] = all(torch.equal(a[k], b[k]) for k in b)
        found[f"offload.{name}.weights_diff"] = _weights_diff(engine, trained[name])


def _bf16(group, found: dict, optimizer) -> None:
    """The distributed-optimizer engine in bf16 (one pass, and micro-batches) against fp32."""
    import dataclasses

    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine
    from tests.test_megatron_engine import MICRO_TOKENS, _models, _policy_loss, _shared_experience, _update_cosine

    shared = _shared_experience()
    advantages = torch.linspace(-1, 1, shared.num_samples)[:, None].expand_as(shared.mask).contiguous()
    start = _models()["qwen2"].state_dict()
    steps = {}
    for case, precision, tokens in (("fp32", "fp32", None), ("bf16", "bf16", None),
                                    ("bf16_micro", "bf16", MICRO_TOKENS)):
        engine = MegatronTrainEngine(_models()["qwen2"], group,
                                     dataclasses.replace(optimizer, micro_batch_tokens=tokens), precision=precision)
        logp = engine.forward_logprobs(shared.sequences, 0.7, prompt_lens=shared.prompt_lens)
        metrics = engine.train_step(shared, _policy_loss(engine), {"advantages": advantages})
        steps[case] = (logp, metrics, engine.export_weights())
    found["bf16.logprobs"] = _max_diff(steps["fp32"][0], steps["bf16"][0])
    found["bf16.logprobs_dtype"] = str(steps["bf16"][0][0].dtype)
    for case in ("bf16", "bf16_micro"):
        found[f"{case}.loss_rel"] = abs(steps[case][1]["loss"] / steps["fp32"][1]["loss"] - 1)
        found[f"{case}.update_cosine"] = _update_cosine(start, steps[case][2], steps["fp32"][2])


def _checks(kind: str, init_file: str, found: dict, save) -> None:
    """`save()` after each phase: a process that hangs later still leaves what it measured."""
    torch.cuda.set_device(0)
    _fp32_only()
    if kind == "nccl":
        import torch.distributed as dist

        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{init_file}", rank=0, world_size=1)
    from stream_rlhf.backends.optimizer_config import OptimizerConfig
    from stream_rlhf.distributed import RankGroup

    group = RankGroup.single("cuda:0")  # one rank: join_megatron takes the process group above, or makes one
    optimizer = OptimizerConfig(lr=1e-2, max_grad_norm=0.5)
    _forward(group, found)
    save()
    trained = _train(group, found, optimizer)
    save()
    if kind == "nccl":
        _offload(group, found, optimizer, trained)
    else:
        _bf16(group, found, optimizer)


def _rank_main(kind: str, init_file: str, out: str) -> None:
    """One process's checks; what it measured (and the traceback, if one broke off) to `out`."""
    found: dict = {}

    def save() -> None:
        part = Path(out + ".part")
        part.write_text(json.dumps(found))
        part.replace(out)  # whole, even if the process is killed while writing

    try:
        _checks(kind, init_file, found, save)
    except Exception:  # noqa: BLE001 - the test reports it next to what was measured before
        found["error"] = traceback.format_exc()
    save()
    os._exit(0)  # no interpreter teardown of megatron's groups


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("megatron_cuda")
    ctx = mp.get_context("spawn")
    procs = {kind: ctx.Process(target=_rank_main, args=(kind, str(folder / f"{kind}.init"),
                                                         str(folder / f"{kind}.json"))) for kind in ("nccl", "single")}
    for p in procs.values():
        p.start()
    deadline = time.monotonic() + 180  # both run at once; a hang costs at most this (pytest allows 300 s)
    results = {}
    for kind, p in procs.items():
        p.join(max(1.0, deadline - time.monotonic()))
        hung = p.is_alive()
        if hung:
            p.kill()
        out = folder / f"{kind}.json"
        results[kind] = json.loads(out.read_text()) if out.exists() else {}
        if hung or p.exitcode != 0:
            results[kind].setdefault("error", "killed at the deadline" if hung else f"exit code {p.exitcode}")
    print(json.dumps(results, indent=1))  # every measured number, in the log of a -rA run
    return results


def _measured(found: dict, kind: str, key: str):
    assert key in found[kind], f"{kind}: {key} not measured: {found[kind].get('error', 'no error recorded')}"
    return found[kind][key]


@pytest.mark.parametrize("model", ["qwen2", "llama", "critic", "vlm"])
def test_forward_on_cuda_equals_the_torch_engine(found, model):
    assert _measured(found, "nccl", f"forward.{model}") < LOGPROB_TOL


def test_training_with_the_distributed_optimizer_equals_the_torch_engine_and_the_plain_optimizer(found):
    assert _measured(found, "nccl", "optimizer.distributed") == "DistributedOptimizer"
    assert _measured(found, "nccl", "optimizer.plain") == "FP32Optimizer"
    assert _measured(found, "nccl", "train.moved") > 1e-3  # training moved the weights: the comparison means something
    for pair in ("distributed-torch", "plain-torch", "distributed-plain"):
        for step in range(2):
            assert _measured(found, "nccl", f"train.{pair}.loss.{step}") < LOGPROB_TOL, pair
            assert _measured(found, "nccl", f"train.{pair}.grad_norm.{step}") < LOGPROB_TOL, pair
        assert _measured(found, "nccl", f"train.{pair}.weights") < WEIGHT_TOL, pair


@pytest.mark.parametrize("optimizer", ["distributed", "plain"])
def test_offload_and_onload_on_cuda_are_a_bit_exact_round_trip(found, optimizer):
    assert _measured(found, "nccl", f"offload.{optimizer}.bytes") > 0
    for check in ("freed_ok", "emptied", "again_is_noop", "onload_bytes_ok", "state_exact", "trains_exactly"):
        assert _measured(found, "nccl", f"offload.{optimizer}.{check}") is True, check


def test_a_one_rank_cuda_stage_without_a_process_group_trains_as_the_torch_engine(found):
    """The path of a job's one-GPU megatron stage: `join_megatron` makes the one-rank group itself."""
    assert _measured(found, "single", "forward.qwen2") < LOGPROB_TOL
    for step in range(2):
        assert _measured(found, "single", f"train.distributed-torch.loss.{step}") < LOGPROB_TOL
    assert _measured(found, "single", "train.distributed-torch.weights") < WEIGHT_TOL


def test_bf16_on_cuda_computes_in_bf16_and_trains_as_fp32_does(found):
    assert _measured(found, "single", "bf16.logprobs_dtype") == "torch.float32"
    assert 0 < _measured(found, "single", "bf16.logprobs") < 0.05  # bf16 matmuls: rounded, not the fp32 values
    for case in ("bf16", "bf16_micro"):
        assert _measured(found, "single", f"{case}.loss_rel") < 1e-2, case
        assert _measured(found, "single", f"{case}.update_cosine") > 0.98, case
