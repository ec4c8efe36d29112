"""A reward function for `env.<task>.reward: examples/own_reward/rewards.py:contains_answer`."""


def contains_answer(reply: str, ground_truth: str, **columns) -> float:
    """1.0 when the ground truth appears in the reply (end-of-turn markers already removed), else 0.0."""
    return float(ground_truth in reply)
