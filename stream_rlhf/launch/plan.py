"""The job plan: a config compiled once, in the driver, into everything a launcher carries out.

    plan = compile_plan(cfg, ...)     # driver/plan.py for RL jobs; dataflow configs wrap their Dataflow
    print(plan.describe())            # which stage on which node, cores and device; what was left out
    json.dumps(plan.as_dict())        # the same, for tools (`stream-rlhf plan CONFIG --json`)
    launcher = make_launcher(plan)    # launch/launcher.py: local processes or Ray actors

A plan is plain typed data: the dataflow (topics, stage specs, admission, the broker's settings),
one `RankPlan` per process (its stage, instance, rank, device, cores and the share of CPUs it
reserves), the warm-start checkpoint and the dataset the driver prepared (or will), and the checks
run before anything starts. Nothing in it starts a process. A plan that spans hosts carries the
job's CURVE keys, which the launcher hands to the broker and each rank (never printed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from stream_rlhf.broker.control.admission import OverlapAdmission, PhaseAdmission
from stream_rlhf.broker.control.topology import BrokerConfig, Topology
from stream_rlhf.broker.sockets import CurveKeys
from stream_rlhf.launch.placement import machine_cores
from stream_rlhf.launch.ray_config import RayConfig
from stream_rlhf.launch.spec import StageSpec

BROKER = "broker"
"""The broker's name among the plan's processes (and in `ray.stage_resources`)."""


@dataclass(frozen=True)
class Dataflow:
    """What the broker and the stage processes are built from."""

    topology: Topology
    broker: BrokerConfig
    stages: dict[str, StageSpec]
    admission: OverlapAdmission | PhaseAdmission | None
    broker_cores: list[int] | None = None
    left_out: dict[str, str] = field(default_factory=dict)
    """Stages this config does not need, with the reason (the plan's "left out" lines, and the run's summary)."""
    trace_folder: str | None = None
    """Where every process appends its trace events (`telemetry/trace.py`); None: `trace: false`."""
    device_groups: dict[str, list[str]] = field(default_factory=dict)
    """Group name -> the stages that run in one process and take turns on its device."""


@dataclass(frozen=True)
class RankPlan:
    """One process of the job: a rank of a stage instance (or the broker)."""

    stage: str
    instance: str
    """`<stage>-<index>`, or "broker"."""
    rank: int
    device: str
    """The torch device (`cpu`, `cuda:N`); under Ray, `cuda:N` becomes the GPU Ray assigns."""
    cores: list[int] | None
    """The cores it is pinned to by the local launcher (None: every core)."""
    threads: int | None
    """torch intra-op threads (None: torch's default)."""
    cpus: float
    """Its share of the CPUs: of each of its cores, a part for every process pinned to that core
    (core sets may overlap: a two-rank stage's ranks on one core each beside processes on both),
    so the job asks for no more CPUs than its cores (the CPUs of its Ray bundle)."""
    gpus: float
    """Its share of its GPU: 1 divided among every process on the same device (0 on the CPU)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources its bundle asks for (`ray.stage_resources`): the nodes it may land on."""

    @property
    def name(self) -> str:
        """The process's name in logs and failures: the instance id for rank 0."""
        return self.instance if self.rank == 0 else f"{self.instance}.rank{self.rank}"

    def node(self, launcher: str) -> str:
        if launcher == "local":
            return "this machine"
        return "a node with " + ", ".join(f"{k}={v:g}" for k, v in sorted(self.resources.items())) \
            if self.resources else "any node"


def _share(amount: float, among: int) -> float:
    """`amount` split `among` processes, rounded down to Ray's 4 decimals (never more than there is)."""
    return math.floor(amount / among * 1e4) / 1e4


@dataclass(frozen=True)
class JobPlan:
    name: str
    flow: Dataflow
    launcher: Literal["local", "ray"] = "local"
    ray: RayConfig = field(default_factory=RayConfig)
    checkpoint: str | None = None
    """The Hugging Face folder RL starts from (warm start, `model.path` or a resumed checkpoint)."""
    checkpoint_ready: bool = True
    """False: the driver has still to make it (the warm start is not cached yet)."""
    dataset: dict[str, str] = field(default_factory=dict)
    """Where the prompts come from: `train` / `eval` files, or `task` for in-memory prompts."""
    dataset_ready: bool = True
    checks: list[str] = field(default_factory=list)
    """The checks run on the driver's machine before anything starts, one line each."""
    keys: CurveKeys | None = field(default=None, repr=False)
    """The job's CURVE keys, made by the driver when the plan spans hosts (`spans_hosts`); the
    launcher hands them to the broker and every rank, which then use CURVE even on loopback."""
    run_dir: str | None = None
    """The driver's run folder, the one the user sees. A rank on another host writes into a run
    folder of its host instead, which the launcher ships back into this one (`launch/ray_hosts.py`)."""
    weights_root: str | None = None
    """The folder of the weight versions in the driver host's /dev/shm; a rank on another host gets
    `<it>-<host tag>` of its own."""
    relocate: str | None = None
    """"package.module:function" giving a stage spec the run folder and weight root of another
    host (`(spec, run_dir, weights_root) -> spec`): what in its arguments names them."""
    host_inputs: str | None = None
    """"package.module:function" naming what a stage's ranks on another host read from the driver's
    run folder before they start (`(stage, spec) -> [path relative to run_dir]`: a resumed run's
    checkpoint parts), which the launcher copies into that host's run folder first."""
    same_host: list[tuple[str, str, str]] = field(default_factory=list)
    """(stage, stage, why): pairs whose ranks must share a host (the launcher refuses a placement
    that splits them, naming the pair and why)."""
    placement_auto: dict[str, Any] | None = None
    """What `placement: auto` chose for the keys the config left to it, why, and the predicted
    iteration time (`planner/auto_placement.py` `PlacementChoice.as_dict`, with its `summary`
    line); None: every placement key was given."""

    @property
    def spans_hosts(self) -> bool:
        """Ranks may run on other hosts than the driver's: a Ray cluster, or `ray.node_hosts`."""
        return self.launcher == "ray" and (self.ray.address is not None or self.ray.node_hosts)

    def ranks(self) -> list[RankPlan]:
        """Every process of the job, the broker first, with its share of the CPUs."""
        every = machine_cores()
        placed: list[tuple[str, str, int, str, list[int] | None, int | None]] = [
            (BROKER, BROKER, 0, "cpu", self.flow.broker_cores, None)]
        grouped = {member: group for group, members in self.flow.device_groups.items() for member in members}
        for stage, spec in self.flow.stages.items():
            if stage in grouped:
                if self.flow.device_groups[grouped[stage]][0] == stage:  # the group's process (one a rank)
                    group = grouped[stage]
                    placed += [(group, f"{group}-0", rank, spec.device(rank), spec.cores_of(rank), spec.threads)
                               for rank in range(spec.ranks)]
                continue
            for index in range(spec.instances):
                for rank in range(spec.ranks):
                    placed.append((stage, f"{stage}-{index}", rank, spec.device(rank), spec.cores_of(rank),
                                   spec.threads))
        on_core: dict[int, int] = {}  # core -> the processes pinned to it (core sets may overlap)
        on_device: dict[str, int] = {}
        for _, _, _, device, cores, _ in placed:
            for core in set(cores if cores is not None else every):
                on_core[core] = on_core.get(core, 0) + 1
            on_device[device] = on_device.get(device, 0) + 1
        out = []
        for stage, instance, rank, device, cores, threads in placed:
            cpus = sum(1 / on_core[core] for core in set(cores if cores is not None else every))
            gpus = _share(1, on_device[device]) if device.startswith("cuda") else 0.0
            out.append(RankPlan(stage, instance, rank, device, cores, threads, _share(cpus, 1), gpus,
                                self.resources_of(stage)))
        return out

    def resources_of(self, unit: str) -> dict[str, float]:
        """The custom Ray resources of a stage's bundles (`ray.stage_resources`); of a device group's
        one bundle, every resource any of its members asks for (the most of each)."""
        wanted: dict[str, float] = {}
        for stage in self.flow.device_groups.get(unit, [unit]):
            for name, amount in self.ray.stage_resources.get(stage, {}).items():
                wanted[name] = max(amount, wanted.get(name, 0.0))
        return wanted

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (`stream-rlhf plan --json`)."""
        topics = {name: {k: v for k, v in (("producers", t.producers), ("consumers", t.consumers), ("join", t.join),
                                            ("capacity", t.capacity)) if v}
                  for name, t in self.flow.topology.topics.items()}
        ranks = [{"process": r.name, "stage": r.stage, "instance": r.instance, "rank": r.rank,
                  "node": r.node(self.launcher), "device": r.device, "cores": r.cores, "threads": r.threads,
                  "cpus": r.cpus, "gpus": r.gpus, "resources": r.resources}
                 | ({"hosts": self.flow.device_groups[r.stage]} if r.stage in self.flow.device_groups else {})
                 for r in self.ranks()]
        out: dict[str, Any] = {
            "name": self.name, "launcher": self.launcher,
            "checkpoint": {"path": self.checkpoint, "ready": self.checkpoint_ready},
            "dataset": {**self.dataset, "ready": self.dataset_ready},
            "broker": {"address": self.flow.broker.address,
                       "curve": self.flow.broker.curve is not None or self.keys is not None},
            "topics": topics, "ranks": ranks, "stages_left_out": dict(self.flow.left_out), "checks": list(self.checks),
        }
        if self.placement_auto is not None:
            out["placement_auto"] = self.placement_auto
        if self.launcher == "ray":
            out["ray"] = {"address": self.ray.address or "local instance", "strategy": self.ray.strategy,
                          "bundles": len(ranks), "spans_hosts": self.spans_hosts, "node_hosts": self.ray.node_hosts}
        return out

    def describe(self) -> str:
        """The plan as a human reads it: one line per process, then topics, left-out stages, checks."""
        data = self.as_dict()
        lines = [f"job {self.name}: launcher {self.launcher}"
                 + (f" ({data['ray']['address']}, {data['ray']['bundles']} bundles, {self.ray.strategy})"
                    if self.launcher == "ray" else "")]
        if self.checkpoint is not None:
            lines.append(f"  starts from {self.checkpoint}"
                         + ("" if self.checkpoint_ready else " (not there yet: the driver warm-starts it once)"))
        if self.dataset:
            lines.append("  prompts: " + ", ".join(f"{k} {v}" for k, v in self.dataset.items())
                         + ("" if self.dataset_ready else " (not written yet: the driver writes them once)"))
        if self.placement_auto is not None:
            lines.append(f"  {self.placement_auto['summary']}")
        lines.append(f"  {'process':<22} {'node':<24} {'device':<8} {'cores':<10} {'threads':>7} {'cpus':>6}")
        for r in data["ranks"]:
            cores = "all" if r["cores"] is None else ",".join(map(str, r["cores"]))
            lines.append(f"  {r['process']:<22} {r['node']:<24} {r['device']:<8} {cores:<10} "
                         f"{r['threads'] if r['threads'] is not None else '-':>7} {r['cpus']:>6.2f}"
                         + (f"  hosts {', '.join(r['hosts'])}" if "hosts" in r else ""))
        for stage, spec in self.flow.stages.items():
            if spec.offload is not None:
                lines.append(f"  offload: {stage}: {spec.offload.describe()}")
        lines.append("  topics:")
        for name, topic in data["topics"].items():
            source = f"join({', '.join(topic['join'])})" if "join" in topic else ", ".join(topic["producers"])
            lines.append(f"    {name:<12} {source} -> {', '.join(topic.get('consumers', [])) or '(joined only)'}")
        for stage, why in data["stages_left_out"].items():
            lines.append(f"  left out: {stage}: {why}")
        lines += [f"  checked: {check}" for check in self.checks]
        return "\n".join(lines)
