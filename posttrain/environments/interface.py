"""The environment contract: `step(message_logs, metadata) -> EnvironmentReturn`, one call per turn for a
batch."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.data.tool_calls import ToolPrompt

Message = dict[str, Any]  # {"role", "content"}; in a rollout also "num_tokens" (its token count)


@dataclass
class Turn:
    """One sample's answer to one assistant turn; `error` (why it failed) makes it count in `num_errors`."""

    observation: Message
    metadata: dict[str, Any]
    reward: float = 0.0
    terminated: bool = False
    answer: str | None = None
    next_stop_strings: list[str] | None = None
    counts: dict[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass
class EnvironmentReturn:
    """What an environment answers for a batch of B samples after one assistant turn."""

    observations: list[Message]  # the next message of each sample (role "environment" or "tool")
    metadata: list[dict[str, Any]]  # per-sample state carried to the next turn
    next_stop_strings: list[list[str] | None]  # stop strings for each sample's next generation
    rewards: torch.Tensor  # [B] float, reward earned by this turn
    terminateds: torch.Tensor  # [B] bool, the episode ended
    answers: list[str | None]  # the answer extracted from the response, for cons@k and logging
    num_errors: int = 0  # reward functions that raised or timed out (each scored 0)
    counts: dict[str, float] = field(default_factory=dict)  # summed over a rollout, logged as rollout/env/*
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_turns(cls, turns: list[Turn], count_names: tuple[str, ...] = ()) -> EnvironmentReturn:
        """The batch's answer from each sample's `Turn`, in order; `counts` summed by name (`count_names`
        always present)."""
        names = sorted({*count_names, *(name for turn in turns for name in turn.counts)})
        return cls(
            observations=[t.observation for t in turns],
            metadata=[t.metadata for t in turns],
            next_stop_strings=[t.next_stop_strings for t in turns],
            rewards=torch.tensor([t.reward for t in turns], dtype=torch.float32),
            terminateds=torch.tensor([t.terminated for t in turns], dtype=torch.bool),
            answers=[t.answer for t in turns],
            num_errors=sum(t.error is not None for t in turns),
            counts={name: float(sum(t.counts.get(name, 0) for t in turns)) for name in names},
        )

    @classmethod
    def final(
        cls,
        metadata: list[dict[str, Any]],
        rewards: list[float] | torch.Tensor,
        answers: list[str | None] | None = None,
        num_errors: int = 0,
    ) -> EnvironmentReturn:
        """A single-turn answer: every episode ends with its reward, with no observation to add."""
        answer = cls.from_turns(
            [Turn({"role": "environment", "content": ""}, m, terminated=True) for m in metadata]
        )
        answer.rewards, answer.num_errors = torch.as_tensor(rewards, dtype=torch.float32), num_errors
        answer.answers = answer.answers if answers is None else answers
        return answer


class EnvironmentInterface(abc.ABC):
    """An environment scores (and may answer) the last assistant message of each conversation."""

    # The rewards this environment may give, inclusive: a reward outside (or NaN/inf) scores 0 and counts
    # as an environment error (`reward_check.checked_return`). Environments declare tighter ranges.
    reward_range: tuple[float, float] = (-1e6, 1e6)
    # An environment that grades against the row's answer names its keyword argument for the answer's
    # metadata key (default "ground_truth"): every row of its tasks must then have an answer.
    ground_truth_kwarg: str | None = None

    @classmethod
    def required_columns(cls, kwargs: dict[str, Any]) -> set[str]:
        """The metadata keys (row columns; `ground_truth` is the answer column) that every row of a task of
        this environment, built with `kwargs`, must have; checked before a run starts."""
        if cls.ground_truth_kwarg is None:
            return set()
        return {kwargs.get(cls.ground_truth_kwarg, "ground_truth")}

    @classmethod
    def tool_prompt(cls, kwargs: dict[str, Any]) -> ToolPrompt | None:
        """The tools this environment (built with `kwargs`) declares in its tasks' prompts (default: none)."""
        return None

    @abc.abstractmethod
    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        """Score one turn: `message_logs[i]` ends with the assistant's latest message."""


def last_assistant_text(message_log: list[Message]) -> str:
    """The content of the last assistant message ('' when there is none)."""
    for message in reversed(message_log):
        if message["role"] == "assistant":
            return message["content"]
    return ""
