"""Named timers for the stages of a step (`with timer.time("generation"):`), with reductions."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

REDUCTIONS = ("sum", "mean", "median", "min", "max", "std", "count")


class Timer:
    """Records every start/stop interval per name; `get_timing_metrics` reduces them."""

    def __init__(self) -> None:
        self._running: dict[str, float] = {}
        self._records: dict[str, list[float]] = {}

    def start(self, name: str) -> None:
        if name in self._running:
            raise RuntimeError(f"timer {name!r} is already running")
        self._running[name] = time.perf_counter()

    def stop(self, name: str) -> float:
        if name not in self._running:
            raise RuntimeError(f"timer {name!r} is not running")
        elapsed = time.perf_counter() - self._running.pop(name)
        self._records.setdefault(name, []).append(elapsed)
        return elapsed

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def get_latest(self, name: str) -> float:
        if not self._records.get(name):
            raise KeyError(f"timer {name!r} has no record")
        return self._records[name][-1]

    def get_timing_metrics(self, reduction: str = "sum") -> dict[str, float]:
        if reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {reduction!r}; choose one of {REDUCTIONS}")
        return {name: _reduce(values, reduction) for name, values in self._records.items() if values}

    def reset(self) -> None:
        self._records.clear()
        self._running.clear()


def _reduce(values: list[float], reduction: str) -> float:
    if reduction == "count":
        return float(len(values))
    if reduction == "std":
        return statistics.pstdev(values)
    functions = {"sum": sum, "mean": statistics.fmean, "median": statistics.median, "min": min, "max": max}
    return float(functions[reduction](values))
