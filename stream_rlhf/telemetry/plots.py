"""PNG curves of a finished run, from its metrics.jsonl, in runs/<name>/plots/ (matplotlib, Agg).

    paths = write_plots(run_dir, eval_points)   # the driver's finish(); summary.json links them

One figure per entry of `PLOTS`: reward (train, and the evaluations before and after RL), KL to
the reference, entropy, response length, tokens/s, staleness and, for a multi-turn job (`env:`),
turns per episode and the fraction of tool time hidden, each against the training iteration. A
curve whose metric the run never logged is left out, and so is a figure with none.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from stream_rlhf.telemetry.metrics import read_metrics

PLOTS_DIR = "plots"
PLOTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("reward", "reward", ("reward",)),
    ("kl", "KL to the reference (per token)", ("kl",)),
    ("entropy", "entropy (per token)", ("entropy",)),
    ("response_len", "response length (tokens)", ("response_len",)),
    ("tokens_per_s", "tokens/s (trained)", ("tokens_per_s",)),
    ("staleness", "staleness (policy versions)", ("staleness_mean", "staleness_max")),
    ("turns", "turns per episode", ("turns_per_episode",)),
    ("tool_hidden", "tool wait hidden (fraction of tool wall time)", ("tool_hidden_frac",)),
)
"""(file stem, title, the metrics.jsonl keys drawn as its curves)."""


def write_plots(run_dir: str | Path, eval_points: dict[str, dict[int, float]] | None = None) -> list[Path]:
    """Draw the run's curves; `eval_points` adds marked points to the reward figure: a label
    ("eval", "eval greedy") -> {iteration: reward}. Returns the PNG files written."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    folder = run_dir / PLOTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, title, keys in PLOTS:
        curves = {key: [(r["iteration"], r[key]) for r in records if key in r] for key in keys}
        points = (eval_points or {}) if stem == "reward" else {}
        if not any(curves.values()) and not points:
            continue
        path = folder / f"{stem}.png"
        _figure(title, {f"train {k}" if stem == "reward" else k: c for k, c in curves.items() if c}, points, path)
        written.append(path)
    return written


def _figure(title: str, curves: dict[str, list[tuple[int, float]]], points: dict[str, dict[int, float]],
            path: Path) -> None:
    figure = Figure(figsize=(6, 3.6), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for label, curve in curves.items():
        axes.plot(*zip(*curve), marker="." if len(curve) < 30 else None, label=label)
    for label, marks in points.items():
        axes.plot(list(marks), list(marks.values()), linestyle="none", marker="D", label=label)
    axes.set_title(title)
    axes.set_xlabel("iteration")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
