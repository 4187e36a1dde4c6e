"""The viewer without a browser: reading samples.jsonl (bad lines counted with their reason), the
page's data, the `stream-rlhf view` command and its server on 127.0.0.1.
`write_samples` builds the small run folder the browser test (test_viewer_browser.py) opens too."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import urllib.request
from dataclasses import asdict
from pathlib import Path

import pytest
from PIL import Image

from stream_rlhf.cli import main
from stream_rlhf.telemetry.sample_log import SAMPLES_FILE, SampleRecord
from stream_rlhf.viewer.page import PAGE_FILE, page_data, write_page
from stream_rlhf.viewer.samples_file import read_samples
from stream_rlhf.viewer.serve import folder_server

BAD_LINES = {3: '{"iteration": 0, "minibatch": 1, "sam', 6: '{"iteration": "one"}'}
"""Line number -> a corrupt line of the samples file `write_samples` makes."""


def write_samples(run_dir: Path) -> list[SampleRecord]:
    """A run folder with 6 good samples over 2 iterations (rewards and KL out of order; two with a
    real image, one with a missing one) and the corrupt lines of BAD_LINES; returns the good ones."""
    run_dir.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 24), (200, 30, 30)).save(run_dir / "red.png")
    rewards = [0.5, -1.0, 1.0, 0.0, 0.25, -0.5]
    good = []
    for n, reward in enumerate(rewards):
        tokens = [str(n), "+", "1", "<eos>"]
        good.append(SampleRecord(
            iteration=n // 3, minibatch=n % 3, sample=n, policy_version=n // 3, staleness=n % 2,
            reward=reward, prompt=f"<image>{n}+1=?" if n < 3 else f"{n}+1=?", response=f"{n}+1",
            tokens=tokens, logprob=[-0.05, -2.5, -0.7, -0.01][: len(tokens)],
            advantage=[reward, -reward, reward / 2, 0.0], kl=[0.01 * n, 0.2 * (n == 4), 0.0, -0.01],
            images=[str(run_dir / "red.png")] if n < 2 else [str(run_dir / "gone.png")] if n == 2 else [],
        ))
    lines = [json.dumps(asdict(r)) for r in good]
    for number, text in sorted(BAD_LINES.items()):
        lines.insert(number - 1, text)
    (run_dir / SAMPLES_FILE).write_text("\n".join(lines) + "\n")
    return good


def write_episode_samples(run_dir: Path) -> list[SampleRecord]:
    """A run folder with a multi-turn sample (policy turn, tool observation, policy turn; a large
    KL logged on the observation, which carries no loss) and a single-turn one; returns both."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tokens = ["calc", ":", " 123", "+", "456", "<eos>", "=", " 579", "\n", "The", " sum", " is", " 579", "<eos>"]
    policy = [1] * 6 + [0] * 3 + [1] * 5
    episode = SampleRecord(
        iteration=0, minibatch=0, sample=0, policy_version=0, staleness=0, reward=1.0, prompt="123+456=?",
        response="calc: 123+456= 579\nThe sum is 579", tokens=tokens,
        logprob=[-0.1, -0.2, -1.5, -0.05, -0.3, -0.01, 0.0, 0.0, 0.0, -0.2, -0.4, -0.1, -2.0, -0.02],
        advantage=[0.8 * p for p in policy], kl=[0.01 * i if p else 0.9 for i, p in enumerate(policy)], images=[],
        turns=[(0, 6, "policy"), (6, 9, "observation"), (9, 14, "policy")])
    single = SampleRecord(
        iteration=0, minibatch=0, sample=1, policy_version=0, staleness=0, reward=0.0, prompt="2+2=?", response="4",
        tokens=["4", "<eos>"], logprob=[-0.7, -0.01], advantage=[-0.3, -0.3], kl=[0.02, 0.0], images=[])
    (run_dir / SAMPLES_FILE).write_text("".join(json.dumps(asdict(r)) + "\n" for r in (episode, single)))
    return [episode, single]


def write_untrained_episode(run_dir: Path) -> list[SampleRecord]:
    """`write_episode_samples`' run with its multi-turn sample a failed episode left out of training,
    and its single-turn one cut by its length limit."""
    episode, single = write_episode_samples(run_dir)
    episode = dataclasses.replace(episode, trained=False, advantage=[0.0] * len(episode.tokens))
    single = dataclasses.replace(single, truncated=True)
    (run_dir / SAMPLES_FILE).write_text("".join(json.dumps(asdict(r)) + "\n" for r in (episode, single)))
    return [episode, single]


def write_left_out_samples(run_dir: Path) -> list[SampleRecord]:
    """`write_samples`' run with its first sample in a group dynamic sampling left out."""
    good = write_samples(run_dir)
    good[0] = dataclasses.replace(good[0], left_out="group returns all equal")
    lines = (run_dir / SAMPLES_FILE).read_text().splitlines()
    lines[0] = json.dumps(asdict(good[0]))
    (run_dir / SAMPLES_FILE).write_text("\n".join(lines) + "\n")
    return good


