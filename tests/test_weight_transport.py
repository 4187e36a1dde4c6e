"""The transport table (`weights/transport.py`): each transport's sender and receiver, opened from
the table, move a small state dict; shm and broadcast here on the CPU (gloo over loopback),
cuda_ipc on a GPU machine (a receiver in a spawned process on the same GPU). Then the stage side
(`stages/weight_sync.py`) over the table."""

from __future__ import annotations

from dataclasses import replace
from typing import get_args, get_type_hints

import pytest
import torch
from torch import nn

from stream_rlhf.backends.torch_rollout import load_weights
from stream_rlhf.backends.vllm_protocol import receive_update
from stream_rlhf.config import build
from stream_rlhf.resume.store import ResumePoint
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.weight_sync import RolloutWeights, open_sender, trained_parameters
from stream_rlhf.weights.shm_store import WeightStore
from stream_rlhf.weights.sync_config import WeightSyncConfig
from stream_rlhf.weights.transport import TRANSPORTS, Link, groups_folder
from tests.rl_tiny import tiny_job
from tests.weight_receiver import receiver_process

CPU = torch.device("cpu")


def state(version: int, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """A small model's worth of mixed tensors whose values say which version they are."""
    torch.manual_seed(version)
    return [
        ("embed.weight", torch.randn(32, 8, device=device)),
        ("layer.0.weight", torch.randn(8, 8, device=device).bfloat16()),
        ("layer.0.bias", torch.full((8,), float(version), device=device)),
        ("step", torch.tensor([version], dtype=torch.int64, device=device)),
    ]


def assert_same(got: list[tuple[str, torch.Tensor]] | dict[str, torch.Tensor], version: int) -> None:
    got = dict(got)
    expected = dict(state(version))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].cpu(), tensor), name


def link(tmp_path, **overrides) -> Link:
    return replace(Link(str(tmp_path), "actor", str(groups_folder(tmp_path)), "gloo", 1 << 10, 20.0), **overrides)


def test_the_table_holds_every_configurable_transport_and_a_link_is_plain_values(tmp_path):
    assert set(TRANSPORTS) == set(get_args(get_type_hints(WeightSyncConfig)["transport"]))
    made = Link.of(tmp_path, "critic", WeightSyncConfig(bucket_mb=2, timeout_s=5.0))
    assert made == link(tmp_path, model="critic", bucket_bytes=2 << 20, timeout_s=5.0,
                        backend="nccl" if torch.cuda.is_available() else "gloo")
    assert Link.from_json(made.to_json()) == made


def test_shm_round_trips_through_the_store(tmp_path):
    shm = TRANSPORTS["shm"]
    sender = shm.open_sender(link(tmp_path), {"rollout-0": 2})
    receiver = shm.join(link(tmp_path), "rollout-0", 1, 2, CPU)
    assert receiver.receive(0) is None  # nothing published yet
    sender.publish(state(1), version=1)
    version, got = receiver.receive(1)
    assert version == 1
    assert_same(got, 1)
    assert receiver.receive(2) is None  # the store shows what exists: nothing to wait for
    sender.publish(state(2), version=2)
    sender.publish(state(3), version=3)
    version, got = receiver.receive(1)  # the newest, whatever was asked
    assert version == 3
    assert_same(got, 3)
    receiver.close()
    sender.close()


def test_shm_sender_writes_a_version_the_trainer_published_already_once(tmp_path):
    """A trainer's own publish (every tensor, for its forwards) comes first; the transport's publish
    of the same version (the trained tensors only) leaves it as it is."""
    store = WeightStore(tmp_path, "actor")
    store.publish(dict(state(1)), version=1)
    TRANSPORTS["shm"].open_sender(link(tmp_path), {"rollout-0": 2}).publish(state(1)[:1], version=1)
    assert_same(store.load_state(1), 1)


def test_broadcast_round_trips_over_a_gloo_group(tmp_path):
    broadcast = TRANSPORTS["broadcast"]
    sender = broadcast.open_sender(link(tmp_path), {"rollout-0": 2})
    try:
        receiver = broadcast.join(link(tmp_path), "rollout-0", 1, 2, CPU)
        sender.publish(state(1), version=1)
        version, got = receiver.receive(1)
        assert version == 1
        assert_same(got, 1)
        sender.publish(state(2), version=2)
        version, got = receiver.receive(2)
        assert version == 2
        assert_same(got, 2)
        receiver.close()
    finally:
        sender.close()


