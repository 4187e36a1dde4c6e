"""The torch engine's training step as a CUDA device wants it: one read of device values per step,
`precision: auto`, fused AdamW; on the CPU the same weights and losses as the plain step.

Host reads are counted for real: a TorchDispatchMode follows every op of the step and marks what
would live on the device (the parameters, the step's samples except the tokens and lengths the
packing reads on the host, and everything computed from them); a read of a marked value to the
host (`.item()`, `float()`, `.tolist()`, `.cpu()`, `.numpy()`) would make the host wait for the
device on CUDA. The `gpu` tests check the same with CUDA's own sync debug mode.

    .venv/bin/python -m pytest tests/test_train_step_device.py -q
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary
from transformers import Qwen2ForCausalLM

from stream_rlhf.algos.losses import entropy_loss, kl_loss, policy_loss
from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.precision import resolve_precision
from stream_rlhf.backends.torch_engine import HOST_FIELDS, TorchTrainEngine
from stream_rlhf.distributed import RankGroup
from stream_rlhf.experience import Experience
from stream_rlhf.rl.config import RLJobConfig
from tests.test_kernel_warm_up import _experience
from tests.test_response_gather import vlm_experience
from tests.tiny_models import tiny_qwen2_config

VOCAB = 40


def _engine(device: str = "cpu", precision: str = "fp32") -> TorchTrainEngine:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(VOCAB))
    return TorchTrainEngine(model, RankGroup.single(device), OptimizerConfig(lr=1e-2), precision=precision)


def _actor_loss(engine: TorchTrainEngine, extra_metrics: bool):
    """The actor's loss (policy, KL and entropy terms) with two or five metrics."""
    def loss_fn(part: Experience, per_sample: dict[str, torch.Tensor]):
        logp, entropy = engine.response_logprobs(part, 1.0, with_entropy=True)  # what the actor's loss reads
        loss, metrics = policy_loss(logp, part.old_logp, per_sample["advantages"], part.mask, 0.2, 0.2,
                                    behavior_logp=part.behavior_logp if extra_metrics else None, is_cap=2.0)
        if extra_metrics:
            kl, kl_metrics = kl_loss(logp, part.ref_logp, part.mask, "k3")
            bonus, ent_metrics = entropy_loss(entropy, part.mask)
            loss = loss + 0.1 * kl + 0.01 * bonus
            metrics.update(kl_loss=kl_metrics["kl"], **ent_metrics)
        return loss, metrics
    return loss_fn


def test_precision_auto_is_bf16_on_cuda_and_fp32_on_the_cpu():
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16"
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
    assert resolve_precision("fp32", torch.device("cuda", 0)) == "fp32"
    assert RLJobConfig.__dataclass_fields__["precision"].default == "auto"
    assert _engine(precision="auto").precision == "fp32"


def test_train_step_gives_the_plain_steps_weights_and_losses_bit_for_bit():
    """Two steps through the engine against the same steps written out with `.item()` per value."""
    engine, plain = _engine(), _engine()
    optimizer = torch.optim.AdamW(plain.trainable, lr=1e-2, weight_decay=0.0)  # what the engine builds on the CPU
    for step in range(2):
        exp = _experience(4, seed=step)
        advantages = torch.randn(exp.mask.shape, generator=torch.Generator().manual_seed(step))
        got = engine.train_step(exp, _actor_loss(engine, True), {"advantages": advantages})
        loss, metrics = _actor_loss(plain, True)(exp, {"advantages": advantages})
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(plain.trainable, 1.0)
        optimizer.step()
        assert got == {**{k: v.item() for k, v in metrics.items()}, "loss": loss.item(), "grad_norm": grad_norm.item()}
    for a, b in zip(engine.model.parameters(), plain.model.parameters()):
        assert torch.equal(a, b)


