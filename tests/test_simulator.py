"""The dataflow simulator (`planner/simulator.py`) on small graphs whose schedules are worked out
by hand in each test's docstring (times in seconds)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stream_rlhf.planner.calibrate import (
    Profile,
    base_cost,
    exclusive_costs,
    fit_alone_speedup,
    fit_contention,
    profile_from_trace,
)
from stream_rlhf.planner.graph import SimGraph, SimStage
from stream_rlhf.planner.search import search
from stream_rlhf.planner.simulator import simulate


def chain(rollout_s: float = 1.0, train_s: float = 2.0, device: str = "", **graph: object) -> SimGraph:
    """prompts (free) -> rollout -> actor_train."""
    stages = (SimStage("prompts", 0.0, side="rollout"),
              SimStage("rollout", rollout_s, inputs=("prompts",), side="rollout", device=device),
              SimStage("actor_train", train_s, inputs=("rollout",), device=device))
    return SimGraph(stages=stages, **{"iterations": 3, "minibatches": 1, **graph})


def spans(prediction, stage: str) -> list[tuple[float, float]]:
    return [(s.start_s, s.end_s) for s in prediction.steps if s.stage == stage]


def test_on_policy_chain_takes_turns():
    """k=0: rollout 0-1, train 1-3 (version 1 at 3), rollout 3-4, train 4-6, rollout 6-7, train 7-9.
    Window (skip 1): 3..9, two iterations: 3 s each; rollout busy 2 of 6 s, train 4 of 6."""
    p = simulate(chain(overlap_depth=0), skip=1)
    assert spans(p, "rollout") == [(0, 1), (3, 4), (6, 7)]
    assert spans(p, "actor_train") == [(1, 3), (4, 6), (7, 9)]
    assert p.iteration_s == 3.0 and p.makespan_s == 9.0 and p.staleness_max == 0
    assert p.figures.busy == {"rollout": pytest.approx(1 / 3), "actor_train": pytest.approx(2 / 3),
                              "prompts": 0.0}
    assert p.figures.bubble_ratio == pytest.approx(0.5)


def test_overlap_depth_one_lets_rollout_run_a_version_ahead():
    """k=1: rollout 0-1, 1-2 (version 0, one ahead), then waits for version 1 (3): 3-4; train 1-3,
    3-5, 5-7. Iterations end at 3, 5, 7: 2 s each in the window, bound by training."""
    p = simulate(chain(overlap_depth=1), skip=1)
    assert spans(p, "rollout") == [(0, 1), (1, 2), (3, 4)]
    assert spans(p, "actor_train") == [(1, 3), (3, 5), (5, 7)]
    assert [s.policy_version for s in p.steps if s.stage == "rollout"] == [0, 0, 1]
    assert p.iteration_s == 2.0 and p.staleness_max == 1
    assert p.figures.busy["actor_train"] == 1.0


def test_stages_on_one_device_run_one_at_a_time():
    """Colocated, k=1: rollout 0-1; at 1 both may start, rollout first (it comes first in the
    graph): 1-2, train 2-4 (version 1 at 4); at 4 rollout's third step 4-5, then train 5-7, 7-9."""
    p = simulate(chain(overlap_depth=1, device="cpu"), skip=1)
    assert spans(p, "rollout") == [(0, 1), (1, 2), (4, 5)]
    assert spans(p, "actor_train") == [(2, 4), (5, 7), (7, 9)]
    assert p.iteration_s == 2.5
    assert p.figures.overlap_hidden_s == 0.0  # nothing ever overlaps on one device


def sync_or_stream(barrier: bool) -> SimGraph:
    stages = (SimStage("prompts", 0.0, side="rollout"),
              SimStage("rollout", 1.0, inputs=("prompts",), side="rollout"),
              SimStage("ref_forward", 0.5, inputs=("rollout",), barrier=barrier),
              SimStage("actor_train", 1.0, inputs=("rollout", "ref_forward"), barrier=barrier))
    return SimGraph(stages=stages, iterations=2, minibatches=2, overlap_depth=0)


