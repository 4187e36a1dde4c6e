"""Medusa heads and their companion training: the heads' targets, and a PPO job where the
`medusa_train` stage fine-tunes them beside the actor (in one process on the real BrokerCore)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from stream_rlhf.algos.medusa import heads_loss
from stream_rlhf.backends.speculation import Speculation
from stream_rlhf.backends.speculative import generate_speculative
from stream_rlhf.backends.torch_rollout import SamplingParams, generate
from stream_rlhf.broker.runtime.inprocess import InProcessBus
from stream_rlhf.config import build, import_dotted
from stream_rlhf.data.arithmetic import problems
from stream_rlhf.data.tokenizer import load_tokenizer
from stream_rlhf.driver.dataflow import compile_job
from stream_rlhf.driver.warm_start import warm_start
from stream_rlhf.models.checkpoint import load_policy
from stream_rlhf.models.medusa import MedusaHeads, has_heads, load_heads, save_heads
from stream_rlhf.models.packing import packed_hidden_states
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.telemetry.metrics import read_metrics
from tests.rl_tiny import tiny_job
from tests.tiny_models import tiny_qwen2_config


def test_new_heads_start_as_the_lm_head_and_round_trip(tmp_path):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(49))
    heads = MedusaHeads.from_policy(model, 3)
    hidden = torch.randn(2, 5, 64)
    for logits in heads(hidden):
        torch.testing.assert_close(logits, model.lm_head(hidden))
    with torch.no_grad():
        heads.blocks[1].linear.weight.normal_()
    save_heads(heads, tmp_path)
    torch.testing.assert_close(load_heads(tmp_path)(hidden), heads(hidden))


def test_head_k_is_trained_on_the_response_token_k_plus_2_ahead():
    """Hidden state t = one-hot of token t + 2 + k for head k, projections = identity: the loss is
    ~0 only if every head is aligned with its target, over exactly the response positions."""
    vocab, heads_n = 16, 2
    heads = MedusaHeads(vocab, vocab, heads_n)
    with torch.no_grad():
        for projection in heads.projections:
            projection.weight.copy_(torch.eye(vocab) * 50)
    sequences = [torch.tensor([1, 5, 6, 7, 8, 9, 10]), torch.tensor([2, 3, 11, 12, 13])]
    prompt_lens = [3, 2]
    for k in range(heads_n):
        hidden = []
        for seq in sequences:
            h = torch.zeros(len(seq), vocab)
            for t in range(len(seq) - 2 - k):
                h[t, seq[t + 2 + k]] = 1.0
            hidden.append(h)
        _, metrics = heads_loss(heads, hidden, sequences, prompt_lens)
        assert metrics[f"head{k}_acc"] == 1.0 and metrics[f"head{k}_loss"] < 1e-6


def run_medusa_job(tmp_path: Path, name: str, **overrides) -> tuple[RLJobConfig, list[dict], list[dict]]:
    cfg = build(RLJobConfig, tiny_job(tmp_path, name, **{"rollout.medusa.enabled": True, "rollout.stop": [],
                                                          "rollout.max_new_tokens": 6, **overrides}))
    flow = compile_job(cfg, str(warm_start(cfg)), str(tmp_path / f"{name}-weights"))
    assert "medusa_train" in flow.stages
    bus = InProcessBus(flow.topology, flow.broker, flow.admission)
    for stage_name, spec in flow.stages.items():
        bus.add(stage_name, import_dotted(spec.cls, "cls")(**spec.kwargs), spec.instances)
    bus.run()
    run_dir = Path(cfg.run_dir)
    return cfg, read_metrics(run_dir / "metrics.jsonl"), read_metrics(run_dir / "medusa_metrics.jsonl")


def rollouts(model, tokenizer, cfg: RLJobConfig) -> tuple[list[torch.Tensor], list[int], SamplingParams]:
    """The final policy's samples on 64 eval prompts, and the sampling they used."""
    prompts = [torch.tensor([tokenizer.bos_token_id, *tokenizer.encode(p.prompt, add_special_tokens=False)])
               for p in problems("eval", 64, 0, cfg.task.max_operand)]
    params = SamplingParams(cfg.rollout.temperature, 1.0, cfg.rollout.max_new_tokens, (), tokenizer.pad_token_id)
    gen = generate(model, prompts, params, torch.Generator().manual_seed(1))
    return [torch.cat([p, r]) for p, r in zip(prompts, gen.response_ids)], [len(p) for p in prompts], params


