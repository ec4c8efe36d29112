"""A KV cache that reserves room for the tokens still to come, so that a decode step writes one position in
place instead of copying the whole cache (transformers' DynamicLayer concatenates at every step: at 32 rows
of a 30-layer model that copy was 8% of a decode on a CPU)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class ReservedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers [B, H, capacity, D]; grows by doubling."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._allocate(keys, values, capacity)

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """Buffers of `capacity` positions holding `keys` / `values` [B, H, T, D] at the start."""
        self.key_buffer = keys.new_empty(*keys.shape[:2], max(capacity, keys.shape[2]), keys.shape[3])
        self.value_buffer = values.new_empty(*values.shape[:2], self.key_buffer.shape[2], values.shape[3])
        self.key_buffer[:, :, : keys.shape[2]] = keys
        self.value_buffer[:, :, : values.shape[2]] = values
        self._set_length(keys.shape[2])

    def _set_length(self, length: int) -> None:
        self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, count = self.keys.shape[2], key_states.shape[2]
        if start + count > self.key_buffer.shape[2]:  # past the reservation: double it
            self._allocate(self.keys, self.values, max(2 * self.key_buffer.shape[2], start + count))
        self.key_buffer[:, :, start : start + count] = key_states
        self.value_buffer[:, :, start : start + count] = value_states
        self._set_length(start + count)
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep rows `beam_idx` (in that order): new buffers of the same capacity, of which only the filled
        positions are copied."""
        length, rows = self.keys.shape[2], beam_idx.to(self.device)
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_empty(len(rows), *old.shape[1:])
            new[:, :, :length] = old[:, :, :length].index_select(0, rows)
            setattr(self, name, new)
        self._set_length(length)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)


def reserve(cache: Cache, extra_tokens: int) -> Cache:
    """`cache` with room for `extra_tokens` more positions in every plain (full-attention, growing) layer;
    other layer kinds (sliding windows, static, linear attention) are left as they are."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
            cache.layers[i] = ReservedLayer(layer.keys, layer.values, layer.keys.shape[2] + extra_tokens)
    return cache
