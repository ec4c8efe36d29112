"""Rewards are checked where they enter a run: every reward a finite float inside its environment's range
(`check_reward`, the one rule), every flag a real boolean (`parse_flag`), or that sample scores 0 and counts
as an environment error naming the environment and the sample; `step_isolated` scores a batch so that one
sample's failure costs that sample alone."""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from typing import Any

import torch

from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn, Message, Turn

log = logging.getLogger(__name__)

DEFAULT_REWARD_RANGE = EnvironmentInterface.reward_range
FAILED_KEY = "failed_samples"  # EnvironmentReturn.extra[FAILED_KEY]: per sample, True where scoring failed


class RewardError(ValueError):
    """A reward or flag that is not what the protocol allows; its message names the source and sample."""


def sample_name(metadata: dict[str, Any] | Any, position: int) -> str:
    """How errors name a sample: its dataset `idx` when the metadata has one, else its batch position."""
    if isinstance(metadata, dict) and "idx" in metadata:
        return f"sample idx={metadata['idx']}"
    return f"sample {position} of the batch"


def check_reward(
    value: Any, source: str, sample: str, reward_range: tuple[float, float] = DEFAULT_REWARD_RANGE
) -> float:
    """`value` as a float if it is a real number (an int, a float, a numpy scalar or a 0-d tensor; not a
    bool, not a string), finite and within `reward_range` (inclusive); else RewardError naming source and
    sample. The one rule for every reward; a Python reward function's bool is made 0.0 or 1.0 first."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(f"{source}, {sample}: reward {value!r} is a {type(value).__name__}, not a number")
    low, high = reward_range
    if not math.isfinite(value) or not low <= value <= high:
        raise RewardError(f"{source}, {sample}: reward {value!r} is not a finite number in [{low}, {high}]")
    return float(value)


def parse_flag(value: Any, name: str, source: str, sample: str) -> bool:
    """`value` if it is a JSON boolean; RewardError for anything else ("false", 0, null, ...)."""
    if not isinstance(value, bool):
        raise RewardError(f"{source}, {sample}: {name} must be true or false, got {value!r}")
    return value


def checked_return(
    answer: EnvironmentReturn,
    source: str,
    metadata: list[dict[str, Any]],
    reward_range: tuple[float, float] = DEFAULT_REWARD_RANGE,
) -> EnvironmentReturn:
    """`answer` with every reward that fails `check_reward` replaced by 0, its episode ended and counted in
    `num_errors` (logged with the source and sample); an answer whose rewards are not one number per
    sample is replaced by a failed answer for the whole batch."""
    rewards = answer.rewards
    if not isinstance(rewards, torch.Tensor) or rewards.shape != (len(metadata),):
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        log.warning("%s: rewards of shape %s for %d samples; all score 0", source, shape, len(metadata))
        return failed_return(metadata, f"{source}: rewards of shape {shape}")
    fixed, terminateds = rewards.float().clone(), answer.terminateds.clone()
    failed = list(answer.extra.get(FAILED_KEY, [False] * len(metadata)))
    bad = 0
    for position, value in enumerate(rewards.tolist()):
        try:
            check_reward(value, source, sample_name(metadata[position], position), reward_range)
        except RewardError as error:
            log.warning("%s; it scores 0 and counts as an environment error", error)
            fixed[position], terminateds[position], failed[position] = 0.0, True, True
            bad += 1
    if not bad:
        return answer
    extra = {**answer.extra, FAILED_KEY: failed}
    return dataclasses.replace(
        answer, rewards=fixed, terminateds=terminateds, num_errors=answer.num_errors + bad, extra=extra
    )


def failed_return(metadata: list[dict[str, Any]], reason: str = "") -> EnvironmentReturn:
    """The answer for samples that could not be scored: reward 0, ended, each counted as an error."""
    content = f"environment error: {reason}" if reason else ""
    observation = {"role": "environment", "content": content}
    turns = [Turn(dict(observation), dict(meta), terminated=True, error=content) for meta in metadata]
    return dataclasses.replace(EnvironmentReturn.from_turns(turns), extra={FAILED_KEY: [True] * len(turns)})


def step_isolated(
    environment: EnvironmentInterface,
    message_logs: list[list[Message]],
    metadata: list[dict[str, Any]],
    source: str,
) -> EnvironmentReturn:
    """`environment.step` on the batch, its rewards checked (`checked_return`, with the environment's
    `reward_range`). When the batched call raises, each sample is scored alone, so that only the samples
    whose own scoring raises score 0 (counted as errors, logged with source and sample)."""
    try:
        answer = environment.step(message_logs, metadata)
        return checked_return(answer, source, metadata, environment.reward_range)
    except Exception as error:
        if len(message_logs) == 1:
            log.warning("%s, %s: scoring raised %r; it scores 0", source, sample_name(metadata[0], 0), error)
            return failed_return(metadata, f"{source}: {type(error).__name__}: {error}")
        log.warning(
            "%s raised on a batch of %d (%r); scoring each sample alone", source, len(metadata), error
        )
    parts = [step_isolated(environment, [log_], [meta], source) for log_, meta in zip(message_logs, metadata)]
    return merge_returns(parts)


def merge_returns(parts: list[EnvironmentReturn]) -> EnvironmentReturn:
    """Concatenate returns in order (counts summed by name, the failed-sample flags joined)."""
    failed = [f for p in parts for f in p.extra.get(FAILED_KEY, [False] * len(p.metadata))]
    return EnvironmentReturn(
        observations=[o for p in parts for o in p.observations],
        metadata=[m for p in parts for m in p.metadata],
        next_stop_strings=[s for p in parts for s in p.next_stop_strings],
        rewards=torch.cat([p.rewards.float() for p in parts]) if parts else torch.zeros(0),
        terminateds=torch.cat([p.terminateds for p in parts]) if parts else torch.zeros(0, dtype=torch.bool),
        answers=[a for p in parts for a in p.answers],
        num_errors=sum(p.num_errors for p in parts),
        counts={
            k: sum(p.counts.get(k, 0.0) for p in parts) for k in sorted({k for p in parts for k in p.counts})
        },
        extra={FAILED_KEY: failed} if any(failed) else {},
    )
