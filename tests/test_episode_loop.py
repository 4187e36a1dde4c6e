"""The episode loop over the real torch turn sampler and the real environment stepper: episodes end
for the right reason with the right tokens, failures end only their episode, limits are the
engine's, and `stream` lets the other episodes go on while one waits for its tool."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Sequence

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from stream_rlhf.backends.episode_sampler import TorchTurnSampler
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.config import ConfigError
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.environment import EpisodeStart, Observation, Turn
from stream_rlhf.envs.episode_handle import episode_tensors
from stream_rlhf.envs.episode_loop import EpisodeLoop, EpisodeResult
from stream_rlhf.envs.observation_cut import ObservationCut
from stream_rlhf.envs.stepper import EnvStepper
from stream_rlhf.models.tokenizer import build_tokenizer
from stream_rlhf.samples import unragged
from tests.episode_envs import Jittery
from tests.tiny_models import tiny_qwen2_config

TOKENIZER = build_tokenizer()
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=(TOKENIZER.eos_token_id,),
                        pad_token_id=TOKENIZER.pad_token_id)
CALLS: list[tuple[int, int]] = []
"""(episode, turn) of every step of the `Ordered` environments, in call order."""
CALLS_LOCK = threading.Lock()
OTHERS_DONE = threading.Event()


@pytest.fixture(scope="module")
def lm() -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen2_config(len(TOKENIZER))).eval()


class Scripted:
    """Answers every turn with `observation`; done after `turns` turns, reward 0.25 per turn."""

    def __init__(self, turns: int = 3, observation: str = "=12", fail: str = "", fail_turn: int = 0):
        self.turns, self.observation, self.fail, self.fail_turn = turns, observation, fail, fail_turn
        self.seen = 0

    def reset(self, start: EpisodeStart) -> None:
        if self.fail == "reset":
            raise RuntimeError("no such sample")

    async def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        self.seen += 1
        if self.seen == self.fail_turn:
            if self.fail == "raise":
                raise ValueError("tool crashed")
            if self.fail == "hang":
                await asyncio.sleep(60)
            if self.fail == "malformed":
                return 3  # type: ignore[return-value]
        return Turn(Observation(self.observation), reward=0.25, done=self.seen >= self.turns)


class Ordered:
    """Records the order of its calls; the `slow` one waits until the others are done."""

    def __init__(self, key: int, slow: bool = False):
        self.key, self.slow, self.seen = key, slow, 0

    def reset(self, start: EpisodeStart) -> None:
        pass

    def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        self.seen += 1
        with CALLS_LOCK:
            CALLS.append((self.key, self.seen))
        if self.slow and self.seen == 1:
            assert OTHERS_DONE.wait(timeout=20), "the other episodes did not go on while this one waited"
        if not self.slow and self.seen == 3:
            with CALLS_LOCK:
                if sum(turn == 3 for _, turn in CALLS) == 3:
                    OTHERS_DONE.set()
        return Turn(Observation("=1"), done=self.seen >= 3)


class Closing(Scripted):
    """`Scripted` with a `close` (async or sync; raising or hanging when asked) that records, per
    environment, every call in order in EVENTS."""

    def __init__(self, closing: str = "async", **options: object):
        super().__init__(**options)  # type: ignore[arg-type]
        self.closing = closing
        self.events: list[str] = []
        EVENTS.append(self.events)

    def reset(self, start: EpisodeStart) -> None:
        self.events.append("reset")
        super().reset(start)

    async def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        self.events.append("step")
        return await super().step(text, token_ids)

    def close(self) -> Awaitable[None] | None:
        if self.closing == "sync":
            self.events.append("close")
            return None
        return self._close()

    async def _close(self) -> None:
        self.events.append("close")
        if self.closing == "raise":
            raise OSError("sandbox gone")
        if self.closing == "hang":
            await asyncio.sleep(60)


EVENTS: list[list[str]] = []
"""The calls each `Closing` environment got, one list per environment made."""


def scripted(**options: object) -> Scripted:
    return Scripted(**options)  # type: ignore[arg-type]


def jittery(**options: object) -> Jittery:
    return Jittery(**options)  # type: ignore[arg-type]


def closing(**options: object) -> Closing:
    return Closing(**options)  # type: ignore[arg-type]


ORDERED_KEYS = iter(())


def ordered(slow_key: int = -1) -> Ordered:
    key = next(ORDERED_KEYS)
    return Ordered(key, slow=key == slow_key)


def run(lm: PreTrainedModel, factory: str, n: int = 4, seed: int = 0, **env: object) -> EpisodeResult:
    options = env.pop("options", {})
    cfg = EnvConfig(factory=f"tests.test_episode_loop:{factory}", options=options, **env)  # type: ignore[arg-type]
    prompts = [torch.tensor(TOKENIZER.encode(f"<bos>{i}+{i}=", add_special_tokens=False)) for i in range(n)]
    loop = EpisodeLoop(cfg, lambda ids: TOKENIZER.decode(ids, skip_special_tokens=True),
                       lambda text: TOKENIZER.encode(text, add_special_tokens=False), PARAMS.max_new_tokens)
    sampler = TorchTurnSampler(lm, n, max(cfg.max_episode_tokens, 16), PARAMS,
                               (seed,), policy_version=7)
    stepper = EnvStepper(cfg.step_timeout_s, cfg.workers)
    try:
        return loop.run([EpisodeStart(f"{i}+{i}=", str(2 * i)) for i in range(n)], prompts, None, sampler, stepper)
    finally:
        sampler.close()
        stepper.close()


def test_episodes_alternate_policy_turns_and_observations(lm: PreTrainedModel) -> None:
    result = run(lm, "scripted", max_episode_tokens=200)
    observation = TOKENIZER.encode("=12", add_special_tokens=False)
    assert result.ended == ["done"] * 4
    assert result.tool_calls == [3] * 4
    for episode in result.episodes:
        assert episode.turns == 3
        assert episode.turn_rewards == [0.25] * 3
        mask = episode.loss_mask
        # policy turn, observation, policy turn, observation, policy turn: the observations exactly the tool's ids
        ends = episode.turn_ends
        for end in ends[:-1]:
            assert episode.token_ids[end + 1:end + 1 + len(observation)] == observation
            assert mask[end + 1:end + 1 + len(observation)] == [0] * len(observation)
        assert sum(mask) == len(mask) - 2 * len(observation)
        assert set(v for v, m in zip(episode.policy_versions, mask) if m) == {7}
        assert ends[-1] == len(episode.token_ids) - 1  # done: the last turn's observation is not appended
    tensors = episode_tensors(result.episodes)
    assert [float(r.sum()) for r in unragged(tensors, "env_rewards")] == [0.75] * 4


@pytest.mark.parametrize(("fail", "reason", "turns"), [
    ("raise", "failed:raised", 2), ("hang", "failed:timeout", 2), ("malformed", "failed:malformed", 2),
    ("reset", "failed:raised", 1),
])
def test_a_failing_environment_ends_only_its_episode(lm: PreTrainedModel, fail: str, reason: str, turns: int) -> None:
    cfg = {"options": {"fail": fail, "fail_turn": 2}, "step_timeout_s": 0.5, "max_episode_tokens": 200}
    result = run(lm, "scripted", **cfg)
    assert result.ended == [reason] * 4
    assert [e.turns for e in result.episodes] == [turns] * 4
    for episode in result.episodes:  # the failing turn's reward is 0; the ones before keep theirs
        assert episode.turn_rewards == ([0.25, 0.0] if turns == 2 else [0.0])
    assert len(result.failures) == 4 and all(f"episode {i}:" in f for i, f in enumerate(result.failures))


def test_the_engine_enforces_turn_and_token_limits(lm: PreTrainedModel) -> None:
    result = run(lm, "scripted", options={"turns": 99}, max_turns=2, max_episode_tokens=200)
    assert result.ended == ["max_turns"] * 4 and [e.turns for e in result.episodes] == [2] * 4
    result = run(lm, "scripted", options={"turns": 99, "observation": "=" + "1" * 10}, max_episode_tokens=30)
    assert result.ended == ["max_episode_tokens"] * 4
    for episode in result.episodes:
        assert episode.num_tokens <= 30  # the observation that would pass the limit is not appended
        assert episode.turn_ends[-1] == len(episode.token_ids) - 1


@pytest.mark.parametrize(("where", "kept"), [("end", "=123456"), ("start", "3456789"), ("middle", "=123789")])
def test_a_long_observation_is_cut_to_its_limit_instead_of_ending_the_episode(lm: PreTrainedModel, where: str,
                                                                               kept: str) -> None:
    long = "=123456789"  # 10 tokens of the tiny tokenizer, one per character
    cfg = {"options": {"turns": 3, "observation": long}, "max_episode_tokens": 60, "max_observation_tokens": 8,
           "observation_cut": where, "observation_cut_marker": "+"}
    result = run(lm, "scripted", **cfg)
    assert result.ended == ["done"] * 4 and result.observations_cut == [2] * 4  # the last turn's is not appended
    marked = {"end": kept + "+", "start": "+" + kept, "middle": kept[:4] + "+" + kept[4:]}[where]
    appended = TOKENIZER.encode(marked, add_special_tokens=False)
    assert len(appended) == 8
    for episode in result.episodes:
        for end in episode.turn_ends[:-1]:
            assert episode.token_ids[end + 1:end + 1 + 8] == appended
    assert run(lm, "scripted", **{**cfg, "max_observation_tokens": 10}).observations_cut == [0] * 4  # it fits


def test_an_observation_cut_marker_that_fills_the_limit_is_a_config_error() -> None:
    cfg = EnvConfig(factory="tests.test_episode_loop:scripted", max_observation_tokens=2, observation_cut_marker="+++")
    with pytest.raises(ConfigError, match=r"env.observation_cut_marker='\+\+\+' is 3 tokens, which leaves nothing "
                                          r"of env.max_observation_tokens=2"):
        ObservationCut(cfg, lambda text: TOKENIZER.encode(text, add_special_tokens=False))


def test_stream_lets_other_episodes_go_on_while_one_waits(lm: PreTrainedModel) -> None:
    global ORDERED_KEYS
    CALLS.clear()
    OTHERS_DONE.clear()
    ORDERED_KEYS = iter(range(4))
    result = run(lm, "ordered", options={"slow_key": 0}, schedule="stream", step_timeout_s=30)
    assert result.ended == ["done"] * 4
    slow_done = CALLS.index((0, 2))
    assert {(key, 3) for key in (1, 2, 3)} <= set(CALLS[:slow_done])  # they finished while episode 0 waited


def test_lockstep_starts_each_round_together(lm: PreTrainedModel) -> None:
    global ORDERED_KEYS
    CALLS.clear()
    ORDERED_KEYS = iter(range(4))
    result = run(lm, "ordered", schedule="lockstep")
    assert result.ended == ["done"] * 4
    rounds = [turn for _, turn in CALLS]
    assert rounds == sorted(rounds)  # every turn-1 step before any turn-2 step, and so on


def test_an_episodes_tokens_do_not_depend_on_when_the_tools_answer(lm: PreTrainedModel) -> None:
    """The same episodes, sampled at temperature 1: under stream with the tools' delays drawn one
    way and another (`Jittery`: the episodes' turns interleave differently), and under lockstep."""
    runs = [run(lm, "jittery", options={"jitter": jitter}, schedule=schedule, max_episode_tokens=200)
            for schedule, jitter in (("stream", 1), ("stream", 2), ("lockstep", 0))]
    assert all(r.ended == ["done"] * 4 for r in runs)
    tokens = [[e.token_ids for e in r.episodes] for r in runs]
    assert tokens[1] == tokens[0] and tokens[2] == tokens[0]
    assert len({tuple(t) for t in tokens[0]}) == 4  # sampled, not one greedy answer


@pytest.mark.parametrize(("options", "env", "ended"), [
    ({"turns": 2}, {}, "done"),
    ({"turns": 99}, {"max_turns": 2}, "max_turns"),
    ({"turns": 99, "observation": "=" + "1" * 10}, {"max_episode_tokens": 30}, "max_episode_tokens"),
    ({"fail": "raise", "fail_turn": 2}, {}, "failed:raised"),
    ({"fail": "hang", "fail_turn": 2}, {"step_timeout_s": 0.5}, "failed:timeout"),
    ({"fail": "malformed", "fail_turn": 2}, {}, "failed:malformed"),
    ({"fail": "reset"}, {}, "failed:raised"),
    ({"turns": 2, "closing": "sync"}, {}, "done"),
])
def test_every_ending_closes_the_environment_once_after_its_last_call(
        lm: PreTrainedModel, options: dict, env: dict, ended: str) -> None:
    EVENTS.clear()
    result = run(lm, "closing", options=options, **{"max_episode_tokens": 200, **env})
    assert result.ended == [ended] * 4
    assert len(EVENTS) == 4  # made in episode order
    for events, steps in zip(EVENTS, result.tool_calls):
        assert events == ["reset"] + ["step"] * steps + ["close"]


def _parts(lm: PreTrainedModel, cfg: EnvConfig, n: int
           ) -> tuple[list[torch.Tensor], EpisodeLoop, TorchTurnSampler, EnvStepper]:
    """n prompts, and a loop, sampler and stepper for them."""
    prompts = [torch.tensor(TOKENIZER.encode(f"<bos>{i}+{i}=", add_special_tokens=False)) for i in range(n)]
    loop = EpisodeLoop(cfg, lambda ids: TOKENIZER.decode(ids, skip_special_tokens=True),
                       lambda text: TOKENIZER.encode(text, add_special_tokens=False), PARAMS.max_new_tokens)
    sampler = TorchTurnSampler(lm, n, 200, PARAMS, (0,), 0)
    return prompts, loop, sampler, EnvStepper(cfg.step_timeout_s, n)


@pytest.mark.parametrize("how", ["raise", "hang"])
def test_a_failing_close_is_reported_and_leaves_its_episode_as_it_ended(lm: PreTrainedModel, how: str) -> None:
    EVENTS.clear()
    cfg = EnvConfig(factory="tests.test_episode_loop:closing", options={"turns": 2, "closing": how},
                    max_episode_tokens=200, step_timeout_s=0.5)
    prompts, loop, sampler, stepper = _parts(lm, cfg, 2)
    result = loop.run([EpisodeStart("1+1=", "2")] * 2, prompts, None, sampler, stepper)
    sampler.close()
    stepper.close()  # waits for the closes, each bounded by step_timeout_s
    assert result.ended == ["done"] * 2 and not result.failures
    failures = stepper.close_failures()
    expected = "raised OSError: sandbox gone" if how == "raise" else "ran past env.step_timeout_s=0.5"
    assert len(failures) == 2 and all("Closing.close " in f and expected in f for f in failures)
    assert stepper.close_failures() == []  # reported once


def test_rollout_stopping_closes_the_environments_of_episodes_in_flight(lm: PreTrainedModel) -> None:
    EVENTS.clear()
    cfg = EnvConfig(factory="tests.test_episode_loop:closing", options={"turns": 99, "fail": "hang", "fail_turn": 1},
                    max_episode_tokens=200, step_timeout_s=30)
    prompts, loop, sampler, stepper = _parts(lm, cfg, 3)
    loop.open(sampler, stepper, None, slots=3)
    loop.add("mb", [EpisodeStart("1+1=", "2")] * 3, prompts, None)
    while sum(events.count("step") for events in EVENTS) < 3:  # every episode waits in its first step
        assert not loop.advance()
    sampler.close()
    stepper.close()
    assert EVENTS == [["reset", "step", "close"]] * 3
