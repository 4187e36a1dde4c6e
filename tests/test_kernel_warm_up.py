"""No Triton compile inside training steps: the token count does not specialise the fused log-prob
kernels, and the engine's warm-up launches every specialisation its steps launch.

The Triton kernels run on CPU tensors through the interpreter (`TRITON_INTERPRET=1`, conftest.py),
where nothing compiles; `kernels/specialisations.py` keys each launch by Triton's own
specialisation rules, so the set it reads is the set of compiles a CUDA run would pay.

    .venv/bin/python -m pytest tests/test_kernel_warm_up.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2ForCausalLM

from stream_rlhf.algos.losses import entropy_loss, policy_loss
from stream_rlhf.backends.kernel_warm_up import warm_up_logprob_kernels, warm_up_sampling_kernel
from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.backends.torch_rollout import SamplingParams, generate
from stream_rlhf.distributed import RankGroup
from stream_rlhf.experience import Experience
from stream_rlhf.kernels import dispatch, logprob, triton_logprob
from stream_rlhf.kernels.specialisations import specialisation_key, specialisations
from stream_rlhf.samples import response_slices
from stream_rlhf.telemetry import trace
from tests.tiny_models import tiny_qwen2_config

pytestmark = pytest.mark.skipif(not dispatch.TRITON_AVAILABLE,
                                reason='triton is not installed: pip install -e ".[kernels]" runs these')

VOCAB = 40
H = 32


@pytest.fixture
def triton_backend(monkeypatch):
    """The Triton kernels, with small tiles so that the loops take several chunks."""
    monkeypatch.setattr(logprob, "TRITON_HIDDEN_BLOCKS", (16, 32, 16))
    previous = dispatch.force_backend("triton")
    yield
    dispatch.force_backend(previous)


def _hidden_inputs(T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), torch.randn(VOCAB, H, generator=g) / H**0.25, torch.randint(0, VOCAB, (T,))


def test_token_count_is_not_part_of_a_specialisation():
    args = {"h_ptr": torch.zeros(4, 2), "T": 48, "V": 33}
    assert specialisation_key("k", args, {}) == specialisation_key("k", {**args, "T": 5}, {})
    assert specialisation_key("k", args, {}) != specialisation_key("k", {**args, "V": 32}, {})  # V is, by 16
    assert specialisation_key("k", args, {}) != specialisation_key("k", {**args, "V": 1}, {})
    assert specialisation_key("k", args, {}) != specialisation_key("k", {**args, "h_ptr": args["h_ptr"].double()}, {})


def test_every_length_runs_the_specialisations_of_the_first(triton_backend):
    """Forward and backward at 1, 16 and 37 tokens: the lengths after the first add no key."""
    counts = []
    for T in (1, 16, 37):
        hidden, weight, labels = _hidden_inputs(T)
        hidden.requires_grad_(True)
        weight.requires_grad_(True)
        logp, ent = logprob.logprobs_from_hidden(hidden, weight, labels, 0.7, with_entropy=True)
        (logp.sum() + ent.sum()).backward()
        counts.append(len(specialisations()))
    assert counts[1:] == counts[:1] * 2


def test_fixed_token_tile_gives_the_log_probs_of_a_tile_fitted_to_the_length(triton_backend):
    """5 tokens in a 64-row tile (now) or a 16-row one (fitted to T, as before): identical values."""
    hidden, weight, labels = _hidden_inputs(5)
    fixed = triton_logprob.hidden_forward(hidden, weight, labels, 1.0, block_t=64, block_v=32, block_k=16)
    fitted = triton_logprob.hidden_forward(hidden, weight, labels, 1.0, block_t=16, block_v=32, block_k=16)
    for a, b in zip(fixed, fitted):
        assert torch.equal(a, b)
    grads = [triton_logprob.hidden_backward(hidden, weight, labels, *fixed[2:], torch.ones(5), None, 1.0,
                                            block_t=bt, block_v=32, block_k=16) for bt in (64, 16)]
    assert torch.equal(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=1e-6)  # dweight sums over the tile's rows


def _experience(n: int, seed: int) -> Experience:
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, 5, (n,), generator=g)
    response_lens = torch.randint(1, 9, (n,), generator=g)
    sequences = [torch.randint(1, VOCAB, (int(p + r),), generator=g) for p, r in zip(prompt_lens, response_lens)]
    mask = (torch.arange(int(response_lens.max()))[None] < response_lens[:, None]).float()
    behavior = -torch.rand(mask.shape, generator=g) * mask
    return Experience(sequences=sequences, prompt_lens=prompt_lens, mask=mask, behavior_logp=behavior,
                      old_logp=behavior.clone(), ref_logp=behavior.clone(), values=None,
                      scores=torch.rand(n, generator=g), group_ids=torch.arange(n), policy_versions=torch.zeros(n))


@pytest.mark.slow  # a model's training steps through the Triton interpreter: ~8 s on a quiet core
def test_warm_up_covers_the_steps_of_a_trainer_and_is_a_trace_span(triton_backend, monkeypatch, tmp_path):
    """Warm-up: the forward and, with and without the entropy's gradient, the two backward kernels
    (5 specialisations); then steps of varying lengths and entropy bonuses add none."""
    monkeypatch.setattr(logprob, "TRITON_HIDDEN_BLOCKS", (16, 16, 16))  # keys no other test of this process has
    torch.manual_seed(0)
    engine = TorchTrainEngine(Qwen2ForCausalLM(tiny_qwen2_config(VOCAB)), RankGroup.single(), OptimizerConfig(lr=1e-3))
    trace.start(tmp_path, process="actor_train-0", thread="rank 0")
    try:
        added = warm_up_logprob_kernels(engine, trains=True)
    finally:
        trace.stop()
    warmed = specialisations()
    assert added == 5
    assert all(p.grad is None for p in engine.trainable)  # the warm-up leaves nothing for a step

    def loss_fn(entropy_coef: float):
        def loss(part: Experience, per_sample: dict[str, torch.Tensor]):
            logp, entropy = engine.logprobs(part.sequences, 1.0, with_entropy=True)
            logp = part.padded(response_slices(logp, part.prompt_lens))
            value, metrics = policy_loss(logp, part.old_logp, per_sample["advantages"], part.mask, 0.2, 0.2)
            bonus, _ = entropy_loss(part.padded(response_slices(entropy, part.prompt_lens)), part.mask)
            return (value + entropy_coef * bonus if entropy_coef else value), metrics
        return loss

    for step, (n, coef) in enumerate([(3, 0.0), (5, 0.01), (8, 0.0), (2, 0.01)]):  # lengths vary every step
        exp = _experience(n, seed=step)
        engine.train_step(exp, loss_fn(coef), {"advantages": torch.randn(exp.mask.shape)})
        engine.forward_logprobs(exp.sequences, 1.0)
    assert specialisations() == warmed
    kernels = {key[0] for key in warmed}
    assert {"_hidden_fwd_kernel", "_hidden_bwd_dhidden_kernel", "_hidden_bwd_dweight_kernel"} <= kernels
    events = [json.loads(line) for path in tmp_path.glob("*.jsonl") for line in path.read_text().splitlines()]
    spans = [e for e in events if e.get("name") == "kernel warm-up"]
    assert len(spans) == 1 and spans[0]["cat"] == "compile"
    assert spans[0]["args"] == {"specialisations": added, "trains": True}
    compiles = [e for e in events if e.get("name", "").startswith("triton compile")]
    assert len(compiles) == added  # each new specialisation is a span of its own


def test_rollout_warm_up_covers_what_sampling_launches(triton_backend):
    """The sampler's warm-up (one row of fp32 logits) compiles what decoding 3 rows of up to 4
    tokens at temperature 0.7 launches: sampling adds no key after it, and a second warm-up none."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(VOCAB + 1)).eval()  # a width no other test of this process has
    before = specialisations()
    assert warm_up_sampling_kernel(model) == 1
    warmed = specialisations()
    assert {key[0] for key in warmed - before} == {"_logits_fwd_kernel"}
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6])]
    with torch.inference_mode():
        out = generate(model, prompts, SamplingParams(temperature=0.7, max_new_tokens=4),
                       torch.Generator().manual_seed(0))
    assert sum(len(r) for r in out.response_ids) > 3  # it decoded
    assert specialisations() == warmed
    assert warm_up_sampling_kernel(model) == 0


