"""The environment side of multi-turn episodes: the episode record's masks and rewards, the
stepper's outcomes for environments that work, raise, hang or return nonsense, the calculator tool
and the `env` config."""

from __future__ import annotations

import asyncio
import threading

import pytest

from stream_rlhf.config import ConfigError, build
from stream_rlhf.envs.calculator import Calculator, evaluate
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.environment import EpisodeStart, Observation, Turn
from stream_rlhf.envs.episode import OBSERVATION_VERSION, Episode, limit_reached
from stream_rlhf.envs.stepper import EnvStepper
from tests.waiting import wait_for

START = EpisodeStart(prompt="123+456+789=", reference="579,1368")


def test_episode_masks_logps_versions_and_rewards_follow_the_turns():
    episode = Episode(prompt_ids=[1, 5, 6])
    episode.add_policy_turn([10, 11, 2], [-0.1, -0.2, -0.3], policy_version=3)
    episode.set_turn_reward(0.25)
    episode.add_observation([20, 21])
    episode.add_policy_turn([12, 2], [-0.4, -0.5], policy_version=4)
    episode.set_turn_reward(1.0)
    t = episode.response_tensors()
    assert t["token_ids"].tolist() == [10, 11, 2, 20, 21, 12, 2]
    assert t["loss_mask"].tolist() == [True, True, True, False, False, True, True]
    assert t["behavior_logp"].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5])
    assert t["policy_versions"].tolist() == [3, 3, 3, OBSERVATION_VERSION, OBSERVATION_VERSION, 4, 4]
    assert t["token_rewards"].tolist() == [0.0, 0.0, 0.25, 0.0, 0.0, 0.0, 1.0]
    assert (episode.turns, episode.num_policy_tokens, episode.num_tokens) == (2, 5, 10)


def test_episode_refuses_what_cannot_be_an_episode():
    episode = Episode(prompt_ids=[1])
    with pytest.raises(ValueError, match="must follow a policy turn"):
        episode.add_observation([5])
    with pytest.raises(ValueError, match="no policy turn"):
        episode.set_turn_reward(1.0)
    with pytest.raises(ValueError, match="2 token ids but 1 log-probs"):
        episode.add_policy_turn([3, 4], [-0.1], policy_version=0)


def test_limits_end_an_episode_by_turns_then_by_tokens():
    episode = Episode(prompt_ids=[1, 2])
    assert limit_reached(episode, max_turns=2, max_episode_tokens=8) is None
    episode.add_policy_turn([3, 4], [0.0, 0.0], policy_version=0)
    episode.add_observation([5, 6, 7])
    assert limit_reached(episode, max_turns=2, max_episode_tokens=8) is None
    assert limit_reached(episode, max_turns=1, max_episode_tokens=8) == "max_turns"
    episode.add_observation([8])
    assert limit_reached(episode, max_turns=2, max_episode_tokens=8) == "max_episode_tokens"


class Scripted:
    """A sync environment that answers with `replies` in turn; `hang` blocks a step until released."""

    def __init__(self, replies: list[object], hang: threading.Event | None = None) -> None:
        self.replies = list(replies)
        self.hang = hang
        self.seen: list[tuple[str, list[int]]] = []

    def reset(self, start: EpisodeStart) -> None:
        self.seen.clear()

    def step(self, text: str, token_ids: list[int]) -> object:
        self.seen.append((text, list(token_ids)))
        if self.hang is not None:
            self.hang.wait(10)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def drain(stepper: EnvStepper, count: int) -> list:
    outcomes = []
    while len(outcomes) < count:
        got = stepper.wait(10)
        assert got, f"only {len(outcomes)} of {count} outcomes arrived"
        outcomes.extend(got)
    return outcomes


def test_stepper_returns_turns_and_names_each_failure_without_raising():
    stepper = EnvStepper(step_timeout_s=0.5, workers=4)
    released = threading.Event()
    envs = {
        "ok": Scripted([Turn(Observation("=3"), reward=0.5)]),
        "raises": Scripted([KeyError("tool down")]),
        "hangs": Scripted([Turn(None)], hang=released),
        "not a turn": Scripted([{"observation": "=3"}]),
        "nan reward": Scripted([Turn(None, reward=float("nan"))]),
        "bad observation": Scripted([Turn("=3")]),  # type: ignore[arg-type]
        "bad message": Scripted([Turn((Observation("=3", role="tool"), "=4"))]),  # type: ignore[arg-type]
        "messages": Scripted([Turn((Observation("=3", role="tool"), Observation("=4", role="tool")))]),
    }
    try:
        for key, env in envs.items():
            stepper.reset(key, env, START)
        assert all(o.failure is None and o.turn is None for o in drain(stepper, len(envs)))
        for key, env in envs.items():
            stepper.step(key, env, "calc:1+2", [7, 8])
        outcomes = {o.key: o for o in drain(stepper, len(envs))}
    finally:
        released.set()
        stepper.close()
    assert stepper.in_flight == 0
    assert outcomes["ok"].turn == Turn(Observation("=3"), reward=0.5) and outcomes["ok"].failure is None
    assert envs["ok"].seen == [("calc:1+2", [7, 8])]
    reasons = {key: (o.failure.reason if o.failure else None) for key, o in outcomes.items()}
    assert reasons == {"ok": None, "raises": "raised", "hangs": "timeout", "not a turn": "malformed",
                       "nan reward": "malformed", "bad observation": "malformed", "bad message": "malformed",
                       "messages": None}
    assert "KeyError: 'tool down'" in outcomes["raises"].failure.message
    assert "env.step_timeout_s=0.5" in outcomes["hangs"].failure.message
    assert "expected envs.environment.Turn" in outcomes["not a turn"].failure.message
    assert "reward=nan" in outcomes["nan reward"].failure.message
    assert "observation='=4': expected Observation(" in outcomes["bad message"].failure.message
    assert all(o.turn is None for key, o in outcomes.items() if key not in ("ok", "messages"))


