"""An environment for instruct models that call Python functions as tools, in the format their chat
template teaches (`options.format`: hermes, the default, for Qwen2.5, Qwen3 and Hermes;
qwen3_coder; llama3_json: `tool_call_formats.py`): no environment code to write, only the tools.

    env:
      factory: stream_rlhf.envs.tool_calls:ToolCalls
      tools: [mypkg.tools:search, mypkg.tools:calculate]     # also written into every prompt
      options: {reward: mypkg.scoring:exact_match}           # (answer, reference) -> float

    policy      <tool_call>
                {"name": "calculate", "arguments": {"expression": "12+7"}}
                </tool_call><|im_end|>
    observation (a "tool" message, as the chat template writes one)  19
    policy      The sum is 19.<|im_end|>      no call: the final answer, scored by `reward`; done

`env.tools` (`envs/config.py`) names the functions: their JSON schemas go to the chat template
with every prompt, and the functions come here as `tools`. Each call the turn writes (in Hermes, a
`<tool_call>` block holding a JSON object with `name` and `arguments`) is run, in order (`async
def` tools awaited, others in a thread), and their results, each written as text (`json.dumps`
for what is not a string), are one "tool" message each, as the chat template writes a run of
them (`data/message_frames.py`). A call that cannot run (bad JSON, an unknown tool, wrong
arguments, or a tool that raises) answers "error: ..." in its place, so the policy sees what went
wrong and the episode goes on; `max_calls` bounds the calls run per turn (the rest
answer an error), `max_result_chars` a result's length. A turn without a call is the final
answer: `reward(answer, reference)` (0.0 without one) and done. Tokens are never re-tokenised:
the turn's text is the policy's tokens decoded without special tokens, so a tokenizer must keep
`<tool_call>` a normal token (Qwen's do; Llama's `<|python_tag|>` is dropped, and the JSON after it
is what `llama3_json` reads).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any

from transformers.utils import get_json_schema

from stream_rlhf.config import import_dotted
from stream_rlhf.envs.environment import EpisodeStart, Observation, Turn
from stream_rlhf.envs.tool_call_formats import FORMATS, Call, parse_calls

Reward = Callable[[str, str], float]


@functools.cache
def _schema(tool: Callable[..., Any]) -> dict[str, Any]:
    """`tool`'s JSON schema (its "function" part), read once per process."""
    return get_json_schema(tool)["function"]


class ToolCalls:
    """One episode's tools (see the module docstring)."""

    def __init__(self, tools: Sequence[Callable[..., Any]], reward: str | None = None, max_calls: int = 4,
                 max_result_chars: int | None = None, format: str = "hermes"):
        """`reward`: dotted path of `fn(answer, reference) -> float`; `max_result_chars`: a longer
        result is cut there and says so (None: never); `format`: how the policy writes its calls
        (a key of `tool_call_formats.FORMATS`)."""
        if format not in FORMATS:
            raise ValueError(f"env.options.format={format!r}: expected one of {', '.join(FORMATS)}")
        self.tools = {tool.__name__: tool for tool in tools}
        self.format = format
        self.schemas = {name: _schema(tool) for name, tool in self.tools.items()} if format == "qwen3_coder" else None
        """What qwen3_coder's values are converted by (the other formats write typed JSON)."""
        self.reward: Reward | None = import_dotted(reward, "env.options.reward") if reward else None
        self.max_calls, self.max_result_chars = max_calls, max_result_chars
        self.start: EpisodeStart | None = None

    def reset(self, start: EpisodeStart) -> None:
        self.start = start

    async def step(self, text: str, token_ids: Sequence[int]) -> Turn:
        if self.start is None:
            raise RuntimeError("step before reset")
        calls = parse_calls(text, self.format, self.schemas)
        if not calls:
            score = float(self.reward(text.strip(), self.start.reference)) if self.reward else 0.0
            return Turn(None, reward=score, done=True)
        results = [await self._run(call) if i < self.max_calls else f"error: more than {self.max_calls} tool calls"
                   for i, call in enumerate(calls)]
        return Turn(tuple(Observation(result, role="tool") for result in results))

    async def _run(self, call: Call) -> str:
        if isinstance(call, str):
            return call
        name, arguments = call
        tool = self.tools.get(name)
        if tool is None:
            return f"error: no tool named {name!r} (tools: {', '.join(sorted(self.tools))})"
        try:
            inspect.signature(tool).bind(**arguments)
        except TypeError as error:
            return f"error: {name}: {error}"
        try:
            result = await tool(**arguments) if inspect.iscoroutinefunction(tool) else await asyncio.to_thread(
                tool, **arguments)
        except Exception as error:  # the tool's failure is the policy's to see, not the run's
            return f"error: {name} raised {type(error).__name__}: {error}"
        text = result if isinstance(result, str) else json.dumps(result)
        if self.max_result_chars is not None and len(text) > self.max_result_chars:
            return f"{text[:self.max_result_chars]} ... (cut: {len(text)} characters)"
        return text
