"""A plain reward function as an environment: `env.<task>.reward: path/to/rewards.py:fn` (or a name given
to `register_reward`). The function sees the reply text and the row's columns and returns a float:

    def reward(reply: str, ground_truth: str, **columns) -> float:
        return float(ground_truth in reply)

`reply` is the last assistant message without end-of-turn markers (`<|im_end|>`, `<eos>`, ...) and
surrounding whitespace. The row's columns arrive as keyword arguments: `ground_truth` (the answer column,
`data.answer_key`), the keys of its `metadata` column and its other columns (prompt, images, task and tools
columns excepted). A function without `**columns` receives only the columns it names; the ones it names
without a default must be in every row (checked before the run starts, naming the row). A row needs an
answer only for a reward that names `ground_truth` so. With
`env.<task>.reward_batched: true` it is called once per batch as `fn(replies, **columns)`, each column a
list, and returns a list of floats.

A call that raises, runs past `timeout_seconds`, or returns anything but a finite number scores 0 and is
counted in `num_errors` (logged as `train/rollout/env_errors`), as the built-in environments do.
"""

from __future__ import annotations

import inspect
import logging
import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from posttrain.environments.answers import strip_end_markers
from posttrain.environments.interface import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    last_assistant_text,
)
from posttrain.environments.reward_check import check_reward
from posttrain.utils.imports import import_attribute, pickle_by_value

logger = logging.getLogger(__name__)

RewardFunction = Callable[..., Any]
_REWARDS: dict[str, RewardFunction] = {}


class RewardTimeout(Exception):
    """A reward function ran past its time limit."""


def register_reward(function: RewardFunction, name: str | None = None) -> str:
    """Make `function` available as `env.<task>.reward: <name>` (default: the function's `__name__`);
    returns the name. The function itself travels to the environment actors, so it needs no import
    path there."""
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


def as_reward(value: Any, source: str = "reward function", sample: str = "a sample") -> float:
    """A reward function's answer as a float: a bool is 0.0 or 1.0, the rest follows `check_reward`."""
    return check_reward(float(value) if isinstance(value, bool) else value, source, sample)


class RewardFunctionEnvironment(EnvironmentInterface):
    """Single-turn: reward = `reward(reply, **columns)` of each sample (see the module docstring)."""

    def __init__(
        self,
        reward: RewardFunction | str,
        batched: bool = False,
        timeout_seconds: float | None = 5.0,
    ):
        self.function = resolve_reward(reward) if isinstance(reward, str) else reward
        self.name = getattr(self.function, "__name__", repr(self.function))
        self.batched, self.timeout_seconds = batched, timeout_seconds
        self.columns = accepted_columns(self.function)

    @classmethod
    def required_columns(cls, kwargs: dict[str, Any]) -> set[str]:
        reward = kwargs["reward"]
        return required_columns(resolve_reward(reward) if isinstance(reward, str) else reward)

    def _kwargs(self, metadata: dict[str, Any]) -> dict[str, Any]:
        if self.columns is None:
            return dict(metadata)
        return {k: v for k, v in metadata.items() if k in self.columns}

    def _score_one(self, reply: str, metadata: dict[str, Any]) -> float:
        with time_limit(self.timeout_seconds):
            value = self.function(reply, **self._kwargs(metadata))
        return as_reward(value, self.name, f"sample idx={metadata.get('idx')}")

    def _score_batch(self, replies: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        names = sorted({k for m in metadata for k in m})
        columns = {k: [m.get(k) for m in metadata] for k in names}
        if self.columns is not None:
            columns = {k: v for k, v in columns.items() if k in self.columns}
        with time_limit(self.timeout_seconds):
            values = self.function(replies, **columns)
        values = list(values)
        if len(values) != len(replies):
            raise ValueError(f"returned {len(values)} rewards for {len(replies)} replies")
        return [as_reward(v) for v in values]

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        replies = [strip_end_markers(last_assistant_text(log)) for log in message_logs]
        if self.batched:
            rewards, num_errors = self._batch_rewards(replies, metadata)
        else:
            rewards, num_errors = self._sample_rewards(replies, metadata)
        return EnvironmentReturn.final(metadata, rewards, replies, num_errors)

    def _sample_rewards(self, replies: list[str], metadata: list[dict[str, Any]]) -> tuple[list[float], int]:
        rewards, num_errors = [], 0
        for reply, meta in zip(replies, metadata):
            try:
                rewards.append(self._score_one(reply, meta))
            except Exception as error:  # a user's bug or a slow call scores 0, never ends the run
                if not num_errors:
                    logger.warning(
                        "reward function %s failed on sample %s: %r", self.name, meta.get("idx"), error
                    )
                rewards.append(0.0)
                num_errors += 1
        return rewards, num_errors

    def _batch_rewards(self, replies: list[str], metadata: list[dict[str, Any]]) -> tuple[list[float], int]:
        try:
            return self._score_batch(replies, metadata), 0
        except Exception as error:  # the whole batch scores 0
            logger.warning("reward function %s failed on a batch of %d: %r", self.name, len(replies), error)
            return [0.0] * len(replies), len(replies)
