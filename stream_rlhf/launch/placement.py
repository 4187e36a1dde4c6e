"""Placement: which cores and devices each stage's ranks run on, checked against this machine.

    placement:                       # `placement: auto` (the default): the driver picks mode,
                                     # with_rollout and device_groups (planner/auto_placement.py)
      mode: separated                # rollout on rollout_cores, the rest on train_cores (CPU)
      device: auto                   # cuda when this machine has a GPU, else cpu
      stages:
        actor_train: {ranks: 2, cores: [0, 1]}      # CPU: the ranks share the cores out
        critic_train: {ranks: 2, devices: [0, 1]}   # CUDA: one device per rank
        ref_forward: {offload: {what: [params], when: step}}   # weights/offload_config.py
      device_groups:                                # stages that share one process per rank
        forwards: [ref_forward, critic_forward]

    ranks = {"actor_train": stage_ranks(placement, "actor_train", rollout_side=False, uses_device=True)}
    preflight(placement, ranks)      # before any process starts: cores, GPUs, device indices

`mode`, `with_rollout` and `device_groups` default to `auto`: the driver chooses them for the
workload before the stages start (`planner/auto_placement.py`); a key given explicitly is kept.
Until then (and for code that builds a config without the driver) an `auto` key reads as its
static fallback (`AUTO_FALLBACK`: separated, nothing with rollout, no groups), and `auto` lists
the keys still to choose.

Cores left out follow the machine: `rollout_cores` and `train_cores` default to halves of the
cores this process may run on (`os.sched_getaffinity`), both the one core of a one-core machine
(`split_cores`). Config checks that need no machine run when the config is built; `preflight`
runs where the stages will run, and raises ConfigError naming the key (a core or device that
does not exist, more ranks than cores or devices, CUDA on a machine without it).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from msgspec import Meta

from stream_rlhf.backends.megatron.config import MegatronConfig, check_ranks
from stream_rlhf.config import ConfigError, check_fields
from stream_rlhf.weights.offload_config import OffloadPolicy


@dataclass(frozen=True)
class StagePlacement:
    """Where one stage's ranks run (`placement.stages.<stage>`)."""

    ranks: Annotated[int, Meta(ge=1)] = 1
    """Processes per instance, one torch.distributed group: a training stage shards its model over
    them (FSDP2), a forward stage splits each mini-batch."""
    devices: list[int] | None = None
    """device cuda: the CUDA device of each rank; None: 0, 1, ... ranks - 1."""
    cores: list[int] | None = None
    """device cpu: the cores the ranks share out (len // ranks each); None: the mode's cores."""
    backend: Literal["torch", "megatron"] = "torch"
    """The train engine of a forward or training stage (`backends/engines.py`): `torch` (HF model,
    FSDP2 over the ranks) or `megatron` (megatron-core, tp x pp over `megatron`, dp the rest of
    the ranks; the `megatron` extra)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """backend megatron: the tensor-, pipeline- and context-parallel sizes (`backends/megatron/config.py`)."""
    offload: OffloadPolicy | None = None
    """What of its model state leaves the device between steps, and when (`weights/offload_config.py`);
    None: nothing (in a device group: everything it holds, when another member takes the device)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.backend == "megatron":
            check_ranks(self.megatron, self.ranks, "megatron")
        elif self.megatron != MegatronConfig():
            raise ConfigError(f"megatron={self.megatron}: backend={self.backend} ignores it (set backend: megatron)")
        if self.devices is not None and len(self.devices) != self.ranks:
            raise ConfigError(f"devices={self.devices}: one device per rank, ranks={self.ranks}")
        if self.devices is not None and len(set(self.devices)) != len(self.devices):
            raise ConfigError(f"devices={self.devices}: two ranks on one device (NCCL needs a device per rank)")
        if self.devices is not None and min(self.devices, default=0) < 0:
            raise ConfigError(f"devices={self.devices}: device indices are >= 0")


AUTO = "auto"
AUTO_FALLBACK: dict[str, Any] = {"mode": "separated", "with_rollout": [], "device_groups": {}}
"""What a key left to `auto` reads as until the driver chose it (module docstring)."""


