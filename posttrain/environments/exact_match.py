"""Exact-match environment for the built-in tasks: reward 1 when the response equals the ground truth."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.environments.interface import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    last_assistant_text,
    strip_special_tokens,
)


class ExactMatchEnvironment(EnvironmentInterface):
    """Single-turn: the stripped response must equal `metadata["ground_truth"]` exactly."""

    def __init__(self, ground_truth_key: str = "ground_truth"):
        self.ground_truth_key = ground_truth_key

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        answers = [strip_special_tokens(last_assistant_text(log)) for log in message_logs]
        rewards = [float(a == str(m[self.ground_truth_key]).strip()) for a, m in zip(answers, metadata)]
        batch_size = len(message_logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""} for _ in range(batch_size)],
            metadata=metadata,
            next_stop_strings=[None] * batch_size,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(batch_size, dtype=torch.bool),
            answers=answers,
        )
