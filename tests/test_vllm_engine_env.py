"""The vLLM engine process's environment as the client builds it (`vllm_client.engine_env`), without
vLLM: this package on its PYTHONPATH, and the torchvision import shim exactly when the engine's
Python has no torchvision."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import stream_rlhf
from stream_rlhf.backends.vllm_client import SHIM, engine_env

PACKAGE_ROOT = str(Path(stream_rlhf.__file__).resolve().parent.parent)


def pythonpath(env: dict[str, str]) -> list[str]:
    return env["PYTHONPATH"].split(os.pathsep)


def test_the_shim_is_a_folder_that_python_imports_at_start_up():
    assert (SHIM / "sitecustomize.py").is_file()
    assert not (SHIM / "__init__.py").exists()  # a PYTHONPATH entry, not a package


def test_a_python_without_torchvision_gets_the_shim_before_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # no torchvision there, nor in this environment
    assert pythonpath(engine_env(sys.executable)) == [str(SHIM), PACKAGE_ROOT, str(tmp_path)]


def test_a_python_with_torchvision_gets_the_package_only(monkeypatch, tmp_path):
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").touch()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert pythonpath(engine_env(sys.executable)) == [PACKAGE_ROOT, str(tmp_path)]


def test_a_python_that_cannot_run_is_left_to_the_engine_start_to_report(tmp_path):
    assert str(SHIM) not in pythonpath(engine_env(str(tmp_path / "no_python")))
