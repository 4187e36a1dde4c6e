"""The warm start's cache folder follows the content of `data.train`, not where the file is: a
cache copied to another checkout or machine (e.g. carried to a GPU machine) is found there."""

from __future__ import annotations

import shutil

from stream_rlhf.config import load_config
from stream_rlhf.driver.warm_start import warm_start_folder
from stream_rlhf.rl.config import RLJobConfig
from tests.bench_run import REPO


def folder_for(train) -> str:
    cfg = load_config(RLJobConfig, REPO / "configs/mllm_ppo.yaml", [f"data.train={train}", f"data.eval={train}"])
    return warm_start_folder(cfg)[0].name


def test_the_same_prompts_anywhere_give_the_same_folder_and_other_prompts_another(tmp_path):
    first = tmp_path / "a" / "train.jsonl"
    first.parent.mkdir()
    first.write_text('{"prompt": "What shape is this?", "answer": "circle"}\n')
    copy = tmp_path / "b" / "train.jsonl"
    copy.parent.mkdir()
    shutil.copy(first, copy)  # a new path and a new mtime
    assert folder_for(first) == folder_for(copy)
    copy.write_text('{"prompt": "What shape is this?", "answer": "square"}\n')
    assert folder_for(first) != folder_for(copy)
