"""The trace of a tiny RL run (`stream-rlhf run`, real broker and stage processes): trace.json is valid
Trace Event JSON (the format's rules, `tests/trace_rules.py`), every stage rank has a named track,
mini-batches are followed by flow arrows from the prompt source to training, and summary.json's
figures (and trace_metrics.jsonl's per iteration) are the ones trace.json gives again. A real viewer
opens it: speedscope (npm, in .tools/ by scripts/setup_browser.sh) in headless Chromium lists a
track for every stage instance and, on actor_train's, the step slices of every trained mini-batch
(read from the viewer's page, not from our parser). Where Perfetto's trace processor can run
(`PERFETTO_TRACE_PROCESSOR`: the path of a `trace_processor_shell`, with the `perfetto` package
installed; neither can be had offline here), it loads trace.json and its step slices give
summary.json's busy fractions again."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stream_rlhf.driver.dataflow import ROLLOUT_SIDE
from stream_rlhf.telemetry.metrics import read_metrics
from stream_rlhf.telemetry.trace_figures import clip, steady_window, trace_figures
from tests.rl_tiny import tiny_job, write_job
from tests.trace_rules import check_trace, flow_pairs

pytestmark = pytest.mark.slow


TRACE_PROCESSOR = os.environ.get("PERFETTO_TRACE_PROCESSOR", "")
ROOT = Path(__file__).resolve().parent.parent
SPEEDSCOPE = ROOT / ".tools" / "node_modules" / "speedscope" / "dist" / "release" / "index.html"
CHROMIUM = Path("/usr/bin/chromium")
WEBGL = ["--headless", "--no-sandbox", "--use-angle=swiftshader", "--enable-unsafe-swiftshader",
         "--disable-background-networking", "--disable-component-update", "--no-first-run"]
"""speedscope draws with WebGL: Chromium's software renderer (SwiftShader) gives it one headless."""
SCREENSHOT = os.environ.get("TRACE_SCREENSHOT")
"""Where to keep speedscope's screenshot of actor_train's track (to look at it); a temporary file otherwise."""


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory) -> tuple[Path, str]:
    """(the run folder, its log) of a tiny 3-iteration run."""
    tmp_path = tmp_path_factory.mktemp("trace")
    name = "traced"
    config = write_job(tmp_path / f"{name}.yaml", tiny_job(tmp_path, name, broker={"shm_prefix": f"t_{name}"}))
    log = tmp_path / f"{name}.log"
    with log.open("w") as out:
        code = subprocess.run([sys.executable, "-m", "stream_rlhf.cli", "run", str(config), "--set",
                               "placement.mode=separated", "--set", "iterations=3"],
                              stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
    text = log.read_text()
    assert code == 0, text[-3000:]
    return tmp_path / name, text


def test_tiny_run_writes_a_valid_trace_and_its_figures(traced_run):
    run_dir, text = traced_run
    data = json.loads((run_dir / "trace.json").read_text())
    assert check_trace(data) == []
    events = data["traceEvents"]
    assert data["otherData"]["lines_skipped"] == 0

    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    tracks = {(processes[e["pid"]], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    instances = set(re.findall(r"instance (\S+) of stage \S+ joined", text))
    assert instances and {(instance, "rank 0") for instance in instances} <= tracks
    assert ("broker", "broker") in tracks

    steps = [e for e in events if e["ph"] == "X" and e["cat"] == "step"]
    trained = {(e["args"]["iteration"], e["args"]["minibatch"]) for e in steps if e["args"]["stage"] == "actor_train"}
    assert trained == {(i, m) for i in range(3) for m in range(2)}
    arrows = {(processes[s["pid"]], processes[f["pid"]]) for s, f in flow_pairs(events)}
    assert {("prompts-0", "rollout-0"), ("rollout-0", "actor_train-0")} <= arrows
    into_training = [f for _, f in flow_pairs(events) if processes[f["pid"]] == "actor_train-0"]
    assert len({f["ts"] for f in into_training}) == len(trained)  # every trained mini-batch has its arrows
    names = {(e["cat"], e["name"]) for e in events if e["ph"] == "X"}
    assert {("payload", "fetch"), ("payload", "publish"), ("wait", "idle"), ("stage", "setup"),
            ("weights", "weights publish"), ("weights", "weights load")} <= names
    assert ("checkpoint", "checkpoint write") in names  # the run's final checkpoint
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"queue prompts>rollout", "queue experience>actor_train", "staleness"} <= counters

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trace"] == trace_figures(events, ROLLOUT_SIDE).summary()
    assert set(summary["trace"]["busy"]) == {e["args"]["stage"] for e in steps}
    assert 0 <= summary["trace"]["bubble_ratio"] <= 1 and summary["trace"]["window_s"] > 0
    assert "trace.bubble_ratio" in text  # the final table, a row per figure
    per_iteration = read_metrics(run_dir / "trace_metrics.jsonl")  # and TensorBoard's trace/ tags
    assert [r["iteration"] for r in per_iteration] == [1, 2]
    assert per_iteration[-1] == trace_figures(events, ROLLOUT_SIDE, skip=2).record(2)
    assert not (run_dir / "timeline").exists()


@pytest.mark.skipif(not TRACE_PROCESSOR, reason="Perfetto's trace processor cannot run offline: the perfetto package "
                    "downloads trace_processor_shell on first use; set PERFETTO_TRACE_PROCESSOR to a "
                    "trace_processor_shell (and pip install perfetto) to run this")
def test_perfettos_trace_processor_loads_the_trace_and_gives_its_busy_fractions(traced_run):
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    run_dir, _ = traced_run
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    lo, hi = steady_window(events)
    query = ("select ts, dur, extract_arg(arg_set_id, 'args.stage') as stage, "
             "extract_arg(arg_set_id, 'args.rank') as rank from slice where category = 'step'")
    processor = TraceProcessor(trace=str(run_dir / "trace.json"), config=TraceProcessorConfig(bin_path=TRACE_PROCESSOR))
    try:
        rows = list(processor.query(query))
    finally:
        processor.close()
    spans: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        if not row.rank:  # the leader's steps (rank 0, or a stage of one rank that records none)
            spans.setdefault(row.stage, []).append((row.ts / 1e9, (row.ts + row.dur) / 1e9))
    busy = {stage: sum(end - start for start, end in clip(steps, lo, hi)) / (hi - lo) for stage, steps in spans.items()}
    expected = json.loads((run_dir / "summary.json").read_text())["trace"]["busy"]
    assert set(busy) == set(expected)
    assert all(abs(busy[stage] - expected[stage]) <= 0.05 for stage in expected), (busy, expected)


@pytest.mark.skipif(not SPEEDSCOPE.is_file() or not CHROMIUM.is_file(), reason="speedscope (npm) in .tools/ and "
                    "/usr/bin/chromium are needed: scripts/setup_browser.sh installs both")
def test_speedscope_shows_every_stage_track_and_the_trained_steps(traced_run, tmp_path):
    from playwright.sync_api import sync_playwright

    run_dir, text = traced_run
    instances = set(re.findall(r"instance (\S+) of stage \S+ joined", text))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=WEBGL)
        page = browser.new_page(viewport={"width": 1400, "height": 4000})  # every sandwich row in view
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(_speedscope_url(run_dir / "trace.json", tmp_path))
        tracks = _tracks(page)
        assert {re.sub(r" \(pid \d+\), rank 0 \(tid 0\)$", "", track) for track in tracks} >= instances
        page.get_by_text(next(t for t in tracks if t.startswith("actor_train-0 "))).click()
        page.get_by_text("Sandwich").click()
        page.locator("td", has_text="{").first.wait_for()  # the table's rows: slice names with their args
        slices = _sandwich_names(page)
        page.get_by_text("Time Order").click()
        page.set_viewport_size({"width": 1400, "height": 700})
        page.screenshot(path=SCREENSHOT or str(tmp_path / "speedscope.png"))
        browser.close()
    assert errors == []
    steps = [json.loads("{" + name.partition(" {")[2]) for name in slices if name.startswith("actor_train experience")]
    trained = {(step["iteration"], step["minibatch"]) for step in steps}
    assert trained == {(i, m) for i in range(3) for m in range(2)}, slices
    assert all(step["stage"] == "actor_train" for step in steps)


def _speedscope_url(trace: Path, folder: Path) -> str:
    """What speedscope's own command line opens: its page, told to load a script that hands it the
    file (`speedscope.loadFileFromBase64`)."""
    script = folder / "profile.js"
    content = base64.b64encode(trace.read_bytes()).decode()
    script.write_text(f"speedscope.loadFileFromBase64({json.dumps(trace.name)}, {json.dumps(content)})")
    return f"{SPEEDSCOPE.as_uri()}#localProfilePath={script}"


def _tracks(page) -> list[str]:
    """The profiles speedscope made of the trace (one per thread with slices), from its profile
    list: the toolbar's "name (1/N)" opens it."""
    page.get_by_text(re.compile(r"\(1/\d+\)$")).click()
    rows = page.locator("tr").all_inner_texts()
    return [row.split("\t")[1] for row in rows if re.match(r"\d+\t", row)]


def _sandwich_names(page) -> list[str]:
    """The symbol names of speedscope's sandwich table (each distinct slice name of the track): its
    rows start with a total weight "1.15s (37%)" (the profile list's, still in the page, with a number)."""
    rows = [row.split("\t") for row in page.locator("tr").all_inner_texts()]
    return [cells[-1].strip() for cells in rows if len(cells) == 3 and cells[0].strip().endswith("%)")]
