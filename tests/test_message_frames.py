"""Observations as chat messages (`Observation.role`): the frame a chat template writes around a
message after an assistant turn makes an episode read, token for token, as `apply_chat_template`
writes the whole conversation (ChatML, and a template that wraps a tool's answer as Qwen2.5's
does); a turn cut before its end-of-turn token gets it; a job without a template, or a role the
template refuses, fails the episode as "malformed". The episode test runs the real episode loop,
torch turn sampler and stepper over a tiny model whose vocabulary has the ChatML tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from stream_rlhf.backends.episode_sampler import TorchTurnSampler
from stream_rlhf.backends.torch_rollout import SamplingParams
from stream_rlhf.data.message_frames import MessageFrames
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.environment import EpisodeStart
from stream_rlhf.envs.episode_loop import EpisodeLoop, EpisodeResult
from stream_rlhf.envs.stepper import EnvStepper
from stream_rlhf.models.tokenizer import build_tokenizer
from tests.tiny_models import tiny_qwen2_config

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WRAPS_TOOLS = (  # Qwen2.5's way (in the tiny alphabet's characters): a run of tool answers is one user turn
    "{% for message in messages %}{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\nresult: {{ message['content'] }} ."
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message['role'] in ['user', 'assistant'] %}<|im_start|>"
    "{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% else %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["\n"])  # (not in the tiny alphabet)
    return tokenizer


TOKENIZER = chat_tokenizer()
END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def rendered(turns: list[dict], template: str) -> list[int]:
    return encode(TOKENIZER.apply_chat_template(turns, chat_template=template, add_generation_prompt=True,
                                                tokenize=False))


@pytest.mark.parametrize("template", [CHATML, WRAPS_TOOLS])
@pytest.mark.parametrize("roles", [("tool",), ("user",), ("tool", "tool"), ("tool", "tool", "user")])
def test_an_episode_with_role_observations_reads_as_the_template_writes_the_conversation(template, roles):
    frames = MessageFrames(TOKENIZER, template)
    turns = [{"role": "user", "content": "12+7+5=?"}]
    ids = rendered(turns, template)  # the prompt, ending with the assistant header
    for answer, observation in (("calc:12+7", "=19"), ("calc:19+5", "=24")):
        ids += encode(answer) + [END]  # the policy's turn, ended by its end-of-turn token
        contents = [f"{observation}{k}" for k in range(len(roles))]
        pieces = frames.around(roles, END)
        ids += pieces[0] + [t for content, after in zip(contents, pieces[1:]) for t in encode(content) + after]
        turns += [{"role": "assistant", "content": answer},
                  *({"role": role, "content": content} for role, content in zip(roles, contents))]
    assert ids == rendered(turns, template)
    if template == WRAPS_TOOLS and roles == ("tool", "tool"):  # one user turn holds both answers
        between = TOKENIZER.decode(frames.around(roles, END)[1])
        assert "result" in between and "<|im_start|>" not in between


def test_a_turn_cut_before_its_end_of_turn_token_gets_it_first():
    frames = MessageFrames(TOKENIZER, CHATML)
    before, after = frames.around(("tool",), encode("9")[0])
    assert before == [END, *frames.around(("tool",), END)[0]]
    written = "<|im_end|>\n<|im_start|>tool\n=1<|im_end|>\n<|im_start|>assistant\n"
    assert TOKENIZER.decode(before + encode("=1") + after) == written


def test_messages_need_a_template_that_writes_the_role():
    with pytest.raises(ValueError, match=r"Observation.role='tool': needs a chat template \(data.chat_template"):
        MessageFrames.of(TOKENIZER, "none").around(("tool",), END)
    with pytest.raises(ValueError, match="Observation.role='system': the chat template cannot write such messages "
                                         r"\(unknown role system\)"):
        MessageFrames(TOKENIZER, WRAPS_TOOLS).around(("system",), END)
    drops = CHATML.replace("{{ message['content'] }}", "{{ message['content'][:3] }}")
    with pytest.raises(ValueError, match="does not write the assistant turn and the messages' contents as given"):
        MessageFrames(TOKENIZER, drops).around(("tool",), END)


def run_episodes(frames: MessageFrames | None, turns: int = 3, **options: object) -> EpisodeResult:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(len(TOKENIZER))).eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=(TOKENIZER.eos_token_id, END),
                            pad_token_id=TOKENIZER.pad_token_id)
    cfg = EnvConfig(factory="tests.episode_envs:Messages", options={"turns": turns, **options}, max_turns=turns,
                    max_episode_tokens=200)
    prompts = [torch.tensor(rendered([{"role": "user", "content": f"{k}+7=?"}], CHATML)) for k in range(4)]
    loop = EpisodeLoop(cfg, lambda ids: TOKENIZER.decode(ids, skip_special_tokens=True), encode, 4, frames)
    sampler = TorchTurnSampler(model, len(prompts), 200, params, (1,), policy_version=0)
    stepper = EnvStepper(cfg.step_timeout_s, cfg.threads(len(prompts)))
    try:
        return loop.run([EpisodeStart("q", "a") for _ in prompts], prompts, None, sampler, stepper)
    finally:
        sampler.close()
        stepper.close()


def test_the_episode_loop_writes_each_observation_in_its_message_frame_without_loss():
    frames = MessageFrames(TOKENIZER, CHATML)
    result = run_episodes(frames)
    assert result.ended == ["done"] * 4, result.failures
    cut = closed = 0
    for episode in result.episodes:
        ends = episode.turn_ends
        assert len(ends) == 3
        for end, next_start in zip(ends, [episode.loss_mask.index(1, e + 1) for e in ends[:-1]]):
            last = episode.token_ids[end]
            before, after = frames.around(("tool",), last)
            assert episode.token_ids[end + 1:next_start] == before + encode("=19") + after
            assert episode.loss_mask[end + 1:next_start] == [0] * (next_start - end - 1)
            cut += last != END
            closed += last == END
    assert cut > 0 and closed > 0  # turns cut at max_new_tokens got <|im_end|> from their observation, others had it


def test_without_a_template_a_role_observation_fails_the_episode_as_malformed():
    result = run_episodes(MessageFrames(TOKENIZER, None), turns=2)
    assert result.ended == ["failed:malformed"] * 4
    assert all("Observation.role='tool': needs a chat template" in failure for failure in result.failures)
    assert [episode.turns for episode in result.episodes] == [1] * 4


def test_a_turn_may_answer_several_messages_written_as_one_run():
    """Two tool messages after each turn (one per call) under the template that groups them."""
    frames = MessageFrames(TOKENIZER, WRAPS_TOOLS)
    result = run_episodes(frames, roles=["tool", "tool"])
    assert result.ended == ["done"] * 4, result.failures
    for episode in result.episodes:
        end = episode.turn_ends[0]
        first, between, after = frames.around(("tool", "tool"), episode.token_ids[end])
        observation = first + encode("=190") + between + encode("=191") + after
        assert episode.token_ids[end + 1:end + 1 + len(observation)] == observation


@pytest.mark.parametrize(("roles", "message"), [
    (["tool", None], "a turn's observations all have a role or none has"),
    (["system"], "Observation.role='system': the chat template cannot write such messages"),
])
def test_observations_the_template_cannot_write_fail_the_episode_as_malformed(roles, message):
    result = run_episodes(MessageFrames(TOKENIZER, WRAPS_TOOLS), turns=2, roles=roles)
    assert result.ended == ["failed:malformed"] * 4
    assert all(message in failure for failure in result.failures), result.failures
