"""The run checkpoint store: atomic parts, the newest complete checkpoint, damage, pruning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from stream_rlhf.config import ConfigError
from stream_rlhf.resume.config import CheckpointConfig
from stream_rlhf.resume.store import CheckpointStore

PARTS = ["actor", "critic"]


def _write(store: CheckpointStore, version: int, part: str) -> Path:
    return store.write_part(version, part, lambda folder: (folder / "state.json").write_text(f'{{"v": {version}}}'))


def test_the_newest_checkpoint_with_every_part_is_the_resume_point(tmp_path):
    store = CheckpointStore(tmp_path, keep=5)
    for version in (2, 4):
        for part in PARTS:
            _write(store, version, part)
    _write(store, 6, "actor")  # the critic had not saved iteration 6 when the run stopped
    (store.folder(6) / ".critic.999.tmp").mkdir()  # nor finished writing it
    assert store.versions(PARTS) == [2, 4]
    point = store.latest(PARTS)
    assert point.version == 4 and (point.part("critic") / "state.json").read_text() == '{"v": 4}'
    assert store.latest(["actor"]).version == 6


def test_a_damaged_checkpoint_is_skipped_with_a_warning_naming_the_file(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep=5)
    for version in (2, 4, 6):
        for part in PARTS:
            _write(store, version, part)
    (store.folder(6) / "critic" / "state.json").write_text('{"v": 7}')  # same size, other bytes
    (store.folder(4) / "actor" / "state.json").write_text("")  # truncated
    with caplog.at_level(logging.WARNING, logger="stream_rlhf"):
        point = store.latest(PARTS)
    assert point.version == 2
    assert "iter-000006/critic/state.json: size or checksum differs" in caplog.text
    assert "iter-000004/actor/state.json: size or checksum differs" in caplog.text


def test_a_part_written_again_replaces_the_old_copy(tmp_path):
    store = CheckpointStore(tmp_path)
    _write(store, 3, "actor")
    store.write_part(3, "actor", lambda folder: (folder / "other.json").write_text("{}"))
    assert sorted(p.name for p in (store.folder(3) / "actor").iterdir()) == ["MANIFEST.json", "other.json"]
    assert [p.name for p in store.folder(3).iterdir()] == ["actor"]  # no staging folder left


def test_prune_keeps_the_newest_complete_checkpoints_and_what_is_newer(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for version in (1, 2, 3):
        for part in PARTS:
            _write(store, version, part)
    _write(store, 4, "actor")
    store.prune(PARTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000002", "iter-000003", "iter-000004"]


def test_checkpoint_config_says_when_a_version_is_saved():
    every3 = CheckpointConfig(every=3)
    assert [v for v in range(1, 11) if every3.due(v, 10)] == [3, 6, 9, 10]
    assert [v for v in range(1, 11) if CheckpointConfig(every=0).due(v, 10)] == [10]
    with pytest.raises(ConfigError, match="keep=0"):
        CheckpointConfig(keep=0)