def test_cuda_ipc_takes_one_receiver_rank_per_group(tmp_path):
    with pytest.raises(ValueError, match=r"cuda_ipc: groups \{'rollout-0': 3\}: one receiver rank per group"):
        TRANSPORTS["cuda_ipc"].open_sender(link(tmp_path), {"rollout-0": 3})


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device; runs on a GPU machine")
def test_cuda_ipc_round_trips_to_a_process_on_the_same_gpu(tmp_path):
    sender = TRANSPORTS["cuda_ipc"].open_sender(link(tmp_path), {"rollout-0": 2})
    try:  # the receiver meets the sender where the table's join does: the folder beside the store
        with receiver_process(groups_folder(tmp_path), "rollout-0", transport="cuda_ipc", timeout_s=30.0) as receiver:
            receiver.joined(timeout_s=60.0)
            sender.publish(state(1, "cuda"), version=1)
            receiver.ask(min_version=1)
            version, got = receiver.answer(timeout_s=60.0)
            assert version == 1
            assert_same(got, 1)
    finally:
        sender.close()


@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_rollout_weights_load_the_newest_version_through_the_jobs_transport(tmp_path, transport):
    """The stage side (`stages/weight_sync.py`): the trainer publishes to its store and through
    `weights.transport`; a rollout instance loads the newest version once it is newer than the one
    it holds, whichever transport carries it."""
    job = JobContext(build(RLJobConfig, tiny_job(tmp_path, "sync", weights={"transport": transport,
                                                                              "timeout_s": 20.0})),
                     "unused", str(tmp_path / "weights"))
    trainer, rollout = nn.Linear(4, 3), nn.Linear(4, 3)
    store = WeightStore(job.weights_root, "actor")
    sender = open_sender(job)
    weights = RolloutWeights(job, "rollout-0")
    try:
        weights.join_model(rollout)
        assert weights.refresh_model(rollout, 0) == 0  # nothing newer than what it holds
        for version in (1, 2):
            with torch.no_grad():
                trainer.bias.fill_(version)
            store.publish(trainer, version)  # the trainer's own publish comes first (its forwards read it)
            sender.publish(trained_parameters(trainer), version)
        assert weights.refresh_model(rollout, 0) == 2
        assert torch.equal(rollout.bias, trainer.bias) and torch.equal(rollout.weight, trainer.weight)
        assert weights.refresh_model(rollout, 2) == 2
        assert weights.engine_update(1) == receive_update(2) and weights.engine_update(2) is None
    finally:
        weights.close()
        sender.close()


def test_a_resumed_rollout_whose_store_lacks_the_checkpoints_version_takes_it_by_broadcast(tmp_path):
    """A resumed run's rollout on another host than the trainer (its host's store empty: the driver
    put the checkpoint's version in its own): the checkpoint's version is the newest it knows of, so
    it loads that version from the resumed trainer's send instead of generating with the warm start."""
    cfg = build(RLJobConfig, tiny_job(tmp_path, "resumed", weights={"transport": "broadcast", "timeout_s": 20.0}))
    job = JobContext(cfg, "unused", str(tmp_path / "weights"), resume=ResumePoint(4, tmp_path / "iter-000004"))
    trainer, rollout = nn.Linear(4, 3), nn.Linear(4, 3)
    sender = open_sender(job)
    weights = RolloutWeights(job, "rollout-0")
    try:
        weights.join_model(rollout)
        assert weights.store.latest_version() == -1 and weights.newest() == 4
        with torch.no_grad():
            trainer.bias.fill_(4.0)
        sender.publish(trained_parameters(trainer), 4)  # the resumed trainer's first send (`_restore`)
        assert weights.refresh_model(rollout, 0) == 4
        assert torch.equal(rollout.bias, trainer.bias) and torch.equal(rollout.weight, trainer.weight)
    finally:
        weights.close()
        sender.close()


def test_shm_receives_tied_tensors_once_and_loading_them_fills_both_names(tmp_path):
    """As the broadcast transport sends them: one copy of a tied embedding per version loaded."""
    def tied(value: float) -> nn.Module:
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight
        with torch.no_grad():
            model[0].weight.fill_(value)
        return model

    WeightStore(tmp_path, "actor").publish(tied(3.0), version=1)
    version, named = TRANSPORTS["shm"].join(link(tmp_path), "rollout-0", 1, 2, CPU).receive(1)
    assert version == 1 and len(named) == 1  # the tied pair, stored and received once
    rollout = tied(0.0)
    load_weights(rollout, named, "rollout-0")
    assert (rollout[1].weight == 3.0).all() and rollout[1].weight is rollout[0].weight
