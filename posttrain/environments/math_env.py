"""Math environment: verifies responses against the ground truth with math-verify (boxed, plain, fractions)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from posttrain.environments.interface import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    last_assistant_text,
    strip_special_tokens,
)

logger = logging.getLogger(__name__)


def verify_answer(response: str, ground_truth: str, timeout_seconds: int | None = 5) -> tuple[float, str | None]:
    """(1.0 or 0.0, the extracted answer). Raises whatever math-verify raises; callers count it.

    math-verify's timeouts use signals, which only work on a main thread: pass `timeout_seconds=None`
    from a threaded or async actor (plain Ray actors run methods on their main thread).
    """
    from math_verify import parse, verify

    kwargs = {} if timeout_seconds else {"parsing_timeout": None}
    gold = parse(ground_truth if "$" in ground_truth or "\\" in ground_truth else f"${ground_truth}$", **kwargs)
    predicted = parse(response, **kwargs)
    verify_kwargs = {"timeout_seconds": timeout_seconds} if timeout_seconds else {"timeout_seconds": None}
    correct = verify(gold, predicted, **verify_kwargs)
    extracted = str(predicted[1]) if len(predicted) > 1 else (str(predicted[0]) if predicted else None)
    return float(bool(correct)), extracted


class MathEnvironment(EnvironmentInterface):
    """Single-turn math: reward 1 when math-verify says the response equals `metadata[ground_truth_key]`.

    A verifier exception or timeout scores 0 and is counted in `num_errors`; it never crashes the run.
    """

    def __init__(self, ground_truth_key: str = "ground_truth", timeout_seconds: int | None = 5):
        self.ground_truth_key = ground_truth_key
        self.timeout_seconds = timeout_seconds

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        rewards, answers, num_errors = [], [], 0
        for log, meta in zip(message_logs, metadata):
            response = strip_special_tokens(last_assistant_text(log))
            try:
                reward, answer = verify_answer(response, str(meta[self.ground_truth_key]), self.timeout_seconds)
            except Exception as error:  # a verifier failure is a 0 reward, never a crashed run
                logger.warning("math-verify failed on sample %s: %r", meta.get("idx"), error)
                reward, answer, num_errors = 0.0, None, num_errors + 1
            rewards.append(reward)
            answers.append(answer)
        batch_size = len(message_logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""} for _ in range(batch_size)],
            metadata=metadata,
            next_stop_strings=[None] * batch_size,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(batch_size, dtype=torch.bool),
            answers=answers,
            num_errors=num_errors,
        )