def test_sync_barriers_wait_for_the_whole_iteration():
    """Two mini-batches, k=0. Sync: rollout 0-1, 1-2; ref 2-2.5, 2.5-3; train 3-4, 4-5 (version 1
    at 5); iteration 1 the same from 5: ends 5 and 10. Stream: ref 1-1.5, 2-2.5; train 1.5-2.5,
    2.5-3.5 (version 1 at 3.5): ends 3.5 and 7."""
    sync, stream = simulate(sync_or_stream(True), skip=1), simulate(sync_or_stream(False), skip=1)
    assert spans(sync, "ref_forward")[:2] == [(2, 2.5), (2.5, 3)]
    assert spans(sync, "actor_train") == [(3, 4), (4, 5), (8, 9), (9, 10)]
    assert spans(stream, "ref_forward")[:2] == [(1, 1.5), (2, 2.5)]
    assert spans(stream, "actor_train") == [(1.5, 2.5), (2.5, 3.5), (5, 6), (6, 7)]
    assert (sync.iteration_s, stream.iteration_s) == (5.0, 3.5)


def test_offloaded_stages_pay_their_load_when_they_take_turns():
    """ref and critic forward share a device and offload: each step follows the other's, so each
    pays 0.25 s: ref 1-1.75, critic 1.75-2.5; rollout's second mini-batch (done at 2) waits for the
    device: ref 2.5-3.25, critic 3.25-4. Memory: rollout's 2 GB on its own device, and on the
    shared one the larger of the two that offload."""
    stages = (SimStage("rollout", 1.0, side="rollout", memory_gb=2.0),
              SimStage("ref_forward", 0.5, inputs=("rollout",), device="gpu", offload=True, load_s=0.25,
                       memory_gb=3.0),
              SimStage("critic_forward", 0.5, inputs=("rollout",), device="gpu", offload=True, load_s=0.25,
                       memory_gb=4.0),
              SimStage("actor_train", 0.1, inputs=("ref_forward", "critic_forward")))
    p = simulate(SimGraph(stages=stages, iterations=1, minibatches=2))
    assert spans(p, "ref_forward") == [(1, 1.75), (2.5, 3.25)]
    assert spans(p, "critic_forward") == [(1.75, 2.5), (3.25, 4)]
    assert p.peak_memory_gb == {"rollout": 2.0, "gpu": 4.0, "actor_train": 0.0}


def test_a_prefetched_onload_overlaps_the_other_members_step():
    """As above with onloads of 0.75 s. ref's first step pays it (1-2.25); critic's first step has
    waited since 1, ref's second (rollout's second mini-batch) only since 2, so critic goes first
    (first come, first served). Without prefetch every turn pays the onload in full: critic
    2.25-3.5, ref 3.5-4.75, critic 4.75-6. With prefetch an onload starts with the step before on
    the device: critic's since 1 (1.25 s before it starts: hidden), 2.25-2.75; ref's since 2.25
    (0.5 s hidden, 0.25 paid), 2.75-3.5; critic's since 2.75 (hidden), 3.5-4."""
    def graph(prefetch: bool) -> SimGraph:
        forwards = [SimStage(name, 0.5, inputs=("rollout",), device="gpu", offload=True, load_s=0.75,
                             prefetch=prefetch) for name in ("ref_forward", "critic_forward")]
        return SimGraph(stages=(SimStage("rollout", 1.0, side="rollout"), *forwards,
                                SimStage("actor_train", 0.1, inputs=("ref_forward", "critic_forward"))),
                        iterations=1, minibatches=2)

    full, pipelined = simulate(graph(False)), simulate(graph(True))
    assert spans(full, "ref_forward") == [(1, 2.25), (3.5, 4.75)]
    assert spans(full, "critic_forward") == [(2.25, 3.5), (4.75, 6)]
    assert spans(pipelined, "ref_forward") == [(1, 2.25), (2.75, 3.5)]
    assert spans(pipelined, "critic_forward") == [(2.25, 2.75), (3.5, 4)]


