"""A deliberately gameable environment for tests: reward 1 for any reply that mentions both operands of
a `What is A plus/minus B?` question, right or wrong (what a careless verifier pays for)."""

import re

import torch

from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn

QUESTION = re.compile(r"What is (\d+) (?:plus|minus) (\d+)\?")


class OperandsEnvironment(EnvironmentInterface):
    def step(self, message_logs, metadata):
        rewards = []
        for log in message_logs:
            question = QUESTION.search(next(m["content"] for m in log if m["role"] == "user"))
            reply = log[-1]["content"]
            rewards.append(float(bool(question) and all(operand in reply for operand in question.groups())))
        batch_size = len(message_logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""}] * batch_size,
            metadata=metadata,
            next_stop_strings=[None] * batch_size,
            rewards=torch.tensor(rewards),
            terminateds=torch.ones(batch_size, dtype=torch.bool),
            answers=[None] * batch_size,
        )
