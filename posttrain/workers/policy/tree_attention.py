"""Attention over shared-prefix rows (shared_prefix.py) that computes only what each token sees: a dense tree
mask makes attention cost (prompt + all continuations)^2 per row, and attention kernels compute every masked
block (four continuations of 512 tokens after a 70-token prompt: 2118^2 = 4.5M pairs where the tokens see
1.2M).

This attention runs, in every layer, one causal attention per continuation over the positions it sees:
its row's prompt, then itself (gathered from the row by index, so the linear layers still compute each
prompt once and no continuation is padded). A continuation's outputs come from its own attention; a
prompt's from the attention of its row's first continuation (its prompt queries are the same in every
continuation's). Causal attention without a mask lets the kernels skip the blocks above the diagonal.
Cost: the sum over continuations of (prompt + continuation)^2 / 2 pairs, what plain rows without padding
would compute. Gradients flow through the gathers (index_select's backward adds them back), so the
backward computes only these pairs too.

`layout_attention` is the Hugging Face attention function (`AttentionInterface`) of this attention and of
context parallelism (context_parallel.py): a forward that passes `attention_layout=` (a SharedPrefixLayout or
a ContextParallelLayout) attends by the layout's `attend`, any other forward goes to HF's SDPA function
unchanged. `use_layout_attention(model, name)` switches a model to it (models whose attention follows HF's
functional interface; the others ignore the layout and apply the rows' dense tree mask)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

ATTENTION_NAME = "posttrain_shared_prefix"


@dataclass
class SharedPrefixLayout:
    """Which positions of shared-prefix rows [R, N] each continuation attends over (flat index: row * N +
    position), and where each position's output lies in the concatenated outputs."""

    sequences: list[torch.Tensor]  # per continuation: its row's prompt positions, then its own
    source_index: torch.Tensor  # [R * N] each position's output in cat(outputs of every sequence)

    def attend(self, query, key, value, dropout: float, scaling: float | None) -> torch.Tensor:
        """[R, H, N, d] queries, [R, H_kv, N, d] keys and values -> [R, N, H, d] (module docstring)."""
        rows, heads, width, head_dim = query.shape
        # Position-major [R * N, heads, d]: a gather then picks whole positions.
        flat_query, flat_key, flat_value = (
            states.transpose(1, 2).reshape(rows * width, -1, head_dim) for states in (query, key, value)
        )
        outputs = []
        for positions in self.sequences:
            index = positions.to(query.device)
            picked = [
                flat.index_select(0, index).transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
                for flat in (flat_query, flat_key, flat_value)
            ]
            outputs.append(_attend(*picked, dropout, scaling)[0].transpose(0, 1))  # [n, heads, d]
        gathered = torch.cat(outputs).index_select(0, self.source_index.to(query.device))  # [R * N, H, d]
        return gathered.view(rows, width, heads, head_dim)


def build_layout(
    num_rows: int, width: int, prompts: list[int], continuations: list[tuple[int, int, int]]
) -> SharedPrefixLayout:
    """The layout of rows [num_rows, width] whose row r starts with a prompt of prompts[r] tokens, with
    continuations (row, start, length) at row positions [start, start + length)."""
    sequences = []
    source_index = torch.zeros(num_rows * width, dtype=torch.long)  # row padding: any output (unread)
    offset = 0  # of the current sequence in the concatenated outputs
    prompt_done = [False] * num_rows
    for row, start, length in continuations:
        prompt = prompts[row]
        sequences.append(torch.cat([torch.arange(prompt), torch.arange(start, start + length)]) + row * width)
        if not prompt_done[row]:  # the row's prompt outputs: from its first continuation's attention
            source_index[row * width : row * width + prompt] = offset + torch.arange(prompt)
            prompt_done[row] = True
        first = row * width + start
        source_index[first : first + length] = offset + prompt + torch.arange(length)
        offset += prompt + length
    return SharedPrefixLayout(sequences, source_index)


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float, scaling: float | None
) -> torch.Tensor:
    """Causal SDPA of [1, H, n, d] queries over [1, H_kv, n, d] keys and values (grouped heads)."""
    gqa = query.shape[1] != key.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa
    )


def layout_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    attention_layout: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention function: `attention_layout.attend` (a SharedPrefixLayout's or a ContextParallelLayout's
    [b, t, H, d] outputs); without a layout, or for shared-prefix rows in a layer with a sliding window or a
    logit soft-cap (not modelled here), HF's SDPA attention with the mask it is given (for shared-prefix
    rows, their dense tree mask)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        if attention_layout is not None and not isinstance(attention_layout, SharedPrefixLayout):
            raise ValueError("policy.context_parallel_size > 1: attention with a sliding window or soft-cap")
        attention_layout = None
    if attention_layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return attention_layout.attend(query, key, value, dropout, scaling), None


def use_layout_attention(model: torch.nn.Module, name: str = ATTENTION_NAME, with_mask: bool = True) -> bool:
    """Switch a Hugging Face model that runs SDPA attention to `layout_attention`, registered as `name`
    (`with_mask`: with SDPA's mask function, for forwards without a layout; without it transformers builds
    no mask); False, unchanged, where the model cannot take it."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == name:
        return True
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if config is None or config._attn_implementation != "sdpa" or can_set is None or not can_set():
        return False
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError:  # transformers before its attention-mask interface
        return False
    AttentionInterface.register(name, layout_attention)
    if with_mask:
        AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    return config._attn_implementation == name


def uses_tree_attention(model: torch.nn.Module) -> bool:
    """Whether the model's attention is `layout_attention` for shared-prefix rows."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTENTION_NAME


def layout_replaces_mask(model: torch.nn.Module) -> bool:
    """Whether every layer of the model attends by the layout alone: tree attention, and no sliding window
    or logit soft-cap in its config (layers with one fall back to the dense tree mask)."""
    config = getattr(model, "config", None)
    return uses_tree_attention(model) and all(
        getattr(config, name, None) in (None, False)
        for name in ("sliding_window", "attn_logit_softcapping", "use_sliding_window")
    )
