"""Micro-batch planning of a policy worker, as plain functions (no process group): which rows go into
each forward/backward (fixed size, a token budget, or packed rows), each cut to its longest row.

Fixed-size micro-batches keep the rows in order, or, where the worker allows it (the loss treats rows
independently and `policy.length_bucketing` is on), take the rows longest first when its cost model
(`ForwardCost`) says that costs less: a batch of responses of uneven length then pads each micro-batch to
rows of about its own length instead of to the longest of a random few. The cost counts padded positions,
attention over them, and prompts shared by the rows of a GRPO group (`shared_prefix.py`: a group's rows
in one micro-batch become one tree row without padding), which keeping a group together can save; the
cheaper plan wins. The same model counts the positions each micro-batch computes (`padding_share`)."""

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
from posttrain.workers.policy.shared_prefix import rows_cost, shared_prefix_cost


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
    segment_ids = torch.cat([torch.full((length,), i) for i, length in enumerate(lengths)])
    segment_ids = segment_ids.to(input_ids.device)
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
    computed_tokens: int = 0  # positions the forward computes (padding included)
    real_tokens: int = 0  # of those, positions holding a token of some row


@dataclass
class ForwardCost:
    """The relative cost of a forward over some rows (shared_prefix.rows_cost: linear layers per position,
    attention per pair): rows padded to the longest, or, where the worker shares prompts
    (`share_prefixes`), tree rows when those are cheaper, as the forward itself decides."""

    attention_ratio: float = 0.0
    share_prefixes: bool = False

    def of(self, data: dict[str, Any], indices: list[int], lengths: list[int]) -> tuple[float, int, int]:
        """(cost, computed positions, real tokens) of one micro-batch of the rows `indices`."""
        own = [lengths[i] for i in indices]
        width = max(own)
        if self.share_prefixes and "token_mask" in data:
            index = torch.tensor(indices, dtype=torch.long)
            input_ids = data["input_ids"].index_select(0, index)[:, :width]
            token_mask = (
                data["token_mask"].index_select(0, index.to(data["token_mask"].device))[:, :width].cpu()
            )
            shared = shared_prefix_cost(input_ids, own, token_mask, self.attention_ratio)
            if shared is not None:
                return shared
        return rows_cost(len(own), width, self.attention_ratio), len(own) * width, sum(own)


def fixed_size_groups(
    data: dict[str, Any], lengths: list[int], batch_size: int, cost: ForwardCost, reorder: bool
) -> list[list[int]]:
    """`batch_size` rows at a time: in order, or (with `reorder`) longest first when `cost` says that is
    cheaper."""
    count = len(lengths)
    in_order = [list(range(i, min(i + batch_size, count))) for i in range(0, count, batch_size)]
    if not reorder or count <= batch_size:
        return in_order
    longest_first = sorted(range(count), key=lambda i: (-lengths[i], i))
    bucketed = [longest_first[i : i + batch_size] for i in range(0, count, batch_size)]

    def total(groups: list[list[int]]) -> float:
        return sum(cost.of(data, indices, lengths)[0] for indices in groups)

    return bucketed if total(bucketed) < total(in_order) else in_order


def plan_microbatches(
    data: dict[str, Any],
    batch_size: int,
    cfg: PolicyConfig,
    cost: ForwardCost | None = None,
    reorder: bool = False,
) -> list[MicroBatch]:
    """Fixed-size (`batch_size` rows; with `reorder`, bucketed by length when `cost` finds it cheaper),
    token-budget (`policy.dynamic_batching`) or packed (`policy.sequence_packing`) micro-batches of
    `data`, each cut to its longest row; `cost` (the worker's forward) also counts each one's positions."""
    cost = cost or ForwardCost()
    lengths = row_lengths(data).tolist()
    if cfg.sequence_packing.enabled:  # causal_lm only (PolicyConfig.validate)
        groups = pack_sequences(lengths, cfg.sequence_packing.max_tokens_per_bin)
    elif cfg.dynamic_batching.enabled:
        budget = cfg.dynamic_batching
        groups = dynamic_microbatch_indices(
            lengths, budget.max_tokens_per_microbatch, budget.sequence_length_round
        )
    else:
        groups = fixed_size_groups(data, lengths, batch_size, cost, reorder)
    microbatches = []
    for indices in groups:
        rows = select_rows(data, indices, seq_len=max(lengths[i] for i in indices))
        real = sum(lengths[i] for i in indices)
        if cfg.sequence_packing.enabled:
            packed = build_packed_row(rows["input_ids"], [lengths[i] for i in indices])
            microbatches.append(MicroBatch(rows, indices, packed, computed_tokens=real, real_tokens=real))
            continue
        _, computed, real = cost.of(data, indices, lengths)
        microbatches.append(MicroBatch(rows, indices, computed_tokens=computed, real_tokens=real))
    return microbatches


def pad_microbatches(microbatches: list[MicroBatch], count: int, rank: int) -> list[MicroBatch]:
    """`microbatches` followed by repeats of the first, marked as padding, up to `count`: every data-parallel
    rank must run the same number of forwards (FSDP all-gathers, pipeline schedules)."""
    if not microbatches and count > 0:
        raise ValueError(f"rank {rank}: got no data while other ranks did; send at least one row per rank")
    first = microbatches[0]
    padding = MicroBatch(first.data, [], first.packed, is_padding=True, computed_tokens=first.computed_tokens)
    return microbatches + [padding] * (count - len(microbatches))