def test_weights_publish_and_load_delay_the_next_version():
    """k=0, publish 0.5, load 0.25: train 1-3, version 1 loadable at 3.5, rollout 3.5-4.75 (load
    included), train 4.75-6.75."""
    p = simulate(chain(overlap_depth=0, iterations=2, publish_s=0.5, weights_load_s=0.25))
    assert spans(p, "rollout") == [(0, 1), (3.5, 4.75)]
    assert spans(p, "actor_train") == [(1, 3), (4.75, 6.75)]


def test_queue_capacity_holds_the_producer_back():
    """Capacity 1: prompts may not step while its previous output waits for rollout to start:
    prompts 0-0.1, then 0.1-0.2 (rollout started at 0.1), then 1.1-1.2 (rollout's second step
    started at 1.1)."""
    stages = (SimStage("prompts", 0.1, side="rollout"),
              SimStage("rollout", 1.0, inputs=("prompts",), side="rollout"),
              SimStage("actor_train", 0.0, inputs=("rollout",)))
    p = simulate(SimGraph(stages=stages, iterations=1, minibatches=3, queue_capacity=1))
    assert spans(p, "prompts") == [(0, 0.1), (0.1, pytest.approx(0.2)), (pytest.approx(1.1), pytest.approx(1.2))]


def test_a_barrier_behind_a_small_queue_is_reported_not_hung():
    stages = (SimStage("prompts", 0.0, side="rollout"),
              SimStage("rollout", 1.0, inputs=("prompts",), side="rollout"),
              SimStage("actor_train", 1.0, inputs=("rollout",), barrier=True))
    with pytest.raises(ValueError, match="cannot go on"):
        simulate(SimGraph(stages=stages, iterations=1, minibatches=3, queue_capacity=1))


def test_the_same_graph_gives_the_same_prediction():
    graph = sync_or_stream(False)
    assert simulate(graph) == simulate(graph)


@pytest.mark.parametrize(("stages", "message"), [
    ((SimStage("rollout", 1.0), SimStage("rollout", 1.0)), "duplicate"),
    ((SimStage("rollout", 1.0, inputs=("prompts",)), SimStage("actor_train", 1.0)), r"\['prompts'\] are not stages"),
    ((SimStage("rollout", 1.0, inputs=("actor_train",)), SimStage("actor_train", 1.0, inputs=("rollout",))), "cycle"),
    ((SimStage("rollout", 1.0),), "trainer='actor_train'"),
])
def test_bad_graphs_name_the_problem(stages, message):
    with pytest.raises(ValueError, match=message):
        SimGraph(stages=stages, iterations=1, minibatches=1)


def test_negative_costs_name_the_stage_and_field():
    with pytest.raises(ValueError, match=r"rollout.step_s=-1"):
        SimStage("rollout", -1)


def _step_event(stage: str, start_s: float, end_s: float, iteration: int, pid: int) -> dict:
    return {"ph": "X", "cat": "step", "name": stage, "ts": round(start_s * 1e6), "dur": round((end_s - start_s) * 1e6),
            "pid": pid, "tid": 0, "args": {"stage": stage, "iteration": iteration, "minibatch": 0}}


