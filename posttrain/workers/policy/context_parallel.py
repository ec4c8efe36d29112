"""Context parallelism (`policy.context_parallel_size`): each sequence of a micro-batch split along its
length over the CP ranks, attention over the whole sequence by an all-gather of keys and values.

Layout (load-balanced): the padded length T is cut into 2 * cp chunks of c = T / (2 * cp) positions; CP
rank r holds chunks r and 2 * cp - 1 - r, so every rank has one early and one late chunk and the causal
attention work (a query sees the keys before it) is the same on every rank.

Attention (`ContextParallelLayout.attend`, run by tree_attention.layout_attention): every layer all-gathers
the keys and values of the whole sequence from the CP ranks (all-gather, not a ring: simple and it runs over
gloo, but each rank holds the full [b, H_kv, T, d] keys and values of the layer it is computing, and autograd
keeps them for the backward, so a rank stores the K/V of all T positions per layer where a ring would hold T /
cp) and attends each local chunk's queries over the keys up to the chunk's end, causally by global position.
On a CPU, plain rows need no mask (CausalChunkAttention: flash attention over the keys before the chunk and,
causally, over its own, merged by log-sum-exp), so memory stays linear in the length; packed rows (whose mask
adds a same-sequence condition), dropout and GPUs use SDPA with a boolean mask of c x (chunk end) per chunk.
The backward of the all-gather sums the key/value gradients of every rank's queries and keeps this rank's part
(an all-reduce, which gloo has, then a slice). Positions fed to the rotary embedding are the global ones.

Logprobs (`context_parallel_logprobs`): each rank computes logits and logprobs of its own positions only (the
logits, [b, T / cp, V], are the memory a long sequence is short of), against the next token of the whole
sequence (every rank holds all of input_ids); then the logprobs [b, T] of the whole sequence are all-gathered,
so the loss sees full rows exactly as without CP and is normalised by the same global counts. Every CP rank
computes that identical loss, so the gather's backward keeps only this rank's positions: the sum of the CP
ranks' parameter gradients is the exact gradient, which FSDP's sum over the dp x cp ranks forms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from posttrain.workers.policy.token_logprobs import TokenLogprobs
from posttrain.workers.policy.tree_attention import use_layout_attention

ATTENTION_NAME = "posttrain_context_parallel"


@dataclass
class ContextParallelLayout:
    """Which chunks of the padded sequence this CP rank holds, and each position's sequence (packed rows)."""

    group: Any  # the CP process group
    cp_size: int
    cp_rank: int
    chunk_len: int  # c = T / (2 * cp)
    segment_ids: torch.Tensor | None = None  # [b, T] sequence of every position of packed rows, else None

    @property
    def chunks(self) -> tuple[int, int]:
        """The two chunks this rank holds, in its local order."""
        return self.cp_rank, 2 * self.cp_size - 1 - self.cp_rank

    def local_positions(self, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of this rank's 2c local positions. [2c] long"""
        c = self.chunk_len
        return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in self.chunks])

    def global_order(self, device: torch.device | None = None) -> torch.Tensor:
        """index[g]: where global position g lies in the concatenation of every rank's local positions."""
        ranks = [ContextParallelLayout(None, self.cp_size, r, self.chunk_len) for r in range(self.cp_size)]
        gathered = torch.cat([rank.local_positions() for rank in ranks])  # [T]: each gathered position's
        return torch.argsort(gathered).to(device)

    def attend(self, query, key, value, dropout: float, scaling: float | None) -> torch.Tensor:
        """Local [b, H, 2c, d] queries, [b, H_kv, 2c, d] keys and values -> [b, 2c, H, d] outputs, attending
        over the whole sequence's keys (module docstring)."""
        # One collective for both (and one order of collectives in the backward on every rank).
        keys, values = GatherSequence.apply(torch.stack([key, value]), self, 3, True)  # 2 x [b, H_kv, T, d]
        c = self.chunk_len
        outputs = []
        for j, chunk in enumerate(self.chunks):
            end = (chunk + 1) * c
            mask = chunk_mask(self, chunk, query.device) if self.segment_ids is not None else None
            chunk_query = query[:, :, j * c : (j + 1) * c]
            outputs.append(
                attend_chunk(chunk_query, keys[:, :, :end], values[:, :, :end], mask, dropout, scaling)
            )
        return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def padded_length(seq_len: int, cp_size: int) -> int:
    """The smallest multiple of 2 * cp that holds seq_len positions."""
    multiple = 2 * cp_size
    return -(-seq_len // multiple) * multiple


class GatherSequence(torch.autograd.Function):
    """All-gather of this rank's local positions (dim `dim`) into the whole sequence in global order.

    Backward: with `sum_grads` (keys and values, which every rank's queries read) the gradients of all ranks
    are summed (all-reduce) before this rank's positions are kept; without it (logprobs, whose downstream
    loss is the same on every rank) this rank's positions of its own gradient are kept."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: ContextParallelLayout, dim: int, sum_grads: bool):
        pieces = [torch.empty_like(local) for _ in range(layout.cp_size)]
        dist.all_gather(pieces, local.contiguous(), group=layout.group)
        ctx.layout, ctx.dim, ctx.sum_grads, ctx.local_len = layout, dim, sum_grads, local.shape[dim]
        order = layout.global_order(local.device)
        ctx.save_for_backward(order)
        return torch.cat(pieces, dim=dim).index_select(dim, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        layout, dim = ctx.layout, ctx.dim
        gathered_grad = torch.zeros_like(grad).index_copy_(dim, order, grad)  # back to gathered order
        if ctx.sum_grads:
            dist.all_reduce(gathered_grad, group=layout.group)
        start = layout.cp_rank * ctx.local_len
        return gathered_grad.narrow(dim, start, ctx.local_len).contiguous(), None, None, None


def chunk_mask(layout: ContextParallelLayout, chunk: int, device: torch.device) -> torch.Tensor:
    """[b or 1, 1, c, (chunk + 1) * c] bool: the queries of global chunk `chunk` see the keys at or before
    their own position, and (packed rows) of their own sequence."""
    c = layout.chunk_len
    end = (chunk + 1) * c
    query_positions = torch.arange(chunk * c, end, device=device)  # [c]
    mask = torch.arange(end, device=device).unsqueeze(0) <= query_positions.unsqueeze(1)  # [c, end]
    mask = mask.view(1, 1, c, end)
    if layout.segment_ids is not None:
        segments = layout.segment_ids.to(device)  # [b, T]
        same = segments[:, chunk * c : end].unsqueeze(-1) == segments[:, :end].unsqueeze(1)  # [b, c, end]
        mask = mask & same.unsqueeze(1)
    return mask


class CausalChunkAttention(torch.autograd.Function):
    """Causal attention of one chunk's queries [b, H, c, d] over the keys and values [b, H, end, d] up to its
    end (the chunk is the last c positions), on a CPU without a mask: flash attention over the keys before
    the chunk (all visible) and, causally, over the chunk's own, merged by their log-sum-exps. The backward
    runs the flash backward of each block with the merged output and log-sum-exp (the blocks' softmax is
    the merged one). Memory is linear in the length, where a boolean mask costs c x end."""

    @staticmethod
    def forward(ctx, query, key, value, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        start = key.shape[2] - query.shape[2]
        blocks = [(0, start, False), (start, key.shape[2], True)] if start else [(0, key.shape[2], True)]
        outs = [
            flash(query, key[:, :, a:b], value[:, :, a:b], 0.0, causal, scale=scale)
            for a, b, causal in blocks
        ]
        lse = outs[0][1] if len(outs) == 1 else torch.logaddexp(outs[0][1], outs[1][1])  # [b, H, c]
        out = sum(o * torch.exp(block_lse - lse).unsqueeze(-1) for o, block_lse in outs)  # [b, H, c, d]
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        query, key, value, out, lse = ctx.saved_tensors
        grad_query, grad_key, grad_value = (torch.zeros_like(t) for t in (query, key, value))
        for a, b, causal in ctx.blocks:
            block = (key[:, :, a:b], value[:, :, a:b])
            dq, dk, dv = flash_backward(
                grad.contiguous(), query, *block, out, lse, 0.0, causal, scale=ctx.scale
            )
            grad_query += dq
            grad_key[:, :, a:b] = dk
            grad_value[:, :, a:b] = dv
        return grad_query, grad_key, grad_value, None


def attend_chunk(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """[b, H, c, d] outputs of a chunk's queries over keys and values [b, H_kv, end, d] (the chunk last):
    CausalChunkAttention on a CPU without a mask (plain rows) or dropout, else SDPA with `mask` (or a causal
    mask built here)."""
    groups = query.shape[1] // keys.shape[1]
    if mask is None and dropout == 0.0 and query.device.type == "cpu":
        if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        return CausalChunkAttention.apply(query.contiguous(), keys.contiguous(), values.contiguous(), scaling)
    if mask is None:
        c, end = query.shape[2], keys.shape[2]
        positions = torch.arange(end, device=query.device)
        mask = (positions.unsqueeze(0) <= positions[end - c :].unsqueeze(1)).view(1, 1, c, end)
    return torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=groups > 1
    )


def use_context_parallel_attention(model: torch.nn.Module) -> None:
    """Switch a Hugging Face model that runs SDPA attention to tree_attention.layout_attention, without a
    mask function: transformers then builds no mask (the layout is one)."""
    if not use_layout_attention(model, ATTENTION_NAME, with_mask=False):
        raise ValueError(
            f"policy.context_parallel_size > 1: {type(model).__name__} does not take a custom attention "
            "function (a Hugging Face model with SDPA attention is needed)"
        )


def segment_ids_of(lengths: list[int], total: int) -> torch.Tensor:
    """[1, total]: the index of each packed sequence at its positions, -1 on padding past them."""
    ids = torch.cat([torch.full((length,), i) for i, length in enumerate(lengths)])
    return torch.nn.functional.pad(ids, (0, total - ids.numel()), value=-1).unsqueeze(0)


def context_parallel_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    group: Any,
    temperature: float,
    packed_lengths: list[int] | None = None,
) -> torch.Tensor:
    """Logprobs [b, T] of the whole sequences `input_ids` [b, T] (every CP rank holds all of them) with the
    compute_token_logprobs contract (position t: log p(token t | < t), position 0 is 0), each rank running
    the model on its own chunks only (module docstring). `position_ids` [b, T]: the rotary positions
    (restarting per sequence in a packed row, whose `packed_lengths` give the same-sequence mask)."""
    batch, seq_len = input_ids.shape
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    total = padded_length(seq_len, cp_size)
    segments = segment_ids_of(packed_lengths, total) if packed_lengths is not None else None
    layout = ContextParallelLayout(group, cp_size, cp_rank, total // (2 * cp_size), segments)
    padded_ids = torch.nn.functional.pad(input_ids, (0, total - seq_len))  # [b, T_pad]
    extra_positions = position_ids[:, -1:] + torch.arange(1, total - seq_len + 1, device=input_ids.device)
    padded_positions = torch.cat([position_ids, extra_positions], dim=1)  # [b, T_pad]
    local = layout.local_positions(input_ids.device)  # [2c]
    inputs = {"input_ids": padded_ids[:, local], "position_ids": padded_positions[:, local]}
    logits = model(**inputs, attention_layout=layout).logits  # [b, 2c, V]
    next_ids = torch.nn.functional.pad(padded_ids[:, 1:], (0, 1))[:, local]  # [b, 2c]: the token after each
    next_logprobs = TokenLogprobs.apply(
        logits.reshape(batch * local.numel(), -1), next_ids.reshape(-1), temperature
    ).view(batch, -1)  # [b, 2c]: log p(token g + 1 | <= g) at local position g
    whole = GatherSequence.apply(next_logprobs, layout, 1, False)  # [b, T_pad]
    return torch.nn.functional.pad(whole[:, : seq_len - 1], (1, 0))  # [b, T]
