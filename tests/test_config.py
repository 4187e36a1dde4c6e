"""Config: every bad key or value fails before anything starts, naming the dotted key."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream_rlhf.config import ConfigError, build, load_config
from stream_rlhf.job import JobConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

GOOD = {
    "name": "t",
    "topics": {
        "items": {"producers": ["src"], "consumers": ["sink"]},
    },
    "stages": {
        "src": {"cls": "tests.stages:CountingSource", "kwargs": {"n": 3}},
        "sink": {"cls": "tests.stages:Sink", "kwargs": {"path": "x", "expected": 3}},
    },
}


def with_(path: str, value):
    import copy

    data = copy.deepcopy(GOOD)
    node = data
    *parents, last = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return data


def test_good_config_builds():
    cfg = build(JobConfig, GOOD)
    assert cfg.topology.inputs_of("sink") == ["items"]
    assert cfg.broker.address == "tcp://127.0.0.1:*"


@pytest.mark.parametrize("path,value,message", [
    ("broker.queue_capacity", 0, "broker.queue_capacity=0: must be >= 1"),
    ("broker.queue_capacity", "8", "broker.queue_capacity='8': expected int"),
    ("broker.heartbeat_timeout_s", 0.5, "broker.heartbeat_timeout_s=0.5: must be >= 2"),
    ("broker.colour", "red", "broker.colour: unknown key"),
    ("broker.address", "tcp://0.0.0.0:5555", "requires curve.key_dir"),
    ("stages.src.instances", 0, "stages.src.instances=0: must be >= 1"),
    ("stages.src.cls", "no_colon", "stages.src.cls='no_colon'"),
    ("topics.items.consumers", [], "topics.items.consumers=[]: no consumer"),
    ("topics.loop", {"join": ["loop2"], "consumers": ["sink"]}, "is not a topic"),
    ("overlap_depth", -1, "overlap_depth=-1: must be >= 0"),
    ("topics.items.producers", "src", "topics.items.producers='src': expected a list"),
    ("broker.heartbeat_interval_s", float("nan"), "broker.heartbeat_interval_s=nan: must be a finite number"),
    ("broker.handshake_timeout_s", float("inf"), "broker.handshake_timeout_s=inf: must be a finite number"),
    ("broker.handshake_timeout_s", "soon", "broker.handshake_timeout_s='soon': expected float"),
])
def test_bad_values_name_the_key(path, value, message):
    with pytest.raises(ConfigError, match=__import__("re").escape(message)):
        build(JobConfig, with_(path, value))


def test_join_cycle_is_refused():
    data = with_("topics.a", {"join": ["b"], "consumers": ["sink"]})
    data["topics"]["b"] = {"join": ["a"], "consumers": ["sink"]}
    with pytest.raises(ConfigError, match="cycle"):
        build(JobConfig, data)


def test_overrides_and_yaml_errors(tmp_path):
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    cfg = load_config(JobConfig, path, ["broker.queue_capacity=3", "overlap_depth=0"])
    assert (cfg.broker.queue_capacity, cfg.overlap_depth) == (3, 0)
    with pytest.raises(ConfigError, match="broker.queue_capacity=-3"):
        load_config(JobConfig, path, ["broker.queue_capacity=-3"])
    # YAML 1.1 reads 2e1 (no dot) as a string: a float key takes it as the number it means
    assert load_config(JobConfig, path, ["broker.handshake_timeout_s=2e1"]).broker.handshake_timeout_s == 20.0
    with pytest.raises(ConfigError, match=r"--set broker.queue_capacity: the value '\[3' is not valid YAML"):
        load_config(JobConfig, path, ["broker.queue_capacity=[3"])
    path.write_text("name: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(JobConfig, path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="the top level is a list, expected a mapping"):
        load_config(JobConfig, path, ["a.b=1"])


def test_shipped_configs_load():
    cfg = load_config(JobConfig, CONFIGS / "broker_demo.yaml")
    assert cfg.topology.topics["experience"].join == ["rollout", "ref_logp", "reward"]
