"""The LoRA benchmark's smoke run works end to end and prints the figures it promises: the
adapters train a tenth of the parameters, the summary says so, every column learns from the same
start, and the LoRA base as the reference runs one process fewer."""

from __future__ import annotations

import pytest

from tests.bench_run import run_bench_json

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_bench_lora_quick_json(tmp_path):
    figures, stdout = run_bench_json("bench/lora.py", tmp_path, 400)
    assert figures["baseline"] == "full" and figures["iterations"] == 2
    full, lora, base = (figures["columns"][c] for c in ("full", "lora", "lora_base"))
    assert full["trained"] == full["total"]  # a text model: every weight trains
    # rank 8 on the 7 projections of 2 layers (q and o 128 x 128, k and v 128 x 64, the MLP 128 x 384)
    assert lora["trained"] == 8 * 2 * (2 * (128 + 128) + 2 * (128 + 64) + 3 * (128 + 384)) == 38_912
    assert lora["total"] == full["total"] + lora["trained"]  # the base, and the adapters beside it
    assert lora["ratios"]["optimizer_memory"] == pytest.approx(lora["trained"] / full["trained"], abs=1e-3)
    assert full["before"] == lora["before"] == base["before"]  # one warm start, the same prompts
    for column in (full, lora, base):
        assert 0 <= column["after"] <= 1 and column["tokens_per_s"] > 0 and column["pss_mb"] > 0
    assert base["processes"] == lora["processes"] - 1  # no ref_forward stage
    assert "AdamW state / full" in stdout  # the human table comes first
