"""Named tensors flattened into a few byte buckets, the unit every weight-sync transport moves.

    layout = BucketLayout.of(model.named_parameters(), bucket_bytes=64 << 20)
    buckets = pack(model.named_parameters(), layout)     # uint8 copies: a snapshot of the weights
    named = unpack(buckets, layout)                       # [(name, typed view into a bucket)]
    BucketLayout.from_json(layout.to_json()) == layout    # how receivers learn the layout

Tensors keep their order; each starts at a 16-byte-aligned offset of its bucket; a bucket holds
tensors until the next would pass `bucket_bytes`, and a tensor larger than that gets a bucket of
its own. Any dtype works (bfloat16 included): the bytes are copied as they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

ALIGN = 16
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)}


@dataclass(frozen=True)
class Entry:
    """Where one named tensor lies in the buckets."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """torch dtype without its prefix: "float32", "bfloat16", "int64"."""
    bucket: int
    offset: int
    """Byte offset in the bucket (a multiple of ALIGN)."""
    nbytes: int


@dataclass(frozen=True)
class BucketLayout:
    entries: tuple[Entry, ...]
    bucket_sizes: tuple[int, ...]
    """Bytes per bucket."""

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> BucketLayout:
        """Lay `named` out, in order, in buckets of at most `bucket_bytes` (bar oversized tensors)."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}: must be >= 1")
        entries: list[Entry] = []
        sizes: list[int] = []
        fill = 0  # bytes used in the open bucket (the last of `sizes`, once there is one)
        for name, tensor in named:
            nbytes = tensor.numel() * tensor.element_size()
            start = -(-fill // ALIGN) * ALIGN
            if not sizes or (fill > 0 and start + nbytes > bucket_bytes):
                sizes.append(0)
                start = 0
            entries.append(Entry(name, tuple(tensor.shape), dtype_name(tensor.dtype), len(sizes) - 1, start, nbytes))
            fill = start + nbytes
            sizes[-1] = fill
        names = [entry.name for entry in entries]
        if len(set(names)) != len(names):
            duplicates = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"BucketLayout.of: duplicate tensor names {duplicates}")
        return cls(tuple(entries), tuple(sizes))

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    def to_json(self) -> str:
        return json.dumps({"entries": [asdict(entry) for entry in self.entries], "bucket_sizes": self.bucket_sizes})

    @classmethod
    def from_json(cls, text: str) -> BucketLayout:
        data = json.loads(text)
        entries = tuple(Entry(**{**entry, "shape": tuple(entry["shape"])}) for entry in data["entries"])
        for entry in entries:
            parse_dtype(entry.dtype)
        return cls(entries, tuple(data["bucket_sizes"]))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: not a torch dtype")
    return DTYPES[name]


def empty_buckets(layout: BucketLayout, device: torch.device | str) -> list[torch.Tensor]:
    """Uninitialised uint8 buckets for `layout` on `device` (a receiver's buffers)."""
    return [torch.empty(size, dtype=torch.uint8, device=device) for size in layout.bucket_sizes]


def pack(named: Iterable[tuple[str, torch.Tensor]], layout: BucketLayout, device: torch.device | str | None = None,
         out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Copy `named` into uint8 buckets laid out by `layout`, on `device` (None: the first tensor's),
    or into `out` (buckets of this layout to reuse). Raises ValueError naming any tensor whose name,
    shape or dtype the layout does not have."""
    given = dict(named)
    expected = {entry.name for entry in layout.entries}
    if given.keys() != expected:
        raise ValueError(f"pack: the tensors do not match the layout: not in the layout "
                         f"{sorted(given.keys() - expected)}, missing {sorted(expected - given.keys())}")
    for entry in layout.entries:
        tensor = given[entry.name]
        if tuple(tensor.shape) != entry.shape or dtype_name(tensor.dtype) != entry.dtype:
            raise ValueError(f"pack: tensor {entry.name!r} is {tuple(tensor.shape)} {dtype_name(tensor.dtype)}; "
                             f"the layout has {entry.shape} {entry.dtype}")
    if out is None:
        first = next(iter(given.values()), None)
        device = device if device is not None else (first.device if first is not None else "cpu")
        buckets = empty_buckets(layout, device)
    else:
        _check_buckets(out, layout, "pack")
        buckets = list(out)
    with torch.no_grad():
        for name, view in unpack(buckets, layout):
            view.copy_(given[name])
    return buckets


def unpack(buckets: Sequence[torch.Tensor], layout: BucketLayout) -> list[tuple[str, torch.Tensor]]:
    """Typed views into `buckets`, in layout order: no copy, they change when the buckets do."""
    _check_buckets(buckets, layout, "unpack")
    return [
        (entry.name, buckets[entry.bucket][entry.offset:entry.offset + entry.nbytes]
         .view(parse_dtype(entry.dtype)).view(entry.shape))
        for entry in layout.entries
    ]


def _check_buckets(buckets: Sequence[torch.Tensor], layout: BucketLayout, caller: str) -> None:
    if len(buckets) != len(layout.bucket_sizes):
        raise ValueError(f"{caller}: {len(buckets)} buckets; the layout has {len(layout.bucket_sizes)}")
    for index, (bucket, size) in enumerate(zip(buckets, layout.bucket_sizes)):
        if bucket.dtype != torch.uint8 or bucket.dim() != 1 or bucket.numel() != size:
            raise ValueError(f"{caller}: bucket {index} is {tuple(bucket.shape)} {dtype_name(bucket.dtype)}; "
                             f"the layout needs ({size},) uint8")
