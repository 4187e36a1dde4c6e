"""What a run leaves to look at: PNG curves (telemetry/plots.py), TensorBoard tags by role
(telemetry/metrics.py), and, end to end, a tiny vision-language run's bounded samples.jsonl,
plots linked from summary.json, role-tagged TensorBoard curves and its view.html."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from stream_rlhf.telemetry.metrics import MetricsWriter, read_metrics
from stream_rlhf.telemetry.plots import PLOTS, write_plots
from stream_rlhf.viewer.page import page_data
from stream_rlhf.viewer.samples_file import read_samples
from tests.rl_tiny import VISION, tiny_job, write_job


def _tags(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard curve of the run: tag -> [(step, value)]."""
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_every_figure_is_drawn_from_the_metrics(tmp_path):
    writer = MetricsWriter(tmp_path, "actor")
    for i in range(4):
        writer.write({"iteration": i, "reward": 0.1 * i, "kl": 0.01, "entropy": 2.0 - i / 10, "response_len": 3.5,
                      "tokens_per_s": 100.0 + i, "staleness_mean": 0.5, "staleness_max": 1, "turns_per_episode": 2.5,
                      "tool_hidden_frac": 0.1 * i})
    paths = write_plots(tmp_path, {"eval": {0: 0.0, 4: 0.5}})
    assert [p.name for p in paths] == [f"{stem}.png" for stem, _, _ in PLOTS]
    for path in paths:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size == (600, 360)


def test_a_figure_without_its_metrics_is_left_out(tmp_path):
    MetricsWriter(tmp_path, "actor").write({"iteration": 0, "reward": 0.5})
    assert [p.name for p in write_plots(tmp_path)] == ["reward.png"]
    assert write_plots(tmp_path / "empty") == []


def test_tensorboard_tags_carry_the_role_and_the_jsonl_keeps_plain_keys(tmp_path):
    MetricsWriter(tmp_path, "actor").write({"iteration": 2, "loss": 0.5, "samples": 16})
    MetricsWriter(tmp_path, "critic", "critic_metrics.jsonl").write({"iteration": 2, "value_loss": 0.25})
    MetricsWriter(tmp_path, "medusa", "medusa_metrics.jsonl").write({"iteration": 2, "loss": 1.5})
    assert _tags(tmp_path) == {"actor/loss": [(2, 0.5)], "actor/samples": [(2, 16.0)],
                               "critic/value_loss": [(2, 0.25)], "medusa/loss": [(2, 1.5)]}
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"iteration": 2, "loss": 0.5, "samples": 16}]
    assert read_metrics(tmp_path / "critic_metrics.jsonl") == [{"iteration": 2, "value_loss": 0.25}]


@pytest.mark.slow
def test_a_tiny_run_logs_bounded_samples_draws_plots_and_tags_tensorboard_by_role(tmp_path):
    """`stream-rlhf run` (one process per stage) on the tiny vision-language PPO job, then `stream-rlhf view`."""
    per_minibatch, iterations, minibatches = 3, 3, 2
    job = tiny_job(tmp_path, "seen", **VISION, broker={"shm_prefix": "t_seen"}, iterations=iterations,
                   samples_log={"per_minibatch": per_minibatch})
    config = write_job(tmp_path / "seen.yaml", job)
    result = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "run", str(config)],
                            check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    run_dir = tmp_path / "seen"

    logged, skipped = read_samples(run_dir / "samples.jsonl")
    assert skipped == []
    per_iteration = [sum(s.record.iteration == i for s in logged) for i in range(iterations)]
    assert per_iteration == [per_minibatch * minibatches] * iterations
    for sample in (s.record for s in logged):
        assert sample.prompt.startswith("<image>") and len(sample.images) == 1 and Path(sample.images[0]).is_file()
        assert 1 <= len(sample.tokens) <= 4 and sample.kl is not None  # rollout.max_new_tokens 4; PPO has a reference
        assert sample.staleness == sample.iteration - sample.policy_version and 0 <= sample.staleness <= 1

    summary = json.loads((run_dir / "summary.json").read_text())
    logged_keys = set(read_metrics(run_dir / "metrics.jsonl")[0])  # a single-turn job: no episode figures
    assert not {"turns_per_episode", "tool_hidden_frac"} & logged_keys
    drawn = [stem for stem, _, keys in PLOTS if set(keys) & logged_keys]
    assert sorted(summary["plots"]) == sorted(str(run_dir / "plots" / f"{stem}.png") for stem in drawn)
    assert len(drawn) == len(PLOTS) - 2
    assert all(Path(path).is_file() for path in summary["plots"])

    tags = _tags(run_dir)
    assert {"actor/loss", "actor/reward", "actor/kl", "critic/value_loss"} <= tags.keys()
    assert not [tag for tag in tags if "/" not in tag]  # no untagged curve left to collide
    assert [step for step, _ in tags["actor/loss"]] == list(range(iterations))

    view = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "view", str(run_dir)],
                          check=False, capture_output=True, text=True, timeout=120)
    assert view.returncode == 0, view.stderr
    data = page_data(run_dir)
    assert len(data["samples"]) == len(logged) and len(data["plots"]) == len(drawn)
    assert all(s["thumbnails"][0].startswith("data:image/png;base64,") for s in data["samples"])
