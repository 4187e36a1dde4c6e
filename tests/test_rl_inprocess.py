"""The RL dataflow with every real stage, run in one process on the real BrokerCore (InProcessBus):
schedules, staleness and determinism without process start-up costs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stream_rlhf.broker.runtime.inprocess import InProcessBus
from stream_rlhf.config import build, import_dotted
from stream_rlhf.data.tokenizer import load_tokenizer
from stream_rlhf.driver import dataflow
from stream_rlhf.driver.dataflow import compile_job
from stream_rlhf.driver.warm_start import warm_start
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.telemetry.metrics import read_metrics
from tests.rl_tiny import tiny_job


def run_inprocess(tmp_path: Path, name: str, every_forward: bool = False,
                  **overrides) -> tuple[RLJobConfig, list[dict]]:
    """`every_forward`: compile the dataflow with the reference and actor forwards it would leave out."""
    cfg = build(RLJobConfig, tiny_job(tmp_path, name, **overrides))
    with pytest.MonkeyPatch.context() as patch:
        if every_forward:
            patch.setattr(dataflow, "left_out_stages", _only_the_critic_left_out)
        flow = compile_job(cfg, str(warm_start(cfg)), str(tmp_path / f"{name}-weights"))
    bus = InProcessBus(flow.topology, flow.broker, flow.admission)
    for stage_name, spec in flow.stages.items():
        bus.add(stage_name, import_dotted(spec.cls, "cls")(**spec.kwargs), spec.instances)
    stats = bus.run()
    assert stats["published.experience"] == cfg.iterations * cfg.rollout_batch.minibatches
    return cfg, read_metrics(Path(cfg.run_dir) / "metrics.jsonl")


LEFT_OUT_STAGES = dataflow.left_out_stages


def _only_the_critic_left_out(cfg: RLJobConfig) -> dict[str, str]:
    return {stage: why for stage, why in LEFT_OUT_STAGES(cfg).items() if stage == "critic_forward"}


def test_sync_and_stream_on_policy_train_on_the_same_batches(tmp_path):
    """Same samples, same rewards, bitwise-same weights after the first iteration. (Later
    iterations may differ: the critic forward takes the newest critic version, and whether
    critic_train has published it yet depends on timing.)"""
    torch.set_num_threads(1)
    sync_cfg, sync = run_inprocess(tmp_path, "sync", schedule="sync", overlap_depth=0, iterations=1)
    stream_cfg, stream = run_inprocess(tmp_path, "stream", schedule="stream", overlap_depth=0, iterations=1)
    assert len(sync) == len(stream) == 1
    for a, b in zip(sync, stream):
        assert a["reward"] == b["reward"] and a["tokens"] == b["tokens"]
        assert a["staleness_max"] == b["staleness_max"] == 0
    sync_weights = load_file(Path(sync_cfg.run_dir) / "checkpoint" / "model.safetensors")
    stream_weights = load_file(Path(stream_cfg.run_dir) / "checkpoint" / "model.safetensors")
    for key, value in sync_weights.items():
        torch.testing.assert_close(stream_weights[key], value, rtol=0, atol=0, msg=key)


def test_overlap_depth_one_trains_every_iteration_in_order_within_the_bound(tmp_path):
    """(In one process the stages take turns, so rollout rarely gets ahead; test_rl_job checks
    the bound where it does, with real processes.)"""
    _, records = run_inprocess(tmp_path, "k1", overlap_depth=1, iterations=4)
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]
    assert all(r["staleness_max"] <= 1 for r in records)
    assert sum(r["samples"] for r in records) == 4 * 2 * 8


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp"])
def test_critic_free_estimators_train(tmp_path, advantage):
    _, records = run_inprocess(tmp_path, advantage, **{"algorithm.advantage": advantage,
                                                        "rollout_batch.samples_per_prompt": 2})
    assert len(records) == 2 and all(r["samples"] == 32 for r in records)


def test_dr_grpo_advantages_and_the_loss_aggregation_reach_the_actors_loss(tmp_path):
    """group_std false without whitening (Dr. GRPO) centres each group's scores, which then sum to 0
    over the group. At the first step (one step, ratio 1, no KL) the policy loss is minus the
    advantages' mean under the aggregation: over samples (sequence_mean) that is 0; over tokens
    (token_mean) long answers weigh more, and it is not; nor is it the same with the std (GRPO's)."""
    torch.set_num_threads(1)
    common = {"algorithm.advantage": "grpo", "algorithm.group_std": False, "algorithm.whiten_advantages": False,
              "rollout_batch.samples_per_prompt": 2, "schedule": "sync", "overlap_depth": 0, "iterations": 1,
              "algorithm.ppo_epochs": 1, "algorithm.train_minibatches": 1, "algorithm.kl.coef": 0.0}
    _, by_sample = run_inprocess(tmp_path, "sequence", **common, **{"algorithm.loss_aggregation": "sequence_mean"})
    _, by_token = run_inprocess(tmp_path, "token", **common)
    assert by_sample[0]["reward"] == by_token[0]["reward"] and by_sample[0]["tokens"] == by_token[0]["tokens"]
    assert by_sample[0]["loss"] == pytest.approx(0.0, abs=1e-6)  # the metrics keep 5 decimals
    assert abs(by_token[0]["loss"]) >= 1e-4
    _, scaled = run_inprocess(tmp_path, "scaled", **{**common, "algorithm.group_std": True})
    assert scaled[0]["reward"] == by_token[0]["reward"] and abs(scaled[0]["loss"] - by_token[0]["loss"]) >= 1e-4


def test_gspo_clips_the_actors_loss_by_sequence(tmp_path):
    """ratio_level sequence (GSPO's clip ranges): the same samples as token-level ratios, clipped
    otherwise (by the whole sample's ratio), so a different share of tokens clips."""
    torch.set_num_threads(1)
    common = {"algorithm.advantage": "grpo", "rollout_batch.samples_per_prompt": 2, "schedule": "sync",
              "overlap_depth": 0, "iterations": 1, "algorithm.clip_low": 3e-4, "algorithm.clip_high": 4e-4,
              "algorithm.loss_aggregation": "sequence_mean"}
    _, by_token = run_inprocess(tmp_path, "token_ratio", **common)
    _, by_sequence = run_inprocess(tmp_path, "gspo", **common, **{"algorithm.ratio_level": "sequence"})
    assert by_sequence[0]["reward"] == by_token[0]["reward"] and by_sequence[0]["tokens"] == by_token[0]["tokens"]
    assert by_sequence[0]["clipfrac"] > 0 and by_token[0]["clipfrac"] > 0
    assert abs(by_sequence[0]["clipfrac"] - by_token[0]["clipfrac"]) > 1e-3


def test_sampler_correction_weights_an_on_policy_runs_tokens_by_proximal_over_behaviour(tmp_path):
    """overlap_depth 0 with algorithm.sampler_correction: the sampler's and the trainer's log-probs
    of the same weights differ by float noise only on this CPU, so the weights are 1 to 1e-3 and
    none is cut; without the key no token is weighted (no weight metrics)."""
    torch.set_num_threads(1)
    common = {"schedule": "sync", "overlap_depth": 0, "iterations": 1}
    _, plain = run_inprocess(tmp_path, "plain", **common)
    _, corrected = run_inprocess(tmp_path, "corrected", **common, **{"algorithm.sampler_correction": True})
    assert "is_weight_mean" not in plain[0]
    assert corrected[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-3) and corrected[0]["is_truncated_frac"] == 0
    assert corrected[0]["reward"] == plain[0]["reward"] and corrected[0]["loss"] == pytest.approx(plain[0]["loss"],
                                                                                                abs=1e-3)


def test_mask_truncated_leaves_the_responses_cut_by_the_length_limit_out_of_the_actors_loss(tmp_path):
    """Two tokens at most: a response is cut unless its second token (or first) is the eos. The
    handle's `truncated`, in every logged sample, says so, and the actor masks exactly those."""
    torch.set_num_threads(1)
    cfg, records = run_inprocess(tmp_path, "overlong", iterations=1, schedule="sync", overlap_depth=0,
                                 **{"rollout.max_new_tokens": 2, "algorithm.mask_truncated": True,
                                    "samples_log.per_minibatch": 1000})
    eos = load_tokenizer(warm_start(cfg)).eos_token
    logged = [json.loads(line) for line in (Path(cfg.run_dir) / "samples.jsonl").read_text().splitlines()]
    cut = [len(sample["tokens"]) == 2 and sample["tokens"][-1] != eos for sample in logged]
    assert len(logged) == records[0]["samples"] == 16
    assert [sample["truncated"] for sample in logged] == cut
    assert 0 < sum(cut) < len(cut)  # both kinds, so the count below means something
    assert records[0]["samples_masked_truncated"] == sum(cut)
    assert records[0]["truncated_frac"] == pytest.approx(sum(cut) / len(cut), abs=1e-4)


def _logged_groups(cfg: RLJobConfig) -> dict[int, list[list[tuple[float, str | None]]]]:
    """Per iteration, each logged group (a prompt's consecutive samples) in order: its samples'
    (reward, why dynamic sampling left it out)."""
    per_prompt = cfg.rollout_batch.samples_per_prompt
    groups: dict[int, list[list[tuple[float, str | None]]]] = {}
    for line in (Path(cfg.run_dir) / "samples.jsonl").read_text().splitlines():
        sample = json.loads(line)
        if sample["sample"] % per_prompt == 0:
            groups.setdefault(sample["iteration"], []).append([])
        groups[sample["iteration"]][-1].append((sample["reward"], sample["left_out"]))
    return groups


@pytest.mark.parametrize("keep", [None, 3], ids=["filter", "keep3"])
def test_dynamic_sampling_trains_only_the_groups_whose_rewards_differ(tmp_path, keep):
    """algorithm.dynamic_sampling (DAPO): every sample logged, the groups of equal rewards (and with
    `groups` those past the first informative ones) left out of training, counted as dropped and
    marked so in the samples log."""
    torch.set_num_threads(1)
    cfg, records = run_inprocess(
        tmp_path, f"dynamic_{keep}", schedule="sync", overlap_depth=0, samples_log={"per_minibatch": 1000},
        rollout_batch={"prompts_per_minibatch": 8, "minibatches": 2, "samples_per_prompt": 4},
        **{"algorithm.advantage": "grpo", "algorithm.dynamic_sampling": {} if keep is None else {"groups": keep}})
    summary = json.loads((Path(cfg.run_dir) / "train_summary.json").read_text())
    logged = _logged_groups(cfg)
    uniform = trained = 0
    for record in records:
        groups = logged[record["iteration"]]
        assert len(groups) == 16 and all(len(g) == 4 for g in groups)  # every generated sample logged
        informative = sum(len({reward for reward, _ in g}) > 1 for g in groups)
        expected = informative if keep is None else min(keep, informative)
        seen = 0  # informative groups so far
        for group in groups:
            alike = len({reward for reward, _ in group}) == 1
            seen += not alike
            why = "group returns all equal" if alike else "surplus group" if seen > expected else None
            assert [left_out for _, left_out in group] == [why] * 4
        assert record["groups_trained"] == expected and record["samples"] == 4 * expected
        assert record["groups_short"] == (0 if keep is None else max(keep - informative, 0))
        assert record["groups_uniform_frac"] == pytest.approx((16 - informative) / 16, abs=1e-4)
        uniform += 4 * (16 - informative)
        trained += 4 * expected
    assert 0 < uniform < 2 * 64  # both kinds of group: the counts above mean something
    assert summary["samples_trained"] == trained
    reasons = summary["dropped_reasons"]
    assert reasons.get("dynamic sampling: group returns all equal", 0) == uniform
    assert reasons.get("dynamic sampling: surplus group", 0) == 2 * 64 - uniform - trained
    assert (keep is None) == ("dynamic sampling: surplus group" not in reasons)  # keep 3 left some out
    assert summary["samples_dropped"] == 2 * 64 - trained  # generated = trained + dropped


def same_score(prompt: str, response: str, reference: str) -> float:
    """A reward function that scores every answer alike: every group's returns are equal."""
    return 0.5


def test_dynamic_sampling_with_no_informative_group_trains_nothing_and_the_policy_version_still_advances(tmp_path):
    torch.set_num_threads(1)
    cfg, records = run_inprocess(
        tmp_path, "all_equal", schedule="sync", overlap_depth=0,
        rollout_batch={"prompts_per_minibatch": 4, "minibatches": 2, "samples_per_prompt": 2},
        **{"algorithm.advantage": "rloo", "algorithm.dynamic_sampling": {},
           "reward.function": "tests.test_rl_inprocess:same_score"})
    summary = json.loads((Path(cfg.run_dir) / "train_summary.json").read_text())
    assert [(r["samples"], r["groups_trained"], r["groups_uniform_frac"]) for r in records] == [(0, 0, 1.0)] * 2
    assert [r["policy_version"] for r in records] == [1, 2] and summary["policy_version"] == 2
    assert summary["samples_trained"] == 0
    assert summary["dropped_reasons"] == {"dynamic sampling: group returns all equal": 2 * 16}


def test_lora_trains_the_adapters_and_rollout_samples_from_the_merged_weights(tmp_path):
    """actor.lora: the policy's final folder differs from the start in the targeted weights alone,
    and at the second iteration rollout's log-probs (the merged version 1 it loaded) are the
    trainer's (its adapters): the sampler-correction weights are 1 to 1e-4 (float noise; version 0's
    log-probs would be off by the policy's move, approx_kl 0.004 here)."""
    torch.set_num_threads(1)
    cfg, records = run_inprocess(tmp_path, "lora", iterations=2, schedule="sync", overlap_depth=0, **{
        "actor.lr": 0.02, "actor.lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]},
        "algorithm.sampler_correction": True, "algorithm.advantage": "grpo", "rollout_batch.samples_per_prompt": 2})
    start = load_file(warm_start(cfg) / "model.safetensors")
    final = load_file(Path(cfg.run_dir) / "checkpoint" / "model.safetensors")
    moved = {key: (final[key] - start[key]).abs().max().item() for key in start}
    targeted = {key for key in start if key.endswith(("q_proj.weight", "v_proj.weight"))}
    assert {key for key, change in moved.items() if change > 0} == targeted
    assert min(moved[key] for key in targeted) > 1e-3
    assert [r["samples"] for r in records] == [32, 32] and records[1]["staleness_max"] == 0
    assert records[1]["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and records[1]["is_truncated_frac"] == 0


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_the_lora_base_as_reference_trains_as_the_ref_forward_stage_does(tmp_path, placement):
    """algorithm.kl.reference=lora_base: no ref_forward stage, actor_train's policy with its
    adapters off gives the reference log-probs; the same KL, losses and final weights as the job with
    the stage (the starting checkpoint), the KL in the loss or in the reward."""
    torch.set_num_threads(1)
    common = {"iterations": 2, "schedule": "sync", "overlap_depth": 0, "actor.lr": 0.02,
              "actor.lora": {"rank": 4}, "algorithm.advantage": "grpo", "rollout_batch.samples_per_prompt": 2,
              "algorithm.kl": {"coef": 0.5, "kind": "k3", "placement": placement}}
    stage_cfg, stage = run_inprocess(tmp_path, f"ref_stage_{placement}", **common)
    base_cfg, base = run_inprocess(tmp_path, f"ref_base_{placement}", **{
        **common, "algorithm.kl": {**common["algorithm.kl"], "reference": "lora_base"}})
    assert "ref_forward" in compile_job(stage_cfg, "checkpoint", "weights").stages
    flow = compile_job(base_cfg, "checkpoint", "weights")
    assert "ref_forward" not in flow.stages and "lora_base" in flow.left_out["ref_forward"]
    assert stage[1]["kl"] > 0  # the policy moved from the reference: the comparison means something
    for mine, theirs in zip(base, stage, strict=True):
        assert mine["reward"] == theirs["reward"]
        for key in ("kl", "loss", "grad_norm"):
            assert mine[key] == pytest.approx(theirs[key], abs=1e-5), key
    expected = load_file(Path(stage_cfg.run_dir) / "checkpoint" / "model.safetensors")
    got = load_file(Path(base_cfg.run_dir) / "checkpoint" / "model.safetensors")
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=0, msg=name)


def test_ppo_with_adapters_on_the_actor_and_the_critic_trains_both(tmp_path):
    """critic.lora too: critic_forward loads each merged critic version (its head included) and
    the critic's value loss falls."""
    torch.set_num_threads(1)
    adapters = {"rank": 4, "target_modules": ["q_proj", "v_proj"]}
    cfg, records = run_inprocess(tmp_path, "ppo_lora", iterations=3, **{"actor.lora": adapters,
                                                                       "critic.lora": adapters})
    critic = read_metrics(Path(cfg.run_dir) / "critic_metrics.jsonl")
    assert [r["iteration"] for r in records] == [r["iteration"] for r in critic] == [0, 1, 2]
    assert critic[-1]["value_loss"] < critic[0]["value_loss"]


def test_micro_batches_and_activation_checkpointing_train_as_one_pass(tmp_path):
    """actor.* and critic.* micro_batch_tokens and gradient_checkpointing: the same samples and
    losses, and the same final weights to float noise, as one pass keeping every activation."""
    torch.set_num_threads(1)
    common = {"schedule": "sync", "overlap_depth": 0, "iterations": 1}
    lean = {f"{trainer}.{key}": value for trainer in ("actor", "critic")
            for key, value in (("micro_batch_tokens", 24), ("gradient_checkpointing", True))}
    whole_cfg, whole = run_inprocess(tmp_path, "one_pass", **common)
    lean_cfg, lean_records = run_inprocess(tmp_path, "lean", **common, **lean)
    assert lean_records[0]["reward"] == whole[0]["reward"] and lean_records[0]["samples"] == whole[0]["samples"]
    assert lean_records[0]["loss"] == pytest.approx(whole[0]["loss"], abs=1e-5)
    expected = load_file(Path(whole_cfg.run_dir) / "checkpoint" / "model.safetensors")
    got = load_file(Path(lean_cfg.run_dir) / "checkpoint" / "model.safetensors")
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=0, msg=name)


