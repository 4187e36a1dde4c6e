"""`launcher: ray`: the tiny RL job as Ray actors, on a local Ray instance and on clusters of two
and three nodes on this machine (`ray.cluster_utils.Cluster`; stages pinned to nodes by custom
resources).

Ray is heavy on a 2-core machine, so these are few and slow; each stops the Ray processes it
started, also when it fails, and checks that none is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stream_rlhf.resume.store import CheckpointStore
from stream_rlhf.telemetry.metrics import read_metrics
from tests.rl_tiny import tiny_job, write_job

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
pytestmark = pytest.mark.slow
LOOPBACK = "127.0.0.1"
PLACED = re.compile(r"ray: (\S+) on node (\w+) \(([\d.]+), pid (\d+)")


def raylets() -> set[int]:
    ps = subprocess.run(["ps", "-e", "-o", "pid=,args="], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in ps.splitlines() if "ray/raylet/raylet" in line}


def reward_workers() -> list[str]:
    """Command lines of reward worker processes (`rl/reward_worker.py`) still running."""
    ps = subprocess.run(["ps", "-e", "-o", "args="], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "stream_rlhf.rl.reward_worker" in line]


def alive(pid: int, wait_s: float = 10.0) -> bool:
    """The process is still running `wait_s` from now (a killed actor's worker takes a moment to exit)."""
    deadline = time.monotonic() + wait_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _running(pid)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def start_job(tmp_path: Path, name: str, *sets: str, **overrides) -> tuple[subprocess.Popen, Path]:
    data = tiny_job(tmp_path, name, broker={"shm_prefix": f"t_{name}"}, launcher="ray", **overrides)
    config = write_job(tmp_path / f"{name}.yaml", data)
    log = tmp_path / f"{name}.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "stream_rlhf.cli", "run", str(config),
                                    *(x for s in sets for x in ("--set", s))],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return process, log


def start_training(tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """A long job on a local Ray instance, once its first iteration has been trained."""
    process, log_file = start_job(tmp_path, name, "placement.mode=separated", "iterations=200", ray={"num_cpus": 2})
    deadline = time.monotonic() + 180
    while (time.monotonic() < deadline and process.poll() is None
           and not (tmp_path / name / "metrics.jsonl").is_file()):
        time.sleep(0.5)
    assert process.poll() is None, log_file.read_text()[-4000:]
    return process, log_file


def finish(process: subprocess.Popen, timeout: float) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGINT)  # the driver drains and stops what it started
        process.wait(timeout=60)
        raise


def run_job(tmp_path: Path, name: str, timeout: float, *sets: str, **overrides) -> tuple[int, str]:
    process, log = start_job(tmp_path, name, *sets, **overrides)
    return finish(process, timeout), log.read_text()


def assert_accounting(run_dir: Path, iterations: int = 2) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == iterations
    assert summary["samples_generated"] == iterations * 2 * 8
    assert summary["samples_generated"] == (summary["samples_trained"] + summary["samples_dropped"]
                                            + summary["samples_in_flight_at_stop"])
    assert summary["samples_trained"] == summary["samples_generated"] and summary["samples_dropped"] == 0
    return summary


def placed(log: str) -> dict[str, tuple[str, int]]:
    """process name -> (Ray node id, pid), from the launcher's log lines."""
    return {m[0]: (m[1], int(m[3])) for m in PLACED.findall(log)}


def test_ray_job_on_a_local_instance_trains_every_sample_it_generated(tmp_path):
    """With the reward function in 2 processes of the reward stage's Ray actor (reward.workers)."""
    before = raylets()
    code, log = run_job(tmp_path, "rayjob", 300, "placement.mode=separated", "reward.workers=2", ray={"num_cpus": 2})
    assert code == 0, log[-4000:]
    assert_accounting(tmp_path / "rayjob")
    assert "reward.function stream_rlhf.data.arithmetic:reward in 2 processes" in log
    assert not reward_workers()  # they ended with the actor
    where = placed(log)
    assert set(where) == {"broker", "prompts-0", "rollout-0", "ref_forward-0", "reward_forward-0",
                          "critic_forward-0", "actor_train-0", "critic_train-0"}
    assert len({node for node, _ in where.values()}) == 1
    plan = json.loads((tmp_path / "rayjob" / "plan.json").read_text())  # the plan the launcher carried out
    assert plan["launcher"] == "ray" and {r["process"] for r in plan["ranks"]} == set(where)
    assert not [name for name, (_, pid) in where.items() if alive(pid)]  # no actor outlived the job
    assert raylets() <= before  # the Ray instance the job started is gone
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("t_rayjob")]


