"""WeightStore's page reuse: retired versions become the spare that the next publish rewrites in
place, never under a reader; the files it writes are plain safetensors."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from stream_rlhf.weights.shm_store import SPARE, WeightStore, reading


class Tied(nn.Module):
    """An embedding shared with the output layer, as tied LM heads are."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(4).to(torch.bfloat16)


def filled(model: nn.Module, value: float) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def test_versions_load_newest_first_and_leave_after_keep_newer(tmp_path):
    model, loaded = nn.Linear(4, 3), nn.Linear(4, 3)
    store = WeightStore(tmp_path, "actor", keep=2)
    with pytest.raises(FileNotFoundError, match="no weights published"):
        store.load_into(loaded)
    for version in (1, 2, 3):
        with torch.no_grad():
            model.bias.fill_(version)
        store.publish(model, version, {"note": f"v{version}"})
    assert store.latest_version() == 3 and store.load_into(loaded) == 3
    assert torch.equal(loaded.bias, torch.full((3,), 3.0)) and torch.equal(loaded.weight, model.weight)
    assert store.metadata(2) == {"note": "v2"}
    assert store.refresh(loaded, 3) == 3 and store.refresh(loaded, 2) == 3
    assert not store.path(1).exists()  # left with keep=2
    with pytest.raises(FileNotFoundError):
        store.metadata(1)


def test_a_retired_version_is_rewritten_in_place_by_the_next_publish(tmp_path):
    store, model = WeightStore(tmp_path, "actor", keep=2), Tied()
    for version in (1, 2):
        store.publish(filled(model, version), version)
    first = os.stat(store.path(1)).st_ino
    store.publish(filled(model, 3), 3)  # v1 leaves the window: the spare
    assert not store.path(1).exists() and os.stat(store.folder / SPARE).st_ino == first
    store.publish(filled(model, 4), 4)  # written over the spare's pages
    assert os.stat(store.path(4)).st_ino == first
    loaded = filled(Tied(), 0)
    assert store.load_into(loaded) == 4
    assert torch.equal(loaded.head.weight, torch.full((10, 4), 4.0)) and loaded.head.weight is loaded.embed.weight
    assert loaded.norm.weight.dtype == torch.bfloat16 and torch.equal(loaded.norm.weight, model.norm.weight)
    tensors = load_file(str(store.path(4)))  # a plain safetensors file, tied weights stored once
    assert set(tensors) == {"embed.weight", "norm.weight", "norm.bias"}


def test_a_version_being_read_is_never_rewritten(tmp_path):
    store, model = WeightStore(tmp_path, "actor", keep=2), Tied()
    for version in (1, 2):
        store.publish(filled(model, version), version)
    held, second = store.path(1), os.stat(store.path(2)).st_ino
    with reading(held):
        opened = load_file(str(held))  # maps the file: rewriting it would change these tensors
        store.publish(filled(model, 3), 3)  # v1 leaves while read: unlinked, not the spare
        store.publish(filled(model, 4), 4)
        assert torch.equal(opened["embed.weight"], torch.full((10, 4), 1.0))
    assert os.stat(store.folder / SPARE).st_ino == second  # v2 left unread at publish 4: the spare
    loaded = Tied()
    assert store.load_into(loaded) == 4 and torch.equal(loaded.embed.weight, torch.full((10, 4), 4.0))


def test_a_reader_that_opened_a_version_as_it_left_is_told_it_is_gone(tmp_path):
    store = WeightStore(tmp_path, "actor", keep=2)
    store.publish(filled(Tied(), 1), 1)
    path = store.path(1)
    errors: list[Exception] = []

    def read() -> None:
        try:
            with reading(path):
                pass
        except FileNotFoundError as exc:
            errors.append(exc)

    with open(path, "r+b") as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)  # as publish holds the spare it rewrites
        reader = threading.Thread(target=read)
        reader.start()
        reader.join(0.3)
        assert reader.is_alive()  # waiting for the lock, the file already opened
        os.rename(path, store.folder / SPARE)
    reader.join(10)
    assert len(errors) == 1 and "left the window" in str(errors[0])


def test_a_dtype_safetensors_cannot_hold_is_named(tmp_path):
    model = nn.Linear(2, 2)
    model.register_buffer("phase", torch.zeros(2, dtype=torch.complex128))
    with pytest.raises(ValueError, match=r"phase: dtype torch.complex128 cannot be stored"):
        WeightStore(tmp_path, "actor").publish(model, 1)


def test_load_state_gives_back_the_names_a_tied_tensor_was_stored_once_under(tmp_path):
    store = WeightStore(tmp_path, "policy")
    embed = torch.arange(6.0).reshape(3, 2)
    store.publish({"model.embed_tokens.weight": embed, "lm_head.weight": embed, "norm.weight": torch.ones(2)}, 1)
    assert len(load_file(str(store.path(1)))) == 2  # the tied pair once
    state = store.load_state(1)
    assert sorted(state) == ["lm_head.weight", "model.embed_tokens.weight", "norm.weight"]
    assert torch.equal(state["lm_head.weight"], embed) and torch.equal(state["model.embed_tokens.weight"], embed)
    store.publish({"model.embed_tokens.weight": embed + 1, "lm_head.weight": embed + 1,
                   "norm.weight": torch.ones(2)}, 2)
    store.publish({"model.embed_tokens.weight": embed + 2, "lm_head.weight": embed + 2,
                   "norm.weight": torch.ones(2)}, 3)
    with pytest.raises(FileNotFoundError):
        store.load_state(1)  # left the window (keep 2)
