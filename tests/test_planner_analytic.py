"""Analytic stage costs (`planner/analytic.py`), the ranks axis of the search (`rank_search.py`)
and `stream-rlhf plan CONFIG --search` without a calibration run, on hand-computed figures.

The model of every hand computation: hidden 4, intermediate 8, 1 layer, 2 heads of 2, 1 kv head,
vocabulary 10, tied embeddings:
    attention 4 x 2 x (2 x 2 + 2 x 1) = 48 weights + 2 x (2 + 2 x 1) = 8 biases      56
    MLP 3 x 4 x 8 = 96, two norms 2 x 4 = 8                                          104
    embedding 10 x 4 = 40, final norm 4                                                44   = 204
A mini-batch: 2 rows x (3 prompt + 5 response tokens) = 16 tokens; 2 mini-batches per iteration.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from stream_rlhf.cli import main
from stream_rlhf.config import ConfigError, build
from stream_rlhf.planner import job_analytic
from stream_rlhf.planner.analytic import ModelShape, Workload, analytic_profile
from stream_rlhf.planner.devices import DeviceFigures, device_figures
from stream_rlhf.planner.rank_search import rank_splits, search_ranks
from stream_rlhf.rl.config import RLJobConfig
from tests.rl_tiny import tiny_job, write_job

SHAPE = ModelShape(hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, head_dim=2, vocab=10)
WORK = Workload(rows=2, prompt_tokens=3, response_tokens=5, minibatches=2, ppo_epochs=1, train_minibatches=1)
MEGA = DeviceFigures("1 MFLOP/s", peak_flops=1e6, efficiency=1.0, bandwidth=1e6, bytes_per_param=2,
                     link_bandwidth=1e6, dp_efficiency=0.8)
"""1e6 FLOP/s, 1e6 bytes/s everywhere, no overheads: costs in units of 1e-6 s per FLOP or byte."""
PPO = {"prompts": (), "rollout": ("prompts",), "ref_forward": ("rollout",), "actor_train": ("ref_forward", "rollout")}


def test_the_parameter_count_is_the_shapes():
    assert SHAPE.params == 204
    assert replace(SHAPE, tied=False).params == 244


def test_costs_of_a_tiny_job_at_a_known_rate():
    """forward 2 x 204 x 16 = 6528 FLOP; rollout: prefill 2 x 204 x 6 = 2448 FLOP, then 5 decode
    steps of max(2 x 204 x 2 = 816 FLOP, 204 x 2 = 408 bytes); actor_train 6 x 204 x 32 FLOP
    + one Adam step of 204 x 28 bytes + the proximal forward over the iteration's 32 tokens
    (the job has no actor_forward)."""
    profile = analytic_profile(PPO, SHAPE, WORK, MEGA)
    assert profile.step_s["ref_forward"] == pytest.approx((6528e-6, 6528e-6))
    assert profile.step_s["rollout"] == pytest.approx(((2448 + 5 * 816) * 1e-6,) * 2)
    assert profile.step_s["actor_train"] == pytest.approx((0.0, (39168 + 5712 + 13056) * 1e-6))
    assert profile.step_s["prompts"] == (0.0, 0.0)
    assert profile.publish_s == pytest.approx(408e-6) and profile.weights_load_s == pytest.approx(408e-6)
    assert profile.inputs == PPO and profile.rollout_side == {"prompts", "rollout"}


def test_a_lora_trainer_costs_its_frozen_weights_no_gradient_and_steps_its_adapters_only():
    """Rank 1 on q_proj (4 + 4) and v_proj (4 + 2): 14 adapter parameters. A pass: 4 x 204 + 6 x 14
    = 900 FLOP a token (the full model's: 6 x 204); a step: 14 x 28 bytes."""
    lora = replace(SHAPE, lora_rank=1, lora_targets=("q_proj", "v_proj"))
    assert lora.trained == 14 and SHAPE.trained == SHAPE.params
    profile = analytic_profile(PPO, SHAPE, WORK, MEGA, shapes={"actor_train": lora})
    assert profile.step_s["actor_train"] == pytest.approx((0.0, (900 * 32 + 14 * 28 + 13056) * 1e-6))


def test_with_the_lora_base_as_reference_actor_train_also_runs_the_reference_forward(tmp_path):
    """algorithm.kl.reference lora_base: no ref_forward stage, and actor_train's step grows by a
    forward over the iteration's 32 tokens (2 x 204 x 32 = 13056 FLOP), beside the proximal one."""
    stages = {name: inputs for name, inputs in PPO.items() if name != "ref_forward"} | {"actor_train": ("rollout",)}
    plain = analytic_profile(stages, SHAPE, WORK, MEGA).step_s["actor_train"][-1]
    base = analytic_profile(stages, SHAPE, replace(WORK, reference_in_trainer=True), MEGA).step_s["actor_train"][-1]
    assert base - plain == pytest.approx(13056e-6)
    cfg = build(RLJobConfig, tiny_job(tmp_path, "w", **{
        "algorithm.advantage": "grpo", "rollout_batch.samples_per_prompt": 2, "actor.lora": {"rank": 4},
        "algorithm.kl.reference": "lora_base"}))
    assert job_analytic.job_workload(cfg).reference_in_trainer is True


def test_the_adapter_count_is_the_real_models():
    """The embedded tiny model with `actor.lora` rank 8 on every projection: what the engine trains."""
    from stream_rlhf.models.lora import add_lora
    from stream_rlhf.models.lora_config import LoRAConfig
    from tests.tiny_models import seeded_qwen2_policy, tiny_qwen2_config

    model = seeded_qwen2_policy(40)
    add_lora(model, LoRAConfig(rank=8), seed=0)
    config = tiny_qwen2_config(40)
    shape = ModelShape(hidden=config.hidden_size, intermediate=config.intermediate_size,
                       layers=config.num_hidden_layers, heads=config.num_attention_heads,
                       kv_heads=config.num_key_value_heads, head_dim=config.head_dim, vocab=40, lora_rank=8,
                       lora_targets=tuple(LoRAConfig().target_modules))
    assert shape.trained == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_decode_is_bandwidth_bound_when_the_weights_take_longer_than_the_flops():
    slow_memory = replace(MEGA, bandwidth=1e5)  # 408 bytes: 4080 us a step against 816
    rollout = analytic_profile(PPO, SHAPE, WORK, slow_memory).step_s["rollout"]
    assert rollout[0] == pytest.approx((2448 + 5 * 4080) * 1e-6)


def test_overheads_are_per_layer_and_head():
    """(1 layer + 1) x 1 ms a forward; a training pass 3 x that per optimizer step; 2 decode overheads."""
    device = replace(MEGA, layer_overhead_s=1e-3, decode_overhead_s=1e-4)
    profile = analytic_profile({**PPO, "actor_forward": ("rollout",)}, SHAPE, WORK, device)
    assert profile.step_s["ref_forward"][0] == pytest.approx(6528e-6 + 2e-3)
    assert profile.step_s["rollout"][0] == pytest.approx(2448e-6 + 2e-3 + 5 * (816e-6 + 2e-4))
    assert profile.step_s["actor_train"][1] == pytest.approx((39168 + 5712) * 1e-6 + 6e-3)


def test_ranks_split_the_compute_and_add_an_all_reduce():
    """2 ranks at 80%: compute / 1.6; Adam's bytes / 2; all-reduce 2 x 1/2 x 408 bytes; 2 rollout
    instances halve a mini-batch's share."""
    profile = analytic_profile(PPO, SHAPE, WORK, MEGA, ranks={"ref_forward": 2, "actor_train": 2, "rollout": 2})
    assert profile.step_s["ref_forward"][0] == pytest.approx(6528e-6 / 1.6)
    assert profile.step_s["actor_train"][1] == pytest.approx((39168 + 13056) / 1.6 * 1e-6 + (5712 / 2 + 408) * 1e-6)
    assert profile.step_s["rollout"][0] == pytest.approx((2448 + 5 * 816) * 1e-6 / 2)


def test_a_reward_model_is_a_forward_and_a_function_costs_nothing():
    stages = {**PPO, "reward_forward": ("rollout",)}
    assert analytic_profile(stages, SHAPE, WORK, MEGA).step_s["reward_forward"] == (0.0, 0.0)
    bigger = replace(SHAPE, vocab=20)  # 244 weights
    with_model = analytic_profile(stages, SHAPE, WORK, MEGA, shapes={"reward_forward": bigger})
    assert with_model.step_s["reward_forward"] == pytest.approx((2 * 244 * 16e-6,) * 2)


def test_rank_splits_of_each_mode():
    stages, side = ["rollout", "ref_forward"], frozenset({"rollout"})
    assert rank_splits(stages, side, 1, "separated") == [{}]
    assert rank_splits(stages, side, 8, "colocated") == [{"rollout": 8, "ref_forward": 8}]
    assert [split["rollout"] for split in rank_splits(stages, side, 8, "separated")] == [1, 2, 4, 6, 7]
    assert all(split["rollout"] + split["ref_forward"] == 8 for split in rank_splits(stages, side, 8, "separated"))


def test_the_search_gives_rollout_the_devices_it_needs():
    """Rollout costs 7 x a trainer's step per mini-batch on one device: of 8 devices separated,
    the best split gives rollout 7 (instances) and training 1."""
    costs = {"prompts": 0.0, "rollout": 7.0, "actor_train": 1.0}

    def profile_of(ranks):
        profile = analytic_profile({"prompts": (), "rollout": ("prompts",), "actor_train": ("rollout",)}, SHAPE,
                                   replace(WORK, minibatches=1), MEGA)
        steps = {stage: (cost / ranks.get(stage, 1),) for stage, cost in costs.items()}
        return replace(profile, step_s=steps, publish_s=0.0, weights_load_s=0.0)

    plans = search_ranks(profile_of, device_count=8, iterations=6, modes=("separated",), groups=[{}])
    assert len(plans) == 5 * 4  # splits x (sync, stream 0, 1, 2)
    best = plans[0]
    assert best.ranks == {"prompts": 7, "rollout": 7, "actor_train": 1}  # the rollout side: prompts too
    assert "rollout.instances=7" in best.sets and "placement.stages.actor_train.devices=[7]" in best.sets
    assert best.prediction.iteration_s == pytest.approx(1.0, rel=1e-6)  # overlapped: each side 1 s a mini-batch
    assert [p.prediction.iteration_s for p in plans] == sorted(p.prediction.iteration_s for p in plans)


def test_device_groups_are_tried_with_several_ranks_when_their_members_have_the_same():
    """Of 4 devices separated, the train side's stages all get the same ranks, so the forwards'
    group is tried at every split; a group is not tried where its members' ranks differ."""
    stages = {"prompts": (), "rollout": ("prompts",), "ref_forward": ("rollout",), "critic_forward": ("rollout",),
              "actor_train": ("ref_forward", "critic_forward")}
    profile = analytic_profile(stages, SHAPE, replace(WORK, minibatches=1), MEGA)
    forwards = {"forwards": ["ref_forward", "critic_forward"]}
    mixed = {"mixed": ["rollout", "ref_forward"]}  # one on each side: the same ranks only at 2 + 2
    plans = search_ranks(lambda ranks: profile, device_count=4, iterations=4, modes=("separated",),
                         groups=[{}, forwards, mixed])
    tried = {(tuple(sorted(p.ranks.items())), tuple(p.groups)) for p in plans}
    splits = {r for r, _ in tried}
    assert len(splits) == 3 and all((r, ("forwards",)) in tried for r in splits)  # 1, 2 and 3 ranks on training
    assert [dict(r)["ref_forward"] for r, groups in tried if groups == ("mixed",)] == [2]


def test_device_presets_take_overrides_and_name_bad_ones():
    h100 = device_figures("h100,count=8,efficiency=0.5")
    assert h100.count == 8 and h100.rate == pytest.approx(494.5e12) and h100.name == "h100,count=8,efficiency=0.5"
    with pytest.raises(ConfigError, match="'tpu' is not a preset"):
        device_figures("tpu")
    with pytest.raises(ConfigError, match="'speed=2' is not key=value"):
        device_figures("h100,speed=2")
    with pytest.raises(ConfigError, match=r"device.efficiency=2.0: must be in \(0, 1\]"):
        device_figures("h100,efficiency=2")


@pytest.fixture
def config(tmp_path) -> Path:
    return write_job(tmp_path / "job.yaml", tiny_job(tmp_path, "analytic", schedule="stream", overlap_depth=1,
                                                     iterations=6, **{"placement.mode": "separated"}))


def test_plan_search_without_a_profile_uses_analytic_costs(config, capsys, monkeypatch):
    """This machine's figures are timed once (here: given, so the test times nothing)."""
    timed = []

    def this_machine(shape, work, threads, cache_dir):
        timed.append((shape, work))
        return replace(MEGA, name="this machine (given)", peak_flops=1e9)

    monkeypatch.setattr(job_analytic, "this_machine", this_machine)
    assert main(["plan", str(config), "--search", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["costs"] == "this machine (given)" and "costs: analytic" in out
    shape, work = timed[0]
    assert (shape.hidden, shape.layers, work.rows, work.response_tokens) == (64, 1, 8, 4)
    assert result["prediction"]["iteration_s"] > 0 and len(result["plans"]) == 3
    times = [plan["iteration_s"] for plan in result["plans"]]
    assert times == sorted(times) and "ranks" not in result["plans"][0]


def test_plan_search_on_a_preset_searches_ranks(config, capsys):
    assert main(["plan", str(config), "--search", "--device", "h100,count=4", "--top", "50", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["costs"] == "h100,count=4"
    splits = {tuple(sorted(plan["ranks"].items())) for plan in result["plans"]}
    rollout = sorted({dict(split)["rollout"] for split in splits})
    assert rollout == [1, 2, 3, 4]  # separated 1, 2, 3 of 4 (and colocated: every stage on 4)
    one_of_each = next(p for p in result["plans"] if p["ranks"]["rollout"] == 1)
    assert "placement.stages.actor_train.ranks=3" in one_of_each["sets"]
    assert "placement.stages.actor_train.devices=[1, 2, 3]" in one_of_each["sets"]
    assert "rollout.instances=3" in next(p for p in result["plans"] if p["ranks"]["rollout"] == 3)["sets"]


def test_this_machine_is_timed_once_per_shape_and_cached(tmp_path, monkeypatch):
    from stream_rlhf.planner import micro_calibration

    timed = []
    monkeypatch.setattr(micro_calibration, "measure", lambda shape, work, threads: timed.append(work.rows) or MEGA)
    assert micro_calibration.this_machine(SHAPE, WORK, 1, tmp_path) == MEGA
    assert micro_calibration.this_machine(SHAPE, WORK, 1, tmp_path) == MEGA  # from the file
    assert micro_calibration.this_machine(SHAPE, replace(WORK, rows=4), 1, tmp_path) == MEGA
    assert timed == [2, 4] and len(list(tmp_path.glob("planner_machine_*.json"))) == 2


def test_timing_a_tiny_model_runs_every_measurement():
    """A smoke test of the real timings (their values depend on the machine): every measurement runs
    on a real model and sampler, and the fitted rate is above zero (the other bounds are clamped)."""
    from stream_rlhf.planner.micro_calibration import measure

    shape = ModelShape(hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, head_dim=32, vocab=49)
    figures = measure(shape, replace(WORK, rows=4), threads=1)
    assert figures.peak_flops > 0 and 0 < figures.efficiency <= 1 and figures.bandwidth > 0
    assert figures.layer_overhead_s >= 0 and figures.decode_overhead_s >= 0 and figures.bytes_per_param == 4