@dataclass(frozen=True)
class PlacementConfig:
    """Which cores and devices each stage runs on.

    separated: rollout (and the prompt source) on `rollout_cores`, forwards and training on
               `train_cores`; both run at once.
    colocated: every stage on every core of `rollout_cores + train_cores`, taking turns.
    On CUDA (`device`), the models of the torch stages live on the GPUs and the cores only run
    their Python.
    """

    mode: Literal["auto", "separated", "colocated"] = AUTO
    """`separated`: rollout's side and the train side on cores of their own, running at once;
    `colocated`: every stage on every core, taking turns (see above); `auto`: the driver picks
    (planner/auto_placement.py)."""
    rollout_cores: list[int] | None = None
    """None: the first half of the cores this process may run on (at least one; `split_cores`)."""
    train_cores: list[int] | None = None
    """None: the cores left to rollout's; on a one-core machine that same core."""
    broker_cores: list[int] | None = None
    """Cores of the broker process; None: `train_cores` when separated (rollout keeps its core to
    itself), every core when colocated."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the torch stages keep their models: `auto` is cuda when this machine has a GPU."""
    stages: dict[str, StagePlacement] = field(default_factory=dict)
    """Per-stage ranks, cores and devices (stages not named: one rank on the mode's cores)."""
    device_groups: dict[str, list[str]] | Literal["auto"] = AUTO
    """`auto`: the driver picks (none on the CPU, where a group saves no time). Group name -> stages
    that share one process per rank and its device, taking turns (in rank 0's order when they have
    several ranks): a member offloads what its policy says when another takes
    the device (`weights/device_turns.py`)."""
    lend_idle_cores: bool = True
    """separated, on the CPU: a side with no step running lends its cores to the other side's
    running stage (`core_lending.py`); false: each side keeps to its own cores."""
    with_rollout: list[str] | Literal["auto"] = AUTO
    """separated: stages that run on the rollout side's cores, beside prompts and rollout (which
    are there always), e.g. a PPO job's critic_forward and critic_train when answers are short
    (rollout alone leaves its cores idle while two trainers share the train side's). Not used
    when colocated. `auto`: the driver picks from the workload's costs (planner/auto_placement.py)."""
    replan_after: Annotated[int, Meta(ge=0)] = 5
    """After this many trained iterations (a critic warm-up's not counted) the driver compares the
    measured iteration time and answer length with the placement's prediction and says (log,
    summary.json `placement.replan`) when another placement is predicted faster by
    `replan_margin`; 0: never."""
    replan_margin: Annotated[float, Meta(gt=0)] = 0.1
    """How much faster (a fraction of the iteration time) another placement must be predicted for
    the re-plan to name it."""
    replan: Literal["warn", "switch"] = "warn"
    """What the re-plan does with a faster placement: `warn` names it (log, summary.json);
    `switch` also moves the running job to it: the stages drain at the next iteration boundary
    (the trainers checkpoint there) and the job resumes from that checkpoint with the new
    placement, once a run, when the predicted gain over the iterations left outweighs a restart
    (`driver/placement_switch.py`)."""
    auto: tuple[str, ...] = field(init=False, default=())
    """The keys given as `auto` and not chosen yet (each reads as `AUTO_FALLBACK`'s value meanwhile)."""

    def __post_init__(self) -> None:
        check_fields(self)
        left = tuple(key for key in AUTO_FALLBACK if getattr(self, key) == AUTO)
        object.__setattr__(self, "auto", left)
        for key in left:
            object.__setattr__(self, key, copy.copy(AUTO_FALLBACK[key]))
        for name in ("rollout_cores", "train_cores", "broker_cores"):
            _check_core_list(name, getattr(self, name))
        for stage, own in self.stages.items():
            _check_core_list(f"stages.{stage}.cores", own.cores)
        _check_device_groups(self.device_groups, self.stages)
        if self.mode == "separated":
            check_groups_on_one_side(self.device_groups, self.with_rollout)
        # fill in the cores left out from this machine's; frozen, so set once here
        rollout, train = split_cores(machine_cores(), self.rollout_cores, self.train_cores)
        object.__setattr__(self, "rollout_cores", rollout)
        object.__setattr__(self, "train_cores", train)

    def of(self, stage: str) -> StagePlacement:
        """`stage`'s own placement: its entry in `stages`, or the defaults."""
        return self.stages.get(stage, StagePlacement())

    def resolved_device(self) -> Literal["cpu", "cuda"]:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def mode_cores(self, rollout_side: bool) -> list[int]:
        """The cores a stage gets from `mode`: its side's when separated, all when colocated."""
        if self.mode == "colocated":
            return sorted(set(self.rollout_cores) | set(self.train_cores))
        return list(self.rollout_cores if rollout_side else self.train_cores)


@dataclass(frozen=True)
class RankPlacement:
    """One rank of a stage: its torch device, its cores and its torch threads."""

    device: str
    cores: list[int]
    threads: int


def stage_ranks(placement: PlacementConfig, stage: str, rollout_side: bool, uses_device: bool) -> list[RankPlacement]:
    """The ranks of `stage` (`uses_device`: it holds a torch model that can live on a GPU)."""
    own = placement.of(stage)
    cores = own.cores or placement.mode_cores(rollout_side)
    key = f"placement.stages.{stage}"
    on_cuda = uses_device and placement.resolved_device() == "cuda"
    if own.devices is not None and not on_cuda:
        raise ConfigError(f"{key}.devices={own.devices}: CUDA device indices, but this stage runs on the CPU "
                          f"(placement.device={placement.device}); give cores instead")
    if on_cuda:
        devices = own.devices if own.devices is not None else list(range(own.ranks))
        per_rank = [cores] * own.ranks
    else:
        if own.ranks > len(cores):
            raise ConfigError(f"{key}.ranks={own.ranks}: more ranks than its cores {cores} "
                              "(one core at least per rank)")
        share = len(cores) // own.ranks
        per_rank = [cores[r * share:(r + 1) * share] for r in range(own.ranks)]
        devices = None
    return [RankPlacement(f"cuda:{devices[r]}" if devices is not None else "cpu", per_rank[r], len(per_rank[r]))
            for r in range(own.ranks)]


