"""YAML into frozen dataclasses, with errors that name the dotted key and the bad value.

    cfg = load_config(DemoConfig, "configs/broker_demo.yaml", overrides=["broker.queue_capacity=4"])

Every config class is a frozen dataclass whose fields carry type hints; `build(cls, data)` checks
each value against its hint (nested dataclasses, list, dict, Literal, Optional, int/float/str/bool),
rejects unknown keys, and then runs the class's own `__post_init__` checks, which raise
ConfigError with their dotted key too.

A field declares its constraint in its type, and its description in the string literal (attribute
docstring) on the line under it:

    batch_size: Annotated[int, Meta(ge=1)] = 8
    \"\"\"Samples per optimizer step.\"\"\"

    def __post_init__(self) -> None:
        check_fields(self)       # every declared constraint: "batch_size=0: must be >= 1"
        ...                      # then the checks that span fields

`Meta` is msgspec's (bounds ge, gt, le, lt; min_length); `config_reference.py` renders the
constraints and descriptions into docs/config.md.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union

import yaml
from msgspec import Meta

from stream_rlhf.strict_yaml import DuplicateKeyError, parse_yaml

T = TypeVar("T")
_YAML11_EXPONENT = re.compile(r"[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+")
"""A number in exponent notation that YAML 1.1 leaves a string when it has no dot (2e-4)."""


class ConfigError(ValueError):
    """A config value is unknown, of the wrong type or impossible; the message names its key."""


def build(cls: type[T], data: Any, prefix: str = "") -> T:
    """Build dataclass `cls` from plain YAML data, checking every key and type; constructing it runs
    its `__post_init__`, which checks the declared constraints (`check_fields`) and then those that
    span fields."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or '<root>'}={data!r}: expected a mapping")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in known:
            raise ConfigError(f"{_join(prefix, str(key))}: unknown key (known: {', '.join(sorted(known))})")
    kwargs = {key: _convert(hints[key], value, _join(prefix, key)) for key, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{prefix or '<root>'}: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(_join(prefix, str(exc)) if prefix else str(exc)) from None


def check_fields(config: Any) -> None:
    """Check every field of the dataclass instance `config` against the constraint its type
    declares (`Annotated[int, Meta(ge=1)]`, also inside `| None`); a ConfigError "name=value: must
    be >= 1" for the first that fails (`build` puts the section's dotted key in front)."""
    for name, meta in declared_constraints(type(config)).items():
        value = getattr(config, name)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}={value!r}: must be a finite number")
        if not _satisfies(meta, value):
            raise ConfigError(f"{name}={value!r}: must be {constraint_text(meta, value)}")


@functools.cache
def declared_constraints(cls: type) -> dict[str, Meta]:
    """Field name -> the msgspec `Meta` its type declares, for the fields of dataclass `cls` that
    declare one."""
    hints = typing.get_type_hints(cls, include_extras=True)
    found = {}
    for f in dataclasses.fields(cls):
        meta = _meta_of(hints[f.name])
        if meta is not None:
            found[f.name] = meta
    return found


def constraint_text(meta: Meta, example: Any = 0) -> str:
    """The constraint as the error and the reference say it: ">= 1", "in (0, 1]", "a non-empty
    string" (`example`: a value of the field, to word a length)."""
    low = f"[{meta.ge}" if meta.ge is not None else f"({meta.gt}" if meta.gt is not None else None
    high = f"{meta.le}]" if meta.le is not None else f"{meta.lt})" if meta.lt is not None else None
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f">= {meta.ge}" if meta.ge is not None else f"> {meta.gt}"
    if high:
        return f"<= {meta.le}" if meta.le is not None else f"< {meta.lt}"
    if meta.min_length == 1:
        return "a non-empty string" if isinstance(example, str) else "non-empty"
    return f"at least {meta.min_length} long"


def _meta_of(hint: Any) -> Meta | None:
    """The `Meta` of an `Annotated[..., Meta(...)]` hint, or of the one inside `X | None`."""
    if typing.get_origin(hint) is Annotated:
        return next((m for m in hint.__metadata__ if isinstance(m, Meta)), None)
    if typing.get_origin(hint) in (Union, types.UnionType):
        return next((m for m in map(_meta_of, typing.get_args(hint)) if m is not None), None)
    return None


def _satisfies(meta: Meta, value: Any) -> bool:
    if meta.min_length is not None and len(value) < meta.min_length:
        return False
    return ((meta.ge is None or value >= meta.ge) and (meta.gt is None or value > meta.gt)
            and (meta.le is None or value <= meta.le) and (meta.lt is None or value < meta.lt))


def load_config(cls: type[T], path: str | Path, overrides: list[str] = ()) -> T:
    """Read a YAML file, apply `a.b=c` overrides (values parsed as YAML), build `cls`. A key given
    twice in one mapping, in the file or in a value, is a ConfigError (`strict_yaml.py`)."""
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level is a {type(data).__name__}, expected a mapping of keys")
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {override!r}: expected dotted.key=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            if node.get(part) == "auto":  # a section written `auto` (placement: auto) is its defaults, with keys set
                node[part] = {}
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part} is not a mapping")
        try:
            node[parts[-1]] = parse_yaml(raw)
        except DuplicateKeyError as exc:
            raise ConfigError(f"--set {override}: key {exc.key!r} given twice in the value") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key}: the value {raw!r} is not valid YAML: {exc}") from None
    return build(cls, data)


def read_yaml(path: str | Path) -> Any:
    """The YAML data of the file at `path` ({} when empty); a missing file or bad YAML is a
    ConfigError naming the file and, for bad YAML, its line and column (for a key given twice in
    one mapping: the key and both lines)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        return parse_yaml(text) or {}
    except DuplicateKeyError as exc:
        raise ConfigError(f"{path}:{exc.line}: key {exc.key!r} given twice in one mapping (first at "
                          f"{path}:{exc.first_line}); remove one of them") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        raise ConfigError(f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")) from None


def import_dotted(path: str, key: str) -> Any:
    """The object that `path` ("package.module:name") names; a ConfigError naming `key` when it
    does not import."""
    module_name, sep, name = path.partition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"{key}={path!r}: expected 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or whatever the module raises as it imports
        raise ConfigError(f"{key}={path!r}: module {module_name} does not import "
                          f"({type(exc).__name__}: {exc})") from None
    if not hasattr(module, name):
        raise ConfigError(f"{key}={path!r}: module {module_name} has no {name}")
    return getattr(module, name)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r}: must be one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r}: expected a list")
        item = args[0] if args else Any
        items = [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping")
        return {str(k): _convert(args[1], v, _join(key, str(k))) for k, v in value.items()}
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str) and _YAML11_EXPONENT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads 2e-4 (no dot) as a string; users mean the number
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r}: must be a finite number")
    if hint in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected {hint.__name__}")
    if not isinstance(value, hint):
        raise ConfigError(f"{key}={value!r}: expected {hint.__name__}")
    return value
