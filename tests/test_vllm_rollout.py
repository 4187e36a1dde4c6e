"""The vLLM rollout backend against a real vLLM engine (CPU build): generation, log-prob parity
with our forward, weight updates through each CPU transport, in-flight updates, errors."""

from __future__ import annotations

import copy
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from stream_rlhf.backends import vllm_protocol as wire
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.backends.vllm_client import GenerateAbandoned, VllmClient, VllmEngineError
from stream_rlhf.backends.vllm_rollout import VllmOptions
from stream_rlhf.backends.vllm_turns import VllmTurnSampler
from stream_rlhf.envs.turns import TurnRequest
from stream_rlhf.models.checkpoint import build_tiny, load_policy
from stream_rlhf.models.model_config import TinyModelConfig
from stream_rlhf.models.packing import sequence_logprobs
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.stages.weight_sync import trained_parameters
from stream_rlhf.weights.shm_store import WeightStore
from stream_rlhf.weights.transport import TRANSPORTS, Link, groups_folder
from tests.vllm_env import vllm_python
from tests.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPTS = ["12+7=", "3+4=", "55+1=", "9+90=", "1+1=", "70+8="] * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer()
    cfg = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
    build_tiny(cfg, tokenizer, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def engine(checkpoint):
    # prefix caching off: the in-flight test updates weights while requests run
    client = VllmClient(str(checkpoint), VllmOptions(max_model_len=64, cpu_cores=[0], prefix_caching=False),
                        python=vllm_python(), start_timeout_s=300)
    yield client
    client.close()
    assert client.process.returncode == 0


def link(root: Path) -> Link:
    """Where the engine's workers meet a trainer whose store is `root` (gloo on loopback)."""
    return Link(str(root), "actor", str(groups_folder(root)), "gloo", 1 << 16, 60.0)


@pytest.fixture(scope="module")
def prompts(checkpoint) -> list[torch.Tensor]:
    tokenizer = build_tokenizer()
    return [torch.tensor(tokenizer.encode(p)) for p in PROMPTS]


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def logprob_error(model: torch.nn.Module, prompts, gen, temperature: float, upto: list[int] | None = None) -> float:
    """Max |vLLM behaviour log-prob - our forward's| over the response tokens (the first upto[i])."""
    sequences = [torch.cat([p, r]) for p, r in zip(prompts, gen.response_ids)]
    with torch.no_grad():
        ours, _ = sequence_logprobs(model, sequences, temperature or 1.0)
    errors = []
    for i, (logp, prompt, theirs) in enumerate(zip(ours, prompts, gen.response_logp)):
        n = len(theirs) if upto is None else upto[i]
        if n:
            errors.append((logp[len(prompt) - 1:][:n] - theirs[:n]).abs().max().item())
    return max(errors)


def params(temperature: float = 1.0, max_new_tokens: int = 5, stop: tuple[int, ...] | None = None) -> SamplingParams:
    tokenizer = build_tokenizer()
    return SamplingParams(temperature, 1.0, max_new_tokens, (tokenizer.eos_token_id,) if stop is None else stop,
                          tokenizer.pad_token_id)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_behaviour_logprobs_equal_our_forward(engine, checkpoint, prompts, temperature):
    gen = engine.generate(prompts, params(temperature), seeds=list(range(len(prompts))))
    assert len(gen.response_ids) == len(prompts)
    eos = build_tokenizer().eos_token_id
    for ids, logp, reason in zip(gen.response_ids, gen.response_logp, gen.finish_reasons):
        assert 1 <= len(ids) <= 5 and len(logp) == len(ids)
        assert (reason == "stop") == (ids[-1].item() == eos)  # the stop token is kept, as in torch_rollout
    assert logprob_error(load_policy(checkpoint).eval(), prompts, gen, temperature) < 1e-4


def test_same_seeds_sample_the_same_responses(engine, prompts):
    first = engine.generate(prompts, params(), seeds=list(range(len(prompts))))
    again = engine.generate(prompts, params(), seeds=list(range(len(prompts))))
    assert all(torch.equal(a, b) for a, b in zip(first.response_ids, again.response_ids))


def test_update_through_shared_memory_file(engine, checkpoint, prompts, tmp_path):
    new = perturbed(load_policy(checkpoint).eval(), seed=1)
    store = WeightStore(tmp_path, "actor")
    store.publish(new, version=1)
    stale = engine.generate(prompts, params(), seeds=list(range(len(prompts))))
    assert logprob_error(new, prompts, stale, 1.0) > 1e-2  # it still had other weights

    engine.join_weights("shm", link(tmp_path), "rollout-0", 2)
    engine.update(1, wire.RECEIVE, 1)
    gen = engine.generate(prompts, params(), seeds=list(range(len(prompts))))
    assert engine.version == 1
    assert logprob_error(new, prompts, gen, 1.0) < 1e-4
    assert all((v == 1).all() for v in gen.token_versions)


def test_update_through_a_gloo_broadcast_group(engine, checkpoint, prompts, tmp_path):
    new = perturbed(load_policy(checkpoint).eval(), seed=2)
    sender = TRANSPORTS["broadcast"].open_sender(link(tmp_path), {"rollout-0": 2})
    try:
        engine.join_weights("broadcast", link(tmp_path), "rollout-0", 2)
        sender.publish(trained_parameters(new), version=2)  # tied head: sent once, as the embedding
        engine.update(2, wire.RECEIVE, 2)
        sender.check()
    finally:
        sender.close()
    gen = engine.generate(prompts, params(), seeds=list(range(len(prompts))))
    assert engine.version == 2
    assert logprob_error(new, prompts, gen, 1.0) < 1e-4
    engine.call("srl_close")


def test_in_flight_update_labels_each_token_with_its_version(engine, checkpoint, prompts, tmp_path):
    old = perturbed(load_policy(checkpoint).eval(), seed=3)
    new = perturbed(old, seed=4)
    store = WeightStore(tmp_path, "actor", keep=3)
    store.publish(old, version=3)
    engine.join_weights("shm", link(tmp_path), "rollout-0", 2)
    engine.update(3, wire.RECEIVE, 3)
    sent = []

    def in_flight() -> wire.Update | None:  # asked as the request goes out: the update lands after step 1
        if sent:
            return None
        sent.append(True)
        store.publish(new, version=4)
        return wire.receive_update(4)

    # no stop token: every response runs 48 steps (asked only after 50 ms of silence, the update
    # once missed a generate that CI finished inside them)
    prompts = prompts * 8
    long = params(max_new_tokens=48, stop=())
    gen = engine.generate(prompts, long, seeds=list(range(len(prompts))), in_flight=in_flight)
    assert engine.version == 4
    for versions in gen.token_versions:
        assert len(versions) == 48
        assert (versions[1:] >= versions[:-1]).all()  # one switch at most, old to new
    switched = [int((v == 3).sum()) for v in gen.token_versions]
    assert set(torch.cat(gen.token_versions).tolist()) == {3, 4}, switched
    assert sent == [True]
    # tokens before the switch were sampled by the old weights alone
    assert logprob_error(old, prompts, gen, 1.0, upto=switched) < 1e-4


def test_updates_log_no_warning_for_the_layers_they_leave_alone(checkpoint, tmp_path, capfd):
    """vLLM's layer-wise reload warns "RotaryEmbedding: Failed to load weights" on every update,
    since no checkpoint holds the rotary cos/sin cache (vLLM keeps the layer's own, rightly); the
    worker extension drops that line during its reloads. An engine of its own, so that its output
    is this test's."""
    client = VllmClient(str(checkpoint), VllmOptions(max_model_len=64, cpu_cores=[0]), python=vllm_python(),
                        start_timeout_s=300)
    try:
        store = WeightStore(tmp_path, "actor")
        client.join_weights("shm", link(tmp_path), "rollout-0", 2)
        for version in (1, 2):
            store.publish(perturbed(load_policy(checkpoint).eval(), seed=version), version=version)
            client.update(version, wire.RECEIVE, version)
    finally:
        client.close()
    log = "".join(capfd.readouterr())
    assert "Failed to load weights" not in log
    assert "layerwise" not in log


def test_a_failed_request_is_reported_and_the_engine_keeps_serving(engine, prompts, tmp_path):
    engine.join_weights("shm", link(tmp_path), "rollout-0", 2)  # an empty store
    with pytest.raises(VllmEngineError, match=r"no weights of version >= 9 in ShmReceiver\(.*/actor\)"):
        engine.update(9, wire.RECEIVE, 9)
    with pytest.raises(VllmEngineError, match="not a WeightSyncExtension method"):
        engine.call("reload_weights")
    gen = engine.generate(prompts[:2], params(), seeds=[0, 1])
    assert len(gen.response_ids) == 2


def test_an_engine_that_cannot_start_is_a_clear_error(checkpoint):
    with pytest.raises(VllmEngineError, match="exited with code"):
        VllmClient(str(checkpoint / "nowhere"), VllmOptions(max_model_len=64), python=vllm_python(),
                   start_timeout_s=120)
    with pytest.raises(VllmEngineError, match="rollout.vllm.python='/no/python': cannot start it"):
        VllmClient(str(checkpoint), VllmOptions(max_model_len=64), python="/no/python")


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (read from /proc)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid] + [p for child in children for p in process_tree(int(child))]


