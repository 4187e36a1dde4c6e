"""A KV cache that writes each step in place and hands attention whole, contiguous buffers.

    cache = PreallocatedCache(capacity=prompt_width + max_new_tokens)
    model(..., attention_mask=mask_2d, **cache_argument(model, cache), use_cache=True)   # as with DynamicCache()

Two costs of Hugging Face's DynamicCache on the CPU, both measured on a 12M model decoding 64 rows
for 48 steps (one thread):
- it appends every decode step with `torch.cat`, copying the whole cache of every layer each step
  (a third of the sampler's time, aten::cat);
- a view of the filled part of a larger buffer, (B, H, :length, D), is not contiguous, and
  SDPA over it ran 3-6x slower than over a contiguous tensor (it copies it first): 2.0-2.4 ms
  against 0.4-0.7 ms per layer and step at 40 cached positions (AMD EPYC). The decode steps' own
  matmul attention (`decode_attention.py`) takes such a view without a copy and leaves out the
  unwritten tail.
So each layer allocates room for `capacity` positions at its first update, writes the new keys
and values into it, and returns the WHOLE buffer (B, H, capacity, D); the cache reports
`capacity` as the attention width (`get_mask_sizes`), as Hugging Face's StaticCache does, so the
mask built from the caller's 2D attention mask (padded with zeros to `capacity`) hides the slots
not written yet. The caller must therefore pass the 2D attention mask on every call (the sampler
and the speculative sampler do). Unwritten slots hold zeros, so a masked slot never brings a NaN
into attention.

When a step would go past the capacity, every layer grows (doubling) before the mask is built.
Batch selection (rows that leave the batch) and cropping (speculative rollback) keep working.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values, (B, H, capacity, D), of which the first `length` are written."""

    def __init__(self, cache: PreallocatedCache):
        super().__init__()
        self.cache = cache
        self.length = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros(batch, heads, self.cache.capacity, dim)
        self.values = value_states.new_zeros(batch, heads, self.cache.capacity, value_states.shape[-1])
        self.length = 0
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: object,
               **kwargs: object) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            raise RuntimeError(f"KV cache: {end} positions past a capacity of {self.keys.shape[-2]} (the cache "
                               "grows in get_mask_sizes, which the model calls before any layer runs)")
        self.keys[:, :, self.length:end] = key_states
        self.values[:, :, self.length:end] = value_states
        self.length = end
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` positions (negative, as DynamicCache.crop requires)."""
        if self.is_initialized:
            self.length = max(0, self.length + min(tokens_to_remove, 0))

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys[indices], self.values[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))

    def reset(self) -> None:
        self.length = 0
        super().reset()

    def grow(self, capacity: int) -> None:
        if self.is_initialized:
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros(*old.shape[:2], capacity, old.shape[-1])
                new[:, :, : self.length] = old[:, :, : self.length]
                setattr(self, name, new)


class PreallocatedCache(DynamicCache):
    """A DynamicCache of `PreallocatedLayer`s (created at their first update) holding `capacity`
    positions each; attention sees all `capacity` of them, the unwritten ones masked."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: must be >= 1")
        super().__init__()
        self.capacity = capacity
        self.layer_class_to_replicate = lambda: PreallocatedLayer(self)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        needed = self.get_seq_length() + query_length
        if needed > self.capacity:  # before any layer of this forward writes: all of them grow together
            self.capacity = max(needed, 2 * self.capacity)
            for layer in self.layers:
                layer.grow(self.capacity)
        return self.capacity, 0


def cache_argument(model: nn.Module, cache: DynamicCache) -> dict[str, DynamicCache]:
    """The keyword argument that hands `model`'s forward its KV cache: `cache` where the forward
    takes it (newer transformers 5.x, where `past_key_values` is deprecated and removed in 5.40),
    `past_key_values` on the 5.x releases before it."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}
