"""How instruct models write tool calls, and how `ToolCalls` (`tool_calls.py`) reads them from a
turn's text: one parser per format, named by `env.options.format`.

    hermes        Qwen2.5, Qwen3, Hermes:  <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>
    qwen3_coder   Qwen3-Coder:             <tool_call><function=add><parameter=a>1</parameter></function></tool_call>
    llama3_json   Llama 3.1 / 3.2:         {"name": "add", "parameters": {"a": 1}}   (the whole turn; ";" between calls)

    calls = parse_calls(text, "hermes", schemas)   # [("add", {"a": 1}), "error: ...", ...] in order

Each call is (name, arguments), or an "error: ..." line for a call that cannot be read, which the
policy then sees in that call's place. A turn with no call is the final answer. `qwen3_coder`
writes every value as text: it is converted by the type the tool's JSON schema gives the
parameter (integer, number, boolean; array and object as JSON; a parameter the schema does not
know: JSON if it parses, else text). `llama3_json` takes a turn that starts with "{" as calls, as
vLLM's parser does: a final answer written as a JSON object would be read as a call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

Call = tuple[str, dict[str, Any]] | str
"""(name, arguments), or an "error: ..." message for a call that cannot be read."""
Schemas = Mapping[str, dict[str, Any]]
"""Each tool's JSON schema (transformers' `get_json_schema`), by name."""

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def hermes_calls(text: str, schemas: Schemas | None = None) -> list[Call]:
    """Each `<tool_call>` block holding {"name": ..., "arguments": {...} or a JSON string of one}."""
    calls: list[Call] = []
    for block in TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
            arguments = call.get("arguments", {}) if isinstance(call, dict) else None
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            calls.append(f"error: the tool call is not JSON ({error})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            calls.append('error: a tool call is {"name": ..., "arguments": {...}}')
            continue
        calls.append((call["name"], arguments))
    return calls


def qwen3_coder_calls(text: str, schemas: Schemas | None = None) -> list[Call]:
    """Each `<tool_call>` block holding `<function=NAME>` and its `<parameter=P>` values."""
    calls: list[Call] = []
    for block in TOOL_CALL.findall(text):
        function = FUNCTION.search(block)
        if function is None:
            calls.append("error: a tool call is <function=NAME> with a <parameter=NAME>value</parameter> per argument")
            continue
        name = function.group(1).strip()
        properties = ((schemas or {}).get(name) or {}).get("parameters", {}).get("properties", {})
        arguments: dict[str, Any] = {}
        for parameter, raw in PARAMETER.findall(function.group(2)):
            parameter, value = parameter.strip(), raw.removeprefix("\n").removesuffix("\n")
            try:
                arguments[parameter] = _typed(value, properties.get(parameter, {}).get("type"))
            except ValueError as expected:
                calls.append(f"error: {name}: parameter {parameter!r} is not {expected}: {value!r:.60}")
                break
        else:
            calls.append((name, arguments))
    return calls


def llama3_json_calls(text: str, schemas: Schemas | None = None) -> list[Call]:
    """A turn that starts with "{": JSON objects {"name": ..., "parameters": {...}} ("arguments"
    too), separated by ";"."""
    rest = text.strip()
    if not rest.startswith("{"):
        return []
    decoder, calls = json.JSONDecoder(), []
    while rest:
        try:
            call, end = decoder.raw_decode(rest)
        except json.JSONDecodeError as error:
            return [*calls, f"error: the tool call is not JSON ({error})"]
        arguments = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            calls.append('error: a tool call is {"name": ..., "parameters": {...}}')
        else:
            calls.append((call["name"], arguments))
        rest = rest[end:].strip().removeprefix(";").strip()
    return calls


FORMATS: dict[str, Callable[[str, Schemas | None], list[Call]]] = {
    "hermes": hermes_calls, "qwen3_coder": qwen3_coder_calls, "llama3_json": llama3_json_calls}


def parse_calls(text: str, format: str, schemas: Schemas | None = None) -> list[Call]:
    """The calls of one turn's `text`, in `format` (a key of FORMATS)."""
    return FORMATS[format](text, schemas)


def _typed(text: str, kind: str | list[str] | None) -> Any:
    """`text` as the JSON-schema type `kind` gives it (a list: the one type besides "null");
    ValueError saying what it is not."""
    stripped = text.strip()
    if isinstance(kind, list):
        if stripped == "null" and "null" in kind:
            return None
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind == "string":
        return text
    if kind == "integer":
        if not re.fullmatch(r"[+-]?\d+", stripped):
            raise ValueError("an integer")
        return int(stripped)
    if kind == "number":
        try:
            return float(stripped)
        except ValueError:
            raise ValueError("a number") from None
    if kind == "boolean":
        if stripped.lower() not in ("true", "false"):
            raise ValueError("true or false")
        return stripped.lower() == "true"
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError:
        if kind is None:
            return text
        raise ValueError(f"a JSON {kind}") from None
    if kind == "array" and not isinstance(value, list) or kind == "object" and not isinstance(value, dict):
        raise ValueError(f"a JSON {kind}")
    return value