def test_a_generate_abandoned_at_stop_kills_the_hung_engine_and_its_processes(checkpoint, prompts, caplog):
    """A rollout told to stop while its engine never answers (stopped here with SIGSTOP) gives up
    the generate, and close() kills the engine and vLLM's own processes below it at once instead
    of sending a Close the engine would never read and waiting for it."""
    client = VllmClient(str(checkpoint), VllmOptions(max_model_len=64, cpu_cores=[0]), python=vllm_python(),
                        start_timeout_s=300)
    tree = process_tree(client.process.pid)
    os.kill(client.process.pid, signal.SIGSTOP)
    stopping = threading.Event()
    threading.Timer(0.5, stopping.set).start()  # while the generate waits
    with pytest.raises(GenerateAbandoned, match="rollout is stopping"):
        client.generate(prompts[:2], params(), seeds=[0, 1], stopping=stopping)
    with caplog.at_level(logging.WARNING, logger="stream_rlhf.backends.vllm_client"):
        client.close()
    assert client.process.returncode == -signal.SIGKILL
    assert [r.getMessage() for r in caplog.records] == [
        f"vLLM engine process {client.process.pid} is busy with an abandoned generate: killing it"]
    for pid in tree[1:]:  # vLLM's engine core and workers are in the engine's process group
        wait_for(lambda pid=pid: not alive(pid), 10, f"engine child {pid} to exit")


