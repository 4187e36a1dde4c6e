"""A slot-addressed static KV cache: fixed buffers that a decode step (and a captured CUDA graph of
it) reads and writes in place, one slot per decoding row.

    cache = SlotCache(slots=64, capacity=128)
    cache.join(slots, prefill_cache, source_rows, prefill_mask)   # rows enter slots with their prefill
    mask = cache.begin(query_length)                              # (S, 1, Q, C) bool, inside the step
                                                                  # (begin(q, rows=range): those slots only)
    model(tokens, attention_mask=mask, position_ids=positions, **cache_argument(model, cache))
    cache.commit(kept)                                            # (S,) how many written positions each slot keeps
    smaller.take(cache, live_slots)                               # the live slots, compacted into a smaller bucket

Every layer holds (S, Hkv, C, D) keys and values allocated once (at the first join, in the
prefill's dtype), so the tensors a step touches never move: a CUDA graph captured over them is
replayed as long as the cache lives (`static_decode.py` keeps one per batch and length bucket).

A slot is a row's place in the buffers, not a row of a batch that shrinks: `columns[s]` is where
slot s writes next and `valid[s]` the columns it has kept (a left-padded prompt's padding is not
valid). A step writes Q positions at columns[s]..columns[s]+Q-1 of EVERY slot (an indexed write,
so slots may sit at different columns); the mask lets query j of slot s see its valid columns and its
own new positions up to j. `commit(kept)` then marks the first kept[s] of them valid and moves
columns[s] on: 1 per decode step for a live row, n + 1 after Medusa accepted n drafts (the rejected
positions are simply overwritten by the next step, no holes), 0 for a finished or empty slot,
which keeps rewriting one column nobody reads. Every query sees at least its own position, so no
softmax row is empty.

Rows joining and leaving (issue 34's multi-turn episodes): `join` writes a prefill into any free
slots and sets their columns to the prefill's width, whatever the other slots are doing; a row
leaves by being committed 0 from then on (its slot is free for the next join once its outputs are
read; `clear` empties it for a row that is fed from column 0 instead: `episode_sampler.py`), and
`take` compacts the live slots of a bucket into a smaller one when few are left; `swap` lets two
slots trade places, so the rows a step needs can be kept together and a step cover only them
(`begin(q, rows=range(a, b))`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer


class SlotLayer(DynamicLayer):
    """One layer's keys and values, (S, Hkv, C, D), written where the cache's `begin` said."""

    def __init__(self, cache: SlotCache, keys: Tensor, values: Tensor):
        super().__init__()
        self.cache = cache
        self.keys, self.values = keys, values
        self.device = keys.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: object,
               **kwargs: object) -> tuple[Tensor, Tensor]:
        """key/value states (R, Hkv, Q, D) into their slots' next Q columns; the buffers of the
        step's slots (0..R-1, `begin`) back."""
        slots, columns = self.cache.write_at  # (R, 1, 1), (R, 1, Q)
        heads = torch.arange(key_states.shape[1], device=self.device)[None, :, None]  # (1, Hkv, 1)
        # an index_put: half the time of a scatter on the CPU
        self.keys.index_put_((slots, heads, columns), key_states)
        self.values.index_put_((slots, heads, columns), value_states)
        rows = self.cache.rows
        return self.keys[rows], self.values[rows]

    def get_seq_length(self) -> int:
        return self.cache.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.capacity, 0