def machine_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def split_cores(available: list[int], rollout: list[int] | None,
                train: list[int] | None) -> tuple[list[int], list[int]]:
    """(rollout cores, train cores): the given ones, and for a side left out (None) its share of
    `available`: with neither given, rollout takes the first half (at least one core) and
    training the rest; with one given, the other takes the cores it leaves. A side that would get
    none (one core, or every core taken) shares the other's."""
    if rollout is None and train is None:
        half = max(1, len(available) // 2)
        return available[:half], available[half:] or available[:half]
    if rollout is None:
        return [c for c in available if c not in train] or list(train), train
    if train is None:
        return rollout, [c for c in available if c not in rollout] or list(rollout)
    return rollout, train


def preflight(placement: PlacementConfig, ranks: dict[str, list[RankPlacement]],
              available: list[int] | None = None) -> None:
    """Check the placement against this machine (where the stages run), before any starts;
    `available`: the cores to check against (default: `machine_cores()`)."""
    available = machine_cores() if available is None else available
    for name in ("rollout_cores", "train_cores", "broker_cores"):
        _check_cores(f"placement.{name}", getattr(placement, name), available)
    for stage, own in placement.stages.items():
        _check_cores(f"placement.stages.{stage}.cores", own.cores, available)
    if placement.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("placement.device=cuda: this machine has no CUDA device (use cpu or auto)")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for stage, placed in ranks.items():
        for rank in placed:
            if rank.device.startswith("cuda:") and int(rank.device[5:]) >= count:
                key = f"placement.stages.{stage}.devices" if stage in placement.stages else f"placement.stages.{stage}"
                raise ConfigError(f"{key}: {rank.device} does not exist (this machine has {count} CUDA device(s)); "
                                  f"ranks={len(placed)} needs that many devices")


def device_group_of(placement: PlacementConfig, stage: str) -> str | None:
    """The device group `stage` belongs to, or None."""
    return next((name for name, members in placement.device_groups.items() if stage in members), None)


def _check_device_groups(groups: dict[str, list[str]], stages: dict[str, StagePlacement]) -> None:
    """Members share one process per rank: the same ranks, cores and devices, each stage in one group;
    megatron members the same tp, pp and cp (megatron keeps its parallel state per process: they
    share its process groups, over which the group's turns run one member at a time)."""
    seen: dict[str, str] = {}
    for name, members in groups.items():
        key = f"device_groups.{name}"
        if len(members) < 2:
            raise ConfigError(f"{key}={members}: a device group hosts two stages or more")
        placed = {m: stages.get(m, StagePlacement()) for m in members}
        for member, _own in placed.items():
            if member in seen:
                raise ConfigError(f"{key}: {member} is in device group {seen[member]} already")
            seen[member] = name
        for field_name in ("ranks", "cores", "devices"):
            values = {m: getattr(own, field_name) for m, own in placed.items()}
            if len({repr(v) for v in values.values()}) > 1:
                raise ConfigError(f"{key}: its stages share one process, so one {field_name} setting: "
                                  + ", ".join(f"stages.{m}.{field_name}={v}" for m, v in values.items()))
        sizes = {m: (own.megatron.tp, own.megatron.pp, own.megatron.cp) for m, own in placed.items()
                 if own.backend == "megatron"}
        if len(set(sizes.values())) > 1:
            named = (f"stages.{m}.megatron={{tp: {tp}, pp: {pp}, cp: {cp}}}" for m, (tp, pp, cp) in sizes.items())
            raise ConfigError(f"{key}: its megatron stages share one process and so megatron's parallel state, "
                              f"so one tp, pp and cp: {', '.join(named)}")


def check_groups_on_one_side(groups: dict[str, list[str]], with_rollout: list[str]) -> None:
    """A device group is one process on one side's cores: with_rollout names all its members or none."""
    for name, members in groups.items():
        moved = [m for m in members if m in with_rollout]
        if moved and len(moved) < len(members):
            raise ConfigError(f"with_rollout={with_rollout}: {', '.join(moved)} of device_groups.{name} would run on "
                              f"rollout's cores, {', '.join(m for m in members if m not in moved)} "
                              "on the train side's, "
                              "but a group's stages share one process: name all of its stages or none")


def _check_core_list(key: str, cores: list[int] | None) -> None:
    if cores is None:
        return
    if not cores:
        raise ConfigError(f"{key}=[]: needs at least one core")
    if min(cores) < 0 or len(set(cores)) != len(cores):
        raise ConfigError(f"{key}={cores}: core numbers are >= 0, each listed once")


def _check_cores(key: str, cores: list[int] | None, available: list[int]) -> None:
    if cores is None:
        return
    missing = [c for c in cores if c not in available]
    if missing:
        raise ConfigError(f"{key}={cores}: cores {missing} are not available to this process (it may run on "
                          f"cores {available}; leave the key out to use them)")
