"""The vision benchmark's smoke run works end to end and prints the keys it promises."""

from __future__ import annotations

import pytest

from tests.bench_run import run_bench_json

pytestmark = pytest.mark.slow

KEYS = {"encoder_calls_prefetch", "encoder_calls_no_prefetch", "iter_s_prefetch", "iter_s_no_prefetch", "speedup"}


@pytest.mark.timeout(900)  # ~100 s on a quiet 2-core machine, several times that on a loaded one
def test_bench_vision_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/vision.py", tmp_path, timeout_s=840)
    assert KEYS <= set(figures), sorted(KEYS - set(figures))
    # every stage that needs features encodes for itself without prefetch: five times the images
    # (rollout, the reference and critic forwards, both trainers; mllm_ppo has no actor forward)
    assert figures["encoder_calls_no_prefetch"] == 5 * figures["encoder_calls_prefetch"] > 0
    assert figures["iter_s_prefetch"] > 0 and figures["iter_s_no_prefetch"] > 0  # speed: bench/RESULTS.md
    assert "encoder calls" in stdout  # the human table comes first
