"""What the simulator runs: the dataflow of one job as stages with step costs, devices and memory.

    graph = SimGraph(stages=(
        SimStage("prompts", side="rollout", step_s=0.001, device="core0"),
        SimStage("rollout", inputs=("prompts",), side="rollout", step_s=1.5, device="core0"),
        SimStage("actor_train", inputs=("rollout",), step_s=3.0, device="core1"),
    ), iterations=6, minibatches=2, overlap_depth=1)
    result = simulate(graph)          # simulator.py

Words as in the rest of the project: an *iteration* trains one policy version; it has
`minibatches` mini-batches; a *step* is one stage's work on one mini-batch. Every stage steps
once per mini-batch of every iteration, in order (one instance per stage: a group of ranks is one
stage whose `step_s` is the group's). A stage with several `inputs` joins them: its step on a
mini-batch waits for each input stage's step on that mini-batch (the broker's `experience`
join). Steps of the stages that share a `device` run one at a time (a device group; on the CPU,
the cores those stages share).

Memory, for the figures (`memory.py`): every process carries the runtime (`SimGraph.runtime_mb`)
plus what its stages hold in host memory (`host_mb`); the stages of one `process` (a device group,
`placement.device_groups`) share one runtime. `memory_gb` is device memory (CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Side = Literal["rollout", "train"]


@dataclass(frozen=True)
class SimStage:
    name: str
    step_s: float | tuple[float, ...]
    """Seconds per step (one mini-batch), the group's when it has several ranks; or one figure per
    mini-batch position of an iteration (a trainer that keeps its optimizer steps for the last)."""
    inputs: tuple[str, ...] = ()
    """Stages whose step on the same mini-batch this one waits for (several: a join)."""
    side: Side = "train"
    """For the figures: the rollout side (prompts, vision prefetch, rollout) or the train side."""
    device: str = ""
    """The device set it runs on; "" (the default): a device of its own."""
    barrier: bool = False
    """The `sync` schedule's phase barrier: its steps of iteration i start only once its input
    stages finished every mini-batch of iteration i."""
    memory_gb: float = 0.0
    """What it holds on its device: parameters, plus gradients and optimizer state for a trainer,
    plus the KV cache for rollout."""
    offload: bool = False
    """It leaves its device between steps (resident only while it steps); see `load_s`."""
    load_s: float = 0.0
    """With `offload`: seconds to bring it back, paid when the step before on its device (in a
    device group: in its process) was another stage's."""
    prefetch: bool = False
    """With `offload`: the onload starts when the step before on its device starts (pipelined
    offload: it overlaps the other member's compute), so only what outlasts that step is paid."""
    process: str = ""
    """The device group whose one process it runs in (its members share that process, a device
    and turns on it, and offload when another member takes the device); "": processes of its own."""
    processes: int = 1
    """Without `process`: how many processes it runs (instances x ranks)."""
    host_mb: float = 0.0
    """Host memory its processes hold beyond the runtime each carries (`SimGraph.runtime_mb`),
    summed over them."""
    alone_speedup: float | None = None
    """Core lending (`placement.lend_idle_cores`): None, it is not on the core board (lending off,
    the prompt source, a device group's member): it borrows nothing and its steps keep no other
    stage from borrowing; a figure >= 1: it is on the board, and while no other stage on the board
    is in a step its step runs this many times faster (on the other side's cores too). `step_s`
    is then the cost on its own cores."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("SimStage.name: must not be empty")
        costs = self.step_s if isinstance(self.step_s, tuple) else (self.step_s,)
        for field_name, values in (("step_s", costs), ("memory_gb", (self.memory_gb,)), ("load_s", (self.load_s,)),
                                   ("host_mb", (self.host_mb,))):
            if not values or min(values) < 0:
                raise ValueError(f"{self.name}.{field_name}={getattr(self, field_name)}: must be >= 0")
        if self.name in self.inputs:
            raise ValueError(f"{self.name}.inputs: a stage cannot wait for itself")
        if self.processes < 1:
            raise ValueError(f"{self.name}.processes={self.processes}: must be >= 1")
        if self.alone_speedup is not None and self.alone_speedup < 1:
            raise ValueError(f"{self.name}.alone_speedup={self.alone_speedup}: must be >= 1 (or None)")


@dataclass(frozen=True)
class SimGraph:
    stages: tuple[SimStage, ...]
    iterations: int
    minibatches: int
    overlap_depth: int = 1
    """Rollout's step of iteration i waits until policy version >= i - overlap_depth is published."""
    rollout: str = "rollout"
    """The stage the staleness bound gates, and which loads each new policy version."""
    trainer: str = "actor_train"
    """Its last step of iteration i publishes policy version i + 1."""
    publish_s: float = 0.0
    """From the end of the trainer's last step of an iteration to the version being loadable."""
    weights_load_s: float = 0.0
    """Added to rollout's first step on a newer version than its previous step's."""
    queue_capacity: int = 64
    """A stage steps only while fewer than this many of its outputs wait for a consumer to start."""
    contention: float = 0.0
    """Slowdown of a step while steps of other devices run (all devices on one host): it lasts
    step_s * (1 + contention * the fraction of its time they ran); 0: devices do not interfere."""
    runtime_mb: float | None = None
    """Host memory every stage process carries (interpreter, torch, the stage runner); None: the
    job's memory is not known (no figures)."""
    other_mb: float = 0.0
    """Host memory of the job's processes that run no stage (the broker, the launcher's fork server)."""

    def __post_init__(self) -> None:
        names = [stage.name for stage in self.stages]
        for stage in self.stages:
            if isinstance(stage.step_s, tuple) and len(stage.step_s) != self.minibatches:
                raise ValueError(f"{stage.name}.step_s: {len(stage.step_s)} figures for {self.minibatches} "
                                 "mini-batches per iteration")
        if len(set(names)) != len(names):
            raise ValueError(f"stages: duplicate names in {names}")
        for stage in self.stages:
            unknown = [name for name in stage.inputs if name not in names]
            if unknown:
                raise ValueError(f"{stage.name}.inputs: {unknown} are not stages ({', '.join(names)})")
        for role in ("rollout", "trainer"):
            if getattr(self, role) not in names:
                raise ValueError(f"{role}={getattr(self, role)!r}: not a stage ({', '.join(names)})")
        if self.iterations < 1 or self.minibatches < 1:
            raise ValueError(f"iterations={self.iterations}, minibatches={self.minibatches}: must be >= 1")
        if self.overlap_depth < 0 or self.queue_capacity < 1 or self.contention < 0:
            raise ValueError(f"overlap_depth={self.overlap_depth}, queue_capacity={self.queue_capacity}, "
                             f"contention={self.contention}: must be >= 0, >= 1 and >= 0")
        devices = {}
        for stage in self.stages:
            if stage.process and devices.setdefault(stage.process, stage.device) != stage.device:
                raise ValueError(f"{stage.name}.device={stage.device!r}: process {stage.process!r} runs on "
                                 f"{devices[stage.process]!r} (a device group's stages share its device)")
        self.order()  # raises on a cycle

    @property
    def lending(self) -> bool:
        """Some stage borrows idle cores (`SimStage.alone_speedup` above 1)."""
        return any((stage.alone_speedup or 1.0) > 1 for stage in self.stages)

    def step_s(self, name: str, minibatch: int) -> float:
        cost = self.stage(name).step_s
        return cost[minibatch] if isinstance(cost, tuple) else cost

    def stage(self, name: str) -> SimStage:
        return next(stage for stage in self.stages if stage.name == name)

    def consumers(self, name: str) -> list[str]:
        return [stage.name for stage in self.stages if name in stage.inputs]

    def order(self) -> list[str]:
        """The stages, each after its inputs (ties: as listed); ValueError on a cycle."""
        done: list[str] = []
        waiting = list(self.stages)
        while waiting:
            ready = [stage for stage in waiting if all(name in done for name in stage.inputs)]
            if not ready:
                raise ValueError(f"stages: the inputs of {[s.name for s in waiting]} form a cycle")
            done.append(ready[0].name)
            waiting.remove(ready[0])
        return done