def test_a_profile_keeps_each_steps_cost_alone_on_its_device():
    """ref_forward 1-3 and critic_forward 2-4 share a core: each ran 1 s alone and 1 s at half
    speed, so each costs 1.5 s; rollout (its own core) 0-1 costs 1 s. Arrows give the inputs;
    the publish and load spans the weight costs."""
    names = {1: "rollout-0", 2: "ref_forward-0", 3: "critic_forward-0", 4: "actor_train-0"}
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
              for pid, name in names.items()]
    steps = [_step_event("rollout", 0, 1, 0, 1), _step_event("ref_forward", 1, 3, 0, 2),
             _step_event("critic_forward", 2, 4, 0, 3), _step_event("actor_train", 4, 5, 0, 4)]
    devices = {"ref_forward": "core1", "critic_forward": "core1", "actor_train": "core1"}
    assert exclusive_costs(steps, devices) == [1.0, 1.5, 1.5, 1.0]
    arrows = [("rollout-0", "ref_forward-0"), ("rollout-0", "critic_forward-0"), ("ref_forward-0", "actor_train-0"),
              ("critic_forward-0", "actor_train-0")]
    pid_of = {name: pid for pid, name in names.items()}
    for flow_id, (source, target) in enumerate(arrows):
        events += [{"ph": "s", "id": flow_id, "pid": pid_of[source], "ts": 0, "name": "minibatch"},
                   {"ph": "f", "id": flow_id, "pid": pid_of[target], "ts": 0, "name": "minibatch"}]
    events += steps + [
        {"ph": "X", "cat": "weights", "name": "weights publish", "ts": 5_000_000, "dur": 200_000, "pid": 4, "tid": 0},
        {"ph": "X", "cat": "weights", "name": "weights load", "ts": 5_300_000, "dur": 100_000, "pid": 1, "tid": 0},
    ]
    profile = profile_from_trace(events, devices, rollout_side={"prompts", "rollout"}, skip=0)
    assert profile.step_s == {"rollout": (1.0,), "ref_forward": (1.5,), "critic_forward": (1.5,), "actor_train": (1.0,)}
    assert profile.inputs == {"rollout": (), "ref_forward": ("rollout",), "critic_forward": ("rollout",),
                              "actor_train": ("critic_forward", "ref_forward")}
    assert (profile.publish_s, profile.weights_load_s) == (0.2, 0.1)
    # simulated on the same placement, on-policy: rollout 0-1, ref 1-2.5, critic 2.5-4, train 4-5
    graph = profile.graph(iterations=1, overlap_depth=0, schedule="stream", devices=devices)
    assert spans(simulate(graph), "actor_train") == [(4.0, 5.0)]


def test_costs_per_minibatch_position():
    """A trainer that trains on the iteration's last mini-batch: 0.1 s, then 2 s. k=0: rollout
    0-1, 1-2; train 1-1.1, 2-4 (version 1 at 4); rollout 4-5, 5-6; train 5-5.1, 6-8."""
    stages = (SimStage("rollout", 1.0, side="rollout"), SimStage("actor_train", (0.1, 2.0), inputs=("rollout",)))
    p = simulate(SimGraph(stages=stages, iterations=2, minibatches=2, overlap_depth=0))
    assert spans(p, "actor_train") == [(1, 1.1), (2, 4), (5, 5.1), (6, 8)]
    with pytest.raises(ValueError, match=r"actor_train.step_s: 2 figures for 3 mini-batches"):
        SimGraph(stages=stages, iterations=2, minibatches=3)


def test_contention_slows_steps_that_overlap_other_devices():
    """Contention 0.5, rollout (1 s) and training (2 s) start together on two devices. Rollout is
    overlapped all along: 1.5 s. Training is overlapped for 1.5 of its T seconds:
    T = 2 (1 + 0.5 * 1.5 / T), so T^2 - 2T - 1.5 = 0 and T = 1 + sqrt(2.5) = 2.5811."""
    stages = (SimStage("rollout", 1.0, side="rollout", device="a"), SimStage("actor_train", 2.0, device="b"))
    p = simulate(SimGraph(stages=stages, iterations=1, minibatches=1, contention=0.5))
    assert spans(p, "rollout") == [(0, pytest.approx(1.5, abs=1e-5))]
    assert spans(p, "actor_train") == [(0, pytest.approx(1 + 2.5**0.5, abs=1e-5))]
    alone = simulate(SimGraph(stages=stages, iterations=1, minibatches=1))
    assert spans(alone, "actor_train") == [(0, 2.0)]


def test_contention_fit_recovers_the_slowdown_of_overlapped_steps():
    """Steps of 2 s and 0.5 s bases, each seen at several overlapped fractions with contention
    0.4: the fit finds 0.4 and the bases; steps that never overlap fit 0."""
    groups = [[(base * (1 + 0.4 * f), f) for f in (0.0, 0.25, 0.5, 1.0)] for base in (2.0, 0.5)]
    assert fit_contention(groups) == 0.4
    assert base_cost(groups[0], 0.4) == pytest.approx(2.0)
    assert fit_contention([[(1.0, 0.0), (1.2, 0.0)]]) == 0.0


