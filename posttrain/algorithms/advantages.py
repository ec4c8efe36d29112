"""Pure math on rewards and logprobs: group-relative (GRPO, Dr. GRPO) and leave-one-out (RLOO) advantages,
REINFORCE++'s batch-whitened advantages, PPO's generalised advantage estimation (GAE), on-policy
distillation's per-token advantages, KL estimators, DAPO's reward helpers (dynamic-sampling group
filter, overlong penalty and filter, scaling), and `ESTIMATORS`, the table of GRPO's advantage estimators."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

Baseline = Literal["mean", "leave_one_out"]
KLKind = Literal["k1", "k2", "k3"]


class NonFiniteRewardError(ValueError):
    """Rewards or advantages that are NaN or infinite reached the advantage or loss computation."""


def check_finite(values: torch.Tensor, name: str = "rewards") -> None:
    """NonFiniteRewardError naming the samples (rows) of `values` [N] or [N, T] that hold NaN or inf.
    Rewards come from the environments, which check them where they enter (`environments.reward_check`),
    so a non-finite value here is a reward source that bypassed that check, not a learning-rate problem."""
    bad = ~torch.isfinite(values.float())
    if bool(bad.any()):
        rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten().tolist() if bad.dim() else [0]
        raise NonFiniteRewardError(
            f"{name} are NaN or infinite at samples {rows[:8]}{' ...' if len(rows) > 8 else ''}: they come "
            "from the environments' rewards (an environment or reward function returned a non-finite "
            "reward without the environments' check), not from the learning rate"
        )


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """View flat rewards [N] (each prompt's generations contiguous) as [G, num_generations]; non-finite
    rewards are a NonFiniteRewardError."""
    check_finite(rewards)
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
    gets exactly 0, whatever rounding the mean would leave."""
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


def dr_grpo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783), [N] -> [N]:

        A_i = R_i - mean(R_1, ..., R_G)

    GRPO's advantage without the division by std(R): that division weights prompts whose rewards barely
    vary (nearly all right or all wrong) more. Its other fix, a constant length normaliser in the loss,
    is `ClippedPGLossConfig.constant_length_normalizer`."""
    return group_relative_advantages(rewards, num_generations, baseline="mean", normalize_std=False)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) with mean and (population) std over the entries of the whole batch where
    mask is 1: [B, T], [B, T] -> [B, T], 0 where mask is 0. An empty mask gives all zeros."""
    mask = mask.float()  # [B, T]
    count = mask.sum().clamp(min=1.0)
    mean = (values.float() * mask).sum() / count
    centered = (values.float() - mean) * mask  # [B, T]
    std = (centered.square().sum() / count).sqrt()
    return centered / (std + eps)  # [B, T]