def test_warm_up_is_a_no_op_where_the_kernels_are_torch():
    previous = dispatch.force_backend("torch")
    try:
        engine = TorchTrainEngine(Qwen2ForCausalLM(tiny_qwen2_config(VOCAB)), RankGroup.single())
        assert warm_up_logprob_kernels(engine, trains=False) == 0
        assert warm_up_sampling_kernel(engine.model) == 0
    finally:
        dispatch.force_backend(previous)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: scripts/gpu_checks.sh tests runs it")
def test_cuda_steps_after_warm_up_compile_nothing_and_the_keys_count_the_compiles():
    """Compiled by Triton itself (TRITON_INTERPRET=0): the warm-up's kernels serve every later length,
    and Triton's own cache holds as many kernels as `specialisations()` has keys for them."""
    kernels = [triton_logprob._hidden_fwd_kernel, triton_logprob._hidden_bwd_dhidden_kernel,
               triton_logprob._hidden_bwd_dweight_kernel]

    def compiled() -> int:
        return sum(len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels)

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(VOCAB))
    engine = TorchTrainEngine(model, RankGroup.single("cuda:0"), OptimizerConfig(lr=1e-3), precision="bf16")
    warm_up_logprob_kernels(engine, trains=True)
    after_warm_up = compiled()
    for step, n in enumerate((3, 5, 8, 13)):
        exp = _experience(n, seed=step)

        def loss(part: Experience, per_sample: dict[str, torch.Tensor]):
            logp, _ = engine.logprobs(part.sequences, 1.0)
            logp = part.padded(response_slices(logp, part.prompt_lens))
            return policy_loss(logp, part.old_logp, per_sample["advantages"], part.mask, 0.2, 0.2)

        engine.train_step(exp, loss, {"advantages": torch.randn(exp.mask.shape)})
    names = {k.fn.__name__ for k in kernels}
    assert compiled() == after_warm_up == len([key for key in specialisations() if key[0] in names])
