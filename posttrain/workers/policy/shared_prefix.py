"""Shared-prefix rows: sequences that begin with the same untrained prompt (the samples of one GRPO group, the
chosen and rejected answers of a DPO pair) compute that prompt once.

A group of n sequences with a common prompt of L tokens becomes one row: the prompt, then each sequence's
continuation in turn. Position ids restart at L for every continuation, and attention lets a continuation see
the prompt and its own earlier tokens only (`tree_attention.py`, which computes just those pairs; for a model
without it the rows carry the equivalent dense tree mask), so every continuation token gets the hidden states
(and logprobs, and gradients) it would get in its own row. The prompt's L tokens are computed once instead of
n times, and the continuations need no padding in the linear layers: with GRPO's 4-16 samples per prompt the
forward and backward shrink by the prompt's repeats and the padding to the longest row.

Only positions a loss reads are exact: a row's tokens after its prompt (from its first trained position
on). The prompt is the tokens before the position that precedes the first trained token, so the
logits of every trained token come from the row's own continuation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from posttrain.workers.policy.token_logprobs import compute_token_logprobs
from posttrain.workers.policy.tree_attention import SharedPrefixLayout, build_layout, layout_replaces_mask


@dataclass
class Placement:
    """Where one sequence of the batch lies in the shared-prefix rows."""

    row: int  # the sequence's row in the batch
    tree_row: int  # the shared-prefix row that holds it
    start: int  # index in the tree row of its first continuation token (its token `prefix_length`)
    prefix_length: int  # L: tokens shared with its group (computed once, at the start of the tree row)
    length: int  # the sequence's own length


@dataclass
class SharedPrefixRows:
    """A batch as shared-prefix rows: forward inputs and where each sequence went."""

    input_ids: torch.Tensor  # [R, N]
    position_ids: torch.Tensor  # [R, N]
    attention_mask: torch.Tensor  # [R, 1, N, N] bool tree mask (True = may attend), or [R, N] ones
    placements: list[Placement]
    layout: SharedPrefixLayout  # the same visibility, for tree_attention.layout_attention

    @property
    def first_kept_position(self) -> int:
        """The first index any trained token's logits are read from: the shortest prefix length."""
        return min(p.prefix_length for p in self.placements)


def prefix_groups(input_ids: torch.Tensor, lengths: list[int], token_mask: torch.Tensor) -> list[list[int]]:
    """Rows grouped by their prompt: the tokens before the position preceding their first trained token.
    Rows with no trained token, or a prompt of one token or less, stay alone. Order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for row, length in enumerate(lengths):
        trained = token_mask[row, :length].nonzero()
        prefix_length = int(trained[0]) - 1 if len(trained) else 0
        key = tuple(input_ids[row, :prefix_length].tolist()) if prefix_length >= 2 else ("alone", row)
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def attention_cost_ratio(config: Any) -> float:
    """FLOPs of attention per (query, key) pair over the FLOPs of the linear layers per token, per layer:
    4h / 2h(2h + 2kv + 3i) for hidden size h, key/value width kv and MLP width i (0 if unknown)."""
    hidden, intermediate = getattr(config, "hidden_size", None), getattr(config, "intermediate_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not (hidden and intermediate and heads):
        return 0.0
    kv_width = getattr(config, "num_key_value_heads", None) or heads
    kv_width *= getattr(config, "head_dim", None) or hidden // heads
    return 2.0 / (2 * hidden + 2 * kv_width + 3 * intermediate)


def rows_cost(num_rows: int, width: int, attention_ratio: float) -> float:
    """Relative cost of a forward over num_rows padded rows of `width` tokens: linear layers per token plus
    (dense-mask) attention per pair."""
    return num_rows * (width + attention_ratio * width * width)


def tree_row_lengths(groups: list[list[int]], lengths: list[int], token_mask: torch.Tensor) -> list[int]:
    """Length of each group's tree row: its prompt once, then every row's continuation."""
    sizes = []
    for rows in groups:
        trained = token_mask[rows[0], : lengths[rows[0]]].nonzero()
        prefix_length = int(trained[0]) - 1 if len(rows) > 1 else 0
        sizes.append(prefix_length + sum(lengths[row] - prefix_length for row in rows))
    return sizes


def tree_rows_cost(sizes: list[int], lengths: list[int], attention_ratio: float) -> float:
    """Relative cost (as rows_cost) of tree rows of `sizes` holding sequences of `lengths` under
    tree attention: the linear layers over the rows padded to the longest, attention over each
    sequence's prompt and continuation (length^2 pairs, as a plain row without padding)."""
    return len(sizes) * max(sizes) + attention_ratio * sum(length * length for length in lengths)