def reinforce_pp_advantages(
    rewards: torch.Tensor, token_mask: torch.Tensor, num_generations: int | None = None
) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262): per-token advantages [N, T] of rewards [N].

        A_{i,t} = R_i - b_i,    A_norm = (A - mean_batch(A)) / std_batch(A)

    mean and std run over every trained token of the global batch (token_mask [N, T], 0/1), so the batch
    mean is the baseline. b_i = 0 (REINFORCE++), or with num_generations the mean reward of sample i's
    group (REINFORCE++-baseline, the paper's variant for several samples per prompt). Departure: the paper
    folds a per-token KL penalty into R; here the KL penalty stays in the loss
    (`loss.reference_policy_kl_penalty`), as in GRPO."""
    check_finite(rewards)
    baselined = rewards.float()  # [N]
    if num_generations is not None:
        baselined = group_relative_advantages(rewards, num_generations, "mean", normalize_std=False)
    return masked_whiten(broadcast_advantages(baselined, token_mask), token_mask)  # [N, T]


def terminal_token_rewards(rewards: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """Sequence rewards [N] placed on each sample's last trained token: [N, T], 0 elsewhere (and 0 for a
    sample with no trained token)."""
    token_mask = token_mask.float()  # [N, T]
    positions = torch.arange(token_mask.shape[1], device=token_mask.device).float()  # [T]
    last = (token_mask * (positions + 1)).argmax(dim=1)  # [N], the last position where the mask is 1
    token_rewards = torch.zeros_like(token_mask)
    token_rewards[torch.arange(token_mask.shape[0]), last] = rewards.float()
    return token_rewards * token_mask  # [N, T]


@dataclass
class GAEResult:
    """Per-token advantages and returns of `gae_advantages`, both [N, T] and 0 off the mask."""

    advantages: torch.Tensor
    returns: torch.Tensor


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, token_mask: torch.Tensor, gamma: float, lam: float
) -> GAEResult:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438) over the tokens of
    token_mask [N, T] (the policy's actions; values [N, T] at them, V(state before the token)):

        delta_t = r_t + gamma * V_{t'} - V_t,   A_t = delta_t + gamma * lam * A_{t'},   R_t = A_t + V_t

    where t' is the next masked token of the same row (V = 0 and A = 0 past the last). Unmasked tokens
    (prompts, environment turns) are skipped, not steps of the episode, so a multi-turn episode is one
    trajectory of its assistant tokens, as in PPO for multi-turn rollouts."""
    mask = token_mask.float()  # [N, T]
    advantages = torch.zeros_like(mask)
    next_value = torch.zeros(mask.shape[0], device=mask.device)  # [N]
    next_advantage = torch.zeros_like(next_value)  # [N]
    for t in reversed(range(mask.shape[1])):
        delta = token_rewards[:, t].float() + gamma * next_value - values[:, t].float()  # [N]
        advantage = delta + gamma * lam * next_advantage  # [N]
        on = mask[:, t] > 0  # [N]
        advantages[:, t] = torch.where(on, advantage, torch.zeros_like(advantage))
        next_value = torch.where(on, values[:, t].float(), next_value)
        next_advantage = torch.where(on, advantage, next_advantage)
    returns = (advantages + values.float()) * mask  # [N, T]
    return GAEResult(advantages, returns)


def distillation_advantages(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, token_mask: torch.Tensor
) -> torch.Tensor:
    """On-policy distillation (Agarwal et al. 2024, GKD, arXiv:2306.13649; the reverse-KL recipe of Qwen3,
    arXiv:2505.09388): the student samples y, and each of its tokens gets the advantage

        A_t = log pi_teacher(y_t | y_<t) - log pi_student(y_t | y_<t)

    the negative of the per-token reverse KL estimate (k1), so the policy gradient lowers
    KL(pi_student || pi_teacher) on the student's own samples. Departure: each token is credited with its
    own term only (no sum over the later tokens, i.e. discount 0), which keeps the variance low.
    Shapes: [B, T], [B, T], [B, T] -> [B, T], 0 where token_mask is 0."""
    return (teacher_logprobs.float() - student_logprobs.float()) * token_mask.float()  # [B, T]


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
    [-output_clamp_value, output_clamp_value] if given. Shapes: [B, T], [B, T] -> [B, T]."""
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
    buffer_len * penalty_factor, reaching -penalty_factor at max_len; -penalty_factor beyond max_len."""
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


