"""Exact-match environment for the built-in tasks: reward 1 when the response equals the ground truth."""

from __future__ import annotations

from typing import Any

from posttrain.environments.reward_function import SingleTurnEnvironment


class ExactMatchEnvironment(SingleTurnEnvironment):
    """Single-turn: the response, without end-of-turn markers at its end and surrounding whitespace, must
    equal `metadata["ground_truth"]` (stripped) character for character: `092` against 092 scores 1;
    `92`, `092.`, `0 92`, `The answer is 092` score 0."""

    def score(self, answer: str | None, metadata: dict[str, Any]) -> float:
        return float(answer == str(metadata[self.ground_truth_key]).strip())