@pytest.mark.slow
def test_companion_training_lowers_the_heads_loss_and_raises_acceptance(tmp_path):
    """The heads start as copies of the LM head (no warm start of theirs), so they draft badly;
    fine-tuned on the run's own rollouts beside the actor, they fit the final policy's samples
    better and accept more than those start heads."""
    cfg, records, medusa = run_medusa_job(tmp_path, "companion", iterations=4,
                                          **{"rollout.medusa.warm_start_steps": 0, "rollout.medusa.epochs": 4,
                                             "model.seed": 7})  # a warm start of its own: no heads saved there
    assert not has_heads(warm_start(cfg))
    assert [r["iteration"] for r in records] == [0, 1, 2, 3] and len(medusa) >= 2
    checkpoint = Path(cfg.run_dir) / "checkpoint"
    model, tokenizer = load_policy(checkpoint).eval(), load_tokenizer(checkpoint)
    heads = {"start": MedusaHeads.from_policy(load_policy(warm_start(cfg)), cfg.rollout.medusa.heads),
             "companion": load_heads(checkpoint)}
    sequences, prompt_lens, params = rollouts(model, tokenizer, cfg)
    with torch.no_grad():
        hidden = packed_hidden_states(model, sequences)
        loss = {name: heads_loss(h, hidden, sequences, prompt_lens)[0].item() for name, h in heads.items()}
    accept = {}
    for name, h in heads.items():
        prompts = [s[:p] for s, p in zip(sequences, prompt_lens)]
        _, stats = generate_speculative(model, h, prompts, params, torch.Generator().manual_seed(2))
        accept[name] = stats.mean_accept_len
    assert loss["companion"] < loss["start"] - 0.5, loss
    assert accept["companion"] > accept["start"] + 0.1, accept


@pytest.mark.slow
def test_the_heads_lag_never_exceeds_its_bound(tmp_path):
    """max_lag 0: rollout drafts only with heads trained on its own policy version, else plainly."""
    _, records, _ = run_medusa_job(tmp_path, "lag", iterations=4, overlap_depth=1,
                                   **{"rollout.medusa.max_lag": 0, "rollout.medusa.probe_every": 1000})
    assert all(r["medusa_lag_max"] == 0 for r in records)
    assert sum(r["speculative_minibatches"] for r in records) >= 1


@pytest.mark.slow
def test_speculation_turns_itself_off_while_slower_than_plain_and_says_so(tmp_path, caplog):
    cfg = build(RLJobConfig, tiny_job(tmp_path, "auto", **{"rollout.medusa.enabled": True}))
    job = JobContext(cfg, str(warm_start(cfg)), str(tmp_path / "weights"))
    log = logging.LoggerAdapter(logging.getLogger("test.speculation"), {})
    speculation = Speculation(job, load_policy(job.checkpoint), log)
    with caplog.at_level(logging.INFO, logger="test.speculation"):
        speculation._time(True, 2e-3)  # ms per token: speculative first...
        speculation._time(False, 1e-3)  # ...then the plain probe is faster
        assert not speculation.speculative
        assert "speculative decoding off (slower than plain): 2.00 ms/token speculative, 1.00 plain" in caplog.text
        for _ in range(5):
            speculation._time(True, 0.2e-3)  # the speculative probes got faster (e.g. companion-trained heads)
        assert speculation.speculative and "speculative decoding back on" in caplog.text
