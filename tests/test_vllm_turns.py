"""The vLLM TurnSampler (`backends/vllm_turns.py`) against a real vLLM engine (CPU build), driven
by a scripted environment: staggered episodes, fixed observation ids after each turn, a few
advances of "tool" wait between turns. Each policy token's behaviour log-prob equals our
full-sequence forward's, masks and rewards are the script's and the torch sampler's (greedy), an
episode samples the same tokens whatever the schedule, later turns hit the prefix cache, in-flight
updates land at turn boundaries, close aborts what runs; and a whole env job on vLLM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from stream_rlhf.backends.episode_sampler import TorchTurnSampler
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.backends.turn_stop import TurnStop
from stream_rlhf.backends.vllm_client import VllmClient
from stream_rlhf.backends.vllm_protocol import Update, receive_update
from stream_rlhf.backends.vllm_rollout import VllmOptions
from stream_rlhf.backends.vllm_turns import VllmTurnSampler
from stream_rlhf.envs.episode import Episode
from stream_rlhf.envs.turns import TurnDone, TurnRequest, TurnSampler
from stream_rlhf.models.checkpoint import build_tiny, load_policy
from stream_rlhf.models.model_config import TinyModelConfig
from stream_rlhf.models.packing import sequence_logprobs
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.samples import SampleImages
from stream_rlhf.telemetry.metrics import read_metrics
from stream_rlhf.weights.shm_store import WeightStore
from stream_rlhf.weights.transport import Link, groups_folder
from tests.rl_tiny import tiny_job, write_job
from tests.test_rl_job import wait_for_iterations
from tests.test_rl_vllm import run
from tests.test_vllm_rollout import perturbed
from tests.vllm_env import REPO, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPTS = ["12+7=", "3+4=", "55+1=", "9+90=", "1+1=", "70+8="]
MAX_MODEL_LEN = 128
MAX_NEW_TOKENS = 6


@dataclass(frozen=True)
class Script:
    """One scripted episode: when its first turn starts, how many turns it has, how many advances
    its tool takes after each turn."""

    start_at: int
    turns: int
    tool_advances: int


def observation(key: int, turn: int) -> list[int]:
    """The fixed ids the script appends after turn `turn` of episode `key`."""
    return build_tokenizer().encode(f" ={key * 7 + turn}; ")


def reward(key: int, turn: int) -> float:
    return key + turn / 10


STAGGERED = [Script(start_at=2 * k, turns=2 + k % 2, tool_advances=k % 3) for k in range(len(PROMPTS))]
"""Episodes starting one after another, 2 or 3 turns each, tools of 0 to 2 advances."""
TOGETHER = [Script(start_at=0, turns=s.turns, tool_advances=2 - s.tool_advances) for s in STAGGERED]
"""The same episodes all started at once, with other tool waits."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer()
    cfg = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=32, max_position_embeddings=MAX_MODEL_LEN)
    build_tiny(cfg, tokenizer, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def engine(checkpoint):
    # prefix caching on (the default) with 32-token blocks (the CPU's smallest; its default 128
    # is longer than these episodes): later turns find their episode's earlier blocks cached
    client = VllmClient(str(checkpoint), VllmOptions(max_model_len=MAX_MODEL_LEN, cpu_cores=[0], block_size=32),
                        python=vllm_python(), start_timeout_s=300)
    yield client
    client.close()
    assert client.process.returncode == 0


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    tokenizer = build_tokenizer()
    return [torch.tensor(tokenizer.encode(p)) for p in PROMPTS]


def params(temperature: float = 1.0, stop: tuple[int, ...] | None = None) -> SamplingParams:
    tokenizer = build_tokenizer()
    return SamplingParams(temperature, 1.0, MAX_NEW_TOKENS, (tokenizer.eos_token_id,) if stop is None else stop,
                          tokenizer.pad_token_id)


def sampler(engine: VllmClient, temperature: float = 1.0, stop: tuple[int, ...] | None = None,
            **kwargs) -> VllmTurnSampler:
    return VllmTurnSampler(engine, params(temperature, stop), (0, "rollout", 1, 0), MAX_MODEL_LEN, **kwargs)


def run_episodes(turns: TurnSampler, prompts: list[torch.Tensor], scripts: list[Script],
                 max_new_tokens: int = MAX_NEW_TOKENS, images: list[SampleImages] | None = None,
                 names: list[tuple[int | str, ...]] | None = None) -> tuple[list[Episode], list[TurnDone]]:
    """The scripted environment's episodes through `turns`, as an episode loop runs them (a
    vision-language model's with each prompt's `images` on every turn; each request naming its
    episode by `names`, as a rollout stage's do: TurnRequest.episode)."""
    episodes = [Episode(p.tolist()) for p in prompts]
    due = {key: script.start_at for key, script in enumerate(scripts)}  # key -> advance its next turn starts at
    dones, step = [], 0
    while due or turns.busy:
        for key in [k for k, at in due.items() if at <= step]:
            del due[key]
            context = torch.tensor(episodes[key].prompt_ids + episodes[key].token_ids)
            turns.start(TurnRequest(key, context, None if images is None else images[key], max_new_tokens,
                                    () if names is None else names[key]))
        for done in turns.advance():
            episode, script = episodes[done.key], scripts[done.key]
            episode.add_policy_turn(done.ids.tolist(), done.logps.tolist(), done.policy_version)
            index = done.key if names is None else names[done.key][-1]  # the script follows the episode, not its slot
            episode.set_turn_reward(reward(index, episode.turns - 1))
            if episode.turns < script.turns:
                episode.add_observation(observation(index, episode.turns - 1))
                due[done.key] = step + 1 + script.tool_advances
            else:
                turns.release(done.key)
            dones.append(done)
        step += 1
        assert step < 100_000, "the episodes never ended"
    turns.close()
    return episodes, dones


def turn_spans(episode: Episode) -> list[tuple[int, int]]:
    """(start, end) in token_ids of each policy turn, from its loss mask."""
    spans, start = [], None
    for i, policy in enumerate(episode.loss_mask + [0]):
        if policy and start is None:
            start = i
        elif not policy and start is not None:
            spans.append((start, i))
            start = None
    return spans


def logprob_errors(model: torch.nn.Module, episode: Episode) -> list[float]:
    """Per policy turn: max |behaviour log-prob - our full-sequence forward's|."""
    with torch.no_grad():
        (ours,), _ = sequence_logprobs(model, [torch.tensor(episode.prompt_ids + episode.token_ids)], 1.0)
    ours = ours[len(episode.prompt_ids) - 1:]  # ours[r]: log p(token_ids[r] | what precedes it)
    behaviour = torch.tensor(episode.behavior_logp)
    return [(ours[a:b] - behaviour[a:b]).abs().max().item() for a, b in turn_spans(episode)]


def test_turns_match_the_script_and_our_forward(engine, checkpoint, prompts):
    episodes, dones = run_episodes(sampler(engine), prompts, STAGGERED)
    eos = build_tokenizer().eos_token_id
    for done in dones:
        assert 1 <= len(done.ids) <= MAX_NEW_TOKENS and len(done.logps) == len(done.ids)
        assert (done.finish_reason == "stop") == (done.ids[-1].item() == eos)
        assert done.policy_version == 0
    model = load_policy(checkpoint).eval()
    for key, (episode, script) in enumerate(zip(episodes, STAGGERED)):
        spans = turn_spans(episode)
        assert len(spans) == episode.turns == script.turns
        # the script's layout: each turn's tokens (mask 1), then its observation (mask 0) but after the last
        mask, rewards = [], []
        for turn, (a, b) in enumerate(spans):
            observed = observation(key, turn) if turn < script.turns - 1 else []
            mask += [True] * (b - a) + [False] * len(observed)
            rewards += [0.0] * (b - a - 1) + [reward(key, turn)] + [0.0] * len(observed)
            assert episode.token_ids[b:b + len(observed)] == observed
        tensors = episode.response_tensors()
        assert tensors["loss_mask"].tolist() == mask
        assert tensors["token_rewards"].tolist() == pytest.approx(rewards)
        assert max(logprob_errors(model, episode)) < 1e-4, key


def test_an_episode_samples_the_same_whatever_the_schedule(engine, prompts):
    staggered, _ = run_episodes(sampler(engine), prompts, STAGGERED)
    together, _ = run_episodes(sampler(engine), prompts, TOGETHER)
    for a, b in zip(staggered, together):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
        assert torch.allclose(torch.tensor(a.behavior_logp), torch.tensor(b.behavior_logp), atol=1e-5)
    other_seed, _ = run_episodes(VllmTurnSampler(engine, params(), (1, "rollout", 1, 0), MAX_MODEL_LEN),
                                 prompts, STAGGERED)
    assert [e.token_ids for e in other_seed] != [e.token_ids for e in staggered]


def test_an_episode_samples_the_same_beside_another_minibatch_in_another_slot(engine, prompts):
    """env.minibatches_in_flight: two mini-batches' episodes share the sampler. An episode named by
    its requests (iteration, mini-batch, index) samples the same tokens alone and beside the other
    mini-batch's episodes in slots of its own; the other mini-batch's seeds are its own."""
    n = len(prompts)
    first = [(0, "rollout", 1, 0, k) for k in range(n)]
    second = [(0, "rollout", 1, 1, k) for k in range(n)]
    alone, _ = run_episodes(sampler(engine), prompts, STAGGERED, names=first)
    shared, _ = run_episodes(sampler(engine), prompts * 2, TOGETHER + STAGGERED, names=second + first)
    assert [e.token_ids for e in shared[n:]] == [e.token_ids for e in alone]
    assert [e.token_ids for e in shared[:n]] != [e.token_ids for e in alone]


def test_greedy_turns_match_our_forward(engine, checkpoint, prompts):
    episodes, _ = run_episodes(sampler(engine, temperature=0.0), prompts, STAGGERED)
    model = load_policy(checkpoint).eval()
    assert max(max(logprob_errors(model, e)) for e in episodes) < 1e-4


def test_the_torch_sampler_gives_the_same_greedy_episodes(engine, checkpoint, prompts):
    """The same scripted episodes through vLLM and the torch sampler (`TorchTurnSampler`):
    greedy, so that both pick the same tokens (sampled, their draws differ: vLLM seeds each turn,
    the torch sampler draws from the mini-batch's generator); then masks, rewards and behaviour
    log-probs are the same."""
    model = load_policy(checkpoint).eval()
    through_vllm, _ = run_episodes(sampler(engine, temperature=0.0), prompts, STAGGERED)
    torch_turns = TorchTurnSampler(model, len(prompts), MAX_MODEL_LEN, params(0.0), (0,),
                                   policy_version=0)
    through_torch, _ = run_episodes(torch_turns, prompts, STAGGERED)
    for a, b in zip(through_vllm, through_torch, strict=True):
        assert a.token_ids == b.token_ids
        ta, tb = a.response_tensors(), b.response_tensors()
        assert torch.equal(ta["loss_mask"], tb["loss_mask"])
        assert torch.equal(ta["token_rewards"], tb["token_rewards"])
        assert torch.equal(ta["policy_versions"], tb["policy_versions"])
        assert (ta["behavior_logp"] - tb["behavior_logp"]).abs().max() < 1e-4


def test_a_stop_string_ends_greedy_turns_at_the_same_token_on_both_samplers(engine, checkpoint, prompts):
    """env.stop_strings: the two characters the greedy turns write most often before their end end
    every turn that writes them, at the token completing them, on vLLM and on the torch sampler
    alike (vLLM keeps that token's log-prob; the texts are the tokenizer's, without special tokens)."""
    tokenizer = build_tokenizer()

    def text(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    _, free = run_episodes(sampler(engine, temperature=0.0), prompts, STAGGERED)
    inside = Counter(text(t.ids[:-1].tolist())[i:i + 2] for t in free for i in range(len(t.ids) - 2))
    stop, _ = inside.most_common(1)[0]
    stopping = replace(params(0.0), stop_strings=(stop,))
    through_vllm, vllm_turns = run_episodes(VllmTurnSampler(engine, stopping, (0, "rollout", 1, 0), MAX_MODEL_LEN),
                                            prompts, STAGGERED)
    torch_turns = TorchTurnSampler(load_policy(checkpoint).eval(), len(prompts), MAX_MODEL_LEN, stopping,
                                   (0,), policy_version=0,
                                   stop_text=TurnStop((stop,), text))
    through_torch, _ = run_episodes(torch_turns, prompts, STAGGERED)
    assert [a.token_ids for a in through_vllm] == [b.token_ids for b in through_torch]
    cut = [t for t in vllm_turns if stop in text(t.ids.tolist())]
    assert cut and len(cut) < len(vllm_turns), stop
    for turn in cut:
        assert stop not in text(turn.ids[:-1].tolist()) and turn.finish_reason == "stop"
        assert len(turn.logps) == len(turn.ids)


def test_later_turns_find_their_episode_in_the_prefix_cache(engine, checkpoint):
    tokenizer = build_tokenizer()
    # 37 tokens each (one whole block), no two alike from the first: only an episode's own turns share blocks
    prompts = [torch.tensor(tokenizer.encode(f"{k} the quick brown fox jumps over {k}+7=")) for k in range(4)]
    first = sampler(engine)
    run_episodes(first, prompts, [Script(start_at=k, turns=1, tool_advances=0) for k in range(4)])
    assert first.cached_tokens == 0 and first.context_tokens == sum(len(p) for p in prompts)
    two = sampler(engine)
    episodes, _ = run_episodes(two, prompts, [Script(start_at=k, turns=2, tool_advances=k) for k in range(4)])
    # each turn finds the prompt's block cached: turn 0 from `first`, turn 1 from turn 0
    assert two.cached_tokens >= 4 * (32 + 32)
    model = load_policy(checkpoint).eval()
    assert max(max(logprob_errors(model, e)) for e in episodes) < 1e-4


def test_close_aborts_the_running_turns(engine, prompts):
    turns = VllmTurnSampler(engine, params(stop=()), (0, "rollout", 2, 0), MAX_MODEL_LEN)
    for key, prompt in enumerate(prompts):
        turns.start(TurnRequest(key, prompt, None, 100 - 10 * key))
    ended = turns.advance()  # the engine goes on with the others (running, or ended and not yet polled)
    assert turns.busy == (len(ended) < len(prompts))
    turns.close()
    assert not turns.busy
    # nothing left in the engine: no turn to answer a poll, and generate (which refuses to run
    # beside multi-turn requests) runs
    request_ids, _, _ = engine.poll_turns(0.0)
    assert request_ids == []
    gen = engine.generate(prompts, params(), seeds=list(range(len(prompts))))
    assert len(gen.response_ids) == len(prompts)
    with pytest.raises(ValueError, match="max_model_len"):
        sampler(engine).start(TurnRequest(0, prompts[0], None, MAX_MODEL_LEN))


def test_in_flight_updates_land_at_turn_boundaries(engine, checkpoint, prompts, tmp_path):
    """An update offered while turns run waits for them to end: every turn is sampled by one
    version, the one it reports (run last: it leaves the engine on other weights)."""
    old = perturbed(load_policy(checkpoint).eval(), seed=1)
    new = perturbed(old, seed=2)
    store = WeightStore(tmp_path, "actor", keep=3)
    store.publish(old, version=1)
    engine.join_weights("shm", Link(str(tmp_path), "actor", str(groups_folder(tmp_path)), "gloo", 1 << 16, 60.0),
                        "rollout-0", 2)
    engine.update(1, "srl_receive", 1)
    published = []

    def pending_update() -> Update | None:
        """Version 2 once an episode has started its second turn (other turns may still run)."""
        if not published and max(turns.seeds.started.values(), default=0) >= 2:
            store.publish(new, version=2)
            published.append(True)
        return receive_update(2) if published and engine.version < 2 else None

    # no stop token, long turns, staggered: the update is likely offered while turns still run in
    # the engine (how many, the machine's speed decides; loading it then fails this test)
    turns = sampler(engine, stop=(), pending_update=pending_update)
    scripts = [Script(start_at=k, turns=2, tool_advances=1) for k in range(len(prompts))]
    episodes, dones = run_episodes(turns, prompts, scripts, max_new_tokens=48)
    assert engine.version == 2
    assert {d.policy_version for d in dones} == {1, 2}
    for episode in episodes:
        spans = turn_spans(episode)
        versions = [episode.policy_versions[a] for a, _ in spans]
        assert versions == sorted(versions)  # a later turn never had older weights
        assert all(set(episode.policy_versions[a:b]) == {v} for (a, b), v in zip(spans, versions))
        errors = {v: logprob_errors(model, episode) for v, model in ((1, old), (2, new))}
        # each turn's log-probs are its version's: no update landed inside a turn
        assert all(errors[v][turn] < 1e-4 for turn, v in enumerate(versions)), (versions, errors)


def _rollout_steps(trace: Path) -> list[tuple[float, float, int, int]]:
    """(start, end, iteration, mini-batch) of every rollout step in the trace, in start order."""
    return sorted((e["ts"], e["ts"] + e["dur"], e["args"]["iteration"], e["args"]["minibatch"])
                  for e in json.loads(trace.read_text())["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") == "step" and e["args"].get("stage") == "rollout")


@pytest.mark.timeout(600)
def test_an_env_job_on_vllm_trains_every_episode_with_two_minibatches_in_flight(tmp_path):
    """The calculator env job (a tool that fails for some samples) with rollout on vLLM, weights
    updated in flight: rollout begins a mini-batch while another's episodes are in flight
    (env.minibatches_in_flight: 2, the default), each joining mini-batch loads the newest weights,
    and every episode is generated and trained once, failures counted by reason. (With updates
    between mini-batches, the default: the next test's job.)"""
    update = "in_flight"
    env = {"factory": "tests.episode_envs:FlakyCalculator", "options": {"latency_s": 0.01}, "max_turns": 3,
           "max_episode_tokens": 32}
    iterations = 3
    name = f"vllm_env_{update}"
    config = write_job(tmp_path / f"{name}.yaml", tiny_job(
        tmp_path, name, iterations=iterations, overlap_depth=1, env=env, broker={"shm_prefix": f"t_{name}"},
        **{"reward.function": None, "algorithm.advantage": "grpo", "rollout_batch.samples_per_prompt": 2,
           "rollout.backend": "vllm", "rollout.vllm": {"python": vllm_python(), "block_size": 32},
           "weights": {"update": update}}))
    summary = run(tmp_path, config)
    assert summary["iterations"] == iterations
    assert summary["samples_generated"] == summary["samples_trained"] == iterations * 2 * 16
    assert summary["samples_dropped"] == 0 and summary["max_staleness"] <= 1  # rollout took every version
    assert summary["episodes"]["count"] >= summary["samples_trained"]
    assert summary["episodes_failed"].get("raised", 0) > 0
    records = read_metrics(tmp_path / name / "metrics.jsonl")
    assert [r["iteration"] for r in records] == list(range(iterations))
    assert all(r["turns_per_episode"] >= 1 for r in records)
    steps = _rollout_steps(tmp_path / name / "trace.json")
    assert sorted((i, m) for _, _, i, m in steps) == [(i, m) for i in range(iterations) for m in range(2)]
    assert any(b[0] < a[1] for a, b in zip(steps, steps[1:])), steps  # one began before the one before ended


@pytest.mark.timeout(600)
def test_an_env_job_whose_vllm_engine_dies_restarts_rollout_and_trains_every_episode(tmp_path):
    """The vLLM engine process dies mid-run (killed here; vLLM's engine core has died of its own
    bugs): rollout's next call to it fails at once, the instance exits instead of hanging, the
    launcher restarts it with a new engine, and every episode is trained once. Weights are updated
    between mini-batches (the default), two mini-batches' episodes in flight, and go by the
    broadcast group, which the new engine's worker joins anew (`weights/broadcast.py`)."""
    env = {"factory": "tests.episode_envs:FlakyCalculator", "options": {"latency_s": 0.01}, "max_turns": 3,
           "max_episode_tokens": 32}
    iterations = 6  # rollout runs at most overlap_depth ahead: iterations 4 and 5 need the new engine
    config = write_job(tmp_path / "vllm_dies.yaml", tiny_job(
        tmp_path, "vllm_dies", iterations=iterations, overlap_depth=1, env=env, broker={"shm_prefix": "t_vllm_dies"},
        **{"reward.function": None, "algorithm.advantage": "grpo", "rollout_batch.samples_per_prompt": 2,
           "rollout.backend": "vllm", "rollout.vllm": {"python": vllm_python(), "block_size": 32},
           "restarts": {"rollout": 1}, "weights.transport": "broadcast"}))
    log = tmp_path / "vllm_dies.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "stream_rlhf.cli", "run", str(config)], stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    try:
        wait_for_iterations(process, log, tmp_path / "vllm_dies" / "metrics.jsonl", 2, timeout_s=300)
        engine_pid = int(re.findall(r"vLLM engine ready in \S+ \(pid (\d+)", log.read_text())[0])
        os.killpg(engine_pid, signal.SIGKILL)  # the engine leads a process group: vLLM's processes with it
        assert process.wait(timeout=400) == 0, log.read_text()[-4000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text()
    assert re.search(r"the vLLM engine process exited with code -9", text), text[-4000:]
    assert "rollout-0 exited with 1: restarting it in " in text, text[-4000:]
    assert len(re.findall(r"vLLM engine ready in ", text)) == 2  # the new instance's engine
    assert "weight-sync group 'rollout-0': the restarted receiver joined" in text, text[-4000:]
    summary = json.loads((tmp_path / "vllm_dies" / "summary.json").read_text())
    assert summary["iterations"] == iterations and summary["samples_trained"] == iterations * 2 * 16
    assert summary["samples_dropped"] == 0 and summary["max_staleness"] <= 1
    assert summary["episodes_failed"].get("raised", 0) > 0
    assert [r["iteration"] for r in read_metrics(tmp_path / "vllm_dies" / "metrics.jsonl")] == list(range(iterations))
    steps = _rollout_steps(tmp_path / "vllm_dies" / "trace.json")
    assert any(b[0] < a[1] for a, b in zip(steps, steps[1:])), steps  # one began before the one before ended
