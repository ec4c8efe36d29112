"""A plain reward function as an environment: `env.<task>.reward: path/to/rewards.py:fn` (or a name given
to `register_reward`). The function sees the reply text and the row's columns and returns a float:

    def reward(reply: str, ground_truth: str, **columns) -> float:
        return float(ground_truth in reply)

`reply` is the last assistant message without end-of-turn markers and surrounding whitespace. The row's
columns arrive as keyword arguments (`ground_truth` is the answer column); a function without `**columns`
receives only the columns it names, and the ones it names without a default must be in every row
(`required_columns`, checked before the run starts). With `env.<task>.reward_batched: true` it is called once
per batch as `fn(replies, **columns)`, each column a list, and returns a list of floats. A call that raises,
runs past `timeout_seconds`, or returns anything `check_reward` refuses scores 0 and is counted in
`num_errors`."""

from __future__ import annotations

import inspect
import logging
import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from posttrain.environments.reward_check import check_reward
from posttrain.environments.single_turn import SingleTurnEnvironment
from posttrain.utils.imports import import_attribute, pickle_by_value

logger = logging.getLogger(__name__)

RewardFunction = Callable[..., Any]
_REWARDS: dict[str, RewardFunction] = {}


class RewardTimeout(Exception):
    """A reward function ran past its time limit."""


def register_reward(function: RewardFunction, name: str | None = None) -> str:
    """Make `function` available as `env.<task>.reward: <name>` (default: its `__name__`) and return the
    name; the function travels to the environment actors by value, so it needs no import path there."""
    if not callable(function):
        raise TypeError(f"register_reward: {function!r} is not a function")
    name = name or function.__name__
    _REWARDS[name] = function
    pickle_by_value(function)
    return name


def resolve_reward(spec: str) -> RewardFunction:
    """The function of a registered name or of `path/to/file.py:fn` / `package.module:fn`."""
    if spec in _REWARDS:
        return _REWARDS[spec]
    if ":" not in spec:
        raise KeyError(
            f"unknown reward function {spec!r}; registered: {sorted(_REWARDS)} (or use path/to/file.py:fn)"
        )
    function = import_attribute(spec, kind="reward function")
    if not callable(function):
        raise TypeError(f"reward function {spec!r} is not callable")
    return function


def accepted_columns(function: RewardFunction) -> set[str] | None:
    """The keyword arguments `function` takes besides the reply (None: any, it has `**columns`)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: pass everything
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters[1:] if p.kind in keyword_kinds}


def required_columns(function: RewardFunction) -> set[str]:
    """The keyword arguments `function` takes besides the reply that have no default: the columns every
    row must have (`ground_truth` is the answer column)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())[1:]
    except (TypeError, ValueError):  # a builtin without a signature: nothing is known to be needed
        return set()
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.kind in keyword_kinds and p.default is inspect.Parameter.empty}


@contextmanager
def time_limit(seconds: float | None):
    """Raise RewardTimeout in the block after `seconds` (SIGALRM: on a main thread only, as in plain Ray
    actors; elsewhere, or with None, no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise RewardTimeout(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class RewardFunctionEnvironment(SingleTurnEnvironment):
    """Single-turn: reward = `reward(reply, **columns)` of each sample (see the module docstring)."""

    ground_truth_kwarg = None

    def __init__(
        self, reward: RewardFunction | str, batched: bool = False, timeout_seconds: float | None = 5.0
    ):
        self.function = resolve_reward(reward) if isinstance(reward, str) else reward
        self.name = f"reward function {getattr(self.function, '__name__', repr(self.function))}"
        self.batched, self.timeout_seconds = batched, timeout_seconds
        self.columns = accepted_columns(self.function)

    @classmethod
    def required_columns(cls, kwargs: dict[str, Any]) -> set[str]:
        reward = kwargs["reward"]
        return required_columns(resolve_reward(reward) if isinstance(reward, str) else reward)

    def _checked(self, value: Any, sample: str) -> float:
        """The function's answer through `check_reward`; a bool, a Python function's natural answer, is
        0.0 or 1.0 first."""
        return check_reward(float(value) if isinstance(value, bool) else value, self.name, sample)

    def score(self, answer: str | None, metadata: dict[str, Any]) -> float:
        kwargs = (
            metadata if self.columns is None else {k: v for k, v in metadata.items() if k in self.columns}
        )
        with time_limit(self.timeout_seconds):
            value = self.function(answer, **kwargs)
        return self._checked(value, f"sample idx={metadata.get('idx')}")

    def rewards(self, answers: list[str | None], metadata: list[dict[str, Any]]) -> tuple[list[float], int]:
        if not self.batched:
            return super().rewards(answers, metadata)
        names = {k for m in metadata for k in m}
        if self.columns is not None:
            names &= self.columns
        columns = {k: [m.get(k) for m in metadata] for k in sorted(names)}
        try:
            with time_limit(self.timeout_seconds):
                values = list(self.function(answers, **columns))
            if len(values) != len(answers):
                raise ValueError(f"returned {len(values)} rewards for {len(answers)} replies")
            return [self._checked(v, f"sample {i} of the batch") for i, v in enumerate(values)], 0
        except Exception as error:  # the whole batch scores 0
            logger.warning("%s failed on a batch of %d: %r", self.name, len(answers), error)
            return [0.0] * len(answers), len(answers)
