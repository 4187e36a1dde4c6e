"""Named tensors into byte buckets and back: dtypes, oversized tensors, the JSON layout, mismatches."""

from __future__ import annotations

import pytest
import torch

from stream_rlhf.weights.buckets import ALIGN, BucketLayout, pack, unpack

BUCKET_BYTES = 256


def named() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5)),                         # 60 bytes
        ("a.bias", torch.randn(5).bfloat16()),                   # 10 bytes
        ("positions", torch.arange(7, dtype=torch.int64)),       # 56 bytes
        ("embed", torch.randn(20, 8)),                           # 640 bytes: more than a bucket
        ("scale", torch.tensor(2.5)),                            # a scalar
        ("head", torch.randn(8, 4).t()),                         # not contiguous
    ]


def test_round_trip_keeps_names_dtypes_shapes_and_values():
    layout = BucketLayout.of(named(), BUCKET_BYTES)
    buckets = pack(named(), layout)
    assert all(b.dtype == torch.uint8 for b in buckets)
    out = unpack(buckets, layout)
    assert [name for name, _ in out] == [name for name, _ in named()]
    for (name, expected), (_, got) in zip(named(), out):
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected), name
    assert all(entry.offset % ALIGN == 0 for entry in layout.entries)


def test_a_tensor_bigger_than_a_bucket_gets_its_own():
    layout = BucketLayout.of(named(), BUCKET_BYTES)
    by_name = {entry.name: entry for entry in layout.entries}
    embed = by_name["embed"]
    assert embed.offset == 0 and layout.bucket_sizes[embed.bucket] == 640
    assert by_name["positions"].bucket == by_name["a.weight"].bucket < embed.bucket < by_name["scale"].bucket
    assert max(size for i, size in enumerate(layout.bucket_sizes) if i != embed.bucket) <= BUCKET_BYTES


def test_pack_is_a_snapshot_and_unpack_is_a_view():
    tensors = named()
    layout = BucketLayout.of(tensors, BUCKET_BYTES)
    buckets = pack(tensors, layout)
    tensors[0][1].add_(1.0)  # the trainer steps on: the snapshot does not move
    assert not torch.equal(unpack(buckets, layout)[0][1], tensors[0][1])
    unpack(buckets, layout)[0][1].zero_()  # views: writing one writes the bucket
    assert torch.equal(unpack(buckets, layout)[0][1], torch.zeros(3, 5))
    pack(tensors, layout, out=buckets)  # repacking into the same buckets
    assert torch.equal(unpack(buckets, layout)[0][1], tensors[0][1])


def test_layout_json_round_trip():
    layout = BucketLayout.of(named(), BUCKET_BYTES)
    assert BucketLayout.from_json(layout.to_json()) == layout


def test_mismatches_name_the_tensor():
    layout = BucketLayout.of(named(), BUCKET_BYTES)
    wrong_shape = [(n, t[:2] if n == "a.weight" else t) for n, t in named()]
    with pytest.raises(ValueError, match=r"tensor 'a.weight' is \(2, 5\) float32; the layout has \(3, 5\) float32"):
        pack(wrong_shape, layout)
    wrong_dtype = [(n, t.half() if n == "a.bias" else t) for n, t in named()]
    with pytest.raises(ValueError, match=r"'a.bias' is \(5,\) float16; the layout has \(5,\) bfloat16"):
        pack(wrong_dtype, layout)
    renamed = [("b.weight" if n == "a.weight" else n, t) for n, t in named()]
    with pytest.raises(ValueError, match=r"not in the layout \['b.weight'\], missing \['a.weight'\]"):
        pack(renamed, layout)
    with pytest.raises(ValueError, match="bucket 0 is"):
        unpack([torch.zeros(1, dtype=torch.uint8)] + pack(named(), layout)[1:], layout)
    with pytest.raises(ValueError, match="duplicate tensor names"):
        BucketLayout.of(named() + named()[:1], BUCKET_BYTES)
    with pytest.raises(ValueError, match="dtype 'float99': not a torch dtype"):
        BucketLayout.from_json(layout.to_json().replace("float32", "float99"))
