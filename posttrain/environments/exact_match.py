"""Exact-match environment for the built-in tasks: reward 1 when the response equals the ground truth."""

from __future__ import annotations

from typing import Any

from posttrain.environments.answers import strip_end_markers
from posttrain.environments.interface import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    last_assistant_text,
)


class ExactMatchEnvironment(EnvironmentInterface):
    """Single-turn: the response, without end-of-turn markers at its end and surrounding whitespace, must
    equal `metadata["ground_truth"]` (stripped) character for character: `092` against 092 scores 1;
    `92`, `092.`, `0 92`, `The answer is 092` score 0."""

    ground_truth_kwarg = "ground_truth_key"

    def __init__(self, ground_truth_key: str = "ground_truth"):
        self.ground_truth_key = ground_truth_key

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        answers = [strip_end_markers(last_assistant_text(log)) for log in message_logs]
        rewards = [float(a == str(m[self.ground_truth_key]).strip()) for a, m in zip(answers, metadata)]
        return EnvironmentReturn.final(metadata, rewards, answers)
