"""Tools as Python functions (`env.tools`, `stream_rlhf.envs.tool_calls:ToolCalls`): calls parsed
from a turn (Hermes, Qwen3-Coder and Llama 3 JSON formats) and run (sync and async), every failure
answered to the policy as an error without ending the episode, the final answer scored; the config
names a bad tool, and a dataset's prompts carry the tools' schemas exactly as
`apply_chat_template(..., tools=)` writes them."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from stream_rlhf.config import ConfigError, build
from stream_rlhf.data.prompts_jsonl import PromptDataset
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.envs.environment import EpisodeStart, Observation, Turn
from stream_rlhf.envs.tool_call_formats import hermes_calls, llama3_json_calls, qwen3_coder_calls
from stream_rlhf.envs.tool_calls import ToolCalls
from stream_rlhf.models.tokenizer import build_tokenizer
from tests.episode_envs import add, lookup

TOOLS = ["tests.episode_envs:add", "tests.episode_envs:lookup"]
WRITES_TOOLS = ("{% if tools %}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}.{% endif %}"
                "{% for message in messages %}{{ message['role'] }}: {% for part in message['content'] %}"
                "{{ part['text'] }}{% endfor %}.{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
"""Writes each tool's name before the conversation (a prompt's content comes as a list of parts)."""


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def step(env: ToolCalls, text: str) -> Turn:
    return asyncio.run(env.step(text, []))


def test_calls_are_parsed_from_every_tool_call_block():
    text = f"let me see {call('add', a=1, b=2)} and {call('lookup', key='x')}"
    assert hermes_calls(text) == [("add", {"a": 1, "b": 2}), ("lookup", {"key": "x"})]
    as_string = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert hermes_calls(as_string) == [("add", {"a": 1, "b": 2})]
    assert hermes_calls("the answer is 3") == []
    bad = hermes_calls("<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>")
    assert bad[0].startswith("error: the tool call is not JSON") and bad[1].startswith("error: a tool call is")


SCHEMAS = {"add": {"parameters": {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}},
           "config": {"parameters": {"properties": {"on": {"type": "boolean"}, "ratio": {"type": "number"},
                                                    "tags": {"type": "array"}, "note": {"type": "string"},
                                                    "limit": {"type": ["integer", "null"]}}}}}


def coder_call(name: str, **values: str) -> str:
    parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in values.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def test_qwen3_coder_calls_take_their_types_from_the_schema():
    text = "I will add. " + coder_call("add", a="12", b="-7") + coder_call(
        "config", on="True", ratio="0.5", tags='["x", "y"]', note=" 12 \nlines", limit="null", extra='{"k": 1}')
    assert qwen3_coder_calls(text, SCHEMAS) == [
        ("add", {"a": 12, "b": -7}),
        ("config", {"on": True, "ratio": 0.5, "tags": ["x", "y"], "note": " 12 \nlines", "limit": None,
                    "extra": {"k": 1}})]  # a parameter the schema does not know: JSON when it parses
    assert qwen3_coder_calls(coder_call("lookup", key="some text"), {}) == [("lookup", {"key": "some text"})]
    assert qwen3_coder_calls("the answer is 5", SCHEMAS) == []
    bad = qwen3_coder_calls(coder_call("add", a="twelve", b="1") + "<tool_call>add(1, 2)</tool_call>", SCHEMAS)
    assert bad == ["error: add: parameter 'a' is not an integer: 'twelve'",
                   "error: a tool call is <function=NAME> with a <parameter=NAME>value</parameter> per argument"]


def test_llama3_json_calls_are_a_turn_of_json_objects():
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "lookup", "arguments": {"key": "x"}}'
    assert llama3_json_calls(text) == [("add", {"a": 1, "b": 2}), ("lookup", {"key": "x"})]
    assert llama3_json_calls("  The answer is {3}.") == []  # not a turn that starts with a call
    assert llama3_json_calls('{"name": "add", "parameters": {"a": 1') == [
        "error: the tool call is not JSON (Expecting ',' delimiter: line 1 column 38 (char 37))"]
    assert llama3_json_calls('{"tool": "add"}') == ['error: a tool call is {"name": ..., "parameters": {...}}']


@pytest.mark.parametrize(("format", "text"), [
    ("qwen3_coder", coder_call("add", a="1", b="2") + coder_call("lookup", key="x")),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "lookup", "parameters": {"key": "x"}}'),
])
def test_other_formats_run_their_calls_as_hermes_does(format, text):
    env = ToolCalls([add, lookup], format=format)
    env.reset(EpisodeStart("1+2=?", "3"))
    turn = step(env, text)
    assert turn.observations == (Observation("3", role="tool"), Observation('{"key": "x", "found": true}', role="tool"))
    with pytest.raises(ValueError, match=r"env.options.format='xml': expected one of hermes, qwen3_coder, llama3_json"):
        ToolCalls([add], format="xml")


def test_a_turn_with_calls_gets_a_tool_message_per_result():
    env = ToolCalls([add, lookup])
    env.reset(EpisodeStart("1+2=?", "3"))
    turn = step(env, call("add", a=1, b=2) + call("lookup", key="x"))
    expected = (Observation("3", role="tool"), Observation('{"key": "x", "found": true}', role="tool"))
    assert turn == Turn(expected, reward=0.0, done=False)


@pytest.mark.parametrize(("text", "answer"), [
    (call("sub", a=1), "error: no tool named 'sub' (tools: add, lookup)"),
    (call("add", a=1), "error: add: missing a required argument: 'b'"),
    (call("lookup", key="missing"), "error: lookup raised KeyError: 'missing'"),
    ("<tool_call>{oops</tool_call>", "error: the tool call is not JSON"),
])
def test_a_call_that_cannot_run_answers_an_error_and_the_episode_goes_on(text, answer):
    env = ToolCalls([add, lookup])
    env.reset(EpisodeStart("q", "a"))
    turn = step(env, text)
    (message,) = turn.observation
    assert not turn.done and message.role == "tool" and message.text.startswith(answer), message


def test_calls_past_max_calls_are_not_run():
    env = ToolCalls([add], max_calls=1)
    env.reset(EpisodeStart("q", "a"))
    turn = step(env, call("add", a=1, b=2) * 2)
    assert turn.observation == (Observation("3", role="tool"), Observation("error: more than 1 tool calls",
                                                                           role="tool"))


def test_a_long_result_is_cut_at_max_result_chars():
    env = ToolCalls([lookup], max_result_chars=10)
    env.reset(EpisodeStart("q", "a"))
    turn = step(env, call("lookup", key="x"))
    assert turn.observation == (Observation('{"key": "x ... (cut: 27 characters)', role="tool"),)


def test_a_turn_without_calls_is_the_final_answer_scored_by_reward():
    env = ToolCalls([add], reward="tests.episode_envs:exact")
    env.reset(EpisodeStart("1+2=?", "3"))
    assert step(env, " 3 ") == Turn(None, reward=1.0, done=True)
    unscored = ToolCalls([add])
    unscored.reset(EpisodeStart("1+2=?", "3"))
    assert step(unscored, "3") == Turn(None, reward=0.0, done=True)


def test_env_tools_reach_the_factory_and_bad_ones_are_named():
    cfg = build(EnvConfig, {"factory": "stream_rlhf.envs.tool_calls:ToolCalls", "tools": TOOLS}, "env")
    env = cfg.make()
    assert isinstance(env, ToolCalls) and list(env.tools) == ["add", "lookup"]
    assert [s["function"]["name"] for s in cfg.tool_schemas()] == ["add", "lookup"]
    cases = {
        "takes no `tools` keyword": {"factory": "stream_rlhf.envs.calculator:Calculator", "tools": TOOLS},
        r"env.tools\[1\]='tests.episode_envs:nothing': module tests.episode_envs has no nothing": {
            "tools": ["tests.episode_envs:add", "tests.episode_envs:nothing"]},
        r"env.tools\[0\]='tests.episode_envs:undescribed': its type hints and docstring": {
            "tools": ["tests.episode_envs:undescribed"]},
        r"env.tools\[0\]='tests.episode_envs:Messages': not a function": {"tools": ["tests.episode_envs:Messages"]},
        "env.options.tools: give the tools as env.tools": {"tools": TOOLS, "options": {"tools": []}},
        "env.tools: empty, and env.factory='stream_rlhf.envs.tool_calls:ToolCalls' needs tools": {},
    }
    for message, fields in cases.items():
        with pytest.raises(ConfigError, match=message):
            build(EnvConfig, {"factory": "stream_rlhf.envs.tool_calls:ToolCalls", **fields}, "env")


def test_a_datasets_prompts_carry_the_tools_as_the_template_writes_them(tmp_path, caplog):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "what is 1+2?", "answer": "3"}) + "\n")
    tokenizer = build_tokenizer()
    schemas = build(EnvConfig, {"factory": "stream_rlhf.envs.tool_calls:ToolCalls", "tools": TOOLS},
                    "env").tool_schemas()
    data = PromptDataset(path, tokenizer, None, None, "error", 1, 0, chat_template=WRITES_TOOLS, tools=schemas)
    turns = [{"role": "user", "content": [{"type": "text", "text": "what is 1+2?"}]}]
    expected = tokenizer.apply_chat_template(turns, chat_template=WRITES_TOOLS, add_generation_prompt=True,
                                             tokenize=False, tools=schemas)
    assert expected == "tools: add lookup.user: what is 1+2?.assistant: "
    assert data.next_sample().prompt_ids.tolist() == tokenizer.encode(expected, add_special_tokens=False)
    with caplog.at_level(logging.WARNING, logger="stream_rlhf"):
        PromptDataset(path, tokenizer, None, None, "error", 1, 0, chat_template=WRITES_TOOLS.split("{% endif %}", 1)[1],
                      tools=schemas)
    assert "the chat template writes no tools" in caplog.text
    with pytest.raises(ValueError, match="tools: the chat template writes them"):
        PromptDataset(path, tokenizer, None, None, "error", 1, 0, tools=schemas)