class WaitsForTheOthers(Scripted):
    """A sync tool whose step returns only once `barrier.parties` steps are inside it at once."""

    def __init__(self, barrier: threading.Barrier):
        super().__init__([Turn(None, reward=1.0, done=True)])
        self.barrier = barrier

    def step(self, text: str, token_ids: list[int]) -> Turn:
        self.barrier.wait(timeout=30)
        return super().step(text, token_ids)


@pytest.mark.parametrize("workers", [None, 8])
def test_sync_calls_get_a_thread_per_episode_in_flight_unless_workers_says_otherwise(workers):
    """env.workers null (the default): as many threads as episodes in flight, so all 40 sync tool
    calls run at once; with env.workers=8 only 8 do, and the rest wait for a thread."""
    episodes = 40
    cfg = EnvConfig(factory="stream_rlhf.envs.calculator:Calculator", workers=workers)
    threads = cfg.threads(episodes)
    assert threads == (workers or episodes)
    stepper = EnvStepper(step_timeout_s=60, workers=threads)
    barrier = threading.Barrier(episodes)
    try:
        for key in range(episodes):
            stepper.step(key, WaitsForTheOthers(barrier), "calc:1+2", [7])
        if threads < episodes:  # the threads are all inside, the other calls queued behind them
            wait_for(lambda: barrier.n_waiting == threads, 30, f"{threads} calls in the tool")
            assert stepper.poll() == [] and barrier.n_waiting == threads
            barrier.abort()
        outcomes = drain(stepper, episodes)
    finally:
        barrier.abort()
        stepper.close()
    assert {o.failure.reason if o.failure else None for o in outcomes} == ({None} if workers is None else {"raised"})


def test_a_reset_that_returns_something_is_malformed():
    class ReturnsPrompt(Scripted):
        def reset(self, start: EpisodeStart) -> object:  # type: ignore[override]
            return start.prompt

    stepper = EnvStepper(step_timeout_s=5, workers=1)
    stepper.reset("e", ReturnsPrompt([]), START)
    [outcome] = drain(stepper, 1)
    stepper.close()
    assert outcome.failure.reason == "malformed" and "reset returned str" in outcome.failure.message


def test_a_waiting_tool_does_not_hold_back_the_others():
    """Async calls overlap: a call submitted first but released last arrives last."""
    gate = asyncio.Event()

    class Gated:
        async def reset(self, start: EpisodeStart) -> None:
            pass

        async def step(self, text: str, token_ids: list[int]) -> Turn:
            if text == "slow":
                await gate.wait()
            return Turn(Observation(text))

    stepper = EnvStepper(step_timeout_s=10, workers=1)
    stepper.step("slow", Gated(), "slow", [1])
    stepper.step("fast", Gated(), "fast", [2])
    first = drain(stepper, 1)
    assert [o.key for o in first] == ["fast"]
    stepper._loop.call_soon_threadsafe(gate.set)
    second = drain(stepper, 1)
    stepper.close()
    assert [o.key for o in second] == ["slow"] and second[0].turn.observation.text == "slow"


def test_calculator_answers_calls_and_scores_the_final_answer():
    stepper = EnvStepper(step_timeout_s=5, workers=1)
    env = Calculator(latency_s=0.01)
    stepper.reset(0, env, START)
    drain(stepper, 1)
    for text in ("calc:123+456+789", "calc: 2*3+4", "calc:12+", "1368"):
        stepper.step(0, env, text, [])
        drain(stepper, 1)
    stepper.step(1, env, "1367", [])  # the same env again: a wrong answer
    [wrong] = drain(stepper, 1)
    stepper.close()
    assert env.calls == 3
    assert (evaluate("123+456+789"), evaluate("2*3+4-1"), evaluate("1+"), evaluate("9**2")) == (1368, 9, None, None)
    assert wrong.turn.done and wrong.turn.observation is None and wrong.turn.reward == 0.1


def test_calculator_turns_in_order():
    env = Calculator()
    asyncio.run(env.reset(START))
    turns = [asyncio.run(env.step(text, [])) for text in ("calc:123+456+789", "calc:12+", "1368")]
    assert [t.observation.text if t.observation else None for t in turns] == ["=1368", "=?", None]
    assert [t.done for t in turns] == [False, False, True] and turns[-1].reward == 1.0


def test_env_config_builds_the_factory_and_names_bad_keys():
    cfg = build(EnvConfig, {"factory": "stream_rlhf.envs.calculator:Calculator", "options": {"latency_s": 0.5},
                            "max_turns": 3}, "env")
    env = cfg.make()
    assert isinstance(env, Calculator) and env.latency_s == 0.5
    with pytest.raises(ConfigError, match="env.factory='stream_rlhf.envs.calculator:Nope'.*has no Nope"):
        build(EnvConfig, {"factory": "stream_rlhf.envs.calculator:Nope"}, "env")
    with pytest.raises(ConfigError, match="env.factory=.*not callable"):
        build(EnvConfig, {"factory": "stream_rlhf.envs.calculator:CALL_PREFIX"}, "env")
    with pytest.raises(ConfigError, match="max_turns=0"):
        build(EnvConfig, {"factory": "stream_rlhf.envs.calculator:Calculator", "max_turns": 0}, "env")


def test_stepper_close_abandons_a_call_that_never_returns():
    released = threading.Event()
    stepper = EnvStepper(step_timeout_s=30, workers=1)
    stepper.step("stuck", Scripted([Turn(None)], hang=released), "x", [])
    stepper.close()
    released.set()
    assert stepper.poll() == [] and stepper.in_flight == 1