def test_a_hugging_face_checkpoint_folder_loads_with_the_same_code(tmp_path):
    """`model.path`: any causal-LM folder with its tokenizer (here a copy of the tiny warm start)."""
    cfg = build(RLJobConfig, tiny_job(tmp_path, "source"))
    folder = tmp_path / "hf_checkpoint"
    shutil.copytree(warm_start(cfg), folder)
    loaded_cfg, records = run_inprocess(tmp_path, "from_path", iterations=1, **{"model.path": str(folder)})
    assert warm_start(loaded_cfg) == folder
    assert len(records) == 1 and (Path(loaded_cfg.run_dir) / "checkpoint" / "config.json").is_file()


def test_without_kl_and_with_one_step_the_ref_and_actor_forwards_are_left_out_and_change_nothing(tmp_path):
    """kl.coef 0 (fixed): no reference stage; and with one optimizer step per iteration no actor
    forward either, the step's own log-probs being the proximal ones. Against a run that keeps both
    stages (kl.coef 1e-30: a KL that cannot move a float32 loss), the losses agree to 1e-6."""
    torch.set_num_threads(1)
    common = {"algorithm.advantage": "grpo", "rollout_batch.samples_per_prompt": 2, "schedule": "sync",
              "overlap_depth": 0, "iterations": 2, "algorithm.ppo_epochs": 1, "algorithm.train_minibatches": 1}
    kept_cfg, kept = run_inprocess(tmp_path, "kept", every_forward=True, **common, **{"algorithm.kl.coef": 1e-30})
    left_cfg, left = run_inprocess(tmp_path, "left", **common, **{"algorithm.kl.coef": 0.0})
    flow = compile_job(left_cfg, "checkpoint", "weights")
    assert not {"ref_forward", "actor_forward"} & set(flow.stages)
    assert flow.topology.topics["experience"].join == ["rollout", "reward"]
    assert "no KL" in flow.left_out["ref_forward"] and "one optimizer step" in flow.left_out["actor_forward"]
    assert [r["proximal_from_step"] for r in kept] == [0, 0] and [r["proximal_from_step"] for r in left] == [1, 1]
    assert_same_training(kept, left)
    assert all(r["kl"] == 0.0 for r in left)
    kept_weights = load_file(Path(kept_cfg.run_dir) / "checkpoint" / "model.safetensors")
    left_weights = load_file(Path(left_cfg.run_dir) / "checkpoint" / "model.safetensors")
    for key, value in kept_weights.items():
        torch.testing.assert_close(left_weights[key], value, rtol=0, atol=1e-5, msg=key)


