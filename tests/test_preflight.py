"""Preflight (`driver/preflight.py`): a path, key folder or address the config names that is not
usable stops `stream-rlhf run` with exit 2 and one line naming the key, before any stage process
starts (before this, a missing CURVE key folder started the stages and then failed with "the
broker exited (code 1) before it was listening" under a traceback).

The broker demo runs the real CLI in a subprocess; the RL rows run its entry point in-process on
the tiny job (as tests/test_bad_configs.py does). A stage process would write into the run folder
(or the demo's trainer folder and the broker's journal), so those must be absent or empty.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stream_rlhf import cli
from stream_rlhf.broker.sockets import generate_keys
from tests.rl_tiny import tiny_job, write_job

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "configs" / "broker_demo.yaml")


def test_a_missing_key_folder_stops_the_broker_demo_before_any_process(tmp_path):
    run_dir, journal = tmp_path / "run", tmp_path / "journal"
    result = subprocess.run(
        [sys.executable, "-m", "stream_rlhf.cli", "run", DEMO, f"--set=stages.trainer.kwargs.run_dir={run_dir}",
         f"--set=broker.journal={journal}", f"--set=broker.curve.key_dir={tmp_path / 'keys'}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (f"config error: broker.curve.key_dir='{tmp_path / 'keys'}': no such "
                                              f"folder (create keys with `stream-rlhf keys {tmp_path / 'keys'}`)")
    assert "Traceback" not in result.stderr and "stage process" not in result.stderr
    assert not run_dir.exists() and not journal.exists()


def _keys_without(folder: Path, name: str) -> Path:
    generate_keys(folder)
    (folder / name).unlink()
    return folder


def _checkpoint(folder: Path, *files: str) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    for name in files:
        (folder / name).write_text("{}")
    return folder


# (overrides made from the test's folder, words of the message)
RL_ROWS = [
    (lambda tmp: [f"broker.curve.key_dir={tmp / 'keys'}"], "broker.curve.key_dir='{tmp}/keys': no such folder"),
    (lambda tmp: [f"broker.curve.key_dir={_keys_without(tmp / 'keys', 'client.key_secret')}"],
     "broker.curve.key_dir='{tmp}/keys': client.key_secret is missing (create keys with `stream-rlhf keys "),
    (lambda tmp: [f"model.path={_checkpoint(tmp / 'model', 'tokenizer.json')}"],
     "model.path='{tmp}/model': no weights there (expected *.safetensors, "),
    (lambda tmp: [f"model.path={_checkpoint(tmp / 'model', 'model.safetensors')}"],
     "model.path='{tmp}/model': no tokenizer there (expected one of tokenizer.json, "),
    (lambda tmp: [f"reward.model_path={_checkpoint(tmp / 'rm')}"], "reward.model_path='{tmp}/rm': no weights there"),
    (lambda tmp: ["launcher=ray", "ray.address=10.0.0.1"],
     "ray.address='10.0.0.1': expected \"auto\", \"local\", HOST:PORT or ray://HOST:PORT"),
    (lambda tmp: ["launcher=ray", "ray.address=ray://head:70000"], "ray.address='ray://head:70000': expected"),
]


@pytest.mark.parametrize(("overrides", "words"), RL_ROWS,
                         ids=["no key folder", "a key missing", "no weights", "no tokenizer", "reward model",
                              "ray no port", "ray port"])
def test_a_bad_path_of_an_rl_job_exits_2_before_the_warm_start(tmp_path, capsys, overrides, words):
    cache = tmp_path / "cache"
    path = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, "bad"))
    code = cli.main(["run", str(path), f"--set=model.warm_start.cache_dir={cache}",
                     *(f"--set={o}" for o in overrides(tmp_path))])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert err.startswith("config error: ") and words.format(tmp=tmp_path) in err, err
    assert "Traceback" not in err
    assert not cache.exists()  # no warm start began
    assert not (tmp_path / "bad").exists()  # the run folder is made after the preflight
