"""What a resumed run continues from besides the trainers' state: the prompt source's cursor and
rollout's kept outputs."""

from __future__ import annotations

import logging

import pytest
import torch
from PIL import Image

from stream_rlhf.config import ConfigError, load_config
from stream_rlhf.driver.resume import prepare_resume, record_start
from stream_rlhf.driver.run import RLRun
from stream_rlhf.resume.store import ResumePoint
from stream_rlhf.rl.config import RLJobConfig
from stream_rlhf.stage import Output
from stream_rlhf.stages.generated_store import GeneratedStore
from stream_rlhf.stages.job_context import JobContext
from stream_rlhf.stages.prompt_cursor import PromptCursors
from tests.test_data_prompts import _dataset, _good, _write


def test_a_dataset_sought_to_a_cursor_continues_as_the_original(tmp_path):
    for i in range(5):
        (tmp_path / "images").mkdir(exist_ok=True)
        Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / f"images/{i}.png")
    lines = [_good(i) for i in range(5)]
    lines.insert(2, _good(9))  # its image is corrupt: found bad when the dataset is built
    (tmp_path / "images/9.png").write_bytes(b"not a png")
    path = _write(tmp_path, lines)
    original = _dataset(path, on_bad="skip", seed=4)
    for _ in range(7):  # into the second epoch, past the bad line
        original.next_sample()
    cursors = PromptCursors(tmp_path / "run")
    cursors.record(3, {"stale": True})
    cursors.record(3, original.cursor())  # a resumed run records an iteration again: the last counts
    expected = [original.next_sample().answer for _ in range(9)]
    resumed = _dataset(path, on_bad="skip", seed=4)
    resumed.seek(cursors.at(3))
    assert [resumed.next_sample().answer for _ in range(9)] == expected
    assert resumed.skipped == original.skipped == {"corrupt image": 1}
    with pytest.raises(FileNotFoundError, match="no prompt cursor for iteration 4"):
        cursors.at(4)


def test_kept_outputs_come_back_whole_until_a_checkpoint_covers_their_iteration(tmp_path):
    store = GeneratedStore(tmp_path)
    for iteration in range(3):
        for minibatch in range(2):
            store.save(Output("rollout", {"ids": torch.arange(4) + iteration}, 4, iteration, minibatch,
                              policy_version=iteration - 1, metadata={"references": ["1", "2", "3", "4"]}))
    kept = store.load(2, 1)
    assert (kept.iteration, kept.minibatch, kept.num_samples, kept.policy_version) == (2, 1, 4, 1)
    assert kept.tensors["ids"].tolist() == [2, 3, 4, 5] and kept.metadata == {"references": ["1", "2", "3", "4"]}
    assert store.samples_from(1) == 16
    store.prune(2)
    assert store.load(1, 0) is None and store.load(2, 0) is not None and store.samples_from(0) == 8
    assert store.load(7, 0) is None


def test_a_warm_up_puts_the_resumed_policy_version_behind_the_checkpoints_iteration(tmp_path):
    cfg = load_config(RLJobConfig, "configs/text_ppo.yaml", ["critic.warmup_iterations=3", "iterations=8"])
    versions = {iteration: JobContext(cfg, "", "", resume=ResumePoint(iteration, tmp_path))
                for iteration in (2, 3, 5)}
    assert {i: (job.start_iteration, job.start_version) for i, job in versions.items()} == \
        {2: (2, 0), 3: (3, 0), 5: (5, 2)}
    fresh = JobContext(cfg, "", "")
    assert (fresh.start_iteration, fresh.start_version) == (0, 0)


def test_the_hint_after_a_stop_says_resume_or_that_the_training_had_ended(tmp_path, caplog):
    cfg = load_config(RLJobConfig, "configs/text_ppo.yaml", ["critic.warmup_iterations=2", "iterations=6",
                                                             f"runs_dir={tmp_path}"])
    run = RLRun(cfg)
    with caplog.at_level(logging.INFO, logger="stream_rlhf"):
        run.log_resume_hint("job.yaml", ResumePoint(4, tmp_path / "iter-000004"))
        run.log_resume_hint("job.yaml", ResumePoint(6, tmp_path / "iter-000006"))
    middle, end = caplog.messages
    assert "holds iteration 4 (policy version 2): continue with `stream-rlhf run job.yaml --resume" in middle
    assert "the training had ended: checkpoint" in end and "before its eval after RL and summary.json: " \
        "`stream-rlhf run job.yaml --resume" in end


def test_resume_refuses_a_trainer_on_another_backend_or_megatron_layout_naming_the_key(tmp_path):
    """Refused before any stage starts (a stage would fail loading its state, and so would each
    recovery); a torch trainer's ranks may change (its state loads on any number)."""
    def config(*sets: str) -> RLJobConfig:
        return load_config(RLJobConfig, "configs/text_ppo.yaml", [f"runs_dir={tmp_path}", *sets])

    actor = "placement.stages.actor_train"
    tp2 = [f"{actor}.backend=megatron", f"{actor}.ranks=2", f"{actor}.megatron.tp=2"]
    record_start(tmp_path / "megatron", config(*tp2), {}, "start")
    for sets, refused in (
        ([f"{actor}.backend=megatron", f"{actor}.ranks=2"], f"{actor}.megatron.tp=1: the run to resume checkpointed "
                                                            "actor_train with 2; a trainer resumes on the backend"),
        ([f"{actor}.backend=megatron", f"{actor}.ranks=4", f"{actor}.megatron.tp=2"], f"{actor}.ranks=4: .* with 2"),
        ([], f"{actor}.backend='torch': the run to resume checkpointed actor_train with 'megatron'"),
    ):
        with pytest.raises(ConfigError, match=refused):
            prepare_resume(tmp_path / "megatron", config(*sets), tmp_path / "weights")
    with pytest.raises(ConfigError, match="no complete checkpoint"):  # past the check
        prepare_resume(tmp_path / "megatron", config(*tp2), tmp_path / "weights")
    record_start(tmp_path / "torch", config(), {}, "start")
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        prepare_resume(tmp_path / "torch", config(f"{actor}.ranks=2"), tmp_path / "weights")
