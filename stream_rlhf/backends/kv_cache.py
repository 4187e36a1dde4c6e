"""A KV cache that writes each step in place: Hugging Face's DynamicCache with preallocated layers.

    cache = preallocated_cache(capacity=prompt_width + max_new_tokens)
    model(..., past_key_values=cache, use_cache=True)      # as with DynamicCache()

DynamicCache appends every decode step with `torch.cat`, copying the whole cache of every layer
each step: for a batch of 64 rows and 48 steps on a 12M model that was a third of the sampler's
time (aten::cat). Here each layer allocates room for `capacity` positions at its first update
and writes the new keys and values into it; the model reads a view of the filled part. A layer
grows (doubling) if a step goes past the capacity, and keeps batch selection (rows that leave
the batch) and cropping (speculative rollback) working.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.device = key_states.device
        self._keys = key_states.new_empty(batch, heads, self.capacity, dim)
        self._values = value_states.new_empty(batch, heads, self.capacity, value_states.shape[-1])
        self.length = 0
        self._view()
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: object,
               **kwargs: object) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            self._grow(max(end, 2 * self._keys.shape[-2]))
        self._keys[:, :, self.length:end] = key_states
        self._values[:, :, self.length:end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): give the number of tokens to remove as a negative integer")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)
        self._view()

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._keys = self._keys.repeat_interleave(repeats, dim=0)
            self._values = self._values.repeat_interleave(repeats, dim=0)
            self._view()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))

    def reset(self) -> None:
        self.length = 0
        super().reset()

    def _grow(self, capacity: int) -> None:
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], capacity, old.shape[-1])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def _view(self) -> None:
        self.keys = self._keys[:, :, : self.length]
        self.values = self._values[:, :, : self.length]


def preallocated_cache(capacity: int) -> DynamicCache:
    """A DynamicCache whose layers (created at their first update) hold `capacity` positions."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = partial(PreallocatedLayer, capacity)
    return cache
