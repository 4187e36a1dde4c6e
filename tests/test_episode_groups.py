"""Several groups of episodes (mini-batches) in flight on one turn sampler: a group added while
another's episodes wait for their tool decodes meanwhile and comes back as soon as its own
episodes end, slots are reused, and a weight change during a turn is recorded per token. And the
lock-step baseline calls a round's environments only once the round's generation is over."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from stream_rlhf.backends.episode_sampler import TorchTurnSampler
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.environment import EpisodeStart, Observation, Turn
from stream_rlhf.envs.episode_loop import EpisodeLoop
from stream_rlhf.envs.stepper import EnvStepper
from stream_rlhf.envs.turns import TurnDone, TurnRequest
from stream_rlhf.models.tokenizer import build_tokenizer
from tests.tiny_models import tiny_qwen2_config

TOKENIZER = build_tokenizer()
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=(TOKENIZER.eos_token_id,),
                        pad_token_id=TOKENIZER.pad_token_id)
GATE = threading.Event()
"""The `Gated` environments' first step waits for it."""
AT_GATE: list[int] = []
"""One entry per `Gated` step that waits at the gate."""


class Gated:
    """Two turns; its first step waits for GATE when `gated` (reset fields say which), reward 1."""

    def __init__(self) -> None:
        self.gated, self.seen = False, 0

    def reset(self, start: EpisodeStart) -> None:
        self.gated = bool(start.fields.get("gated"))

    def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        self.seen += 1
        if self.gated and self.seen == 1:
            AT_GATE.append(1)
            assert GATE.wait(timeout=30), "the test never opened the gate"
        return Turn(Observation("=1"), reward=1.0, done=self.seen >= 2)


EVENTS: list[str] = []
""""end" for every turn the sampler ended, "call" for every environment step, in order."""


class Logged:
    """Three turns, each step logged in EVENTS."""

    def __init__(self) -> None:
        self.seen = 0

    def reset(self, start: EpisodeStart) -> None:
        pass

    def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        self.seen += 1
        EVENTS.append("call")
        return Turn(Observation("=1"), done=self.seen >= 3)


class LoggingSampler(TorchTurnSampler):
    def advance(self) -> list[TurnDone]:
        done = super().advance()
        EVENTS.extend("end" for _ in done)
        return done


@pytest.fixture(scope="module")
def lm() -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen2_config(len(TOKENIZER))).eval()


def group(n: int, gated: bool) -> tuple[list[EpisodeStart], list[torch.Tensor]]:
    starts = [EpisodeStart(f"{i}+{i}=", str(2 * i), fields={"gated": gated}) for i in range(n)]
    return starts, [torch.tensor(TOKENIZER.encode(f"<bos>{i}+{i}=", add_special_tokens=False)) for i in range(n)]


def test_a_group_added_while_another_waits_ends_first(lm: PreTrainedModel) -> None:
    GATE.clear()
    AT_GATE.clear()
    cfg = EnvConfig(factory="tests.test_episode_groups:Gated", max_episode_tokens=64, workers=8)
    loop = EpisodeLoop(cfg, lambda ids: TOKENIZER.decode(ids, skip_special_tokens=True),
                       lambda text: TOKENIZER.encode(text, add_special_tokens=False), PARAMS.max_new_tokens)
    sampler = TorchTurnSampler(lm, 6, 64, PARAMS, (0,), policy_version=3)
    stepper = EnvStepper(cfg.step_timeout_s, cfg.workers)
    try:
        loop.open(sampler, stepper, None, slots=6)
        loop.add("a", *group(3, gated=True), None)
        assert loop.free_slots == 3
        with pytest.raises(ValueError, match="4 episodes, 3 free slots"):
            loop.add("x", *group(4, gated=False), None)
        ended = []
        while len(AT_GATE) < 3:
            ended += loop.advance()  # group a's first turns, until all three wait at the gate
        assert not ended and not sampler.busy
        loop.add("b", *group(3, gated=False), None)
        sampler.policy_version = 4  # the weights a joining mini-batch loads
        while not ended:
            ended += loop.advance()
        assert [tag for tag, _ in ended] == ["b"]  # b went through both turns while a waited
        b = ended[0][1]
        assert b.ended == ["done"] * 3 and all(e.turn_rewards == [1.0, 1.0] for e in b.episodes)
        assert all(set(e.policy_versions) == {-1, 4} for e in b.episodes)
        assert loop.free_slots == 3  # b's slots are free again
        loop.add("c", *group(3, gated=False), None)
        GATE.set()
        while loop.groups:
            ended += loop.advance()
        assert sorted(tag for tag, _ in ended) == ["a", "b", "c"]
        results = dict(ended)
        assert results["a"].ended == ["done"] * 3 and results["c"].ended == ["done"] * 3
        for episode in results["a"].episodes:  # turn 1 by version 3, turn 2 by 4
            versions = [v for v, m in zip(episode.policy_versions, episode.loss_mask) if m]
            assert versions[0] == 3 and versions[-1] == 4
        assert results["a"].tool_hidden_s > 0  # b and c decoded while a's tools ran
        assert loop.free_slots == 6
    finally:
        GATE.set()
        sampler.close()
        stepper.close()


def test_a_turn_across_a_weight_change_records_each_tokens_version(lm: PreTrainedModel) -> None:
    sampler = TorchTurnSampler(lm, 1, 32, SamplingParams(temperature=1.0, max_new_tokens=6, pad_token_id=0),
                               (0,), policy_version=5)
    sampler.start(TurnRequest(0, torch.tensor([1, 9, 10]), None, 6))
    done = sampler.advance() + sampler.advance() + sampler.advance()
    sampler.policy_version = 6
    while sampler.busy:
        done += sampler.advance()
    assert len(done) == 1
    turn = done[0]
    assert turn.policy_version == 5 and turn.versions.tolist() == [5, 5, 5, 6, 6, 6]
    sampler.close()


def test_lockstep_calls_a_rounds_environments_once_its_generation_is_over(lm: PreTrainedModel) -> None:
    EVENTS.clear()
    cfg = EnvConfig(factory="tests.test_episode_groups:Logged", max_episode_tokens=64, schedule="lockstep")
    loop = EpisodeLoop(cfg, lambda ids: TOKENIZER.decode(ids, skip_special_tokens=True),
                       lambda text: TOKENIZER.encode(text, add_special_tokens=False), PARAMS.max_new_tokens)
    # turns of 1 to 4 tokens (a stop token may come at any step): they end at different steps
    sampler = LoggingSampler(lm, 6, 64, PARAMS, (1,), policy_version=0)
    stepper = EnvStepper(cfg.step_timeout_s, cfg.workers)
    try:
        result = loop.run(*group(6, gated=False), None, sampler, stepper)
    finally:
        sampler.close()
        stepper.close()
    assert result.ended == ["done"] * 6
    runs = [EVENTS[0]]
    for event in EVENTS[1:]:  # consecutive runs of the same event
        runs[-1:] = [runs[-1] + "," + event] if runs[-1].startswith(event) else [runs[-1], event]
    assert [run.split(",") for run in runs] == [["end"] * 6, ["call"] * 6] * 3  # no call before a round's last end