class SlotCache(Cache):
    """`slots` rows of `capacity` positions per layer; see the module docstring."""

    def __init__(self, slots: int, capacity: int, device: torch.device | str = "cpu"):
        if slots < 1 or capacity < 1:
            raise ValueError(f"slots={slots}, capacity={capacity}: both must be >= 1")
        super().__init__(layers=[])
        self.slots, self.capacity = slots, capacity
        self.columns = torch.zeros(slots, dtype=torch.long, device=device)  # (S,) next column per slot
        self.valid = torch.zeros((slots, capacity), dtype=torch.bool, device=device)  # (S, C)
        self.all_slots = torch.arange(slots, device=device)[:, None, None]  # (S, 1, 1)
        self.rows = slice(0, slots)
        """The step's slots (`begin`)."""
        self.write_at = (self.all_slots, self.columns[:, None, None])
        """Where the layers write: slot (R, 1, 1) and column (R, 1, Q) indices, set by `begin`."""
        self.graphs: dict[tuple, object] = {}
        """Captured steps over these buffers (`static_decode.py`), dropped when the buffers change."""

    def reset(self) -> None:
        """Every slot empty; the buffers (and the graphs over them) stay."""
        self.columns.zero_()
        self.valid.zero_()

    def allocate_like(self, layers: list[DynamicLayer]) -> None:
        """Buffers with the layer count, heads, head size and dtype of `layers`' keys and values,
        unless they are already so (new buffers drop the graphs captured over the old ones)."""
        def shape(t: Tensor) -> tuple:
            return (t.shape[1], t.shape[3], t.dtype)

        wanted = [(shape(layer.keys), shape(layer.values)) for layer in layers]
        if [(shape(layer.keys), shape(layer.values)) for layer in self.layers] == wanted:
            return
        device = self.columns.device
        self.layers = [SlotLayer(self, *(torch.zeros((self.slots, heads, self.capacity, dim), dtype=dtype,
                                                     device=device) for heads, dim, dtype in pair))
                       for pair in wanted]
        self.graphs.clear()

    def join(self, slots: Tensor, prefill: Cache, rows: Tensor, prefill_mask: Tensor) -> None:
        """Rows `rows` (J,) of a prefill's cache (any DynamicCache of width W) enter slots `slots`
        (J,): their keys and values at columns 0..W-1, valid where `prefill_mask` (J, W) is 1."""
        width = prefill_mask.shape[1]
        if width > self.capacity:
            raise ValueError(f"join: a prefill of {width} positions into a cache of capacity {self.capacity}")
        self.allocate_like(prefill.layers)
        for mine, theirs in zip(self.layers, prefill.layers):
            mine.keys[slots, :, :width] = theirs.keys[rows, :, :width]
            mine.values[slots, :, :width] = theirs.values[rows, :, :width]
        self.valid[slots] = False
        self.valid[slots, :width] = prefill_mask.bool()
        self.columns[slots] = width

    def take(self, other: SlotCache, slots: Tensor) -> None:
        """Slots `slots` (J,) of `other` (same capacity) into this cache's slots 0..J-1."""
        if other.capacity != self.capacity:
            raise ValueError(f"take: capacity {other.capacity} into {self.capacity}")
        self.allocate_like(other.layers)
        count = len(slots)
        for mine, theirs in zip(self.layers, other.layers):
            mine.keys[:count], mine.values[:count] = theirs.keys[slots], theirs.values[slots]
        self.valid[:count], self.columns[:count] = other.valid[slots], other.columns[slots]
        self.valid[count:], self.columns[count:] = False, 0

    def clear(self, slots: Tensor) -> None:
        """Slots `slots` (J,) empty: the next step writes them from column 0 (a new row may join)."""
        self.valid[slots] = False
        self.columns[slots] = 0

    def swap(self, a: int, b: int) -> None:
        """Slots a and b trade places: their keys, values, valid columns and next columns."""
        buffers = [t for layer in self.layers for t in (layer.keys, layer.values)] + [self.valid, self.columns]
        for buffer in buffers:  # row copies: cheaper than index_put for two rows
            row = buffer[a].clone()
            buffer[a] = buffer[b]
            buffer[b] = row

    def begin(self, query_length: int, rows: range | None = None) -> Tensor:
        """Before a step of `query_length` positions over the slots `rows` (default: every slot; the
        others are neither read nor written): set where the layers write, and the attention mask
        (R, 1, Q, C) bool (True = attend). No host synchronisation: capturable."""
        self.rows = slice(0, self.slots) if rows is None else slice(rows.start, rows.stop)
        columns = self.columns[self.rows]  # (R,)
        offsets = torch.arange(query_length, device=self.columns.device)  # (Q,)
        # a finished slot may sit near the end: its writes (read by nobody) stay inside the buffers
        written = (columns[:, None] + offsets).clamp(max=self.capacity - 1)  # (R, Q)
        self.write_at = (self.all_slots[self.rows], written[:, None, :])
        position = torch.arange(self.capacity, device=self.columns.device)  # (C,)
        own = (position >= columns[:, None, None]) & (position <= written[:, :, None])  # (R, Q, C)
        return (self.valid[self.rows, None, :] | own)[:, None]

    def commit(self, kept: Tensor) -> None:
        """After a step: slot s of the step's keeps the first kept[s] (R,) positions it wrote."""
        position = torch.arange(self.capacity, device=self.columns.device)  # (C,)
        start = self.columns[self.rows, None]
        self.valid[self.rows] |= (position >= start) & (position < start + kept[:, None])
        self.columns[self.rows] += kept
