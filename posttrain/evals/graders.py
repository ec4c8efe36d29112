"""Strict graders of validation replies, kept beside the environment's reward so that a reward the
policy has learned to game shows up as a gap between the two.

A grader is a plain function `grader(sample) -> 1.0 | 0.0 | None` of one validation sample (the dict
`run_validation` makes: `prompt`, `response`, `reward`, `answer`, `ground_truth`, ...); None means "cannot
grade this sample" (it is left out of the strict accuracy). `resolve_grader` takes a built-in name or a
user's function as `path/to/file.py:function` or `package.module:function`, or a name given to
`register_grader` from Python."""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from posttrain.config import ConfigError
from posttrain.environments.answers import parse_number, strip_end_markers
from posttrain.utils.imports import import_attribute

log = logging.getLogger(__name__)
Grader = Callable[[dict[str, Any]], "float | None"]

_NUMBER = re.compile(r"[+\-\u2212]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def final_number(sample: dict[str, Any]) -> float | None:
    """1.0 when the last number in the reply equals the ground truth, else 0.0; None when the ground truth
    is not a number. `59 + 63 = 122` -> 1 and `59 + 63 = ?` -> 0 (its last number is 63) for 122. The
    reply of a multi-turn episode is its last assistant turn (`final_response`): not a tool's result."""
    gold = parse_number(str(sample.get("ground_truth", "")))
    if gold is None:
        return None
    reply = sample["final_response"] if "final_response" in sample else sample["response"]
    numbers = _NUMBER.findall(strip_end_markers(reply))
    return float(bool(numbers) and parse_number(numbers[-1]) == gold)


BUILTIN_GRADERS: dict[str, Grader] = {"final_number": final_number}
_REGISTERED: dict[str, Grader] = {}


def register_grader(function: Grader, name: str | None = None) -> str:
    """Make `function` available as `grpo.validation.grader` / `eval.grader: <name>` (default: its
    `__name__`); returns the name. Graders run on the driver, so no actor needs to import it."""
    if not callable(function):
        raise TypeError(f"register_grader: {function!r} is not a function")
    name = name or function.__name__
    _REGISTERED[name] = function
    return name


def resolve_grader(spec: str | None) -> Grader | None:
    """The grader for a built-in name or an import spec (None: no strict grading)."""
    if spec is None:
        return None
    if spec in BUILTIN_GRADERS or spec in _REGISTERED:
        return BUILTIN_GRADERS.get(spec) or _REGISTERED[spec]
    if ":" not in spec:
        raise KeyError(
            f"unknown grader {spec!r}; built-in: {sorted(BUILTIN_GRADERS)}, "
            f"registered: {sorted(_REGISTERED)} "
            "(or file.py:function)"
        )
    grader = import_attribute(spec, kind="grader")
    if not callable(grader):
        raise TypeError(f"grader {spec!r} is not a function")
    return grader


def grader_problems(key: str, spec: str | None) -> list[ConfigError]:
    """An error naming `key` when the grader `spec` cannot be loaded (a missing file or function)."""
    try:
        resolve_grader(spec)
    except (ImportError, OSError, AttributeError, KeyError, TypeError, SyntaxError) as error:
        return [ConfigError(key, error.args[0] if isinstance(error, KeyError) else str(error))]
    return []


def strict_grades(samples: list[dict[str, Any]], grader: Grader) -> dict[str, float]:
    """Grade every sample in place (`strict_grade`, None where the grader cannot) and summarise them. A
    grader that raises leaves the sample ungraded; the failures are counted (`num_strict_errors`) and the
    first is logged with its sample."""
    num_errors = 0
    for sample in samples:
        try:
            grade = grader(sample)
        except Exception as error:  # a validation grader's bug must not end the training run
            if not num_errors:
                log.warning(
                    "grader %s failed on sample idx %s: %r",
                    getattr(grader, "__name__", grader),
                    sample.get("idx"),
                    error,
                )
            grade, num_errors = None, num_errors + 1
        sample["strict_grade"] = None if grade is None else float(grade)
    summary = summarize_strict_grades(samples)
    if num_errors:
        summary["num_strict_errors"] = float(num_errors)
    return summary


def summarize_strict_grades(samples: list[dict[str, Any]]) -> dict[str, float]:
    """`strict_accuracy` and `reward_gap` (mean reward minus mean strict grade) over the graded samples."""
    graded = [s for s in samples if s.get("strict_grade") is not None]
    if not graded:
        return {"num_strict_graded": 0.0}
    strict = sum(s["strict_grade"] for s in graded) / len(graded)
    reward = sum(s["reward"] for s in graded) / len(graded)
    return {"strict_accuracy": strict, "reward_gap": reward - strict, "num_strict_graded": float(len(graded))}


def reward_hacking_warning(
    metrics: dict[str, float], samples: list[dict[str, Any]], max_gap: float
) -> str | None:
    """A warning naming one sample when the reward runs ahead of the strict grade by more than `max_gap`."""
    gap = metrics.get("reward_gap")
    if gap is None or gap <= max_gap:
        return None
    graded = [s for s in samples if s.get("strict_grade") is not None]
    sample = max(graded, key=lambda s: s["reward"] - s["strict_grade"])
    return (
        f"validation reward {metrics['strict_accuracy'] + gap:.3f} runs ahead of the strict grade "
        f"{metrics['strict_accuracy']:.3f} by {gap:.3f} (> {max_gap}): the policy may be gaming its reward. "
        f"Sample idx {sample.get('idx')}: prompt {sample['prompt'][-120:]!r} -> reply "
        f"{sample['response'][:120]!r}, reward {sample['reward']:.2f}, strict grade "
        f"{sample['strict_grade']:.0f} (ground truth {sample.get('ground_truth')!r})"
    )
