"""reasoning-gym's scorer as the reward (`env.<task>.cls: reasoning_gym`): the reply's answer (inside its last
`<answer>...</answer>` when it has one, else the whole reply) scored by the task's own `score_answer`
against the row's reasoning-gym entry. Scores are in [0, 1]; partial credit (a right number in the wrong
form) is less than 1, so validation's pass@k (threshold 1.0) counts only full marks."""

from __future__ import annotations

import json
import re
from typing import Any

from posttrain.data.reasoning_gym import ENTRY_COLUMN
from posttrain.environments.single_turn import SingleTurnEnvironment

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ReasoningGymEnvironment(SingleTurnEnvironment):
    """Single turn; reward = reasoning-gym's score of the answer for the row's entry."""

    def extract(self, reply: str) -> str | None:
        tagged = ANSWER_TAG.findall(reply)
        return (tagged[-1] if tagged else reply).strip()

    def score(self, answer: str | None, metadata: dict[str, Any]) -> float:
        from reasoning_gym import get_score_answer_fn

        if ENTRY_COLUMN not in metadata:
            raise KeyError(f"the row has no {ENTRY_COLUMN!r} column: use data.dataset: reasoning_gym:<task>")
        entry = json.loads(metadata[ENTRY_COLUMN])
        return float(get_score_answer_fn(entry["metadata"]["source_dataset"])(answer, entry))
