"""CUDA IPC weight sync: the handle records and the no-CUDA errors here; the real transfer (a
sender here, a receiver in a spawned process on the same GPU) on a GPU machine."""

from __future__ import annotations

import json

import pytest
import torch

from stream_rlhf.weights.cuda_ipc import (
    FIXED,
    REBUILD_PARAMETERS,
    CudaIpcReceiver,
    CudaIpcSender,
    handle_record,
    rebuild_args,
)
from tests.weight_receiver import receiver_process

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA IPC needs a CUDA device; runs on a GPU machine")


def fake_args() -> tuple:
    """What reduce_tensor gives for a 64-byte uint8 bucket, with made-up handles."""
    values = {
        "tensor_cls": torch.Tensor, "tensor_size": torch.Size([64]), "tensor_stride": (1,), "tensor_offset": 0,
        "storage_cls": torch.storage.TypedStorage, "dtype": torch.uint8, "storage_device": 3,
        "storage_handle": bytes(range(64)), "storage_size_bytes": 2 << 20, "storage_offset_bytes": 512,
        "requires_grad": False, "ref_counter_handle": b"/torch_123_456", "ref_counter_offset": 7,
        "event_handle": b"\x00\xff" * 32, "event_sync_required": True,
    }
    return tuple(values[name] for name in REBUILD_PARAMETERS)


def test_handle_record_is_json_and_rebuilds_the_arguments_on_the_receivers_device():
    args = fake_args()
    record = json.loads(json.dumps(handle_record(args)))
    kwargs = rebuild_args(record, device_index=0)
    expected = dict(zip(REBUILD_PARAMETERS, args), storage_device=0)
    assert kwargs == expected
    assert all(kwargs[key] is value for key, value in FIXED.items())


def test_handle_record_refuses_what_is_not_a_plain_uint8_bucket():
    args = dict(zip(REBUILD_PARAMETERS, fake_args()))
    with pytest.raises(ValueError, match="dtype=torch.float32: buckets must have torch.uint8"):
        handle_record(tuple({**args, "dtype": torch.float32}.values()))
    with pytest.raises(ValueError, match=r"fields .*; expected"):
        rebuild_args({"storage_handle": None}, device_index=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_without_cuda_both_ends_say_what_is_missing(tmp_path):
    with pytest.raises(RuntimeError, match="CudaIpcSender: CUDA IPC needs a CUDA device"):
        CudaIpcSender(tmp_path, ["rollout-0"], bucket_bytes=1 << 20, timeout_s=1.0)
    with pytest.raises(RuntimeError, match="CudaIpcReceiver: CUDA IPC needs a CUDA device"):
        CudaIpcReceiver.join(tmp_path, "rollout-0", timeout_s=1.0)


def weights(version: int) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(version)
    return [
        ("embed.weight", torch.randn(256, 32, device="cuda")),
        ("layer.0.weight", torch.randn(32, 32, device="cuda").bfloat16()),
        ("step", torch.tensor([version], dtype=torch.int64, device="cuda")),
    ]


@pytest.mark.slow
@pytest.mark.gpu
@needs_cuda
def test_receiver_process_gets_the_newest_version_through_ipc(tmp_path):
    sender = CudaIpcSender(tmp_path, ["rollout-0"], bucket_bytes=16 << 10, timeout_s=30.0)
    try:
        with receiver_process(tmp_path, "rollout-0", transport="cuda_ipc", timeout_s=30.0) as receiver:
            receiver.joined(timeout_s=60.0)
            sender.publish(weights(1), version=1)
            receiver.ask()
            version, got = receiver.answer(timeout_s=60.0)
            assert version == 1
            for name, tensor in weights(1):
                assert torch.equal(got[name], tensor.cpu()), name
            sender.publish(weights(2), version=2)
            sender.publish(weights(3), version=3)
            receiver.ask(min_version=3)
            version, got = receiver.answer()
            assert version == 3
            for name, tensor in weights(3):
                assert torch.equal(got[name], tensor.cpu()), name
    finally:
        sender.close()
