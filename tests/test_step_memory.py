"""How a training step fits in memory (`backends/step_memory.py`): micro-batches whose gradients
add up to the one pass's, and activation checkpointing, on the torch engine (one rank here; two
FSDP2 ranks in tests/test_torch_engine.py)."""

from __future__ import annotations

import pytest
import torch

from stream_rlhf.algos.aggregation import row_weights
from stream_rlhf.backends.optimizer_config import OptimizerConfig
from stream_rlhf.backends.step_memory import micro_batches
from stream_rlhf.backends.torch_engine import TorchTrainEngine
from stream_rlhf.distributed import RankGroup
from tests.test_torch_engine import _critic, _experience, _loss, _model


def _tokens(*lengths: int) -> list[torch.Tensor]:
    return [torch.arange(1, n + 1) for n in lengths]


def test_runs_are_whole_samples_in_order_within_the_budget():
    runs = micro_batches(_tokens(3, 4, 2, 9, 1, 1), 7)
    assert [r.tolist() for r in runs] == [[0, 1], [2], [3], [4, 5]]  # 9 > 7 alone
    assert [r.tolist() for r in micro_batches(_tokens(3, 4), None)] == [[0, 1]]


def test_a_prompt_its_samples_share_counts_once_in_the_budget():
    """A group of four samples of a 20-token prompt and 5-token answers computes 20 + 4 x 5 = 40
    tokens packed (`pack_shared`): one run of 40, where counting whole samples (25 each) would cut
    the group in four and run the prompt four times. A new run counts the prompt again."""
    prompt = torch.arange(1, 21)
    group = [torch.cat([prompt, torch.full((5,), 30 + i)]) for i in range(4)]
    other = torch.cat([torch.arange(50, 60), torch.full((5,), 7)])  # another prompt: its whole 15 tokens
    prompt_lens = torch.tensor([20, 20, 20, 20, 10])
    assert [r.tolist() for r in micro_batches(group + [other], 40, prompt_lens)] == [[0, 1, 2, 3], [4]]
    assert [r.tolist() for r in micro_batches(group + [other], 40)] == [[0], [1], [2], [3, 4]]  # no prompt_lens
    assert [r.tolist() for r in micro_batches(group, 34, prompt_lens[:4])] == [[0, 1], [2, 3]]  # 20+5+5, again


def _trained(optimizer: OptimizerConfig, steps: int = 2) -> tuple[TorchTrainEngine, list[dict[str, float]]]:
    """An engine after `steps` optimizer steps (the last under sequence_mean row weights; its
    gradients are still on the parameters) and each step's metrics."""
    engine = TorchTrainEngine(_model(), RankGroup.single(), optimizer)
    exp = _experience()
    advantages = torch.linspace(-1, 1, exp.num_samples)[:, None].expand_as(exp.mask).contiguous()
    weighted = {"advantages": advantages, "row_weights": row_weights(exp.mask, "sequence_mean", 8)}
    metrics = [engine.train_step(exp, _loss(engine), per_sample)
               for per_sample in [{"advantages": advantages}] * (steps - 1) + [weighted]]
    return engine, metrics


@pytest.mark.parametrize("budget", [1, 9, 20])  # a run per sample; runs of 1-2 samples; of 2-4
def test_micro_batches_accumulate_the_one_pass_gradients(budget):
    """The gradients to float noise (Adam's first steps divide tiny gradients by their own size,
    so the weights are compared at the noise that amplifies: 1e-5 at lr 1e-3)."""
    whole, whole_metrics = _trained(OptimizerConfig(lr=1e-3, max_grad_norm=0.5))
    micro, micro_metrics = _trained(OptimizerConfig(lr=1e-3, max_grad_norm=0.5, micro_batch_tokens=budget))
    for (name, a), b in zip(whole.model.named_parameters(), micro.model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)
    weights, again = whole.export_weights(), micro.export_weights()
    for name in weights:
        torch.testing.assert_close(again[name], weights[name], atol=1e-5, rtol=0, msg=name)
    for a, b in zip(whole_metrics, micro_metrics):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], abs=1e-6), key


def _saved_bytes(engine: TorchTrainEngine) -> int:
    """Bytes autograd keeps for the backward of one actor loss (what activation memory is)."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    exp = _experience()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, _ = _loss(engine)(exp, {"advantages": torch.ones_like(exp.mask)})
    loss.backward()
    return sum(saved)


def test_activation_checkpointing_keeps_less_for_the_backward_and_trains_the_same():
    kept = _saved_bytes(TorchTrainEngine(_model(), RankGroup.single(), OptimizerConfig()))
    recomputed = _saved_bytes(TorchTrainEngine(_model(), RankGroup.single(), OptimizerConfig(
        gradient_checkpointing=True)))
    assert recomputed < 0.7 * kept, (recomputed, kept)
    whole, _ = _trained(OptimizerConfig(lr=1e-3))
    again, _ = _trained(OptimizerConfig(lr=1e-3, gradient_checkpointing=True))
    for (name, a), b in zip(whole.model.named_parameters(), again.model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_the_forwards_in_runs_give_the_one_pass_outputs():
    """A forward-only engine's budget (the reference and the forward stages take their trainer's):
    log-probs, values and the (N, R) response log-probs as in one pass."""
    exp = _experience()
    whole = TorchTrainEngine(_model(), RankGroup.single())
    runs = TorchTrainEngine(_model(), RankGroup.single(), micro_batch_tokens=9)
    for a, b in zip(whole.forward_logprobs(exp.sequences, 0.7, prompt_lens=exp.prompt_lens),
                    runs.forward_logprobs(exp.sequences, 0.7, prompt_lens=exp.prompt_lens)):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    torch.testing.assert_close(runs.forward_response_logprobs(exp, 1.0), whole.forward_response_logprobs(exp, 1.0),
                               atol=1e-6, rtol=0)
    critic, critic_runs = (TorchTrainEngine(_critic(), RankGroup.single(), micro_batch_tokens=budget)
                           for budget in (None, 9))
    for a, b in zip(critic.forward_values(exp.sequences), critic_runs.forward_values(exp.sequences)):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
