"""Micro-batch planning of a policy worker, as plain functions (no process group): which rows go into
each forward/backward (fixed size, a token budget, or packed rows), each cut to its longest row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.distributed.batched_data_dict import (
    BatchedDataDict,
    dynamic_microbatch_indices,
    pack_sequences,
)
from posttrain.workers.policy.config import PolicyConfig


def length_mask(input_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """1 where position < length: [B] lengths -> [B, seq_len] long mask."""
    positions = torch.arange(seq_len, device=input_lengths.device)  # [T]
    return (positions.unsqueeze(0) < input_lengths.unsqueeze(1)).long()  # [B, T]


def row_lengths(data: dict[str, Any]) -> torch.Tensor:
    """Each row's length: `input_lengths`, or the full width when the batch has none. [B] long"""
    if "input_lengths" in data:
        return data["input_lengths"].long()
    return torch.full((data["input_ids"].shape[0],), data["input_ids"].shape[1], dtype=torch.long)


@dataclass
class PackedRow:
    """Several sequences concatenated in one row, kept apart by a block-diagonal causal mask."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L], restarting at 0 for each sequence
    attention_mask: torch.Tensor  # [1, 1, L, L] bool, True = may attend
    lengths: list[int]


def build_packed_row(input_ids: torch.Tensor, lengths: list[int]) -> PackedRow:
    """Concatenate the first lengths[i] tokens of each row of input_ids [n, T] into one packed row."""
    pieces = [input_ids[i, :length] for i, length in enumerate(lengths)]
    row_ids = torch.cat(pieces).unsqueeze(0)  # [1, L]
    position_ids = torch.cat([torch.arange(length) for length in lengths]).unsqueeze(0).to(input_ids.device)
    segment_ids = torch.cat([torch.full((length,), i) for i, length in enumerate(lengths)]).to(
        input_ids.device
    )
    same_segment = segment_ids.unsqueeze(0) == segment_ids.unsqueeze(1)  # [L, L]
    causal = torch.ones_like(same_segment).tril()  # [L, L]
    attention_mask = (same_segment & causal).view(1, 1, *same_segment.shape)  # [1, 1, L, L]
    return PackedRow(row_ids, position_ids, attention_mask, list(lengths))


def unpack_row_logprobs(row_logprobs: torch.Tensor, lengths: list[int], seq_len: int) -> torch.Tensor:
    """Split packed-row logprobs [1, L] back into [n, seq_len], zero at each sequence start and padding."""
    unpacked = row_logprobs.new_zeros(len(lengths), seq_len)  # [n, T]
    offset = 0
    for i, length in enumerate(lengths):
        unpacked[i, 1:length] = row_logprobs[0, offset + 1 : offset + length]
        offset += length
    return unpacked


def select_rows(data: dict[str, Any], indices: list[int], seq_len: int | None = None) -> BatchedDataDict:
    """Rows `indices` of every value; tensors with a sequence dim (dim 1) equal to the batch's T cut to
    seq_len."""
    full_len = data["input_ids"].shape[1]
    index = torch.tensor(indices, dtype=torch.long)
    rows = BatchedDataDict()
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            value = value.index_select(0, index.to(value.device))
            if seq_len is not None and value.dim() >= 2 and value.shape[1] == full_len:
                value = value[:, :seq_len]
        else:
            value = [value[i] for i in indices]
        rows[key] = value
    return rows


@dataclass
class MicroBatch:
    """One forward/backward unit: its rows of the data (what the loss function sees) and forward inputs."""

    data: BatchedDataDict
    indices: list[int]  # rows of the local batch, in the order of `data`
    packed: PackedRow | None = None
    is_padding: bool = False  # a repeated micro-batch that only keeps ranks in step (its loss is scaled by 0)


def plan_microbatches(data: dict[str, Any], batch_size: int, cfg: PolicyConfig) -> list[MicroBatch]:
    """Fixed-size (`batch_size` rows), token-budget (`policy.dynamic_batching`) or packed
    (`policy.sequence_packing`) micro-batches of `data`, each cut to its longest row."""
    lengths = row_lengths(data).tolist()
    if cfg.sequence_packing.enabled:
        if cfg.model_kind != "causal_lm":
            raise ValueError("policy.sequence_packing: only for model_kind='causal_lm'")
        groups = pack_sequences(lengths, cfg.sequence_packing.max_tokens_per_bin)
    elif cfg.dynamic_batching.enabled:
        budget = cfg.dynamic_batching
        groups = dynamic_microbatch_indices(
            lengths, budget.max_tokens_per_microbatch, budget.sequence_length_round
        )
    else:
        groups = [
            list(range(i, min(i + batch_size, len(lengths)))) for i in range(0, len(lengths), batch_size)
        ]
    microbatches = []
    for indices in groups:
        rows = select_rows(data, indices, seq_len=max(lengths[i] for i in indices))
        packed = None
        if cfg.sequence_packing.enabled:
            packed = build_packed_row(rows["input_ids"], [lengths[i] for i in indices])
        microbatches.append(MicroBatch(rows, indices, packed))
    return microbatches


def pad_microbatches(microbatches: list[MicroBatch], count: int, rank: int) -> list[MicroBatch]:
    """`microbatches` followed by repeats of the first, marked as padding, up to `count`: every data-parallel
    rank must run the same number of forwards (FSDP all-gathers, pipeline schedules)."""
    if not microbatches and count > 0:
        raise ValueError(f"rank {rank}: got no data while other ranks did; send at least one row per rank")
    padding = [MicroBatch(microbatches[0].data, [], microbatches[0].packed, is_padding=True)] * (
        count - len(microbatches)
    )
    return microbatches + padding