def tree_plan(
    input_ids: torch.Tensor, lengths: list[int], token_mask: torch.Tensor, attention_ratio: float
) -> tuple[list[list[int]], list[int], float] | None:
    """(prompt groups, their tree rows' lengths, rows_cost) of the batch [b, T] as tree rows, or None when
    tree rows are not worth it (no shared prompt, or not cheaper than padded rows)."""
    groups = prefix_groups(input_ids, lengths, token_mask)
    if len(groups) == len(lengths):
        return None
    sizes = tree_row_lengths(groups, lengths, token_mask)
    cost = tree_rows_cost(sizes, lengths, attention_ratio)
    if cost >= rows_cost(len(lengths), max(lengths), attention_ratio):
        return None
    return groups, sizes, cost


def shared_prefix_cost(
    input_ids: torch.Tensor, lengths: list[int], token_mask: torch.Tensor, attention_ratio: float
) -> tuple[float, int, int] | None:
    """(rows_cost, positions computed, real tokens) of the batch [b, T] as tree rows, or None when
    build_shared_prefix_rows would not use them (see tree_plan)."""
    plan = tree_plan(input_ids, lengths, token_mask, attention_ratio)
    if plan is None:
        return None
    _, sizes, cost = plan
    return cost, len(sizes) * max(sizes), sum(sizes)


def tree_mask(row_segments: torch.Tensor) -> torch.Tensor:
    """The dense tree mask [R, N, N] (True = may attend) of rows whose positions are labelled by segment
    (0: the prompt, k: the k-th continuation, -1: padding): the prompt and the query's own continuation,
    causally; a padding position sees itself (no empty rows)."""
    width = row_segments.shape[1]
    query, key = row_segments.unsqueeze(2), row_segments.unsqueeze(1)  # [R, N, 1], [R, 1, N]
    visible = ((key == 0) | (key == query)) & (query >= 0)
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # [N, N]
    padding_self = torch.eye(width, dtype=torch.bool) & (query < 0)
    return (visible & causal) | padding_self


