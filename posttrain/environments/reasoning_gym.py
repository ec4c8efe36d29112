"""reasoning-gym's scorer as the reward (`env.<task>.cls: reasoning_gym`): the reply's answer (inside its last
`<answer>...</answer>` when it has one, else the whole reply) scored by the task's own `score_answer`. A reply
that contains the answer gets partial credit, len(answer) / len(reply), so validation's pass@k (threshold 1.0)
counts full marks only; `full_marks_only: true` (env kwargs) makes the reward 1 for full marks, else 0."""

from __future__ import annotations

import json
import re
from typing import Any

from posttrain.data.reasoning_gym import ENTRY_COLUMN
from posttrain.environments.single_turn import SingleTurnEnvironment

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ReasoningGymEnvironment(SingleTurnEnvironment):
    """Single turn; reward = reasoning-gym's score of the answer for the row's entry."""

    def __init__(self, full_marks_only: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.full_marks_only = full_marks_only

    def extract(self, reply: str) -> str | None:
        tagged = ANSWER_TAG.findall(reply)
        return (tagged[-1] if tagged else reply).strip()

    def score(self, answer: str | None, metadata: dict[str, Any]) -> float:
        from reasoning_gym import get_score_answer_fn

        if ENTRY_COLUMN not in metadata:
            raise KeyError(f"the row has no {ENTRY_COLUMN!r} column: use data.dataset: reasoning_gym:<task>")
        entry = json.loads(metadata[ENTRY_COLUMN])
        score = float(get_score_answer_fn(entry["metadata"]["source_dataset"])(answer, entry))
        return float(score == 1.0) if self.full_marks_only else score