def test_a_step_alone_runs_faster_on_lent_cores():
    """Lending: rollout (1 s) and training (2 s, 2x faster alone) start together on their sides.
    Training does 1 s of its work while rollout runs, then the other 1 s at 2x: it ends at 1.5.
    A stage off the board (alone_speedup None, like the prompt source) keeps nobody from
    borrowing: training alone all along ends at 1; with lending off it takes its 2 s."""
    def graph(rollout_speedup: float | None, train_speedup: float | None) -> SimGraph:
        return SimGraph(stages=(SimStage("rollout", 1.0, side="rollout", device="a", alone_speedup=rollout_speedup),
                                SimStage("actor_train", 2.0, device="b", alone_speedup=train_speedup)),
                        iterations=1, minibatches=1)

    lent = simulate(graph(1.0, 2.0))
    assert spans(lent, "rollout") == [(0, 1)]
    assert spans(lent, "actor_train") == [(0, pytest.approx(1.5, abs=1e-5))]
    assert spans(simulate(graph(None, 2.0)), "actor_train") == [(0, pytest.approx(1.0, abs=1e-5))]
    assert spans(simulate(graph(None, None)), "actor_train") == [(0, 2.0)]
    with pytest.raises(ValueError, match=r"actor_train.alone_speedup=0.5: must be >= 1"):
        SimStage("actor_train", 2.0, alone_speedup=0.5)


def test_lent_cores_speed_up_a_chain_that_takes_turns():
    """k=0, both sides 2x faster alone: they never overlap, so every step runs alone: rollout
    0-0.5, train 0.5-1.5, rollout 1.5-2, ... 1.5 s an iteration instead of 3."""
    p = simulate(replace(chain(overlap_depth=0), stages=tuple(
        replace(stage, alone_speedup=None if stage.name == "prompts" else 2.0) for stage in chain().stages)), skip=1)
    assert spans(p, "rollout") == [pytest.approx(span, abs=1e-5) for span in [(0, 0.5), (1.5, 2.0), (3.0, 3.5)]]
    assert spans(p, "actor_train") == [pytest.approx(span, abs=1e-5) for span in [(0.5, 1.5), (2.0, 3.0), (3.5, 4.5)]]
    assert p.iteration_s == pytest.approx(1.5, abs=1e-5)


def test_lending_fit_recovers_the_speedup_alone():
    """Train side only (one device): actor_train costs 2 s on its own cores and runs 2x alone.
    Iteration 0: it shares the device with critic_train from 0 to 4 (2 s exclusive each, none
    alone); 1: alone 5-6 (1 s); 2: critic_train shares 7-8 (0.5 s exclusive each), then it is
    alone 8-8.75 (0.75 s: 1.5 s of work): 1.25 s exclusive, 0.6 of it alone. The fit finds 2 and
    the own-core cost 2; critic_train never ran alone (nothing to fit: 1 and absent). Without
    lending the cost is the mean of what the steps took."""
    names = {4: "actor_train-0", 5: "critic_train-0"}
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
              for pid, name in names.items()]
    events += [_step_event("actor_train", 0, 4, 0, 4), _step_event("critic_train", 0, 4, 0, 5),
               _step_event("actor_train", 5, 6, 1, 4),
               _step_event("actor_train", 7, 8.75, 2, 4), _step_event("critic_train", 7, 8, 2, 5)]
    devices = {"actor_train": "train", "critic_train": "train"}
    lent = profile_from_trace(events, devices, rollout_side=set(), skip=0, lending=True)
    assert lent.alone_speedup == {"actor_train": pytest.approx(2.0)}
    assert lent.step_s == {"actor_train": (pytest.approx(2.0),), "critic_train": (pytest.approx(1.25),)}
    plain = profile_from_trace(events, devices, rollout_side=set(), skip=0)
    assert plain.alone_speedup == {} and plain.step_s["actor_train"] == (pytest.approx(4.25 / 3),)
    # two positions of different own-core costs (2 and 0.5), s = 1.6; alone fractions that do not vary: no fit
    positions = [[(base / (1 + 0.6 * a), a) for a in (0.0, 0.25, 0.5, 1.0)] for base in (2.0, 0.5)]
    assert fit_alone_speedup(positions) == pytest.approx(1.6)
    assert fit_alone_speedup([[(1.0, 0.5), (1.2, 0.5)]]) is None


