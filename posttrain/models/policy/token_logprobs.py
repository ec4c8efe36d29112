"""Token logprobs from logits, aligned so that position t holds log p(token t | tokens < t)."""

from __future__ import annotations

import torch


def compute_token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Position t holds log p(input_ids[t] | input_ids[<t]) in fp32 from logits / temperature; position 0 is 0."""
    scaled_logits = logits[:, :-1].float() / temperature  # [B, T-1, V]
    next_ids = input_ids[:, 1:].unsqueeze(-1)  # [B, T-1, 1]
    next_logits = scaled_logits.gather(-1, next_ids).squeeze(-1)  # [B, T-1]
    next_logprobs = next_logits - torch.logsumexp(scaled_logits, dim=-1)  # [B, T-1]
    return torch.nn.functional.pad(next_logprobs, (1, 0), value=0.0)  # [B, T]


def first_trained_position(token_mask: torch.Tensor | None) -> int:
    """The first position any row trains on (>= 1), or 1 without a token_mask: logprobs before it are
    left 0, since no loss reads them."""
    if token_mask is None or not bool(token_mask.any()):
        return 1
    return max(1, int(token_mask.any(dim=0).nonzero()[0]))
