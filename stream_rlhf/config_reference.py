"""The config reference, docs/config.md, rendered from the config classes themselves: every key of
an RL job (`RLJobConfig`) and of a broker job (`JobConfig`), with its type, default, declared
constraint and description (the docstring under the field).

    python -m stream_rlhf.config_reference > docs/config.md      # regenerate after changing a field

A nested dataclass is a section of its own, named by its dotted key (`algorithm.kl`); a mapping of
dataclasses (`placement.stages`) is a section `placement.stages.<stage>`. tests/test_config_reference.py
fails when docs/config.md differs from what this renders, or a config field has no description.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal, Union

from stream_rlhf.config import constraint_text, declared_constraints
from stream_rlhf.job import JobConfig
from stream_rlhf.rl.config import RLJobConfig

REGENERATE = "python -m stream_rlhf.config_reference > docs/config.md"
"""The command that rewrites docs/config.md."""


def field_descriptions(cls: type) -> dict[str, str]:
    """Field name -> its description: the string literal under the field in the class body (or in a
    base class's, for an inherited field), its lines joined; a field without one is left out."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            found.update(_own_descriptions(klass))
    return found


@functools.cache
def _class_node(cls: type) -> ast.ClassDef:
    return ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]


def _own_descriptions(cls: type) -> dict[str, str]:
    body = _class_node(cls).body
    found = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            found[statement.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return found


def sections(cls: type, key: str = "") -> Iterator[tuple[str, type]]:
    """(dotted key, dataclass) of `cls` and of every dataclass nested in it, depth first."""
    yield key, cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner, suffix = _nested(hints[f.name])
        if inner is not None:
            yield from sections(inner, _join(key, f.name) + suffix)


def render() -> str:
    """docs/config.md."""
    lines = [
        "# Config reference",
        "",
        "Generated from the config classes (`stream_rlhf/config_reference.py`); do not edit it by hand.",
        f"Regenerate it with `{REGENERATE}`; tests/test_config_reference.py fails when it is stale.",
        "",
        "Each key's description is the docstring under its field; its constraint is the field's declared",
        "`Meta`, checked when the config is built (a key that breaks one fails naming the dotted key and",
        "value). Checks that span keys (e.g. grpo needs `rollout_batch.samples_per_prompt >= 2`) are in",
        "each class's `__post_init__`; unknown keys, wrong types and a key given twice in one mapping",
        "(naming the key and both lines) are errors too.",
        "",
        "Set a key in the YAML file, or on the command line: `stream-rlhf run CONFIG --set algorithm.kl.coef=0.05`.",
        "",
    ]
    roots = (("RL job", "`stream-rlhf run configs/text_ppo.yaml`", RLJobConfig),
             ("Broker job", "`stream-rlhf run configs/broker_demo.yaml`: hand-written stages", JobConfig))
    for title, how, root in roots:
        lines += [f"## {title} ({how})", ""]
        for key, cls in sections(root):
            lines += _section(key, cls)
    return "\n".join(lines)


def _section(key: str, cls: type) -> list[str]:
    heading = f"### `{key}`" if key else "### top level"
    summary = (ast.get_docstring(_class_node(cls)) or "").split("\n\n")[0]
    lines = [heading, ""]
    if summary:
        lines += [" ".join(summary.split()), ""]
    lines += ["| key | type | default | constraint | description |", "|---|---|---|---|---|"]
    hints = typing.get_type_hints(cls)
    described = field_descriptions(cls)
    constraints = declared_constraints(cls)
    for f in (f for f in dataclasses.fields(cls) if f.init):  # init=False: worked out, not a key
        meta = constraints.get(f.name)
        constraint = constraint_text(meta, _default(f)) if meta is not None else ""
        nested, suffix = _nested(hints[f.name])
        kind = _type_name(hints[f.name], f"section `{_join(key, f.name)}{suffix}`" if nested is not None else "")
        cells = [f"`{f.name}`", kind, "" if nested is not None else _default_text(f), constraint,
                 described.get(f.name, "")]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines + [""]


def _nested(hint: Any) -> tuple[type | None, str]:
    """The dataclass a field's hint holds (itself, `X | None`, or the values of a `dict[str, X]`) and
    the suffix of its section's key."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return hint, ""
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        sections = [a for a in inner if dataclasses.is_dataclass(a)]  # `X | Literal["auto"]`: X's section
        return _nested(inner[0]) if len(inner) == 1 else _nested(sections[0]) if len(sections) == 1 else (None, "")
    if origin is dict and dataclasses.is_dataclass(args[1]):
        return args[1], ".<name>"
    return None, ""


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _type_name(hint: Any, section: str = "") -> str:
    """The hint as the reference writes it; `section`: what a nested dataclass is called."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return section
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a, section) for a in args)
    if origin is dict and section:
        return f"mapping of {section}"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return "any" if hint is Any else "..." if hint is Ellipsis else hint.__name__


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _default_text(f: dataclasses.Field) -> str:
    value = _default(f)
    if value is dataclasses.MISSING:
        return "required"
    return f"`{json.dumps(value)}`"


if __name__ == "__main__":
    sys.stdout.write(render())