def test_with_rollout_ahead_the_trainer_computes_the_proximal_log_probs_once_and_trains_as_with_the_forward(tmp_path):
    """overlap_depth 1, two optimizer steps: no actor forward; actor_train computes the proximal
    log-probs itself, as it did before when the forward's were stale, and the KL (in the reward)
    is the sampler's behaviour log-probs against the reference. Against a run with the actor
    forward kept, the losses and the KL agree."""
    torch.set_num_threads(1)
    common = {"overlap_depth": 1, "iterations": 2, "algorithm.kl.placement": "reward"}
    _, kept = run_inprocess(tmp_path, "kept1", every_forward=True, **common)
    left_cfg, left = run_inprocess(tmp_path, "left1", **common)
    assert "actor_forward" not in compile_job(left_cfg, "c", "w").stages
    assert "proximal_recomputed" in kept[0]
    assert [r["proximal_recomputed"] for r in left] == [1, 1]  # once per iteration, never a second pass
    assert_same_training(kept, left)
    for a, b in zip(kept, left):
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-6)  # same weights sampled and forwarded


def assert_same_training(kept: list[dict], left: list[dict]) -> None:
    """The same samples and the same losses, to 1e-6, iteration by iteration."""
    assert len(kept) == len(left)
    for a, b in zip(kept, left):
        assert b["reward"] == a["reward"] and b["tokens"] == a["tokens"]
        for key in ("loss", "approx_kl", "clipfrac", "entropy"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key


@pytest.mark.parametrize("medusa", [False, True])
def test_static_decoding_samples_and_trains_as_eager(tmp_path, medusa):
    """`rollout.decode: static` through the rollout engine (plain, and Medusa's speculation): the
    same samples and rewards as eager decoding, and bitwise the same weights after an iteration."""
    torch.set_num_threads(1)
    speculation = {"rollout.medusa.enabled": True, "rollout.medusa.warm_start_steps": 5} if medusa else {}
    runs = {mode: run_inprocess(tmp_path, mode, schedule="sync", overlap_depth=0, iterations=1,
                                **{"rollout.decode": mode}, **speculation)
            for mode in ("eager", "static")}
    (eager_cfg, eager), (static_cfg, static) = runs["eager"], runs["static"]
    assert [(r["reward"], r["tokens"]) for r in static] == [(r["reward"], r["tokens"]) for r in eager]
    assert not medusa or [r["speculative_minibatches"] for r in static] == [2]  # both mini-batches speculated
    eager_weights = load_file(Path(eager_cfg.run_dir) / "checkpoint" / "model.safetensors")
    static_weights = load_file(Path(static_cfg.run_dir) / "checkpoint" / "model.safetensors")
    for key, value in eager_weights.items():
        torch.testing.assert_close(static_weights[key], value, rtol=0, atol=0, msg=key)
