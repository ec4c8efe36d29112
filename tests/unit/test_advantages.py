"""Advantages, KL estimators and DAPO reward helpers against hand-derived numbers."""

import math

import pytest
import torch

from posttrain.algorithms.advantages import (
    ESTIMATORS,
    EstimatorInputs,
    broadcast_advantages,
    distillation_advantages,
    dr_grpo_advantages,
    gae_advantages,
    group_relative_advantages,
    groups_with_signal,
    kl_estimate,
    masked_whiten,
    overlong_filter_mask,
    overlong_reward_penalty,
    reinforce_pp_advantages,
    scale_rewards,
    terminal_token_rewards,
)


def test_mean_baseline_divides_by_group_std_and_zero_variance_group_gets_zero():
    """Group [1,0,0,0]: mean 0.25, deviations [.75,-.25,-.25,-.25], sample var (.5625+3*.0625)/3 = .25,
    std .5 -> [1.5,-.5,-.5,-.5]. Group [2,2,2,2]: std 0, so no division and exactly 0."""
    rewards = torch.tensor([1.0, 0, 0, 0, 2, 2, 2, 2])
    advantages = group_relative_advantages(rewards, num_generations=4, eps=0.0)
    torch.testing.assert_close(advantages, torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]))


def test_constant_group_with_inexact_mean_gives_exact_zero():
    """0.1 three times: the float mean may round, but the group has no signal, so all three are exactly 0."""
    advantages = group_relative_advantages(torch.tensor([0.1, 0.1, 0.1]), num_generations=3)
    assert torch.equal(advantages, torch.zeros(3))


def test_mean_baseline_without_std_normalisation_is_reward_minus_mean():
    """Group [1,0,0,0] without std: [0.75, -0.25, -0.25, -0.25]."""
    advantages = group_relative_advantages(torch.tensor([1.0, 0, 0, 0]), 4, normalize_std=False)
    torch.testing.assert_close(advantages, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_leave_one_out_baseline():
    """Group [1,0,0,0]: A_0 = 1 - mean(0,0,0) = 1, A_j = 0 - mean(1,0,0) = -1/3 (= 4/3 * (r - 0.25))."""
    rewards = torch.tensor([1.0, 0, 0, 0])
    expected = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3])
    torch.testing.assert_close(
        group_relative_advantages(rewards, 4, "leave_one_out", normalize_std=False), expected
    )


def test_dr_grpo_is_reward_minus_group_mean_without_std_division():
    """Groups [1,0,0,0] and [1,1,1,0]: means .25 and .75, so Dr. GRPO gives [.75,-.25,-.25,-.25] and
    [.25,.25,.25,-.75]. GRPO divides both by their std .5 (sample variance (.5625 + 3 * .0625) / 3 = .25),
    giving [1.5,-.5,-.5,-.5] and [.5,.5,.5,-1.5]: the same scale as Dr. GRPO's, doubled."""
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0])
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75])
    torch.testing.assert_close(dr_grpo_advantages(rewards, 4), expected)
    torch.testing.assert_close(group_relative_advantages(rewards, 4, eps=0.0), expected * 2)


def test_masked_whiten_uses_the_batch_mean_and_population_std_of_masked_entries():
    """Masked entries 1, 2, 3: mean 2, population variance (1 + 0 + 1) / 3 = 2/3, std 0.816497, so
    -1/0.816497 = -1.224745, 0, 1.224745; the unmasked entries (9s) are 0 and do not count."""
    values = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    expected = torch.tensor([[-1.224745, 0.0, 0.0], [1.224745, 0.0, 0.0]])
    torch.testing.assert_close(masked_whiten(values, mask), expected)
    assert torch.equal(masked_whiten(values, torch.zeros(2, 3)), torch.zeros(2, 3))


