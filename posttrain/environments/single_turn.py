"""Single-turn environments whose reward is a score of the reply: the base of the plain reward function
(`reward_function`), and the built-in verifiers `math` and `exact_match`."""

from __future__ import annotations

import logging
from typing import Any

from posttrain.environments.answers import final_answer, grade_answer, strip_end_markers
from posttrain.environments.interface import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    last_assistant_text,
)

logger = logging.getLogger(__name__)


class SingleTurnEnvironment(EnvironmentInterface):
    """Single turn: each sample's answer is `extract(reply)` and its reward `score(answer, metadata)`, the
    reply being the last assistant message without end-of-turn markers. A score that raises is reward 0,
    counted in `num_errors` (the first of a batch logged), and never ends the run."""

    ground_truth_kwarg = "ground_truth_key"

    def __init__(self, ground_truth_key: str = "ground_truth") -> None:
        self.ground_truth_key = ground_truth_key
        self.name = type(self).__name__

    def extract(self, reply: str) -> str | None:
        """The answer the reply commits to (default: the whole reply)."""
        return reply

    def score(self, answer: str | None, metadata: dict[str, Any]) -> float:
        raise NotImplementedError

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        answers = [self.extract(strip_end_markers(last_assistant_text(log))) for log in message_logs]
        rewards, num_errors = self.rewards(answers, metadata)
        return EnvironmentReturn.final(metadata, rewards, answers, num_errors)

    def rewards(self, answers: list[str | None], metadata: list[dict[str, Any]]) -> tuple[list[float], int]:
        """Each sample's reward, and the number of samples whose score raised (scored 0)."""
        rewards, num_errors = [], 0
        for answer, meta in zip(answers, metadata):
            try:
                rewards.append(self.score(answer, meta))
            except Exception as error:  # a verifier's failure, a user's bug or a slow call scores 0
                if not num_errors:
                    logger.warning("%s failed on sample %s: %r", self.name, meta.get("idx"), error)
                rewards.append(0.0)
                num_errors += 1
        return rewards, num_errors


class MathEnvironment(SingleTurnEnvironment):
    """Math: reward 1 when the answer the reply commits to (`answers.final_answer`: the last `\\boxed{}`,
    else the answer stated last) equals `metadata[ground_truth_key]` (`answers.grade_answer`); a verifier
    exception or timeout scores 0 and is counted in `num_errors`."""

    def __init__(self, ground_truth_key: str = "ground_truth", timeout_seconds: int | None = 5):
        super().__init__(ground_truth_key)
        self.timeout_seconds = timeout_seconds

    def extract(self, reply: str) -> str | None:
        return final_answer(reply)

    def score(self, answer: str | None, metadata: dict[str, Any]) -> float:
        return grade_answer(answer, str(metadata[self.ground_truth_key]), self.timeout_seconds)


class ExactMatchEnvironment(SingleTurnEnvironment):
    """Exact match (the built-in tasks): the reply, without end-of-turn markers at its end and surrounding
    whitespace, must equal `metadata[ground_truth_key]` (stripped) character for character: `092` against
    092 scores 1; `92`, `092.`, `0 92`, `The answer is 092` score 0."""

    def score(self, answer: str | None, metadata: dict[str, Any]) -> float:
        return float(answer == str(metadata[self.ground_truth_key]).strip())