def build_shared_prefix_rows(
    input_ids: torch.Tensor,
    lengths: list[int],
    token_mask: torch.Tensor,
    attention_ratio: float = 0.0,
    dense_mask: bool = True,
) -> SharedPrefixRows | None:
    """The batch [b, T] as one row per prompt group, or None when that would not be cheaper (see
    tree_plan; `attention_ratio`: see attention_cost_ratio). With `dense_mask` false the rows carry no tree
    mask, only a [R, N] mask of ones (which HF models turn into no mask at all): for a model whose attention
    reads the layout instead (tree_attention.layout_replaces_mask)."""
    plan = tree_plan(input_ids, lengths, token_mask, attention_ratio)
    if plan is None:
        return None
    groups = plan[0]
    pieces, positions, segments, placements, prompts = [], [], [], [], []
    for tree_row, rows in enumerate(groups):
        trained = token_mask[rows[0], : lengths[rows[0]]].nonzero()
        prefix_length = int(trained[0]) - 1 if len(rows) > 1 else 0  # a group has a prompt of >= 2 tokens
        prompts.append(prefix_length)
        ids = [input_ids[rows[0], :prefix_length]]
        pos = [torch.arange(prefix_length)]
        seg = [torch.zeros(prefix_length, dtype=torch.long)]  # segment 0: the shared prompt
        offset = prefix_length
        for number, row in enumerate(rows, start=1):
            continuation = input_ids[row, prefix_length : lengths[row]]
            ids.append(continuation)
            pos.append(torch.arange(prefix_length, lengths[row]))
            seg.append(torch.full((len(continuation),), number, dtype=torch.long))
            placements.append(Placement(row, tree_row, offset, prefix_length, lengths[row]))
            offset += len(continuation)
        pieces.append(torch.cat(ids))
        positions.append(torch.cat(pos))
        segments.append(torch.cat(seg))
    row_ids = pad_sequence(pieces, batch_first=True)  # [R, N]
    row_positions = pad_sequence(positions, batch_first=True)  # [R, N]
    row_segments = pad_sequence(segments, batch_first=True, padding_value=-1)  # [R, N], -1: padding
    num_rows, width = row_ids.shape
    if dense_mask:
        mask = tree_mask(row_segments).unsqueeze(1)  # [R, 1, N, N]
    else:  # a 2D mask of ones: no padding to mask, so HF builds no mask (and detects no packed rows)
        mask = torch.ones(num_rows, width, dtype=torch.long)
    continuations = [(p.tree_row, p.start, p.length - p.prefix_length) for p in placements]
    layout = build_layout(num_rows, width, prompts, continuations)
    device = input_ids.device
    return SharedPrefixRows(row_ids, row_positions.to(device), mask.to(device), placements, layout)


def unpack_shared_prefix_logprobs(
    row_logprobs: torch.Tensor, rows: SharedPrefixRows, batch_size: int, seq_len: int
) -> torch.Tensor:
    """Tree-row logprobs [R, N] (index j = log p(token j | the tokens it sees)) back to [b, seq_len]:
    positions after each sequence's prompt, i.e. from prefix_length + 1 on; 0 elsewhere."""
    out = row_logprobs.new_zeros(batch_size, seq_len)  # [b, T]
    for p in rows.placements:
        count = p.length - p.prefix_length - 1  # tokens after the continuation's first
        if count > 0:
            out[p.row, p.prefix_length + 1 : p.length] = row_logprobs[
                p.tree_row, p.start + 1 : p.start + 1 + count
            ]
    return out


def shared_prefix_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    lengths: list[int],
    token_mask: torch.Tensor,
    temperature: float,
    device: torch.device,
) -> torch.Tensor | None:
    """Logprobs [b, T] of a causal LM at every trained position, each shared prompt computed once (zeros up
    to each row's prompt end, as no loss reads them); None when no two rows share a prompt."""
    ratio, dense_mask = attention_cost_ratio(model.config), not layout_replaces_mask(model)
    rows = build_shared_prefix_rows(input_ids, lengths, token_mask, ratio, dense_mask=dense_mask)
    if rows is None:
        return None
    width = rows.input_ids.shape[1]  # N
    num_kept = width - rows.first_kept_position  # K: no trained token reads an earlier position's logits
    inputs = {
        name: getattr(rows, name).to(device) for name in ("input_ids", "position_ids", "attention_mask")
    }
    # attention_layout is read by tree_attention.layout_attention
    logits = model(**inputs, logits_to_keep=num_kept, attention_layout=rows.layout).logits  # [R, K, V]
    row_logprobs = compute_token_logprobs(logits, inputs["input_ids"][:, -num_kept:], temperature)  # [R, K]
    row_logprobs = torch.nn.functional.pad(row_logprobs, (width - num_kept, 0))  # [R, N]
    return unpack_shared_prefix_logprobs(row_logprobs, rows, input_ids.shape[0], input_ids.shape[1])
