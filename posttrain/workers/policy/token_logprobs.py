"""Token logprobs from logits, aligned so that position t holds log p(token t | tokens < t)."""

from __future__ import annotations

import torch


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """bf16 / fp16 as fp32; fp32 and fp64 as they are (no copy)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


class TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits / temperature) at the target tokens, [N, V] -> [N], with a hand-written backward.

    At a real vocabulary the logits are the largest tensor of a step, and autograd's composition (divide,
    logsumexp, gather) makes several full-size passes and temporaries in its backward; the gradient in one
    expression is (onehot(target) - softmax) * grad / temperature: one full-size tensor, written in place."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        scaled = (
            at_least_fp32(logits) if temperature == 1.0 else at_least_fp32(logits) / temperature
        )  # [N, V]
        log_normalizer = torch.logsumexp(scaled, dim=-1)  # [N]
        ctx.save_for_backward(logits, targets, log_normalizer)
        ctx.temperature = temperature
        return scaled.gather(-1, targets[:, None]).squeeze(-1) - log_normalizer  # [N]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, log_normalizer = ctx.saved_tensors
        temperature = ctx.temperature
        scaled = at_least_fp32(logits) if temperature == 1.0 else at_least_fp32(logits) / temperature
        grad_logits = torch.sub(scaled, log_normalizer[:, None]).exp_()  # softmax [N, V], a new tensor
        grad_logits.mul_(-grad[:, None]).scatter_add_(-1, targets[:, None], grad[:, None])
        if temperature != 1.0:
            grad_logits.div_(temperature)
        return grad_logits.to(logits.dtype), None, None


def compute_token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Position t holds log p(input_ids[t] | input_ids[<t]) in fp32 (fp64 logits: fp64) from logits /
    temperature; position 0 is 0."""
    batch, length, vocab = logits.shape
    # Every position's logits against the next token (a dummy 0 after the last, dropped): a view of the
    # logits, where slicing off the last position first would copy them.
    next_ids = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=0).reshape(-1)  # [B*T]
    logprobs = TokenLogprobs.apply(logits.reshape(batch * length, vocab), next_ids, temperature)  # [B*T]
    return torch.nn.functional.pad(logprobs.view(batch, length)[:, :-1], (1, 0), value=0.0)  # [B, T]


def first_trained_position(token_mask: torch.Tensor | None) -> int:
    """The first position any row trains on (>= 1), or 1 without a token_mask: logprobs before it are
    left 0, since no loss reads them."""
    if token_mask is None or not bool(token_mask.any()):
        return 1
    return max(1, int(token_mask.any(dim=0).nonzero()[0]))


def _next_token_log_normalizer(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits / temperature, their logsumexp over the vocabulary): [b, K, V] and [b, K], fp32 or wider."""
    scaled = at_least_fp32(logits) if temperature == 1.0 else at_least_fp32(logits) / temperature
    return scaled, torch.logsumexp(scaled, dim=-1)


def topk_next_token_logprobs(
    logits: torch.Tensor, k: int, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens at each position and their logprobs, aligned like compute_token_logprobs:
    position t holds the distribution of token t given tokens < t (from the logits at t - 1); position 0
    is 0 (logprobs) and 0 (ids). [b, K, V] -> ([b, K, k] fp32, [b, K, k] long)."""
    scaled, log_normalizer = _next_token_log_normalizer(logits[:, :-1], temperature)  # [b, K-1, V]
    values, ids = torch.topk(scaled, k, dim=-1)  # [b, K-1, k]
    values = values - log_normalizer.unsqueeze(-1)
    pad = (0, 0, 1, 0)  # one position in front
    return torch.nn.functional.pad(values, pad), torch.nn.functional.pad(ids, pad)


def next_token_logprobs_at(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(ids[t, j] | tokens < t) for each position t and each of its k candidate ids, aligned like
    compute_token_logprobs (position 0 is 0): [b, K, V], [b, K, k] -> [b, K, k], differentiable."""
    scaled, log_normalizer = _next_token_log_normalizer(logits[:, :-1], temperature)  # [b, K-1, V]
    gathered = scaled.gather(-1, ids[:, 1:]) - log_normalizer.unsqueeze(-1)  # [b, K-1, k]
    return torch.nn.functional.pad(gathered, (0, 0, 1, 0))
