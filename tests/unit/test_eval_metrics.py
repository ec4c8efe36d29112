"""pass@k and cons@k against hand-computed values."""

import math

import pytest

from posttrain.evals import eval_cons_k, eval_pass_k


def test_pass_at_1_of_two_correct_out_of_three_is_two_thirds():
    assert eval_pass_k([1, 0, 1], num_tests_per_prompt=3, k=1) == pytest.approx(2 / 3)


def test_pass_at_k_all_correct_is_one_and_none_correct_is_zero():
    assert eval_pass_k([1, 1, 1], 3, 2) == 1.0
    assert eval_pass_k([0, 0, 0], 3, 2) == 0.0


def test_pass_at_2_with_five_samples_two_correct():
    """1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7."""
    assert eval_pass_k([1, 0, 0, 1, 0], 5, 2) == pytest.approx(0.7)


def test_pass_at_k_is_one_when_fewer_wrong_samples_than_k():
    """n=5, c=2, k=4: C(3,4) = 0, so every 4-subset holds a correct sample."""
    assert eval_pass_k([1, 1, 0, 0, 0], 5, 4) == 1.0


def test_pass_at_k_averages_over_prompts_and_counts_rewards_at_the_threshold_as_correct():
    """Prompt 1 [0.5, 0, -1], prompt 2 [-1, 0, 1]. Threshold 1 (default: partial credit is no pass): 0 and
    1/3, mean 1/6. Threshold 0.5: 1/3 and 1/3, mean 1/3. cons@3 with answers a, b, a / c, c, d: the majority
    sample is the first (reward 0.5) and the first of the second prompt (-1): 0 at threshold 1, 0.5 at 0.5."""
    rewards = [0.5, 0, -1, -1, 0, 1]
    assert eval_pass_k(rewards, 3, 1) == pytest.approx(1 / 6)
    assert eval_pass_k(rewards, 3, 1, threshold=0.5) == pytest.approx(1 / 3)
    answers = ["a", "b", "a", "c", "c", "d"]
    assert eval_cons_k(rewards, 3, 3, answers) == 0.0
    assert eval_cons_k(rewards, 3, 3, answers, threshold=0.5) == 0.5


def test_pass_at_k_is_exact_for_64_samples():
    """Chen et al.'s product form 1 - prod_{i=n-c+1}^{n} (1 - k/i) for n=64, c=10, k=32."""
    n, c, k = 64, 10, 32
    expected = 1 - math.prod(1 - k / i for i in range(n - c + 1, n + 1))
    assert eval_pass_k([1] * c + [0] * (n - c), n, k) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "rewards, n, k, message",
    [
        ([1, 0], 2, 0, "k must be >= 1"),
        ([1, 0], 2, 3, "must be >= k=3"),
        ([1, 0, 1], 2, 1, "not a positive multiple"),
    ],
)
def test_pass_and_cons_reject_invalid_settings(rewards, n, k, message):
    with pytest.raises(ValueError, match=message):
        eval_pass_k(rewards, n, k)
    with pytest.raises(ValueError, match=message):
        eval_cons_k(rewards, n, k, ["a"] * len(rewards))


def test_cons_at_k_majority_answer_wins():
    """Answers a, b, a with rewards 1, 0, 1: with k=3 the only subset votes a (2 to 1), correct."""
    assert eval_cons_k([1, 0, 1], 3, 3, ["a", "b", "a"]) == 1.0
    assert eval_cons_k([0, 1, 0], 3, 3, ["a", "b", "a"]) == 0.0


def test_cons_at_1_equals_mean_accuracy():
    assert eval_cons_k([1, 0, 1], 3, 1, ["a", "b", "a"]) == pytest.approx(2 / 3)


def test_cons_at_k_tie_goes_to_answer_first_in_sample_order():
    """k=2 over a, b, a (rewards 1, 0, 1): {0,1} ties a-b -> a right; {0,2} a right; {1,2} ties b-a ->
    b (first) wrong. 2/3. A single tied pair b, a (rewards 0, 1) -> b -> 0; a, b (1, 0) -> a -> 1."""
    assert eval_cons_k([1, 0, 1], 3, 2, ["a", "b", "a"]) == pytest.approx(2 / 3)
    assert eval_cons_k([0, 1], 2, 2, ["b", "a"]) == 0.0
    assert eval_cons_k([1, 0], 2, 2, ["a", "b"]) == 1.0


def test_cons_at_k_missing_answers_do_not_vote():
    """None, None, a: a wins alone -> its reward 1. All None: no vote -> wrong."""
    assert eval_cons_k([0, 0, 1], 3, 3, [None, None, "a"]) == 1.0
    assert eval_cons_k([1, 1, 1], 3, 3, [None, None, None]) == 0.0


def test_cons_at_k_averages_over_prompts():
    """Prompt 1 (a, a right) -> 1; prompt 2 (b right, c wrong, c wrong) at k=3 -> c wins -> 0. Mean 0.5."""
    assert eval_cons_k([1, 1, 1, 1, 0, 0], 3, 3, ["a", "a", "a", "b", "c", "c"]) == 0.5


def test_cons_at_k_sampled_subsets_are_reproducible_and_close_to_exact():
    """n=12, k=6: C(12,6) = 924 subsets enumerated exactly vs 400 sampled with a seed."""
    answers = ["x"] * 5 + ["y"] * 4 + ["z"] * 3
    rewards = [1] * 5 + [0] * 7
    exact = eval_cons_k(rewards, 12, 6, answers)
    sampled = eval_cons_k(rewards, 12, 6, answers, max_subsets=400, seed=3)
    assert sampled == eval_cons_k(rewards, 12, 6, answers, max_subsets=400, seed=3)
    assert abs(sampled - exact) < 0.1


def test_cons_at_k_rejects_answer_count_mismatch():
    with pytest.raises(ValueError, match="2 extracted_answers for 3 rewards"):
        eval_cons_k([1, 0, 1], 3, 1, ["a", "b"])
