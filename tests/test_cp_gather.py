"""Context-parallel log-probs over real gloo groups (2 and 4 processes) match one process's reference."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stream_rlhf.kernels import force_backend
from stream_rlhf.kernels.cp_gather import (
    LAYOUTS,
    cp_gather,
    cp_token_logprobs,
    cp_token_logprobs_from_hidden,
    local_positions,
    shard,
)

BATCH, SEQ, VOCAB, HIDDEN = 2, 16, 50, 8
TEMPERATURE = 0.7


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same full-sequence inputs on every rank: ids (B, S), logits (B, S, V), hidden (B, S, H), weight (V, H)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=gen)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    return ids, logits, hidden, weight


def _reference(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log_softmax + gather over the full sequence: (B, S - 1)."""
    logp = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, dim=-1)  # (B, S - 1, V)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def _boundary_positions(cp_size: int, layout: str) -> list[int]:
    """Positions p < S - 1 whose label p + 1 lives on another rank."""
    owner = {int(p): r for r in range(cp_size) for p in local_positions(SEQ, cp_size, r, layout)}
    return [p for p in range(SEQ - 1) if owner[p] != owner[p + 1]]


def _check_rank(cp_size: int, rank: int, layout: str) -> None:
    ids, logits, hidden, weight = _inputs()
    expected = _reference(logits, ids)  # (B, S - 1)

    logits_local = shard(logits, cp_size, rank, layout).requires_grad_()  # (B, S_local, V)
    got = cp_token_logprobs(logits_local, ids, cp_size, rank, layout, temperature=TEMPERATURE)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    boundary = _boundary_positions(cp_size, layout)  # none with a single rank
    assert bool(boundary) == (cp_size > 1)
    torch.testing.assert_close(got[:, boundary], expected[:, boundary], atol=1e-5, rtol=1e-5)

    # The same loss on every rank; each rank's logits get the gradient of its own positions.
    loss_weights = torch.linspace(-1.0, 1.0, BATCH * (SEQ - 1)).view(BATCH, SEQ - 1)
    (got * loss_weights).sum().backward()
    full_logits = logits.clone().requires_grad_()
    (_reference(full_logits, ids) * loss_weights).sum().backward()
    torch.testing.assert_close(logits_local.grad, shard(full_logits.grad, cp_size, rank, layout), atol=1e-5, rtol=1e-5)

    from_hidden = cp_token_logprobs_from_hidden(
        shard(hidden, cp_size, rank, layout), weight, ids, cp_size, rank, layout, temperature=TEMPERATURE
    )
    torch.testing.assert_close(from_hidden, _reference(hidden @ weight.T, ids), atol=1e-5, rtol=1e-5)

    values = torch.arange(BATCH * SEQ * 3, dtype=torch.float32).view(BATCH, SEQ, 3)
    assert torch.equal(cp_gather(shard(values, cp_size, rank, layout), cp_size, rank, layout), values)


def _worker(rank: int, cp_size: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=cp_size, rank=rank, timeout=timedelta(seconds=30)
    )
    try:
        torch.set_num_threads(1)
        force_backend("torch")  # the eager kernels: fast on CPU, and what the reference checks here
        for layout in LAYOUTS:
            _check_rank(cp_size, rank, layout)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("cp_size", [2, 4])
def test_cp_logprobs_match_single_process(cp_size, free_port):
    mp.spawn(_worker, args=(cp_size, free_port), nprocs=cp_size, join=True)


def test_cp_size_one_needs_no_process_group():
    previous = force_backend("torch")
    try:
        _check_rank(1, 0, "contiguous")
    finally:
        force_backend(previous)


@pytest.mark.parametrize(
    ("seq_len", "cp_size", "layout", "names"),
    [
        (15, 2, "contiguous", ["seq_len=15", "cp_size=2"]),
        (12, 4, "load_balanced", ["seq_len=12", "cp_size=4", "8"]),
        (16, 3, "load_balanced", ["seq_len=16", "cp_size=3", "6"]),
    ],
)
def test_bad_lengths_name_the_values(seq_len, cp_size, layout, names):
    with pytest.raises(ValueError) as err:
        local_positions(seq_len, cp_size, 0, layout)
    for name in names:
        assert name in str(err.value)


def test_layouts():
    assert local_positions(8, 2, 0, "contiguous").tolist() == [0, 1, 2, 3]
    assert local_positions(8, 2, 0, "load_balanced").tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1, "load_balanced").tolist() == [2, 3, 4, 5]
    for layout in LAYOUTS:
        held = torch.cat([local_positions(24, 3, r, layout) for r in range(3)])
        assert sorted(held.tolist()) == list(range(24))
