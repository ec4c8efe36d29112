"""Statistics of learning curves graded per question, shared by grpo_parity.py and verifier_only.py.

A curve is a list of points `{"step", "train_s", "grades"}`, `grades` the 0/1 (or None: ungraded) strict
grades of the same held-out questions in the same order. The intervals are bootstrap percentiles: each
draw resamples the seeds of each arm and, shared by every arm and step (paired), the questions.
"""

from __future__ import annotations

import random
from collections.abc import Callable

Curve = list[dict]


def accuracy(grades: list) -> float:
    graded = [g for g in grades if g is not None]
    return sum(graded) / len(graded) if graded else float("nan")


def _mean_over_seeds(curves: list[Curve], index: int, questions: list[int]) -> float:
    return sum(accuracy([c[index]["grades"][q] for q in questions]) for c in curves) / len(curves)


def bootstrap(
    arms: dict[str, list[Curve]], statistic: Callable[[Callable[[str, int], float]], float], draws: int = 1000
) -> dict[str, float]:
    """`statistic(value)` on the data and its 95% bootstrap interval; `value(arm, point index)` is the mean
    over that arm's seeds of the accuracy at that point."""
    num_questions = len(next(iter(arms.values()))[0][0]["grades"])
    everything = list(range(num_questions))
    estimate = statistic(lambda arm, i: _mean_over_seeds(arms[arm], i, everything))
    rng, values = random.Random(0), []
    for _ in range(draws):
        questions = [rng.randrange(num_questions) for _ in everything]
        seeds = {arm: [rng.choice(curves) for _ in curves] for arm, curves in arms.items()}
        values.append(statistic(lambda arm, i, s=seeds, q=questions: _mean_over_seeds(s[arm], i, q)))
    values.sort()
    return {
        "value": round(estimate, 4),
        "low": round(values[int(0.025 * draws)], 4),
        "high": round(values[int(0.975 * draws) - 1], 4),
    }


def paired_difference(pairs: list[list[tuple[float, float]]], draws: int = 2000) -> dict[str, float]:
    """The mean of a - b over `pairs` [seed][unit] of (a, b) and its 95% bootstrap interval: each draw
    resamples the seeds, then the units within each drawn seed, keeping each pair together."""
    rng, values = random.Random(0), []
    for _ in range(draws):
        drawn = [[rng.choice(run) for _ in run] for run in (rng.choice(pairs) for _ in pairs)]
        values.append(sum(a - b for run in drawn for a, b in run) / sum(map(len, drawn)))
    values.sort()
    flat = [a - b for run in pairs for a, b in run]
    return {
        "value": round(sum(flat) / len(flat), 4),
        "low": round(values[int(0.025 * draws)], 4),
        "high": round(values[int(0.975 * draws) - 1], 4),
    }


def area(value: Callable[[str, int], float], arm: str, steps: list[int]) -> float:
    """The mean accuracy over the step span (trapezoids between the graded steps)."""
    total = sum(
        (steps[i + 1] - steps[i]) * (value(arm, i) + value(arm, i + 1)) / 2 for i in range(len(steps) - 1)
    )
    return total / (steps[-1] - steps[0]) if len(steps) > 1 else value(arm, 0)


def time_to_reach(points: list[dict], target: float) -> float | None:
    """The training seconds of the first point whose mean accuracy reaches `target` (None: never)."""
    return next((p["train_s"] for p in points if p["accuracy"] >= target), None)


def mean_curve(curves: list[Curve]) -> list[dict]:
    """Per point: the step, the mean over seeds of the training seconds and of the accuracy."""
    return [
        {
            "step": curves[0][i]["step"],
            "train_s": round(sum(c[i]["train_s"] for c in curves) / len(curves), 1),
            "accuracy": round(sum(accuracy(c[i]["grades"]) for c in curves) / len(curves), 4),
        }
        for i in range(min(len(c) for c in curves))
    ]
