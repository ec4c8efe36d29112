"""Math environment: grades the answer a reply commits to (the last `\\boxed{}`, else the answer stated last)
against the ground truth; what is graded, with examples, is in `posttrain.environments.answers`."""

from __future__ import annotations

from typing import Any

from posttrain.environments.answers import final_answer, grade_answer
from posttrain.environments.reward_function import SingleTurnEnvironment


class MathEnvironment(SingleTurnEnvironment):
    """Single-turn math: reward 1 when the reply's final answer (`answers.final_answer`) equals
    `metadata[ground_truth_key]` (`answers.grade_answer`); a verifier exception or timeout scores 0 and is
    counted in `num_errors`."""

    def __init__(self, ground_truth_key: str = "ground_truth", timeout_seconds: int | None = 5):
        super().__init__(ground_truth_key)
        self.timeout_seconds = timeout_seconds

    def extract(self, reply: str) -> str | None:
        return final_answer(reply)

    def score(self, answer: str | None, metadata: dict[str, Any]) -> float:
        return grade_answer(answer, str(metadata[self.ground_truth_key]), self.timeout_seconds)
