"""Reward functions as a user writes them, in a file of their own (loaded by path in the tests)."""


def digit_share(reply):
    """The share of the reply's characters that are digits: an untrained model already varies on it."""
    return sum(c.isdigit() for c in reply) / max(1, len(reply))


def contains_answer(reply, ground_truth):
    """1 when the ground truth appears anywhere in the reply."""
    return float(ground_truth in reply)


def batched_length(replies, ground_truth):
    """Batched: the reply's length over ten, one float per reply."""
    return [len(reply) / 10 for reply in replies]