@dataclass
class EstimatorInputs:
    """What an estimator reads beside the rewards and the token mask, each estimator its own fields: the
    config's knobs and its helper model's tensors. The batch holds groups of `num_generations` samples of
    one prompt, contiguous: sample i is in group i // num_generations."""

    num_generations: int
    baseline: Baseline = "mean"  # grpo (and the reward term of on_policy_distillation)
    normalize_std: bool = True  # grpo (and the reward term of on_policy_distillation)
    min_reward: float = 1.0  # rejection_sampling: the least reward accepted
    gamma: float = 1.0  # gae
    lam: float = 0.95  # gae
    whiten_gae: bool = True  # gae: whiten its advantages over the batch's trained tokens
    whiten_distillation: bool = True  # on_policy_distillation: the same for its teacher-student term
    reward_weight: float = 0.0  # on_policy_distillation: weight of the group-relative term added
    values: torch.Tensor | None = None  # gae: the critic's V [B, T], 0 off the trained tokens
    teacher_logprobs: torch.Tensor | None = None  # on_policy_distillation: log pi_teacher [B, T]
    student_logprobs: torch.Tensor | None = None  # on_policy_distillation: the sampling policy's [B, T]


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator of GRPO's loop: an entry of `ESTIMATORS`."""

    fn: Callable[[torch.Tensor, torch.Tensor, EstimatorInputs], torch.Tensor]
    """(rewards [B], token_mask [B, T] 0/1, inputs) -> advantages [B, T], 0 where token_mask is 0"""
    helper: Literal["none", "critic", "teacher"] = "none"
    """the model beside the policy whose tensors it reads: the critic's values, the teacher's logprobs"""
    loss: Literal["clipped_pg", "nll"] = "clipped_pg"
    """the policy's loss: GRPO's clipped policy gradient on the advantages, or SFT's NLL"""
    keep: Callable[[torch.Tensor, EstimatorInputs], torch.Tensor] | None = None
    """(rewards [B], inputs) -> 0/1 [B]: the samples the loss trains on (the others get sample_mask 0;
    their share is logged as `<name>/accepted_share`); None: all"""


def grpo_estimate(rewards: torch.Tensor, token_mask: torch.Tensor, inputs: EstimatorInputs) -> torch.Tensor:
    """`group_relative_advantages` with the inputs' baseline and std normalisation, on the trained tokens."""
    baselined = group_relative_advantages(
        rewards, inputs.num_generations, inputs.baseline, inputs.normalize_std
    )
    return broadcast_advantages(baselined, token_mask)  # [B, T]


def gae_estimate(rewards: torch.Tensor, token_mask: torch.Tensor, inputs: EstimatorInputs) -> torch.Tensor:
    """PPO: the reward on each sample's last trained token, `gae_advantages` from the critic's values,
    whitened over the batch's trained tokens with whiten_gae."""
    token_rewards = terminal_token_rewards(rewards, token_mask)  # [B, T]
    gae = gae_advantages(token_rewards, inputs.values, token_mask, inputs.gamma, inputs.lam)
    return masked_whiten(gae.advantages, token_mask) if inputs.whiten_gae else gae.advantages  # [B, T]


def distillation_estimate(
    rewards: torch.Tensor, token_mask: torch.Tensor, inputs: EstimatorInputs
) -> torch.Tensor:
    """`distillation_advantages` (whitened over the batch's trained tokens with whiten_distillation), plus
    reward_weight times GRPO's group-relative advantage when reward_weight > 0."""
    advantages = distillation_advantages(inputs.teacher_logprobs, inputs.student_logprobs, token_mask)
    if inputs.whiten_distillation:
        advantages = masked_whiten(advantages, token_mask)
    if inputs.reward_weight > 0:
        advantages = advantages + inputs.reward_weight * grpo_estimate(rewards, token_mask, inputs)
    return advantages  # [B, T]


def accepted(rewards: torch.Tensor, inputs: EstimatorInputs) -> torch.Tensor:
    """Rejection sampling: 1 for the samples whose reward is >= min_reward, else 0, [B] -> [B]."""
    return (rewards >= inputs.min_reward).float()


# grpo.advantage_estimator -> its estimator. A new estimator is one entry here (its formula a function
# above); grpo_config.GRPOLoopConfig.advantage_estimator documents the names.
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(grpo_estimate),
    "dr_grpo": Estimator(lambda r, m, i: broadcast_advantages(dr_grpo_advantages(r, i.num_generations), m)),
    "reinforce_pp": Estimator(lambda r, m, i: reinforce_pp_advantages(r, m)),
    "reinforce_pp_baseline": Estimator(lambda r, m, i: reinforce_pp_advantages(r, m, i.num_generations)),
    "gae": Estimator(gae_estimate, helper="critic"),
    "on_policy_distillation": Estimator(distillation_estimate, helper="teacher"),
    "rejection_sampling": Estimator(
        lambda r, m, i: broadcast_advantages(accepted(r, i), m), loss="nll", keep=accepted
    ),
}
