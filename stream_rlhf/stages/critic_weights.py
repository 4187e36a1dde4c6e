"""The critic's versions from critic_train to critic_forward when they may run on different hosts.

    sender = open_critic_sender(job)               # critic_train's leader; None on one host
    sender.publish(weights.items(), version)       # after publishing the version to its own store

    relay = CriticRelay.join(job, ctx.group)       # every critic_forward rank; None on one host
    relay.fetch(min_version, store, ctx)           # in await_inputs: into this host's store

On one host critic_forward reads each version from the /dev/shm store critic_train publishes to.
When the launcher names an address book (`weights/address_book.py`: ranks on several hosts), the
versions also go by a broadcast group ("critic_forward-0": critic_train's leader, then each
critic_forward rank) and the forward's leader writes each one it receives into its own host's
store, where every rank loads it as before (`engine.refresh`); on the trainer's own host the
version is there already and is not written twice. Every rank asks for the same versions (what
each batch needs: `critic_forward.py`; a collective); a drain while waiting aborts the step. A
restarted critic_forward joins the group anew (`weights/broadcast.py`), so it restarts as on one
host.
Both ends are the broadcast transport's (`weights/transport.py`: the protocol rollout's use too),
the only one of the table that crosses hosts.
"""

from __future__ import annotations

from stream_rlhf.distributed import RankGroup
from stream_rlhf.stage import StageContext, StepAborted
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.weights.address_book import launcher_book
from stream_rlhf.weights.group import WeightSyncClosed
from stream_rlhf.weights.shm_store import WeightStore
from stream_rlhf.weights.transport import TRANSPORTS, Link, WeightReceiver, WeightSender

GROUP = "critic_forward-0"
"""The critic's group (critic_forward has one instance); rollout's groups are `rollout-<i>`."""
ACROSS_HOSTS = TRANSPORTS["broadcast"]
CRITIC = "critic"
"""The store (and link) of the critic's versions."""


def critic_forward_ranks(job: JobContext) -> int:
    placement = job.config.placement.stages.get("critic_forward")
    return placement.ranks if placement is not None else 1


def crosses_hosts() -> bool:
    """The launcher named an address book: the critic's versions go by broadcast."""
    return launcher_book() is not None


def open_critic_sender(job: JobContext) -> WeightSender | None:
    if not crosses_hosts():
        return None
    ranks = critic_forward_ranks(job)
    names = ["critic_train (critic sender)", *(f"critic_forward rank {r}" for r in range(ranks))]
    return ACROSS_HOSTS.open_sender(Link.of(job.weights_root, CRITIC, job.config.weights), {GROUP: 1 + ranks},
                                   rank_names={GROUP: names})


class CriticRelay:
    """A critic_forward rank's receiver; see the module docstring."""

    def __init__(self, receiver: WeightReceiver):
        self.receiver = receiver
        self.received = 0

    @classmethod
    def join(cls, job: JobContext, group: RankGroup) -> CriticRelay | None:
        if not crosses_hosts():
            return None
        link = Link.of(job.weights_root, CRITIC, job.config.weights)
        return cls(ACROSS_HOSTS.join(link, GROUP, 1 + group.rank, 1 + critic_forward_ranks(job), group.device))

    def fetch(self, min_version: int, store: WeightStore, ctx: StageContext) -> None:
        """Receive a critic of version >= `min_version` unless one was received already; the
        leader writes it into `store` when that lacks it."""
        if self.received >= min_version:
            return
        try:
            received = self.receiver.receive(min_version, stop=ctx.stopping)
        except (WeightSyncClosed, RuntimeError) as exc:
            if ctx.stopping.is_set():
                raise StepAborted(f"stopping while waiting for critic version {min_version}") from exc
            raise
        if received is None:
            raise RuntimeError(f"critic version >= {min_version}: the critic's transport had none to give")
        version, named = received
        self.received = version
        if ctx.group.is_leader and store.latest_version() < version:
            store.publish({name: tensor.clone() for name, tensor in named}, version)  # views of one buffer

    def close(self) -> None:
        self.receiver.close()