class DeviceReads(TorchDispatchMode):
    """Counts host reads of values that would live on the device (module docstring), by caller."""

    OWN_FRAMES = ("read", "__torch_dispatch__", "__torch_function__")

    def __init__(self, on_device: list[torch.Tensor]):
        super().__init__()
        self.marked = WeakIdKeyDictionary({t: True for t in on_device})
        self.reads: Counter[str] = Counter()

    def read(self, tensor: torch.Tensor) -> None:
        if tensor in self.marked:
            frames = [f for f in traceback.extract_stack()
                      if "site-packages" not in f.filename and f.name not in self.OWN_FRAMES]
            self.reads[f"{Path(frames[-1].filename).name}:{frames[-1].name}"] += 1  # the innermost caller

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.read(inputs[0])
        elif any(t in self.marked for t in inputs):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.marked[t] = True
        return out


class ListReads(TorchFunctionMode):
    """`.tolist()`, `.cpu()` and `.numpy()` read without an op that TorchDispatchMode sees."""

    def __init__(self, counter: DeviceReads):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy):
            self.counter.read(args[0])
        return func(*args, **(kwargs or {}))


def _device_reads(engine: TorchTrainEngine, exp: Experience, loss_fn) -> Counter[str]:
    per_sample = {"advantages": torch.randn(exp.mask.shape)}
    on_device = [*engine.model.parameters(), *per_sample.values(),
                 *(getattr(exp, name) for name in ("mask", "old_logp", "behavior_logp", "ref_logp"))]
    assert set(HOST_FIELDS) == {"sequences", "prompt_lens"}  # what the count leaves unmarked
    counter = DeviceReads(on_device)
    with ListReads(counter), counter:
        engine.train_step(exp, loss_fn, per_sample)
    return counter.reads


def test_a_train_step_reads_device_values_once_however_many_metrics_and_samples():
    engine = _engine()
    for n, extra in ((2, False), (5, True)):
        reads = _device_reads(engine, _experience(n, seed=n), _actor_loss(engine, extra))
        assert reads == {"losses.py:host_metrics": 1}

    def reads_a_metric(part: Experience, per_sample: dict[str, torch.Tensor]):
        loss, metrics = _actor_loss(engine, False)(part, per_sample)
        float(metrics["clipfrac"])  # what the losses did per metric before: the count sees it
        return loss, metrics

    assert _device_reads(engine, _experience(2, seed=0), reads_a_metric) == {
        "losses.py:host_metrics": 1, "test_train_step_device.py:reads_a_metric": 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: scripts/gpu_checks.sh tests runs it")
def test_cuda_train_step_is_fused_bf16_and_synchronises_in_our_code_once():
    engine = _engine("cuda:0", precision="auto")
    assert engine.precision == "bf16" and engine.optimizer.defaults["fused"] is True
    _assert_one_step_synchronises_in_our_code_once(engine, _experience(8, seed=0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: scripts/gpu_checks.sh tests runs it")
def test_cuda_train_step_of_a_vision_language_model_synchronises_in_our_code_once():
    """The image tokens are counted on the host, the M-RoPE positions placed there."""
    model, exp = vlm_experience()
    engine = TorchTrainEngine(model, RankGroup.single("cuda:0"), OptimizerConfig(lr=1e-2), precision="auto")
    exp.old_logp, exp.ref_logp = exp.behavior_logp.clone(), exp.behavior_logp.clone()
    _assert_one_step_synchronises_in_our_code_once(engine, exp)


def _assert_one_step_synchronises_in_our_code_once(engine: TorchTrainEngine, exp: Experience) -> None:
    """A warm-up step, then one step under CUDA's sync debug mode: one synchronising call of ours
    (the metrics' read, `losses.py`)."""
    engine.train_step(exp, _actor_loss(engine, True), {"advantages": torch.randn(exp.mask.shape)})  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.train_step(exp, _actor_loss(engine, True), {"advantages": torch.randn(exp.mask.shape)})
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    print("synchronising calls in one step:", dict(syncs))
    ours = {k: v for k, v in syncs.items() if k.split(":")[0] in {p.name for p in Path("stream_rlhf").rglob("*.py")}}
    assert sum(ours.values()) == 1 and next(iter(ours)).startswith("losses.py")