OWNER = """
import sys, time
from stream_rlhf.backends.vllm_client import VllmClient
from stream_rlhf.backends.vllm_rollout import VllmOptions
from stream_rlhf.backends.vllm_turns import VllmTurnSampler
client = VllmClient(sys.argv[1], VllmOptions(max_model_len=64, cpu_cores=[0]), python=sys.argv[2], start_timeout_s=300)
print("engine pid", client.process.pid, flush=True)
time.sleep(600)
"""


def test_an_engine_whose_rollout_is_killed_exits_with_every_vllm_process(checkpoint):
    """kill -9 of the process that owns the engine (a rollout stage): the engine gets SIGTERM from
    Linux, closes vLLM and leaves none of vLLM's processes behind (on CPU the engine core runs in the
    engine's own process, `vllm_rollout.py`; on CUDA in processes of its own, which must go too)."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(checkpoint), vllm_python()], stdout=subprocess.PIPE,
                             text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        engine_pid = next(int(line.split()[-1]) for line in owner.stdout if line.startswith("engine pid "))
        tree = process_tree(engine_pid)
    finally:
        owner.kill()
        owner.wait()
    for pid in tree:
        wait_for(lambda pid=pid: not alive(pid), 30, f"engine process {pid} to exit")


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped by a parent that is gone."""
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" not in status.read_text()


def test_more_prompt_tokens_than_one_engine_step_takes(engine, prompts):
    """More prompt tokens than vLLM schedules in one step (its max_num_batched_tokens, 2048-4096 on
    CPU): with chunked prefill a prompt split across steps crashes vLLM's CPU sampler (its seeded
    generators have no offset to rewind); prompts that do not fit wait for the next step instead."""
    many = [p for p in prompts for _ in range(12)]  # 288 prompts
    many = [torch.cat([p] * 5)[:40] for p in many]  # ~11,500 prompt tokens
    gen = engine.generate(many, params(), seeds=list(range(len(many))))
    assert len(gen.response_ids) == len(many) and all(1 <= len(ids) <= 5 for ids in gen.response_ids)
    again = engine.generate(many[:8], params(), seeds=list(range(8)))  # the engine serves on, the same tokens
    assert all(torch.equal(a, b) for a, b in zip(gen.response_ids[:8], again.response_ids))


def test_a_dead_engine_is_an_error_at_the_next_call_not_a_hang(checkpoint, prompts):
    """The engine process exits (vLLM's engine core died) while a multi-turn episode's turn runs:
    the next call raises, and closing the turn sampler and the client sends nothing and returns
    (a send to the socket whose peer is gone blocked for good: a rollout stage hung at its close)."""
    client = VllmClient(str(checkpoint), VllmOptions(max_model_len=64, cpu_cores=[0]), python=vllm_python(),
                        start_timeout_s=300)
    slept = []
    turns = VllmTurnSampler(client, params(max_new_tokens=40), (0, "rollout", 0, 0), 64,
                            on_close=lambda: slept.append(1))
    turns.start(TurnRequest(0, prompts[0], None, 40))
    turns.advance()
    os.killpg(client.process.pid, signal.SIGKILL)
    client.process.wait()
    with pytest.raises(VllmEngineError, match=r"poll_turns: the vLLM engine process exited with code -9"):
        while turns.busy:
            turns.advance()
    turns.close()
    assert slept == [], "a dead engine is not put to sleep"
    with pytest.raises(VllmEngineError, match=r"generate: the vLLM engine process exited with code -9"):
        client.generate(prompts[:2], params(), seeds=[0, 1])
    client.close()
