"""The megatron engine's offload without a GPU: `HostCopies` moves storages, not tensors, so views
into one buffer (megatron's params and main_grad) survive a round trip bit for bit; and a megatron
engine on a CPU device offloads nothing (its state already lives in host memory). On CUDA:
`test_megatron_cuda.py`."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from stream_rlhf.backends.megatron.offload import HostCopies


def test_storages_round_trip_and_views_into_them_see_every_byte_again():
    buffer = torch.randn(64)  # like a DDP grad buffer: parameters' main_grad are views of it
    views = [buffer[:16].view(4, 4), buffer[16:40], buffer[40:].view(2, 12)]
    alone = torch.randn(3, 5)
    expected = [t.clone() for t in views + [alone]]
    host = HostCopies()
    assert host.offload("grads", views + [alone]) == 64 * 4 + 15 * 4  # each storage once
    assert buffer.untyped_storage().nbytes() == 0 and alone.untyped_storage().nbytes() == 0
    assert host.offload("grads", views) == 0  # already off
    assert host.offload("params", [alone]) == 0  # emptied by another kind: left to it
    assert host.onload("params") == 0
    assert host.onload("grads") == 64 * 4 + 15 * 4
    for tensor, before in zip(views + [alone], expected, strict=True):
        assert torch.equal(tensor, before)
    views[1].add_(1.0)  # the views still alias the buffer
    assert torch.equal(buffer[16:40], expected[1] + 1.0)
    assert host.offload("grads", views) == 64 * 4 and host.onload("grads") == 64 * 4  # and again
    assert torch.equal(buffer[16:40], expected[1] + 1.0)


def _cpu_engine_main(out: str) -> None:
    torch.set_num_threads(1)
    from stream_rlhf.backends.megatron.engine import MegatronTrainEngine
    from stream_rlhf.backends.optimizer_config import OptimizerConfig
    from stream_rlhf.distributed import RankGroup
    from tests.test_megatron_engine import _models
    from tests.test_torch_engine import _experience, _loss

    engine = MegatronTrainEngine(_models()["qwen2"], RankGroup.single(), OptimizerConfig(lr=1e-2))
    exp = _experience()
    engine.train_step(exp, _loss(engine), {"advantages": torch.ones_like(exp.mask)})
    params = list(engine.model.parameters())
    state = params + [p.main_grad for p in params] + engine.optimizer.state_tensors()
    before = [t.clone() for t in state]
    everything = {"params", "grads", "optimizer"}
    moved = [engine.offload(everything), engine.onload(everything)]
    Path(out).write_text(json.dumps({
        "moved": moved, "state": len(state),
        "unchanged": all(torch.equal(a, b) and a.untyped_storage().nbytes() > 0 for a, b in zip(state, before))}))
    os._exit(0)  # no interpreter teardown of megatron's groups


@pytest.mark.slow
def test_offload_on_a_cpu_device_moves_nothing(tmp_path):
    pytest.importorskip("megatron.core", reason="needs the megatron extra: pip install -e '.[megatron]'")
    out = tmp_path / "found.json"
    proc = mp.get_context("spawn").Process(target=_cpu_engine_main, args=(str(out),))  # megatron's state is per process
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    found = json.loads(out.read_text())
    assert found["moved"] == [0, 0]
    assert found["state"] > 0 and found["unchanged"] is True
