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