def test_a_ray_job_whose_broker_dies_fails_at_once_naming_it(tmp_path):
    """The broker's actor is killed mid-job: no rank can drain without it, so the driver kills
    them at once (not after the stop grace) and fails naming the broker; nothing is left running."""
    before = raylets()
    process, log_file = start_training(tmp_path, "nobroker")
    where = placed(log_file.read_text())
    os.kill(where["broker"][1], signal.SIGKILL)
    assert finish(process, 120) != 0
    log = log_file.read_text()
    assert "the broker failed while" in log and "its Ray worker died" in log, log[-4000:]
    assert "cannot drain without the broker: killing its actor" in log
    assert "ignored shutdown" not in log  # no rank waited out the stop grace
    assert not [name for name, (_, pid) in where.items() if alive(pid)]
    assert raylets() <= before
    left = [n for n in os.listdir("/dev/shm") if n.startswith("t_nobroker")]  # the killed ranks' segments
    assert not left, (left, where, log[-3000:])  # whose segment (a pid in `where`?) and the driver's last words


@pytest.fixture
def two_nodes():
    """A head node offering `rollout_node` and a second offering `train_node` (100 of each: a bundle asks
    for one), one CPU each."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"rollout_node": 100},
                                                            "include_dashboard": False})
    try:
        train = cluster.add_node(num_cpus=1, resources={"train_node": 100})
        cluster.wait_for_nodes(timeout=60)
        yield cluster, cluster.head_node.node_id, train.node_id
    finally:
        cluster.shutdown()


def test_ray_job_across_two_nodes_runs_each_stage_where_its_resources_are(tmp_path, two_nodes):
    """Each stage's actor on the node its resources name; a Ray worker of a stage killed with
    SIGKILL is restarted on its node while its stage has restarts left, then the job fails naming
    it and stops every actor. (A whole run across nodes: the three-host tests below.)"""
    cluster, rollout_node, train_node = two_nodes
    on_rollout, on_train = {"rollout_node": 1}, {"train_node": 1}
    resources = {"prompts": on_rollout, "rollout": on_rollout, "broker": on_train, "ref_forward": on_train,
                 "reward_forward": on_train, "critic_forward": on_train, "actor_train": on_train,
                 "critic_train": on_train}
    ray_settings = {"address": cluster.address, "strategy": "SPREAD", "stage_resources": resources,
                    "start_timeout_s": 60}
    process, log_file = start_job(tmp_path, "killed", "placement.mode=separated", "placement.rollout_cores=[0]",
                                  "placement.train_cores=[1]", "iterations=200", "restarts={rollout: 1}",
                                  "checkpoint.recoveries=0", ray=ray_settings)
    deadline = time.monotonic() + 180
    while (time.monotonic() < deadline and process.poll() is None
           and not (tmp_path / "killed" / "metrics.jsonl").is_file()):
        time.sleep(0.5)
    first = placed(log_file.read_text())
    assert "rollout-0" in first and process.poll() is None, log_file.read_text()[-4000:]
    assert {first["prompts-0"][0], first["rollout-0"][0]} == {rollout_node}
    assert {first[n][0] for n in first if n not in ("prompts-0", "rollout-0")} == {train_node}
    assert len(first) == 8
    os.kill(first["rollout-0"][1], signal.SIGKILL)
    while time.monotonic() < deadline and placed(log_file.read_text())["rollout-0"] == first["rollout-0"]:
        time.sleep(0.5)
    again = placed(log_file.read_text())["rollout-0"]
    assert again != first["rollout-0"] and again[0] == rollout_node, log_file.read_text()[-4000:]
    assert "rollout-0 failed (its Ray worker died" in log_file.read_text()  # ... restarting it in 0.5s
    os.kill(again[1], signal.SIGKILL)
    assert finish(process, 120) == 1
    log = log_file.read_text()
    assert "job killed failed: stage instance(s) failed: rollout-0: its Ray worker died" in log, log[-4000:]
    pids = [pid for _, pid in first.values()] + [again[1]]
    assert not [pid for pid in pids if alive(pid)]  # no actor outlived the job


def test_a_device_group_runs_as_one_ray_actor_and_trains_every_sample(tmp_path):
    """`placement.device_groups` under Ray: the three forwards run in one actor (one bundle) taking
    turns, every generated sample is trained, and no actor or raylet outlives the job."""
    before = raylets()
    forwards = ["ref_forward", "reward_forward", "critic_forward"]
    code, log = run_job(tmp_path, "raygroup", 300, "placement.mode=separated", ray={"num_cpus": 2},
                        **{"placement.device_groups": {"forwards": forwards}})
    assert code == 0, log[-4000:]
    summary = assert_accounting(tmp_path / "raygroup")
    where = placed(log)
    assert set(where) == {"broker", "prompts-0", "rollout-0", "forwards-0", "actor_train-0", "critic_train-0"}
    assert f"forwards-0: {', '.join(forwards)} in one process" in log  # run_device_group, in the actor's worker
    plan = json.loads((tmp_path / "raygroup" / "plan.json").read_text())
    assert plan["ray"]["bundles"] == 6 and {r["process"] for r in plan["ranks"]} == set(where)
    assert next(r for r in plan["ranks"] if r["process"] == "forwards-0")["hosts"] == forwards
    # the members with a model took turns on the device: each moved its model off for the others
    assert set(summary["offload"]) == {"ref_forward", "critic_forward"}, summary["offload"]
    assert all(moved["offloads"] >= 1 for moved in summary["offload"].values()), summary["offload"]
    assert not [name for name, (_, pid) in where.items() if alive(pid)]  # no actor outlived the job
    assert raylets() <= before
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("t_raygroup")]


@pytest.fixture(scope="module")
def three_hosts():
    """Three nodes on 127.0.0.1, one CPU each, offering `rollout_node`, `forwards_node` and
    `train_node`: with `ray.node_hosts` each is a host of its own. One cluster for the tests
    below (the last of this module: a local Ray instance started while it runs could meet it);
    each test's job is a driver of its own, whose actors end with it."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as patch:
        # the driver's ray.init would turn the cluster's 127.0.0.1 into this machine's address
        patch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"rollout_node": 100},
                                                                "include_dashboard": False,
                                                                "node_ip_address": LOOPBACK})
        try:
            nodes = [cluster.add_node(num_cpus=1, resources={name: 100}, node_ip_address=LOOPBACK)
                     for name in ("forwards_node", "train_node")]
            cluster.wait_for_nodes(timeout=60)
            yield cluster, [cluster.head_node.node_id, *(node.node_id for node in nodes)]
        finally:
            cluster.shutdown()


