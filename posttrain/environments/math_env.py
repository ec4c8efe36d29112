"""Math environment: grades the answer a reply commits to (the last `\\boxed{}`, else the answer stated last)
against the ground truth; what is graded, with examples, is in `posttrain.environments.answers`."""

from __future__ import annotations

import logging
from typing import Any

from posttrain.environments.answers import grade_reply
from posttrain.environments.interface import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    last_assistant_text,
)

logger = logging.getLogger(__name__)


class MathEnvironment(EnvironmentInterface):
    """Single-turn math: reward 1 when the reply's final answer equals `metadata[ground_truth_key]`.

    Only the answer the reply commits to is graded (`answers.final_answer`): `59 + 63 = 122` and
    `\\boxed{122}` score 1 against 122; `59 + 63 = ?`, the restated question, `122 or 123` score 0.
    Numbers compare exactly (`0.5`, `1/2`, `\\frac{1}{2}` match); other answers through math-verify.
    A verifier exception or timeout scores 0 and is counted in `num_errors`; it never crashes the run.
    """

    ground_truth_kwarg = "ground_truth_key"

    def __init__(self, ground_truth_key: str = "ground_truth", timeout_seconds: int | None = 5):
        self.ground_truth_key = ground_truth_key
        self.timeout_seconds = timeout_seconds

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        rewards, answers, num_errors = [], [], 0
        for log, meta in zip(message_logs, metadata):
            try:
                reward, answer = grade_reply(
                    last_assistant_text(log), str(meta[self.ground_truth_key]), self.timeout_seconds
                )
            except Exception as error:  # a verifier failure is a 0 reward, never a crashed run
                logger.warning("grading failed on sample %s: %r", meta.get("idx"), error)
                reward, answer, num_errors = 0.0, None, num_errors + 1
            rewards.append(reward)
            answers.append(answer)
        return EnvironmentReturn.final(metadata, rewards, answers, num_errors)