def test_reinforce_pp_whitens_rewards_over_the_batch_tokens():
    """REINFORCE++: rewards 1 (3 trained tokens) and 0 (1 token). Token values 1, 1, 1, 0: mean .75,
    population variance (3 * .0625 + .5625) / 4 = .1875, std .433013; so 0.25 / 0.433013 = 1/sqrt 3 =
    0.577350 on the first sample's tokens and -0.75 / 0.433013 = -sqrt 3 = -1.732051 on the second's. The
    mean is token-weighted: the longer response pulls the baseline to .75, not .5."""
    token_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]])
    advantages = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), token_mask)
    third = 1 / math.sqrt(3)
    expected = torch.tensor([[0.0, third, third, third], [0.0, -math.sqrt(3), 0.0, 0.0]])
    torch.testing.assert_close(advantages, expected)


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens_over_the_batch():
    """REINFORCE++-baseline, groups [1,0] and [1,1], one token each: group-centred [.5,-.5,0,0]; over the
    4 tokens the mean is 0 and the population std sqrt((.25 + .25) / 4) = 0.353553, so [1.414214,
    -1.414214, 0, 0]. The all-equal group stays 0, and one batch std scales every group (GRPO would
    divide the first group by its own std .707107 instead: [.707107, -.707107])."""
    token_mask = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]])
    advantages = reinforce_pp_advantages(torch.tensor([1.0, 0, 1, 1]), token_mask, num_generations=2)
    expected = torch.tensor([[0.0, math.sqrt(2)], [0.0, -math.sqrt(2)], [0.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(advantages, expected)


def test_terminal_token_rewards_sit_on_the_last_trained_token():
    """Rewards 1, 2, 3: row 0's last trained token is position 4 (an environment token at 3 between its
    turns), row 1's is position 1, row 2 has none and gets nothing."""
    token_mask = torch.tensor([[0, 1, 1, 0, 1], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    expected = torch.tensor([[0.0, 0, 0, 0, 1], [0, 2, 0, 0, 0], [0, 0, 0, 0, 0]])
    torch.testing.assert_close(terminal_token_rewards(torch.tensor([1.0, 2, 3]), token_mask), expected)


def test_gae_skips_untrained_tokens_and_matches_the_recursion_by_hand():
    """Assistant tokens at 1, 2 and 4 (prompt at 0, an environment token at 3 whose value 9 must not
    count), values .5, .6, .8, reward 1 on token 4; gamma .9, lambda .8 (gamma * lambda = .72):
    t=4: delta = 1 + .9 * 0 - .8 = .2, A = .2;
    t=2: delta = 0 + .9 * .8 - .6 = .12, A = .12 + .72 * .2 = .264;
    t=1: delta = 0 + .9 * .6 - .5 = .04, A = .04 + .72 * .264 = .23008.
    Returns A + V: .73008, .864, 1.0. With gamma = lambda = 1, A_t = R - V_t: .5, .4, .2, returns all 1."""
    token_mask = torch.tensor([[0, 1, 1, 0, 1]])
    values = torch.tensor([[9.0, 0.5, 0.6, 9.0, 0.8]])
    rewards = terminal_token_rewards(torch.tensor([1.0]), token_mask)
    result = gae_advantages(rewards, values, token_mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(result.advantages, torch.tensor([[0.0, 0.23008, 0.264, 0.0, 0.2]]))
    torch.testing.assert_close(result.returns, torch.tensor([[0.0, 0.73008, 0.864, 0.0, 1.0]]))
    monte_carlo = gae_advantages(rewards, values, token_mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(monte_carlo.advantages, torch.tensor([[0.0, 0.5, 0.4, 0.0, 0.2]]))
    torch.testing.assert_close(monte_carlo.returns, torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]]))


def test_group_advantages_reject_bad_group_size_and_baseline():
    with pytest.raises(ValueError, match="num_generations=2"):
        group_relative_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError, match="baseline"):
        group_relative_advantages(torch.ones(4), 2, baseline="median")
    with pytest.raises(ValueError, match="leave_one_out"):
        group_relative_advantages(torch.ones(4), 1, baseline="leave_one_out")


def test_broadcast_advantages_fills_trained_tokens_only():
    token_mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    expected = torch.tensor([[0.0, 2.0, 2.0], [0.0, -1.0, 0.0]])
    torch.testing.assert_close(broadcast_advantages(torch.tensor([2.0, -1.0]), token_mask), expected)


def test_kl_estimators_k1_k2_k3_by_hand():
    """x = logp - ref: x = 1 gives k1 = 1, k2 = 0.5, k3 = e^-1 + 1 - 1 = 0.367879; x = -1 gives k1 = -1,
    k2 = 0.5, k3 = e^1 - 1 - 1 = 0.718282."""
    logprobs, ref_logprobs = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -1.0]])
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, "k1"), torch.tensor([[1.0, -1.0]]))
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, "k2"), torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(
        kl_estimate(logprobs, ref_logprobs, "k3"), torch.tensor([[math.exp(-1), math.e - 2]])
    )


def test_kl_input_and_output_clamps():
    """x = 1 clamped to 0.5 first: k3 = e^-0.5 + 0.5 - 1 = 0.106531. k2 = 0.5 clamped at 0.3 after."""
    logprobs, ref_logprobs = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    clamped_in = kl_estimate(logprobs, ref_logprobs, "k3", input_clamp_value=0.5)
    torch.testing.assert_close(clamped_in, torch.tensor([[math.exp(-0.5) - 0.5]]))
    clamped_out = kl_estimate(logprobs, ref_logprobs, "k2", output_clamp_value=0.3)
    torch.testing.assert_close(clamped_out, torch.tensor([[0.3]]))
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logprobs, ref_logprobs, "k4")