ON_THREE_HOSTS = {stage: {f"{host}_node": 1} for host, stages in (
    ("rollout", ("prompts", "rollout")), ("forwards", ("ref_forward", "reward_forward", "critic_forward")),
    ("train", ("broker", "actor_train", "critic_train"))) for stage in stages}
"""ray.stage_resources placing the tiny PPO job on `three_hosts`: rollout, the forwards, the trainers."""


def trace_events(run_dir: Path, name: str) -> dict[str, list[dict]]:
    """process -> its trace events called `name`, from every process's events file."""
    out: dict[str, list[dict]] = {}
    for path in (run_dir / "trace_events").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("name") == name:
                out.setdefault(event["pid"], []).append(event)
    return out


@pytest.mark.timeout(600)
def test_ppo_across_three_hosts_fetches_payloads_over_tcp_and_sends_weights_by_broadcast(tmp_path, three_hosts):
    """Rollout, the forwards and the trainers each on a host of their own (`ray.node_hosts`): the
    broker and payload servers use the keys the driver made, every consumer on another host than
    its producer fetches over TCP, rollout gets each policy by the broadcast group, and the sample
    accounting is the local launcher's. No host shares a folder with the driver or another host:
    each writes a run folder and a weight store of its own, shipped into the driver's run folder
    (metrics per iteration, the trace of every stage, the checkpoint the driver evaluates)."""
    cluster, (rollout_node, forwards_node, train_node) = three_hosts
    resources = ON_THREE_HOSTS
    ray_settings = {"address": cluster.address, "strategy": "SPREAD", "stage_resources": resources,
                    "start_timeout_s": 60, "node_hosts": True}
    # 3 iterations: rollout runs one policy ahead (overlap_depth 1), so only the third needs a new one
    code, log = run_job(tmp_path, "hosts", 480, "placement.mode=separated", "placement.rollout_cores=[0]",
                        "placement.train_cores=[1]", "iterations=3", ray=ray_settings)
    assert code == 0, log[-4000:]
    run_dir = tmp_path / "hosts"
    assert_accounting(run_dir, iterations=3)
    where = placed(log)
    nodes = {"rollout_node": rollout_node, "forwards_node": forwards_node, "train_node": train_node}
    for process in where:
        stage = process.rsplit("-", 1)[0]
        assert where[process][0] == nodes[next(iter(resources[stage]))], process
    assert {ip for _, _, ip, _ in PLACED.findall(log)} == {LOOPBACK}  # every node, so every socket, on loopback
    hosts = dict(re.findall(r"ray: (\S+) on node \w+ \(.*, host (\S+)\)", log))
    assert len(set(hosts.values())) == 3 and hosts["rollout-0"] != hosts["ref_forward-0"] != hosts["actor_train-0"]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["broker"]["curve"] is True and plan["ray"]["spans_hosts"] is True
    assert any("weights.transport shm -> broadcast" in check for check in plan["checks"])
    # the remote paths were taken: each mini-batch's rollout handle crossed to the forwards host,
    # the experience to the trainers' host, and rollout loaded each new policy from the group
    fetched = {process: len(events) for process, events in trace_events(run_dir, "fetch tcp").items()}
    assert fetched.get("ref_forward-0", 0) == 6 and fetched.get("actor_train-0", 0) == 6, fetched
    assert "rollout-0" not in fetched  # its inputs (prompts) come from its own host: /dev/shm
    received = trace_events(run_dir, "weights receive")
    assert {e["args"]["transport"] for e in received.get("rollout-0", [])} == {"broadcast"}, received
    # critic_forward, on another host than critic_train, got the trained critic by its group, newer
    # versions in order (version 2 only when it came before critic_forward's last step: with
    # overlap_depth 1 that step needs a critic of version 1 or newer, so timing decides)
    critic = [e["args"]["version"] for e in received.get("critic_forward-0", [])]
    assert critic and critic == sorted(set(critic)) and 1 <= critic[0] and critic[-1] <= 2, received
    assert not [name for name, (_, pid) in where.items() if alive(pid)]
    # every host wrote into a run folder of its own, shipped into the driver's and removed at the end
    folders = dict(re.findall(r"ray: host (\S+) writes its run folder at (\S+), shipped to", log))
    assert set(folders) == set(hosts.values()) and len(set(folders.values())) == 3
    assert not [folder for folder in folders.values() if Path(folder).exists()]
    assert [r["iteration"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
    assert len(read_metrics(run_dir / "critic_metrics.jsonl")) == 3
    assert (run_dir / "checkpoint" / "config.json").is_file() and (run_dir / "train_summary.json").is_file()
    merged = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert tracks == set(where), tracks  # the broker and every stage instance, from three hosts
    # each host's clock was measured against the driver's for the merge (one machine: within 50 ms)
    offsets = {host: float(ms) for host, ms in re.findall(r"ray: host (\S+)'s clock is ([-+\d.]+) ms", log)}
    assert set(offsets) == set(folders) and all(abs(ms) < 50 for ms in offsets.values()), offsets
    clocks = json.loads((run_dir / "trace_events" / "clocks.json").read_text())["hosts"]
    assert set(clocks) == set(folders) and all(abs(c["offset_ns"]) < 50_000_000 for c in clocks.values()), clocks
    assert all(clocks[host]["files"] for host in clocks)  # the events files each host's processes wrote
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("t_hosts")]  # every host's store is gone


@pytest.mark.timeout(900)
def test_metrics_from_another_host_arrive_while_the_job_runs_and_its_drain_checkpoint_after(tmp_path, three_hosts):
    """The trainers on a host of their own (`ray.node_hosts`): metrics.jsonl reaches the driver's
    run folder while the job still runs; SIGTERM drains every stage (none waits out the stop grace,
    no actor outlives the job), and the checkpoint the trainers wrote as they drained is there too
    (the driver names it to resume from). The run resumes from it on the same three hosts: each
    gets what its ranks read (the trainers' parts and metrics, rollout's kept outputs, the prompt
    cursor) and the run trains every sample once."""
    cluster, _ = three_hosts
    resources = ON_THREE_HOSTS
    process, log_file = start_job(tmp_path, "live", "placement.mode=separated", "placement.rollout_cores=[0]",
                                  "placement.train_cores=[1]", "iterations=200",
                                  ray={"address": cluster.address, "strategy": "SPREAD", "stage_resources": resources,
                                       "start_timeout_s": 60, "node_hosts": True})
    metrics = tmp_path / "live" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None and not read_metrics(metrics):
        time.sleep(0.2)
    assert process.poll() is None and read_metrics(metrics), log_file.read_text()[-4000:]
    process.terminate()  # SIGTERM, as a scheduler stops a job: handled as Ctrl-C
    assert finish(process, 120) == 130
    log = log_file.read_text()
    assert "interrupted: draining every stage" in log and "ignored shutdown" not in log, log[-4000:]
    assert "continue with `stream-rlhf run" in log, log[-4000:]  # a complete checkpoint in the driver's folder
    where = placed(log)
    assert len(where) == 8 and not [name for name, (_, pid) in where.items() if alive(pid)]
    assert len(read_metrics(metrics)) >= 1 and not list((tmp_path / "live").rglob("*.shipping"))

    point = CheckpointStore(tmp_path / "live" / "checkpoints").latest(["actor", "critic"])
    assert point is not None and point.version >= 1
    iterations = point.version + 2
    resume_log = tmp_path / "live-resume.log"
    with resume_log.open("w") as out:
        resumed = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "run", str(tmp_path / "live.yaml"),
                                  "--resume", "--set", f"iterations={iterations}"], stdout=out,
                                 stderr=subprocess.STDOUT, timeout=420)
    log = resume_log.read_text()
    assert resumed.returncode == 0, log[-4000:]
    summary = json.loads((tmp_path / "live" / "summary.json").read_text())
    assert summary["resumed_from"] == [point.version]
    assert summary["samples_trained"] == iterations * 2 * 8 and summary["samples_dropped"] == 0, summary
    assert [r["iteration"] for r in read_metrics(metrics)] == list(range(iterations))  # none lost, none twice
    assert [r["iteration"] for r in read_metrics(tmp_path / "live" / "critic_metrics.jsonl")] == list(range(iterations))
    got = re.findall(r"ray: host (\S+) got (.+) of the driver's run folder", log)  # one line per stage
    sent = sorted(path for _, paths in got for path in paths.split(", "))
    folder = f"checkpoints/{point.folder.name}"
    assert sent == sorted([f"{folder}/actor", "metrics.jsonl", "samples.jsonl", f"{folder}/critic",
                           "critic_metrics.jsonl", "checkpoints/generated", "checkpoints/prompt_cursor.jsonl"]), got
    assert len({host for host, _ in got}) == 2, got  # the trainers' host and rollout's; the forwards read nothing


