"""Payload plane: tensors of every awkward kind through shared memory and over TCP."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from stream_rlhf.broker import shm
from stream_rlhf.broker.messages import Handle, decode, encode, Publish
from stream_rlhf.broker.payload import MemoryTransport, PayloadError, ShmTransport


def awkward_tensors() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "fp32": torch.randn(3, 5),
        "bf16": torch.randn(7, 3).to(torch.bfloat16),
        "fp16": torch.randn(2, 2).half(),
        "int64": torch.arange(10),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
        "noncontig": base.t(),  # (6, 4) view with strides (1, 6)
        "sliced": base[:, ::2],
    }


def make_handle(fields, handle_id="h") -> Handle:
    handle = Handle(handle_id, "t", 0, 0, 0, 1, fields=fields, producer="p")
    return decode(encode(Publish(handle))).handle  # exactly what crosses the wire


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("prefer", ["auto", "tcp"])
def test_round_trip_awkward_tensors(shm_prefix, prefer):
    producer = ShmTransport(prefix=shm_prefix)
    consumer = ShmTransport(prefix=shm_prefix, serve=False, prefer=prefer)
    try:
        want = awkward_tensors()
        handle = make_handle(producer.put("h", want))
        assert_same(consumer.get(handle), want)
    finally:
        consumer.close()
        producer.close()


def test_local_get_is_zero_copy_and_copy_on_write(shm_prefix):
    producer = ShmTransport(prefix=shm_prefix, serve=False)
    try:
        handle = make_handle(producer.put("h", {"x": torch.zeros(1024)}))
        a = producer.get(handle)["x"]
        b = producer.get(handle)["x"]
        a[0] = 42.0  # a consumer scribbling on its input must not corrupt another consumer's view
        assert b[0].item() == 0.0
        assert a.untyped_storage().data_ptr() != torch.zeros(1).untyped_storage().data_ptr()
    finally:
        producer.close()


def test_release_unlinks_and_mapped_tensors_stay_valid(shm_prefix):
    producer = ShmTransport(prefix=shm_prefix, serve=False)
    handle = make_handle(producer.put("h", {"x": torch.arange(5.0)}))
    got = producer.get(handle)["x"]
    assert len(shm.list_segments(shm_prefix)) == 1
    producer.release("h")
    assert shm.list_segments(shm_prefix) == []
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(PayloadError, match="is gone"):
        producer.get(handle)
    producer.close()


def test_tcp_fetch_of_released_handle_names_it(shm_prefix):
    producer = ShmTransport(prefix=shm_prefix)
    consumer = ShmTransport(prefix=shm_prefix, serve=False, prefer="tcp")
    try:
        handle = make_handle(producer.put("h7", {"x": torch.ones(3)}), "h7")
        producer.release("h7")
        with pytest.raises(PayloadError, match="h7"):
            consumer.get(handle)
    finally:
        consumer.close()
        producer.close()


def test_non_tensor_is_refused_with_a_clear_error(shm_prefix):
    producer = ShmTransport(prefix=shm_prefix, serve=False)
    try:
        with pytest.raises(PayloadError, match="field 'x'.*tensor"):
            producer.put("h", {"x": [1, 2, 3]})
    finally:
        producer.close()


def test_close_unlinks_everything_held(shm_prefix):
    producer = ShmTransport(prefix=shm_prefix, serve=False)
    for i in range(3):
        producer.put(f"h{i}", {"x": torch.ones(10)})
    assert len(shm.list_segments(shm_prefix)) == 3
    producer.close()
    assert shm.list_segments(shm_prefix) == []


def _consume(handle_bytes: bytes, queue) -> None:
    handle = decode(handle_bytes).handle
    consumer = ShmTransport(prefix="unused", serve=False)
    tensors = consumer.get(handle)
    queue.put({k: (str(v.dtype), list(v.shape), v.float().sum().item()) for k, v in tensors.items()})
    consumer.close()


def test_other_process_maps_the_segment(shm_prefix):
    producer = ShmTransport(prefix=shm_prefix, serve=False)
    want = awkward_tensors()
    handle = make_handle(producer.put("h", want))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_consume, args=(encode(Publish(handle)), queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(30)
    producer.close()
    assert child.exitcode == 0
    for name, tensor in want.items():
        assert got[name] == (str(tensor.dtype), list(tensor.shape), pytest.approx(tensor.float().sum().item()))


def test_sweep_reclaims_segments_of_dead_processes_only(shm_prefix):
    live = shm.create(shm.segment_name(shm_prefix, __import__("os").getpid(), 0), 16)
    dead_pid = 2**22 + 12345  # above pid_max on this machine: no such process
    shm.create(shm.segment_name(shm_prefix, dead_pid, 0), 16).close()
    assert shm.sweep(shm_prefix) == 1
    assert [pid for _, pid in shm.list_segments(shm_prefix)] == [__import__("os").getpid()]
    live.close()
    shm.unlink(shm.segment_name(shm_prefix, __import__("os").getpid(), 0))


def test_memory_transport_round_trip():
    transport = MemoryTransport()
    want = awkward_tensors()
    handle = make_handle(transport.put("h", want))
    assert_same(transport.get(handle), want)
    transport.release("h")
    with pytest.raises(PayloadError):
        transport.get(handle)