def test_a_profile_stands_for_a_schedule_without_actor_forward():
    """At overlap_depth >= 1 actor_train computes the proximal log-probs itself: actor_forward's
    cost (0.3 s an iteration) moves into the trainer's last position, and back out (as much as
    ref_forward costs) for a schedule that runs it again; any other difference is refused."""
    with_forward = Profile(
        step_s={"rollout": (1.0, 1.0), "ref_forward": (0.1, 0.1), "actor_forward": (0.15, 0.15),
                "actor_train": (0.0, 2.0)}, minibatches=2,
        inputs={"rollout": (), "ref_forward": ("rollout",), "actor_forward": ("rollout",),
                "actor_train": ("actor_forward", "ref_forward", "rollout")},
        rollout_side=frozenset({"rollout"}), publish_s=0.0, weights_load_s=0.0, alone_speedup={"ref_forward": 1.5})
    without = with_forward.for_stages({"rollout", "ref_forward", "actor_train"})
    assert without.step_s == {"rollout": (1.0, 1.0), "ref_forward": (0.1, 0.1), "actor_train": (0.0, 2.3)}
    assert without.inputs["actor_train"] == ("ref_forward", "rollout")
    back = without.for_stages(with_forward.step_s)
    assert list(back.step_s) == ["rollout", "ref_forward", "actor_forward", "actor_train"]
    assert back.step_s["actor_forward"] == (0.1, 0.1) and back.step_s["actor_train"] == (0.0, pytest.approx(2.1))
    assert back.inputs["actor_train"] == ("actor_forward", "ref_forward", "rollout")
    assert back.inputs["actor_forward"] == ("rollout",)
    assert back.alone_speedup == {"ref_forward": 1.5, "actor_forward": 1.5}
    assert with_forward.for_stages(with_forward.step_s) is with_forward
    with pytest.raises(ValueError, match="only actor_forward may differ"):
        with_forward.for_stages({"rollout", "actor_train"})


def _profile(contention: float):
    return Profile(step_s={"prompts": (0.0,), "rollout": (1.0,), "actor_train": (2.0,)}, minibatches=1,
                   inputs={"prompts": (), "rollout": ("prompts",), "actor_train": ("rollout",)},
                   rollout_side=frozenset({"prompts", "rollout"}), publish_s=0.0, weights_load_s=0.0,
                   contention=contention)


def test_search_picks_overlap_when_the_sides_do_not_interfere():
    """Separated, stream k=1: training (2 s) bounds the iteration, rollout (1 s) hides beside it;
    k=2 is as fast, so the smaller depth wins. Colocated, every schedule keeps the one device set
    busy from 0 to 6 x (1 + 2) = 18 s (the window's figure differs where rollout ran ahead of it)."""
    plans = search(_profile(contention=0.0), iterations=6)
    assert plans[0].sets == ["schedule=stream", "overlap_depth=1", "placement.mode=separated",
                             "placement.device_groups={}", "placement.with_rollout=[]"]
    assert plans[0].prediction.iteration_s == pytest.approx(2.0)
    assert [p.prediction.makespan_s for p in plans if p.mode == "colocated"] == pytest.approx([18.0] * 4)
    assert len(plans) == 8  # (sync + stream k=0..2) x 2 modes


def test_search_colocates_when_contention_costs_more_than_overlap_saves():
    """Contention 2, separated, k=1: in the steady state rollout lasts 3 s and training T =
    2 (1 + 2 * 3 / T), T = 1 + sqrt(13) = 4.6 s; the last training step runs alone (2 s). Taking
    turns on one device set (3 s per iteration) is faster."""
    plans = search(_profile(contention=2.0), iterations=6)
    assert plans[0].mode == "colocated"
    overlapped = next(p for p in plans
                      if p.sets[:3] == ["schedule=stream", "overlap_depth=1", "placement.mode=separated"])
    durations = [end - start for start, end in spans(overlapped.prediction, "actor_train")]
    assert durations[3:] == pytest.approx([1 + 13**0.5, 1 + 13**0.5, 2.0], abs=1e-4)
    assert overlapped.prediction.iteration_s > 3.0