@pytest.mark.timeout(600)
def test_stages_killed_on_other_hosts_restart_there_and_a_trainer_killed_is_recovered_from_a_checkpoint(
        tmp_path, three_hosts):
    """Across hosts (`ray.node_hosts`), rollout and then critic_forward killed: each restarts on its
    host, its new process joins its broadcast weight group anew (once a reason to give them no
    restarts), and what the dead one had published is still fetched from its host's payload
    server, so the run goes on without a recovery; what it left there is unlinked there. Then
    actor_train's worker, once a checkpoint has reached the driver: the run resumes from it on the
    same hosts (each gets the files its ranks read) and trains every sample once."""
    cluster, (rollout_node, forwards_node, _) = three_hosts
    iterations = 60  # the tiny job trains ~5 a second here: the three kills must land before its end
    process, log_file = start_job(tmp_path, "recover", "placement.mode=separated", "placement.rollout_cores=[0]",
                                  "placement.train_cores=[1]", f"iterations={iterations}", "checkpoint.every=2",
                                  "checkpoint.recoveries=1",
                                  ray={"address": cluster.address, "strategy": "SPREAD",
                                       "stage_resources": ON_THREE_HOSTS, "start_timeout_s": 60, "node_hosts": True})
    metrics = tmp_path / "recover" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    killed = []
    for victim, node, after in (("rollout-0", rollout_node, 1), ("critic_forward-0", forwards_node, 4)):
        while time.monotonic() < deadline and process.poll() is None and len(read_metrics(metrics)) < after:
            time.sleep(0.2)
        first = placed(log_file.read_text())[victim]
        assert process.poll() is None, log_file.read_text()[-4000:]
        os.kill(first[1], signal.SIGKILL)
        killed.append(first[1])
        while time.monotonic() < deadline and placed(log_file.read_text())[victim] == first:
            time.sleep(0.2)
        assert placed(log_file.read_text())[victim][0] == node, log_file.read_text()[-4000:]  # again on its host
    store = CheckpointStore(tmp_path / "recover" / "checkpoints")
    # the new processes' trace files reach the driver within a second or two (remote log lines take
    # up to ~15 s): once both have received a version, each has rejoined its group
    restarted = {victim: placed(log_file.read_text())[victim][1] for victim in ("rollout-0", "critic_forward-0")}
    traces = [tmp_path / "recover" / "trace_events" / f"{name}.rank_0.{pid}.jsonl" for name, pid in restarted.items()]
    while time.monotonic() < deadline and process.poll() is None and (
            store.latest(["actor", "critic"]) is None
            or not all(t.is_file() and '"weights receive"' in t.read_text() for t in traces)):
        time.sleep(0.2)
    assert process.poll() is None and store.latest(["actor", "critic"]) is not None, log_file.read_text()[-4000:]
    assert all('"weights receive"' in t.read_text() for t in traces), traces  # by broadcast, in the new processes
    assert "recovering from the failure" not in log_file.read_text()  # the restarts kept the run going
    # the broker had each host's payload server unlink what the dead processes left there (their
    # pools, their payloads once acknowledged): segments are named <prefix>_<pid>_<n>
    left = re.compile(rf"\w+_({'|'.join(map(str, killed))})_\d+")
    while time.monotonic() < deadline and any(left.fullmatch(p.name) for p in Path("/dev/shm").iterdir()):
        time.sleep(0.2)
    assert not [p.name for p in Path("/dev/shm").iterdir() if left.fullmatch(p.name)]
    os.kill(placed(log_file.read_text())["actor_train-0"][1], signal.SIGKILL)
    assert finish(process, 420) == 0, log_file.read_text()[-4000:]
    log = log_file.read_text()
    assert "rollout-0 failed (its Ray worker died" in log and "critic_forward-0 failed (its Ray worker died" in log
    assert "recovering from the failure of actor_train-0" in log, log[-4000:]
    summary = json.loads((tmp_path / "recover" / "summary.json").read_text())
    assert len(summary["resumed_from"]) == 1 and summary["resumed_from"][0] >= 2, summary["resumed_from"]
    assert summary["samples_trained"] == iterations * 2 * 8 and summary["samples_dropped"] == 0, summary
    assert [r["iteration"] for r in read_metrics(metrics)] == list(range(iterations))
    point = f"checkpoints/iter-{summary['resumed_from'][0]:06d}"
    assert f"got {point}/actor, metrics.jsonl" in log and f"got {point}/critic" in log, log[-4000:]
