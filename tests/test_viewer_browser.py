"""view.html in a real headless Chromium (Debian's, driven by Playwright; scripts/setup_browser.sh
installs both): it renders every good sample, the colouring switch changes the tokens' computed
colours, the order filter reorders the cards, the corrupt lines are reported, a multi-turn sample
shows its turns (policy tokens coloured, observations shaded) and a failed episode left out of
training is marked. A missing browser fails the test, naming the setup script; it never skips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stream_rlhf.viewer.page import write_page
from tests.test_viewer_page import (
    BAD_LINES,
    write_episode_samples,
    write_left_out_samples,
    write_samples,
    write_untrained_episode,
)

pytestmark = pytest.mark.slow  # a real Chromium process (scripts/setup_browser.sh installs it before the full suite)
CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--no-first-run"]
SCREENSHOT = os.environ.get("VIEWER_SCREENSHOT")
"""Where to keep the page's screenshot (to look at it); a temporary file otherwise."""


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is not installed: run scripts/setup_browser.sh")
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} does not exist (Debian's chromium package): run scripts/setup_browser.sh")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(params=[write_samples])
def page(browser, tmp_path, request):
    good = request.param(tmp_path)
    tab = browser.new_page(viewport={"width": 1100, "height": 900})
    errors = []
    tab.on("pageerror", lambda error: errors.append(str(error)))
    tab.on("request", lambda request: errors.append(f"request {request.url}")
           if not request.url.startswith(("file:", "data:")) else None)
    tab.goto(write_page(tmp_path).as_uri())
    tab.good = good
    yield tab
    assert errors == []  # no script error, nothing fetched from a network
    tab.close()


def _token_colours(page) -> list[str]:
    return page.eval_on_selector_all(".sample .token", "spans => spans.map(s => getComputedStyle(s).backgroundColor)")


def _card_rewards(page) -> list[float]:
    return [float(r) for r in page.eval_on_selector_all(".sample", "cards => cards.map(c => c.dataset.reward)")]


def test_renders_every_good_sample_and_reports_the_skipped_lines(page, tmp_path):
    assert page.locator(".sample").count() == len(page.good) == 6
    assert page.locator(".sample .token").count() == sum(len(r.tokens) for r in page.good)
    summary = page.inner_text("#skipped-summary")
    assert summary == f"2 lines of samples.jsonl skipped (lines {', '.join(map(str, sorted(BAD_LINES)))})"
    page.click("#skipped-summary")
    reasons = page.locator("#skipped-lines li").all_inner_texts()
    assert reasons[0].startswith("line 3: ") and reasons[1] == "line 6: Expected `int`, got `str` - at `$.iteration`"
    assert page.locator(".prompt img").count() == 2  # the two samples with red.png
    assert "image not readable: " in page.inner_text(".sample:nth-child(3) .prompt")
    page.screenshot(path=SCREENSHOT or str(tmp_path / "view.png"), full_page=True)


def test_colouring_switch_changes_token_colours(page):
    by_logprob = _token_colours(page)
    page.check('input[name="colour"][value="advantage"]')
    by_advantage = _token_colours(page)
    assert page.inner_text("#legend-high") == "+1.000"  # the largest |advantage| in the log
    page.check('input[name="colour"][value="kl"]')
    by_kl = _token_colours(page)
    assert len(set(by_logprob)) > 1 and len(set(by_advantage)) > 1 and len(set(by_kl)) > 1
    assert by_logprob != by_advantage != by_kl != by_logprob
    # the advantage hue follows the sign: sample 0 (reward 0.5) starts green, its second token is red
    first, second = by_advantage[0], by_advantage[1]
    assert _rgb(first)[1] > _rgb(first)[0] and _rgb(second)[0] > _rgb(second)[1]


def test_filters_reorder_the_cards(page):
    logged = [r.reward for r in page.good]
    assert _card_rewards(page) == logged
    page.select_option("#order", "reward_low")
    assert _card_rewards(page) == sorted(logged)
    page.select_option("#order", "kl_high")
    mean_kl = {r.reward: sum(r.kl) / len(r.kl) for r in page.good}
    assert _card_rewards(page) == sorted(logged, key=lambda reward: -mean_kl[reward])
    page.select_option("#iteration", "1")
    assert sorted(_card_rewards(page)) == sorted(r.reward for r in page.good if r.iteration == 1)


@pytest.mark.parametrize("page", [write_episode_samples], indirect=True)
def test_a_multi_turn_sample_shows_its_turns(page, tmp_path):
    episode, single = page.good
    turns = page.eval_on_selector_all(".sample:nth-child(1) .turn", """turns => turns.map(t => ({
        classes: t.className, start: +t.dataset.start, end: +t.dataset.end,
        label: t.querySelector(".turn-label").textContent, tokens: t.querySelectorAll(".token").length,
        background: getComputedStyle(t).backgroundColor,
        colours: [...t.querySelectorAll(".token")].map(s => getComputedStyle(s).backgroundColor)}))""")
    assert [(t["classes"], t["start"], t["end"], t["label"]) for t in turns] == [
        ("turn policy", 0, 6, "turn 1"), ("turn observation", 6, 9, "observation"), ("turn policy", 9, 14, "turn 2")]
    assert [t["tokens"] for t in turns] == [6, 3, 5]
    policy, observation = turns[0], turns[1]
    assert observation["background"] != policy["background"] == "rgba(0, 0, 0, 0)"  # the observation is shaded
    assert set(observation["colours"]) == {"rgba(0, 0, 0, 0)"}  # its tokens are not coloured
    assert len(set(policy["colours"])) > 1  # the policy tokens are, by log-prob
    assert page.locator(".sample:nth-child(1) .token.observation").count() == 3
    meta = page.inner_text(".sample:nth-child(1) .meta")
    assert "2 turns" in meta and "mean KL 0.0636" in meta  # over the 11 policy tokens alone
    # the single-turn sample is drawn as before: no turn blocks, every token coloured
    assert page.locator(".sample:nth-child(2) .turn").count() == 0
    assert page.locator(".sample:nth-child(2) .response > .token").count() == len(single.tokens)
    assert "turn" not in page.inner_text(".sample:nth-child(2) .meta")
    page.check('input[name="colour"][value="kl"]')  # the scale leaves out the observation tokens
    assert page.inner_text("#legend-high") == "+0.130"  # token 13's KL, the largest on a policy token
    page.screenshot(path=SCREENSHOT or str(tmp_path / "view_turns.png"), full_page=True)


@pytest.mark.parametrize("page", [write_untrained_episode], indirect=True)
def test_a_failed_episode_left_out_of_training_is_marked_and_faded_and_a_cut_sample_says_so(page, tmp_path):
    assert page.get_attribute(".sample:nth-child(1)", "class") == "sample untrained"
    assert "not trained: a failed episode (env.failed_episodes: mask)" in page.inner_text(".sample:nth-child(1) .meta")
    opacity = "el => getComputedStyle(el).opacity"
    assert page.eval_on_selector(".sample:nth-child(1) .response", opacity) == "0.45"
    assert page.get_attribute(".sample:nth-child(2)", "class") == "sample"  # a trained sample as before
    assert "not trained" not in page.inner_text(".sample:nth-child(2) .meta")
    assert "cut at its length limit" in page.inner_text(".sample:nth-child(2) .meta")  # `truncated`
    assert "cut at" not in page.inner_text(".sample:nth-child(1) .meta")
    assert page.eval_on_selector(".sample:nth-child(2) .response", opacity) == "1"
    page.screenshot(path=SCREENSHOT or str(tmp_path / "view_untrained.png"), full_page=True)


@pytest.mark.parametrize("page", [write_left_out_samples], indirect=True)
def test_a_sample_dynamic_sampling_left_out_is_marked_and_faded(page, tmp_path):
    first = '.sample[data-line="1"]'
    assert page.get_attribute(first, "class") == "sample untrained"
    assert "not trained: group returns all equal (algorithm.dynamic_sampling)" in page.inner_text(f"{first} .meta")
    assert page.eval_on_selector(f"{first} .response", "el => getComputedStyle(el).opacity") == "0.45"
    assert page.locator(".sample.untrained").count() == 1  # the others trained
    page.screenshot(path=SCREENSHOT or str(tmp_path / "view_left_out.png"), full_page=True)


def _rgb(css: str) -> tuple[int, int, int]:
    """(r, g, b) of a computed `rgba(r, g, b, a)`."""
    return tuple(int(float(v)) for v in css[css.index("(") + 1:-1].split(",")[:3])
