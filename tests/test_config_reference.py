"""The config schema stays declared and its reference current: docs/config.md is what
`stream_rlhf.config_reference` renders, every config field has a description, and every declared
constraint is checked when a config is built."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from stream_rlhf.broker.control.topology import TopicConfig
from stream_rlhf.cli import main
from stream_rlhf.config import ConfigError, build, declared_constraints
from stream_rlhf.config_reference import REGENERATE, field_descriptions, render, sections
from stream_rlhf.envs.config import EnvConfig
from stream_rlhf.job import JobConfig
from stream_rlhf.launch.spec import StageSpec
from stream_rlhf.planner.devices import PRESETS, DeviceFigures
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.rl.reward_parts_config import ProcessRewardConfig

ROOT = Path(__file__).resolve().parent.parent
ROOTS = (RLJobConfig, JobConfig)


def test_docs_config_md_is_what_the_config_classes_render():
    written = (ROOT / "docs" / "config.md").read_text()
    assert written == render(), f"docs/config.md is stale: regenerate it with `{REGENERATE}`"


def test_run_help_points_to_the_reference(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "docs/config.md" in capsys.readouterr().out


def test_every_field_of_every_config_class_has_a_description():
    """Statically, every annotated field of a class named *Config anywhere in stream_rlhf (also in
    modules that need an optional extra to import); and every field of every section of the two
    job configs (StagePlacement, OffloadPolicy, StageSpec, ...)."""
    missing = []
    for path in sorted((ROOT / "stream_rlhf").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
                body = node.body
                for statement, following in zip(body, [*body[1:], None]):
                    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and not (
                            isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                            and isinstance(following.value.value, str)):
                        missing.append(f"{path.relative_to(ROOT)}: {node.name}.{statement.target.id}")
    for root in ROOTS:
        for key, cls in sections(root):
            described = field_descriptions(cls)
            missing += [f"{root.__name__} {key or 'top level'}: {cls.__name__}.{f.name}"
                        for f in dataclasses.fields(cls) if not described.get(f.name)]
    assert not missing, "fields without a description (a string literal on the line under the field):\n" + \
        "\n".join(sorted(set(missing)))


def _example(cls: type, tmp_path: Path) -> object:
    """A valid instance of config class `cls` (the classes with required fields get them here)."""
    examples = {
        RLJobConfig: lambda: build(RLJobConfig, {"name": "r", "runs_dir": str(tmp_path)}),
        JobConfig: lambda: JobConfig("j", {"t": TopicConfig(producers=["a"], consumers=["b"])}, {}),
        TopicConfig: lambda: TopicConfig(producers=["a"], consumers=["b"]),
        StageSpec: lambda: StageSpec("m:C"),
        ProcessRewardConfig: lambda: ProcessRewardConfig(function="stream_rlhf.data.arithmetic:step_reward"),
        EnvConfig: lambda: EnvConfig(factory="stream_rlhf.envs.calculator:Calculator"),
        DeviceFigures: lambda: PRESETS["h100"],
    }
    return examples[cls]() if cls in examples else cls()


def _breaking(meta: object, value: object) -> object:
    """A value that breaks the declared constraint `meta` (a field's value `value` shows its type)."""
    step = 1 if isinstance(value, int) else 0.5
    if meta.ge is not None:
        return meta.ge - step
    if meta.gt is not None:
        return meta.gt
    if meta.le is not None:
        return meta.le + step
    if meta.lt is not None:
        return meta.lt
    return value[:0]  # min_length: an empty string or list


def _constrained_classes() -> list[type]:
    """The sections of the two job configs, and `plan --device`'s figures, that declare constraints."""
    found = {cls for root in ROOTS for _, cls in sections(root) if declared_constraints(cls)} | {DeviceFigures}
    return sorted(found, key=lambda cls: cls.__qualname__)


@pytest.mark.parametrize("cls", _constrained_classes(), ids=lambda cls: cls.__name__)
def test_every_declared_constraint_is_checked_when_the_class_is_built(cls, tmp_path):
    """dataclasses.replace runs __post_init__ again: each class with a declared constraint calls
    check_fields, and the error names the field and the value."""
    example = _example(cls, tmp_path)
    for name, meta in declared_constraints(cls).items():
        value = getattr(example, name)
        bad = _breaking(meta, value if value is not None else (1 if meta.min_length is None else ""))
        with pytest.raises(ConfigError, match=rf"^{name}={bad!r}: must be "):
            dataclasses.replace(example, **{name: bad})


def test_build_puts_the_dotted_key_in_front_of_a_declared_constraint(tmp_path):
    with pytest.raises(ConfigError, match=r"^placement\.stages\.actor_train\.megatron\.tp=0: must be >= 1$"):
        build(RLJobConfig, {"name": "r", "runs_dir": str(tmp_path),
                            "placement": {"stages": {"actor_train": {"megatron": {"tp": 0}}}}})
    with pytest.raises(ConfigError, match=r"^rollout\.vllm\.max_model_len=1: must be >= 2$"):
        build(RLJobConfig, {"name": "r", "runs_dir": str(tmp_path), "rollout": {"vllm": {"max_model_len": 1}}})
