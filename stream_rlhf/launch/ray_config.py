"""The `ray` section of a job config: where the Ray launcher finds its cluster and places the ranks.

    launcher: ray
    ray:
      address: auto                    # a running cluster (`ray start --head`); null: a local one
      strategy: SPREAD                 # how the placement group spreads the ranks' bundles
      stage_resources:                 # custom resources a stage's bundles ask for: pins stages
        rollout: {rollout_node: 1}     # to the nodes that offer them (`ray start --resources`)
        actor_train: {train_node: 1}
      node_hosts: false                # test/debug: every Ray node counts as a host of its own

A job on a cluster (`address` set) or with `node_hosts` spans hosts (`JobPlan.spans_hosts`): the
driver generates CURVE keys and hands them to the broker and the ranks, which bind their node's
address with them. `node_hosts` exercises the across-hosts paths on one machine (a
`ray.cluster_utils.Cluster` whose nodes all have the IP 127.0.0.1): each node gets a host id of its
own, so a rank on another node than its producer fetches payloads over TCP, rollout and the critic
forward get their weights by broadcast groups, and each node's ranks write a run folder and a weight
store of their own (shipped into the driver's run folder), as on separate machines.

Importing this module never imports Ray (a config with `launcher: local` does not need it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from msgspec import Meta

from stream_rlhf.config import ConfigError, check_fields

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class RayConfig:
    """How `launcher: ray` runs the job's broker and ranks (`launch/ray_job.py`)."""

    address: str | None = None
    """The cluster `ray.init(address=...)` joins ("auto", "HOST:PORT", "ray://HOST:PORT"); None:
    the driver starts a Ray instance of its own on this machine and shuts it down at the end."""
    num_cpus: Annotated[int, Meta(ge=1)] | None = None
    """With `address` None: the CPUs of that local instance; None: Ray's count of this machine's."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """The placement group's strategy over the bundles, one bundle per rank (and the broker's)."""
    stage_resources: dict[str, dict[str, float]] = field(default_factory=dict)
    """Stage (or "broker") -> custom resources each of its bundles asks for, on top of the CPUs and
    GPUs of the plan: a stage lands only on nodes that offer them."""
    start_timeout_s: Annotated[float, Meta(gt=0)] = 120.0
    """How long the placement group may wait for its bundles before the job fails, naming them."""
    node_hosts: bool = False
    """Test/debug setting: treat every Ray node as a host of its own (its own host id, run folder
    and weight store, so no folder or /dev/shm shared with the driver or another node's ranks), so
    that ranks on another node than their peers take the across-hosts paths (payloads over TCP with
    CURVE, weights by broadcast, files shipped to the driver) even when the nodes share one
    machine. Off: the host id is the machine's."""

    @property
    def own_instance(self) -> bool:
        """The ranks run on a Ray instance of this machine the job starts (`address` left out), not a
        cluster: their cores are the plan's, so they keep them (`ray_job._under_ray`)."""
        return self.address is None and not self.node_hosts

    def __post_init__(self) -> None:
        check_fields(self)
        if self.address is not None and not self.address:
            raise ConfigError("ray.address='': leave it out (null) for a local Ray instance")
        if self.num_cpus is not None and self.address is not None:
            raise ConfigError(f"ray.num_cpus={self.num_cpus}: only for a local instance (ray.address is "
                              f"{self.address!r}; the cluster's nodes say how many CPUs they have)")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"ray.strategy={self.strategy!r}: one of {', '.join(STRATEGIES)}")
        for stage, resources in self.stage_resources.items():
            for name, amount in resources.items():
                if name in ("CPU", "GPU", "memory"):
                    raise ConfigError(f"ray.stage_resources.{stage}.{name}: CPUs and GPUs come from the plan "
                                      "(placement); name custom resources here")
                if amount <= 0:
                    raise ConfigError(f"ray.stage_resources.{stage}.{name}={amount}: must be > 0")