def test_groups_with_signal_keeps_groups_with_unequal_rewards():
    """Groups [1,1], [0,1], [2,2] -> only the middle one has signal."""
    mask = groups_with_signal(torch.tensor([1.0, 1, 0, 1, 2, 2]), num_generations=2)
    assert mask.tolist() == [False, True, False]


def test_overlong_penalty_is_zero_then_linear_then_full():
    """max 10, buffer 4: lengths 6 -> 0; 8 -> (6 - 8) / 4 = -0.5; 10 -> -1; 12 -> -1; factor 2 doubles."""
    lengths = torch.tensor([6, 8, 10, 12])
    torch.testing.assert_close(overlong_reward_penalty(lengths, 10, 4), torch.tensor([0.0, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(
        overlong_reward_penalty(lengths, 10, 4, 2.0), torch.tensor([0.0, -1.0, -2.0, -2.0])
    )
    with pytest.raises(ValueError, match="buffer_len=11"):
        overlong_reward_penalty(lengths, 10, 11)


def test_overlong_filter_masks_truncated_samples():
    assert overlong_filter_mask(torch.tensor([True, False, True])).tolist() == [0.0, 1.0, 0.0]


def test_scale_rewards_is_affine():
    """[1, 0] * 2 - 1 = [1, -1]."""
    torch.testing.assert_close(scale_rewards(torch.tensor([1.0, 0.0]), 2.0, -1.0), torch.tensor([1.0, -1.0]))


def test_distillation_advantage_is_teacher_minus_student_logprob_on_trained_tokens():
    """Student logprobs ln .5 and ln .25 on its two sampled tokens, teacher ln .25 and ln .5: advantages
    ln(.25/.5) = -0.693147 (the teacher likes the token less: push it down) and ln(.5/.25) = 0.693147;
    the untrained prompt position stays 0 whatever the logprobs there."""
    student = torch.tensor([[-3.0, math.log(0.5), math.log(0.25)]])
    teacher = torch.tensor([[-1.0, math.log(0.25), math.log(0.5)]])
    advantages = distillation_advantages(teacher, student, torch.tensor([[0, 1, 1]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.0, -math.log(2), math.log(2)]]))


def test_every_estimator_of_the_table_gives_per_token_advantages_zero_off_the_mask():
    """Each entry's fn: rewards [4] (two groups of two), token_mask [4, 3] with an untrained prompt column
    and a sample without trained tokens, the critic's values and both policies' logprobs -> [4, 3], 0
    wherever token_mask is 0 (nonzero somewhere, so a fn of zeros would not pass)."""
    generator = torch.Generator().manual_seed(0)
    token_mask = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 0, 0], [0, 1, 1]]).float()
    inputs = EstimatorInputs(
        num_generations=2,
        reward_weight=0.5,
        values=torch.randn(4, 3, generator=generator) * token_mask,
        teacher_logprobs=-torch.rand(4, 3, generator=generator),
        student_logprobs=-torch.rand(4, 3, generator=generator),
    )
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    for name, estimator in ESTIMATORS.items():
        advantages = estimator.fn(rewards, token_mask, inputs)
        assert advantages.shape == (4, 3), name
        assert torch.equal(advantages * (1 - token_mask), torch.zeros(4, 3)), name
        assert advantages.abs().sum() > 0, name
        assert estimator.helper in ("none", "critic", "teacher") and estimator.loss in ("clipped_pg", "nll")


def test_distillation_estimator_adds_the_weighted_group_advantage_to_teacher_minus_student():
    """Unwhitened, reward_weight .5, no std division. teacher - student per token: [[1, 0], [1, -4],
    [-2, 0], [-1, 2]], masked by [[1, 1], [1, 0], [1, 0], [0, 1]]: [[1, 0], [1, 0], [-2, 0], [0, 2]].
    Rewards [1, 0 | 1, 1]: group means .5 and 1, so R - mean = [.5, -.5, 0, 0], times .5 = [.25, -.25, 0,
    0] on each trained token. Sum: [[1.25, .25], [.75, 0], [-2, 0], [0, 2]]."""
    token_mask = torch.tensor([[1, 1], [1, 0], [1, 0], [0, 1]]).float()
    inputs = EstimatorInputs(
        num_generations=2,
        normalize_std=False,
        whiten_distillation=False,
        reward_weight=0.5,
        teacher_logprobs=torch.tensor([[-1.0, -2.0], [-1.0, -5.0], [-3.0, -1.0], [-2.0, -2.0]]),
        student_logprobs=torch.tensor([[-2.0, -2.0], [-2.0, -1.0], [-1.0, -1.0], [-1.0, -4.0]]),
    )
    advantages = ESTIMATORS["on_policy_distillation"].fn(
        torch.tensor([1.0, 0.0, 1.0, 1.0]), token_mask, inputs
    )
    torch.testing.assert_close(advantages, torch.tensor([[1.25, 0.25], [0.75, 0.0], [-2.0, 0.0], [0.0, 2.0]]))
