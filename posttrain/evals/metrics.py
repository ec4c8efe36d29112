"""Evaluation metrics over n samples per prompt: unbiased pass@k and cons@k (majority vote over k-subsets)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Hashable, Sequence
from fractions import Fraction

import torch

Rewards = Sequence[float] | torch.Tensor


def _per_prompt_rewards(rewards: Rewards, num_tests_per_prompt: int, k: int) -> list[list[float]]:
    """Flat rewards (each prompt's n samples contiguous) -> one list of n rewards per prompt, after checks."""
    flat = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1).tolist()
    if k < 1:
        raise ValueError(f"k must be >= 1, got k={k}")
    if num_tests_per_prompt < k:
        raise ValueError(f"num_tests_per_prompt={num_tests_per_prompt} must be >= k={k}")
    if not flat or len(flat) % num_tests_per_prompt:
        raise ValueError(
            f"{len(flat)} rewards are not a positive multiple of num_tests_per_prompt={num_tests_per_prompt}"
        )
    n = num_tests_per_prompt
    return [flat[start : start + n] for start in range(0, len(flat), n)]


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt (Chen et al. 2021): 1 - C(n - c, k) / C(n, k), in exact integers."""
    return float(1 - Fraction(math.comb(num_samples - num_correct, k), math.comb(num_samples, k)))


def eval_pass_k(rewards: Rewards, num_tests_per_prompt: int, k: int, threshold: float = 1.0) -> float:
    """Mean over prompts of the unbiased pass@k; a sample is correct when its reward is >= threshold (by
    default 1.0, the maximum of a 0/1 or partial-credit reward: partial credit is not a pass).

    rewards: flat [num_prompts * n], each prompt's n = num_tests_per_prompt samples contiguous.
    Raises ValueError for k < 1, n < k, or a length not divisible by n."""
    groups = _per_prompt_rewards(rewards, num_tests_per_prompt, k)
    scores = [pass_at_k(len(group), sum(r >= threshold for r in group), k) for group in groups]
    return sum(scores) / len(scores)


def majority_answer(answers: Sequence[Hashable | None]) -> int | None:
    """Index (into answers) of the first sample carrying the majority answer; None if nothing votes.

    None answers (nothing extracted) do not vote. Ties go to the answer that appears first in sample order."""
    counts: dict[Hashable, int] = {}
    first_index: dict[Hashable, int] = {}
    for index, answer in enumerate(answers):
        if answer is None:
            continue
        counts[answer] = counts.get(answer, 0) + 1
        first_index.setdefault(answer, index)
    if not counts:
        return None
    winner = max(counts, key=lambda answer: (counts[answer], -first_index[answer]))
    return first_index[winner]


def _k_subsets(n: int, k: int, max_subsets: int, rng: random.Random) -> list[tuple[int, ...]]:
    """All k-subsets of range(n) in sample order when C(n, k) <= max_subsets, else max_subsets random ones."""
    if math.comb(n, k) <= max_subsets:
        return list(itertools.combinations(range(n), k))
    return [tuple(sorted(rng.sample(range(n), k))) for _ in range(max_subsets)]


def _cons_at_k_one_prompt(
    rewards: list[float],
    answers: Sequence[Hashable | None],
    k: int,
    max_subsets: int,
    rng: random.Random,
    threshold: float,
) -> float:
    """Fraction of k-subsets whose majority answer is correct (reward >= threshold of its first sample in
    the subset)."""
    subsets = _k_subsets(len(rewards), k, max_subsets, rng)
    num_correct = 0
    for subset in subsets:
        winner = majority_answer([answers[i] for i in subset])
        num_correct += winner is not None and rewards[subset[winner]] >= threshold
    return num_correct / len(subsets)


def eval_cons_k(
    rewards: Rewards,
    num_tests_per_prompt: int,
    k: int,
    extracted_answers: Sequence[Hashable | None],
    max_subsets: int = 10_000,
    seed: int = 0,
    threshold: float = 1.0,
) -> float:
    """cons@k (majority voting), averaged over prompts.

    For each prompt, over its k-subsets of the n = num_tests_per_prompt samples: the most common extracted
    answer of the subset wins; a tie goes to the tied answer that appears first in sample order within the
    subset; None answers do not vote (a subset where nothing votes is wrong). The subset is correct when
    the reward of the first sample in the subset carrying the winning answer is >= threshold. Answers are
    compared with == as given (normalise them first). All C(n, k) subsets are enumerated when there are at
    most max_subsets of them; otherwise max_subsets subsets are drawn uniformly (with replacement among
    subsets) from random.Random(seed), so the result is an unbiased, reproducible estimate."""
    groups = _per_prompt_rewards(rewards, num_tests_per_prompt, k)
    if len(extracted_answers) != len(groups) * num_tests_per_prompt:
        raise ValueError(
            f"{len(extracted_answers)} extracted_answers for {len(groups) * num_tests_per_prompt} rewards"
        )
    rng = random.Random(seed)
    n = num_tests_per_prompt
    answers = [extracted_answers[i * n : (i + 1) * n] for i in range(len(groups))]
    scores = [
        _cons_at_k_one_prompt(group, votes, k, max_subsets, rng, threshold)
        for group, votes in zip(groups, answers)
    ]
    return sum(scores) / len(scores)
