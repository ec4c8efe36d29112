"""`BatchedDataDict`: the batch that travels between driver and workers, a dict of tensors and lists that
share a batch dimension (dim 0), dealt to data-parallel ranks by global batch. Also the two micro-batch
planners (token budget, sequence packing); the policy worker plans each rank's micro-batches with them.

Batch keys used across posttrain (the batch contract; docs/architecture.md):
- `input_ids [B, T]` right-padded token ids; `input_lengths [B]` unpadded lengths
- `token_mask [B, T]` 1 where a token is trained on (never position 0, never padding)
- `sample_mask [B]` 1 for samples that count in the loss
- `advantages [B, T]`, `prev_logprobs [B, T]`, `generation_logprobs [B, T]`,
  `reference_policy_logprobs [B, T]`: position t holds log p(token t | tokens < t); position 0 is 0
- generation output: `output_ids`, `logprobs`, `generation_lengths`, `unpadded_sequence_lengths`, `truncated`
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def _batch_len(value: Any) -> int:
    return int(value.shape[0]) if isinstance(value, torch.Tensor) else len(value)


def _take(value: Any, indices: list[int]) -> Any:
    if isinstance(value, torch.Tensor):
        return value[torch.as_tensor(indices, dtype=torch.long)]
    return [value[i] for i in indices]


def _pad_cat(tensors: list[torch.Tensor], pad_value: float) -> torch.Tensor:
    """Concatenate along dim 0, right-padding dim 1 to the longest."""
    if tensors[0].dim() < 2:
        return torch.cat(tensors)
    length = max(t.shape[1] for t in tensors)
    padded = [
        torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, length - t.shape[1]), value=pad_value)
        for t in tensors
    ]
    return torch.cat(padded)


def dynamic_microbatch_indices(
    lengths: Sequence[int], max_tokens: int, length_round: int = 1
) -> list[list[int]]:
    """Micro-batches (lists of row indices) whose padded size, rows x longest rounded length, stays under
    `max_tokens`. Rows are taken longest first so that rows of similar length share a micro-batch."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    current_len = 0
    for i in order:
        row_len = -(-int(lengths[i]) // length_round) * length_round  # rounded up
        if row_len > max_tokens:
            raise ValueError(
                f"sample {i} has {lengths[i]} tokens (rounded {row_len}), over the budget {max_tokens}"
            )
        longest = max(current_len, row_len)
        if current and longest * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], row_len
        current.append(i)
        current_len = longest
    if current:
        batches.append(current)
    return batches


def pack_sequences(lengths: Sequence[int], max_tokens_per_bin: int) -> list[list[int]]:
    """First-fit-decreasing bins of row indices, each bin's total length <= the budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > max_tokens_per_bin:
            raise ValueError(f"sample {i} has {lengths[i]} tokens, over the bin budget {max_tokens_per_bin}")
        target = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
        if target is None:
            bins.append([])
            room.append(max_tokens_per_bin)
            target = len(bins) - 1
        bins[target].append(i)
        room[target] -= int(lengths[i])
    return bins


class BatchedDataDict(dict):
    """A dict of tensors (batch dim 0) and lists of equal batch size."""

    @classmethod
    def from_batches(
        cls, batches: Sequence[dict], pad_value_dict: dict[str, float] | None = None
    ) -> BatchedDataDict:
        """Concatenate batches key by key; tensors are right-padded along dim 1 (pad value per key, 0
        default)."""
        if not batches:
            return cls()
        keys = list(batches[0].keys())
        for j, batch in enumerate(batches[1:], start=1):
            if set(batch.keys()) != set(keys):
                raise ValueError(f"batch {j} has keys {sorted(batch.keys())}, batch 0 has {sorted(keys)}")
        pad_value_dict = pad_value_dict or {}
        merged = cls()
        for key in keys:
            values = [batch[key] for batch in batches]
            if isinstance(values[0], torch.Tensor):
                merged[key] = _pad_cat(values, pad_value_dict.get(key, 0))
            else:
                merged[key] = [item for value in values for item in value]
        merged.check_consistent()
        return merged

    def check_consistent(self) -> None:
        """Raise if the values do not share one batch size (naming each key's size)."""
        sizes = {key: _batch_len(value) for key, value in self.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"mismatched batch sizes: {sizes}")

    @property
    def size(self) -> int:
        if not self:
            return 0
        self.check_consistent()
        return _batch_len(next(iter(self.values())))

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict:
        indices = [int(i) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]
        return BatchedDataDict({key: _take(value, indices) for key, value in self.items()})

    def slice(self, start: int, end: int) -> BatchedDataDict:
        return self.select_indices(list(range(start, min(end, self.size))))

    def to(self, device: str | torch.device) -> BatchedDataDict:
        return BatchedDataDict(
            {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()}
        )

    def shard_by_batch_size(self, shards: int, batch_size: int | None = None) -> list[BatchedDataDict]:
        """Cut into global batches of `batch_size` (default: the whole batch), deal each evenly across
        `shards`, and concatenate per shard, so that every shard's k-th local batch belongs to global
        batch k: 8 rows, batch 4, 2 shards -> rows [0,1,4,5] and [2,3,6,7]."""
        batch_size = batch_size or self.size
        if self.size % batch_size:
            raise ValueError(
                f"batch of {self.size} rows is not a multiple of the global batch size {batch_size}"
            )
        if batch_size % shards:
            raise ValueError(f"global batch size {batch_size} does not divide into {shards} shards")
        per_shard = batch_size // shards
        shard_indices: list[list[int]] = [[] for _ in range(shards)]
        for start in range(0, self.size, batch_size):
            for s in range(shards):
                first = start + s * per_shard
                shard_indices[s].extend(range(first, first + per_shard))
        return [self.select_indices(indices) for indices in shard_indices]
