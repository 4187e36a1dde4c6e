"""Searching schedules and placements with the simulator: which `--set`s make a job fastest.

    plans = search(profile, iterations=8)        # profile: calibrate.py, from a run's trace
    plans[0].sets        # ["schedule=stream", "overlap_depth=1", "placement.mode=separated",
                         #  "placement.device_groups={}", "placement.with_rollout=[critic_forward, critic_train]"]
    plans[0].prediction  # simulator.py: iteration_s, bubble ratio, busy fractions, staleness, memory
    kept, dropped = within_memory(plans, limit_mb=2500)   # plans predicted over the limit left out

Candidates are every schedule x overlap depth x placement mode x device groups x train-side
stages on rollout's cores the engine runs:

    sync             overlap_depth 0 (its barriers already serialise the phases)
    stream           overlap_depth 0 .. max_overlap_depth
    separated        the rollout side (driver/dataflow.py ROLLOUT_SIDE) on one device set, every other
                     stage on the other; steps of the two slow each other by the profile's contention
    colocated        every stage on one device set, one step at a time, no contention
    no groups        a process per stage
    forwards         the job's forward stages in one process (`placement.device_groups`)
    forwards, trainers   and actor and critic training in another
    with_rollout     separated only: which train-side stages run on rollout's cores
                     (`placement.with_rollout`, `with_rollout_candidates`): none, critic_train, the
                     critic's two stages, the forwards, the forwards and critic_train (those the job
                     has, each set once: at most 5, so up to 6 placements per grouping where there
                     were 2); a pair the config refuses (a device group split between the sides) is
                     left out

A device group's stages share a device set already (the config requires it), so on the CPU a
group changes no step's cost: it saves a runtime per process left out (`memory.py`) and, on CUDA,
device memory (one member's model on the device at a time), and pays the profile's onload
seconds whenever a member takes the device from another. Not modelled: a grouped stage borrows no
idle cores from the other side (`placement.lend_idle_cores` lends to stages of their own process
only), and fewer processes contend less for two cores: on text_ppo (8 iterations, this 2-core
VM) the forwards and trainers grouped ran 0.89 and 0.91 s per iteration against 0.93 and 1.02 s
separate, where the profile of the first separate run predicts 0.98 s for both.

Separated plans lend idle cores between the sides (`placement.lend_idle_cores`, the default):
a stage whose speed-up alone the profile could fit (`Profile.alone_speedup`, from a run that lent
cores) runs that much faster while it is the only one in a step; the others keep their costs.
Colocated plans use the profile's costs as they are (no lending there; a step's cost on every
core is not measured apart). Plans are ranked by predicted iteration time; ties go to the
smaller overlap depth (less staleness), then to fewer groups (what the time does not pay for is
left as it is), then to the order above (fewer stages moved to rollout's cores first).

Which side a stage's steps count on for the figures and the sync barriers is the dataflow's
(`Profile.rollout_side`: prompts and rollout); `with_rollout` moves only its cores.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from stream_rlhf.config import ConfigError
from stream_rlhf.launch.placement import check_groups_on_one_side
from stream_rlhf.planner.calibrate import Profile
from stream_rlhf.planner.simulator import Prediction, simulate
from stream_rlhf.rl.stage_kinds import STAGE_KINDS

Mode = Literal["separated", "colocated"]
MODES: tuple[Mode, ...] = ("separated", "colocated")
Groups = Mapping[str, Sequence[str]]
"""`placement.device_groups`: group name -> its stages."""
Moved = tuple[str, ...]
"""`placement.with_rollout`: train-side stages on rollout's cores when separated."""


@dataclass(frozen=True)
class Plan:
    schedule: Literal["stream", "sync"]
    overlap_depth: int
    mode: Mode
    prediction: Prediction
    groups: Groups = field(default_factory=dict)
    ranks: Mapping[str, int] = field(default_factory=dict)
    """Per stage, its devices (`rank_search.py`: rollout instances, ranks of the others, separated:
    on the devices after rollout's); {}: one each, where the config puts them."""
    with_rollout: Moved = ()
    """Separated: the train-side stages on rollout's cores (`placement.with_rollout`)."""

    @property
    def sets(self) -> list[str]:
        """The `--set` lines that make a config run this plan (the groups in YAML's flow style)."""
        spread = []
        first = self.ranks.get("rollout", 0) if self.mode == "separated" else 0  # the train side's devices follow
        for stage, n in self.ranks.items():
            if stage == "rollout" and n > 1:
                spread.append(f"rollout.instances={n}")
            elif stage in STAGE_KINDS and STAGE_KINDS[stage].groupable and (n > 1 or first):
                spread += [f"placement.stages.{stage}.ranks={n}",
                           f"placement.stages.{stage}.devices=[{', '.join(map(str, range(first, first + n)))}]"]
        return [f"schedule={self.schedule}", f"overlap_depth={self.overlap_depth}", f"placement.mode={self.mode}",
                groups_set(self.groups), with_rollout_set(self.with_rollout), *spread]


def groups_set(groups: Groups) -> str:
    """The `--set` line of `placement.device_groups`, in YAML's flow style."""
    listed = ", ".join(f"{name}: [{', '.join(members)}]" for name, members in groups.items())
    return f"placement.device_groups={{{listed}}}"


def with_rollout_set(moved: Moved) -> str:
    """The `--set` line of `placement.with_rollout`."""
    return f"placement.with_rollout=[{', '.join(moved)}]"