def test_bad_lines_are_skipped_with_line_and_reason(tmp_path):
    good = write_samples(tmp_path)
    logged, skipped = read_samples(tmp_path / SAMPLES_FILE)
    assert [s.record for s in logged] == good
    assert [s.line for s in logged] == [1, 2, 4, 5, 7, 8]
    assert [s.line for s in skipped] == [3, 6]
    assert "truncated" in skipped[0].reason
    assert skipped[1].reason == "Expected `int`, got `str` - at `$.iteration`"


def test_per_token_lists_must_match_the_tokens(tmp_path):
    record = asdict(write_samples(tmp_path)[0])
    record["advantage"] = [0.0]
    (tmp_path / SAMPLES_FILE).write_text(json.dumps(record) + "\n")
    logged, skipped = read_samples(tmp_path / SAMPLES_FILE)
    assert logged == [] and skipped[0].reason == "`advantage` has 1 values for 4 tokens"


def test_turns_are_read_and_bad_turns_skipped(tmp_path):
    episode, single = write_episode_samples(tmp_path)
    logged, skipped = read_samples(tmp_path / SAMPLES_FILE)
    assert [s.record for s in logged] == [episode, single] and skipped == []
    assert page_data(tmp_path)["samples"][0]["turns"] == [(0, 6, "policy"), (6, 9, "observation"), (9, 14, "policy")]
    bad = {"gap": [[0, 6, "policy"], [7, 14, "observation"]], "short": [[0, 6, "policy"], [6, 9, "observation"]],
           "kind": [[0, 6, "policy"], [6, 14, "tool"]], "empty": [[0, 0, "policy"], [0, 14, "policy"]]}
    lines = [json.dumps(asdict(episode) | {"turns": turns}) for turns in bad.values()]
    (tmp_path / SAMPLES_FILE).write_text("\n".join(lines) + "\n")
    logged, skipped = read_samples(tmp_path / SAMPLES_FILE)
    assert logged == [] and [s.reason for s in skipped] == [
        '`turns` span [7, 14, "observation"]: expected a non-empty span from token 6, kind policy or observation',
        "`turns` cover 9 of 14 tokens",
        '`turns` span [6, 14, "tool"]: expected a non-empty span from token 6, kind policy or observation',
        '`turns` span [0, 0, "policy"]: expected a non-empty span from token 0, kind policy or observation',
    ]


def test_page_data_thumbnails_and_plots(tmp_path):
    write_samples(tmp_path)
    (tmp_path / "plots").mkdir()
    Image.new("RGB", (60, 40), "white").save(tmp_path / "plots" / "reward.png")
    data = page_data(tmp_path)
    assert len(data["samples"]) == 6 and [s["line"] for s in data["skipped"]] == [3, 6]
    thumbnails = [s["thumbnails"] for s in data["samples"]]
    assert thumbnails[0][0].startswith("data:image/png;base64,") and thumbnails[0] == thumbnails[1]
    assert thumbnails[2] == [None]  # gone.png: the page names the path instead
    assert thumbnails[3:] == [[], [], []]
    assert [p["name"] for p in data["plots"]] == ["plots/reward.png"]


def test_the_page_is_self_contained_and_text_cannot_break_out(tmp_path):
    records = write_samples(tmp_path)
    hostile = asdict(records[0]) | {"prompt": "</script><script>alert(1)</script>{{script}}"}
    with (tmp_path / SAMPLES_FILE).open("a") as f:
        f.write(json.dumps(hostile) + "\n")
    html = write_page(tmp_path).read_text()
    assert html.count("</script>") == 2  # the data's and the page script's own
    assert "{{" not in html.replace("{{script}}", "")  # every placeholder filled, once
    for remote in ("http://", "https://", "//cdn", "@import"):
        assert remote not in html


def test_view_command_writes_the_page_and_refuses_bad_arguments(tmp_path, capsys):
    write_samples(tmp_path)
    assert main(["view", str(tmp_path)]) == 0
    assert (tmp_path / PAGE_FILE).is_file()
    assert main(["view", str(tmp_path / "nothing")]) == 2
    assert "view " + str(tmp_path / "nothing") + ": not a folder" in capsys.readouterr().err
    assert main(["view", str(tmp_path), "--port", "9000"]) == 2
    assert "--port 9000: only with --serve" in capsys.readouterr().err


def test_a_run_without_samples_still_gets_a_page(tmp_path):
    data = page_data(tmp_path)
    assert data["samples"] == [] and data["skipped"] == [] and data["plots"] == []
    assert write_page(tmp_path).is_file()


def test_server_binds_loopback_only_and_serves_the_page(tmp_path):
    write_samples(tmp_path)
    write_page(tmp_path)
    with folder_server(tmp_path, 0) as server:
        host, port = server.server_address
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/{PAGE_FILE}", timeout=30) as response:
                assert response.status == 200 and b'id="data"' in response.read()
        finally:
            server.shutdown()
    assert host == "127.0.0.1"


@pytest.mark.slow
def test_view_serve_through_the_real_cli(tmp_path):
    write_samples(tmp_path)
    command = [sys.executable, "-m", "stream_rlhf.cli", "view", str(tmp_path), "--serve", "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().startswith("wrote ")
        serving = process.stdout.readline()
        assert "http://127.0.0.1:" in serving
        url = serving.split(" at ")[1].split()[0]
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.status == 200
    finally:
        process.terminate()
        process.wait(timeout=30)
