"""Pure math on rewards and logprobs: group-relative (GRPO, Dr. GRPO), leave-one-out (RLOO) and
batch-normalised (REINFORCE++) advantages, KL estimators, and DAPO's reward helpers (dynamic-sampling group
filter, overlong penalty and filter, scaling).
"""

from __future__ import annotations

from typing import Literal

import torch

Baseline = Literal["mean", "leave_one_out"]
KLKind = Literal["k1", "k2", "k3"]


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """View flat rewards [N] (each prompt's generations contiguous) as [G, num_generations]."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"num_generations={num_generations} does not divide the {rewards.numel()} rewards into groups"
        )
    return rewards.float().view(-1, num_generations)  # [G, n]


def group_relative_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    baseline: Baseline = "mean",
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages [N] of rewards [N] against their group (the num_generations samples of one prompt).

    baseline "mean": A_i = r_i - mean(group) (GRPO); "leave_one_out": A_i = r_i - mean of the other
    samples of the group (RLOO). With normalize_std, A_i is divided by (std + eps), the group's sample
    standard deviation (Bessel-corrected), only where that std is > 0. A group whose rewards are all equal
    gets exactly 0, whatever rounding the mean would leave.
    """
    grouped = _grouped(rewards, num_generations)  # [G, n]
    group_sum = grouped.sum(dim=1, keepdim=True)  # [G, 1]
    if baseline == "mean":
        advantages = grouped - group_sum / num_generations  # [G, n]
    elif baseline == "leave_one_out":
        if num_generations < 2:
            raise ValueError("baseline='leave_one_out' needs num_generations >= 2")
        advantages = grouped - (group_sum - grouped) / (num_generations - 1)  # [G, n]
    else:
        raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {baseline!r}")
    constant = ~groups_with_signal(rewards, num_generations)  # [G]
    advantages = advantages.masked_fill(constant.unsqueeze(1), 0.0)
    if normalize_std and num_generations > 1:
        std = grouped.std(dim=1, keepdim=True)  # [G, 1]
        advantages = torch.where(std > 0, advantages / (std + eps), advantages)
    return advantages.reshape(-1)  # [N]


def rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """RLOO: A_i = r_i - mean of the group's other rewards, not divided by the std. [N] -> [N]."""
    return group_relative_advantages(rewards, num_generations, baseline="leave_one_out", normalize_std=False)


def reinforce_pp_advantages(
    rewards: torch.Tensor, num_generations: int, group_baseline: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262): advantages normalised over the whole batch, not per
    group. Plain REINFORCE++ (`group_baseline` False): A_i = (r_i - mean_B(r)) / (std_B(r) + eps), the
    batch's mean and (Bessel-corrected) std over all N samples. REINFORCE++-baseline (`group_baseline`):
    the group's mean is subtracted first, then the batch normalisation: a_i = r_i - mean(group(i)),
    A_i = (a_i - mean_B(a)) / (std_B(a) + eps). A batch whose centred rewards are all 0 gets 0.
    Departure: the paper folds a per-token KL penalty into the reward; here KL stays a loss term
    (`loss.reference_policy_kl_penalty`). [N] -> [N]"""
    grouped = _grouped(rewards, num_generations)  # [G, n]
    if group_baseline:  # a group whose rewards are all equal is exactly 0, whatever rounding leaves
        centred = grouped - grouped.mean(dim=1, keepdim=True)  # [G, n], batch mean 0
        centred = centred.masked_fill(~groups_with_signal(rewards, num_generations).unsqueeze(1), 0.0)
    else:
        centred = grouped - grouped.mean()  # [G, n]
    flat = centred.reshape(-1)  # [N]
    std = flat.std() if flat.numel() > 1 else flat.new_zeros(())
    return flat / (std + eps) if bool(std > 0) else torch.zeros_like(flat)


def dr_grpo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): A_i = r_i - mean(group(i)), not divided by the group's
    std (which over-weights groups that are nearly all right or all wrong). Pair it with the loss's
    constant-length normaliser (`loss.constant_length_normalizer`). [N] -> [N]"""
    return group_relative_advantages(rewards, num_generations, baseline="mean", normalize_std=False)


def broadcast_advantages(advantages: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample advantages [N] onto the trained tokens: [N, T], zero where token_mask is 0."""
    return advantages.float().unsqueeze(1) * token_mask.float()  # [N, T]


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: KLKind = "k3",
    input_clamp_value: float | None = None,
    output_clamp_value: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1, k2, k3).

    With x = logprobs - ref_logprobs (clamped to [-input_clamp_value, input_clamp_value] if given):
    k1 = x, k2 = x^2 / 2, k3 = exp(-x) + x - 1. The estimate is then clamped to
    [-output_clamp_value, output_clamp_value] if given. Shapes: [B, T], [B, T] -> [B, T].
    """
    log_ratio = logprobs.float() - ref_logprobs.float()  # [B, T]
    if input_clamp_value is not None:
        log_ratio = log_ratio.clamp(-input_clamp_value, input_clamp_value)
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind == "k3":
        kl = torch.exp(-log_ratio) + log_ratio - 1.0
    else:
        raise ValueError(f"kl kind must be 'k1', 'k2' or 'k3', got {kind!r}")
    if output_clamp_value is not None:
        kl = kl.clamp(-output_clamp_value, output_clamp_value)
    return kl  # [B, T]


# -- DAPO ---------------------------------------------------------------------------------------------


def groups_with_signal(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """DAPO dynamic sampling: bool [G], True for groups whose rewards are not all equal (they have a
    non-zero advantage somewhere). Rows to keep: `groups_with_signal(...).repeat_interleave(n)` [N]."""
    grouped = _grouped(rewards, num_generations)  # [G, n]
    return grouped.amax(dim=1) != grouped.amin(dim=1)  # [G]


def overlong_reward_penalty(
    lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment, to be added to the rewards: [N] lengths -> [N] penalties <= 0.

    0 for lengths <= max_len - buffer_len; then falls linearly, ((max_len - buffer_len) - length) /
    buffer_len * penalty_factor, reaching -penalty_factor at max_len; -penalty_factor beyond max_len.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len={buffer_len} must be in (0, max_len={max_len}]")
    excess = lengths.float() - (max_len - buffer_len)  # [N]
    return -penalty_factor * (excess / buffer_len).clamp(0.0, 1.0)  # [N]


def overlong_filter_mask(truncated: torch.Tensor) -> torch.Tensor:
    """DAPO overlong filtering: sample_mask [N] (float) that is 0 for truncated samples, 1 otherwise."""
    return (~truncated.bool()).float()  # [N]


def scale_rewards(rewards: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """Affine reward shaping: rewards * scale + shift, [N] -> [N]."""
    return rewards.float() * scale + shift