def with_rollout_candidates(stages: Iterable[str]) -> list[Moved]:
    """The train-side stages tried on rollout's cores (module docstring), those the job has, in
    `STAGE_KINDS` order, each set once, none first."""
    present = set(stages)
    forwards = {stage for stage, kind in STAGE_KINDS.items() if stage in present and kind.work == "forward"}
    wanted = [set(), {"critic_train"}, {"critic_forward", "critic_train"}, forwards, forwards | {"critic_train"}]
    candidates: list[Moved] = []
    for names in wanted:
        moved = tuple(stage for stage in STAGE_KINDS if stage in names & present)
        if moved not in candidates:
            candidates.append(moved)
    return candidates


def fits(groups: Groups, moved: Moved) -> bool:
    """The placement's own check (`launch/placement.py`): no device group split between the sides."""
    try:
        check_groups_on_one_side({name: list(members) for name, members in groups.items()}, list(moved))
    except ConfigError:
        return False
    return True


def device_group_candidates(stages: Iterable[str]) -> list[dict[str, list[str]]]:
    """No groups; the forwards in one group; and the trainers in another (each where the job has
    two stages or more for it)."""
    present = set(stages)
    joinable = [stage for stage, kind in STAGE_KINDS.items() if stage in present and kind.device_group]
    forwards = [stage for stage in joinable if STAGE_KINDS[stage].work == "forward"]
    trainers = [stage for stage in joinable if STAGE_KINDS[stage].trains]
    candidates: list[dict[str, list[str]]] = [{}]
    if len(forwards) > 1:
        candidates.append({"forwards": forwards})
    if len(trainers) > 1:
        candidates.append({**candidates[-1], "trainers": trainers})
    return candidates


def devices_of(profile: Profile, mode: Mode, with_rollout: Collection[str] = ()) -> dict[str, str]:
    """Stage -> device set under a placement mode; separated, the rollout side and `with_rollout`
    on rollout's cores (driver/dataflow.py `on_rollout_cores`' rule, for a profile without its config)."""
    if mode == "colocated":
        return {stage: "all cores" for stage in profile.step_s}
    rollout_cores = profile.rollout_side | set(with_rollout)
    return {stage: "rollout cores" if stage in rollout_cores else "train cores" for stage in profile.step_s}


def predict(profile: Profile, iterations: int, schedule: Literal["stream", "sync"], overlap_depth: int,
            mode: Mode, groups: Groups | None = None, with_rollout: Collection[str] = ()) -> Prediction:
    graph = profile.graph(iterations=iterations, overlap_depth=overlap_depth, schedule=schedule,
                          devices=devices_of(profile, mode, with_rollout), groups=groups,
                          lending=mode == "separated")
    if mode == "colocated":  # one device set: nothing runs beside a step to slow it
        graph = replace(graph, contention=0.0)
    return simulate(graph)


def search(profile: Profile, iterations: int, max_overlap_depth: int = 2, modes: tuple[Mode, ...] = MODES,
           groups: Sequence[Groups] | None = None, with_rollout: Sequence[Moved] | None = None) -> list[Plan]:
    """Every candidate (module docstring), best first; `groups`: the device groups to try
    (None: `device_group_candidates` of the profile's stages); `with_rollout`: the stages on
    rollout's cores to try when separated (None: `with_rollout_candidates`)."""
    candidates: list[tuple[Literal["stream", "sync"], int]] = [("sync", 0)]
    candidates += [("stream", depth) for depth in range(max_overlap_depth + 1)]
    tried = device_group_candidates(profile.step_s) if groups is None else groups
    moves = with_rollout_candidates(profile.step_s) if with_rollout is None else with_rollout
    plans = [Plan(schedule, depth, mode, predict(profile, iterations, schedule, depth, mode, grouping, moved), grouping,
                  with_rollout=moved)
             for grouping, mode, moved in placement_candidates(tried, modes, moves) for schedule, depth in candidates]
    order = {id(plan): position for position, plan in enumerate(plans)}
    return sorted(plans, key=lambda plan: (round(plan.prediction.iteration_s, 9), plan.overlap_depth,
                                           order[id(plan)]))


def placement_candidates(groups: Sequence[Groups], modes: Sequence[Mode],
                         with_rollout: Sequence[Moved]) -> list[tuple[Groups, Mode, Moved]]:
    """(device groups, mode, stages on rollout's cores) of every placement tried, in the order ties
    go by: each grouping, each mode, separated with each `with_rollout` that leaves the groups
    whole (`fits`), colocated with none."""
    return [(grouping, mode, moved) for grouping in groups for mode in modes
            for moved in (with_rollout if mode == "separated" else [()])
            if mode == "colocated" or fits(grouping, moved)]


def within_memory(plans: list[Plan], limit_mb: float | None) -> tuple[list[Plan], int]:
    """The plans whose predicted host memory is at most `limit_mb` (None: every plan), in order,
    and how many were left out."""
    if limit_mb is None:
        return plans, 0
    unknown = [plan for plan in plans if plan.prediction.peak_host_mb is None]
    if unknown:
        raise ValueError("the profile has no memory figures (its run's summary has no memory block)")
    kept = [plan for plan in plans if (mb := plan.prediction.peak_host_mb) is not None and mb <= limit_mb]
    return kept, len(plans) - len(kept)
