"""How metrics combine over micro-batches, data-parallel ranks and global batches, written once.

A metric named `*_min` or `*_max` is an extreme and combines by min / max. Every other metric of a loss
is a share already divided by the global batch's counts, so micro-batches and ranks combine by sum and
several global batches (optimizer steps) by mean. A loss function may name another reduction per metric
in a `metric_reductions` attribute (`metric_reductions(loss_fn)`); the training worker then uses it over
micro-batches and data-parallel ranks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


def reduction_of(key: str, reductions: Mapping[str, str] | None = None) -> str:
    """The reduction `reductions` names for `key`; else "min" for `*_min`, "max" for `*_max`, else "sum"."""
    if reductions and key in reductions:
        return reductions[key]
    if key.endswith("_min"):
        return "min"
    if key.endswith("_max"):
        return "max"
    return "sum"


_REDUCTIONS = {"sum": np.sum, "mean": np.mean, "min": np.min, "max": np.max}


def reduce_metrics(
    parts: Sequence[Mapping[str, Any]],
    reductions: Mapping[str, str] | None = None,
    default: str | None = None,
) -> dict[str, float]:
    """Each metric over the parts (micro-batches or ranks) that report it, by its own reduction (sum /
    mean / min / max): `reductions` names it per metric; the others use `default`, or without one the
    suffix rule of `reduction_of`."""
    named = {**(reductions or {}), "<default>": default or "sum"}
    _check_reductions(named, lambda name, reduction: f"unknown reduction {reduction!r} for metric {name!r}")
    values_by_key: dict[str, list[float]] = {}
    for index, metrics in enumerate(parts):
        for key, value in metrics.items():
            number = as_number(value)
            if number is None:
                raise TypeError(
                    f"part {index}: metric {key!r} is not a scalar number: {type(value).__name__}"
                )
            values_by_key.setdefault(key, []).append(number)
    return {
        key: float(_REDUCTIONS[(reductions or {}).get(key) or default or reduction_of(key)](values))
        for key, values in values_by_key.items()
    }


def metric_reductions(loss_fn: Any) -> dict[str, str]:
    """The reductions a loss names for its metrics in its `metric_reductions` attribute (metric -> "sum" /
    "mean" / "min" / "max"), checked."""
    declared = dict(loss_fn.metric_reductions)
    loss_name = type(loss_fn).__name__
    _check_reductions(
        declared, lambda name, reduction: f"{loss_name}.metric_reductions[{name!r}] = {reduction!r}"
    )
    return declared


def _check_reductions(reductions: Mapping[str, str], culprit: Callable[[str, str], str]) -> None:
    """A ValueError for the first reduction that is not sum / mean / min / max, `culprit(name, reduction)`
    naming where it was set."""
    for name, reduction in reductions.items():
        if reduction not in _REDUCTIONS:
            raise ValueError(f"{culprit(name, reduction)}; use one of {sorted(_REDUCTIONS)}")


def reduce_timing(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Stage timings across ranks: the slowest rank sets the pace, so max."""
    return reduce_metrics(per_rank, default="max")


def mean_over_steps(metrics: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Per-global-batch lists (as `Policy.train` returns them) -> one float each: the mean, or the min /
    max for `*_min` / `*_max`."""
    over_steps = {"sum": "mean", "min": "min", "max": "max"}
    return {key: float(_REDUCTIONS[over_steps[reduction_of(key)]](values)) for key, values in metrics.items()}


def single_step_metrics(metrics: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Per-global-batch lists -> floats, for a call that trained (or evaluated) exactly one global batch."""
    return {key: float(values[0]) for key, values in metrics.items()}


def as_number(value: Any) -> float | None:
    """A plain float for Python/numpy/tensor scalars and one-element arrays or tensors (bools count as 0/1);
    None for anything else."""
    if isinstance(value, (bool, int, float, np.number, np.bool_)):
        return float(value)
    size = value.numel() if hasattr(value, "numel") else getattr(value, "size", None)
    if hasattr(value, "item") and size == 1:
        return as_number(value.item())
    return None
