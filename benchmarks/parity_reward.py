"""The one reward both arms of benchmarks/grpo_parity.py train on: posttrain as a reward function
(`env.math.reward: benchmarks/parity_reward.py:last_number_matches`), TRL through `trl_grpo.py`. Plain
Python, so that the TRL environment, which has no posttrain, imports it too."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def last_number_matches(reply: str, ground_truth: str) -> float:
    """1.0 when the last integer in the reply equals the answer: `59 + 63 = 122` -> 1, `122 or 123` -> 0."""
    numbers = _NUMBER.findall(reply)
    return float(bool(numbers) and numbers[-1] == str(ground_truth).strip())
