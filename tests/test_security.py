"""Loopback by default; CURVE required beyond it; handshake refusals are clear and fatal."""

from __future__ import annotations

import threading

import pytest
import zmq

from stream_rlhf.broker import sockets
from stream_rlhf.broker.client import ControlClient, HandshakeError
from stream_rlhf.broker.messages import SCHEMA_VERSION, Error, Hello, decode, encode
from stream_rlhf.broker.runner import StageRunner
from stream_rlhf.broker.stage import Stage
from stream_rlhf.broker.topology import BrokerConfig, CurveConfig, needs_curve
from tests.broker_process import broker_process

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("address,needs", [
    ("tcp://127.0.0.1:5555", False), ("tcp://localhost:1", False), ("tcp://[::1]:1", False),
    ("ipc:///tmp/x", False), ("tcp://0.0.0.0:5555", True), ("tcp://10.1.2.3:5555", True),
    ("tcp://eth0:5555", True), ("tcp://*:5555", True),
])
def test_what_counts_as_loopback(address, needs):
    assert needs_curve(address) is needs


def test_router_refuses_to_bind_beyond_loopback_without_keys():
    context = zmq.Context()
    with pytest.raises(sockets.CurveKeyError, match="CURVE keys are required"):
        sockets.router(context, "tcp://0.0.0.0:*", None, 1024)
    context.term()


def test_missing_key_file_is_named(tmp_path):
    context = zmq.Context()
    with pytest.raises(sockets.CurveKeyError, match="broker.key_secret"):
        sockets.router(context, "tcp://0.0.0.0:*", str(tmp_path), 1024)
    context.term()


def test_curve_broker_admits_only_authorized_clients(tmp_path):
    keys = sockets.generate_keys(tmp_path / "keys")
    stranger = sockets.generate_keys(tmp_path / "stranger")  # a key pair the broker never saw
    config = BrokerConfig(address="tcp://0.0.0.0:*", curve=CurveConfig(str(keys)), shm_prefix="curve")
    with broker_process(config) as (process, address):
        local = address.replace("0.0.0.0", "127.0.0.1")
        with ControlClient(local, str(keys)) as client:
            assert client.stats()["instances"] == 1
        with pytest.raises(HandshakeError):
            ControlClient(local, str(stranger), timeout_s=2)
        with pytest.raises(HandshakeError):
            ControlClient(local, None, timeout_s=2)  # plaintext against a CURVE server
        assert process.is_alive()


def test_runner_without_keys_against_a_curve_broker_fails_and_never_hangs(tmp_path):
    """The broker never answers a plaintext peer, so the runner's io thread sat in a send with
    its socket open and `Context.term()` waited for it for ever after the HandshakeError."""
    keys = sockets.generate_keys(tmp_path / "keys")
    config = BrokerConfig(address="tcp://0.0.0.0:*", curve=CurveConfig(str(keys)), shm_prefix="curvehang")
    with broker_process(config) as (process, address):
        runner = StageRunner(Stage(), "src", "src-0", address.replace("0.0.0.0", "127.0.0.1"), handshake_timeout_s=1)
        failures: list[Exception] = []

        def run() -> None:
            try:
                runner.run()
            except HandshakeError as exc:
                failures.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the runner hung after its failed handshake"
        assert len(failures) == 1 and "are the CURVE keys right?" in str(failures[0])
        assert process.is_alive()


def test_wrong_schema_version_is_a_fatal_refusal_naming_both_versions():
    with broker_process(BrokerConfig(address="tcp://127.0.0.1:*", shm_prefix="schema")) as (_, address):
        context = zmq.Context()
        sock = sockets.dealer(context, address, "old-stage", None)
        sock.send(encode(Hello(SCHEMA_VERSION + 1, "src", "old-stage")))
        assert sock.poll(5000)
        reply = decode(sock.recv())
        sock.close()
        context.term()
    assert isinstance(reply, Error) and reply.fatal and reply.code == "schema"
    assert f"{SCHEMA_VERSION + 1}" in reply.reason and f"{SCHEMA_VERSION}" in reply.reason


def test_runner_of_unknown_stage_fails_with_the_brokers_reason():
    with broker_process(BrokerConfig(address="tcp://127.0.0.1:*", shm_prefix="unknown")) as (_, address):
        runner = StageRunner(Stage(), "nobody", "nobody-0", address, handshake_timeout_s=10)
        with pytest.raises(HandshakeError, match="'nobody' is not in the topology"):
            runner.run()


def test_runner_without_broker_times_out_naming_the_address(free_port):
    address = f"tcp://127.0.0.1:{free_port}"
    runner = StageRunner(Stage(), "src", "src-0", address, handshake_timeout_s=1)
    with pytest.raises(HandshakeError, match=f"no READY from broker {address} within 1"):
        runner.run()
