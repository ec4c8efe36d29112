"""Rewards are checked where they enter: a NaN, infinite, out-of-range or non-numeric reward, and a sample
whose scoring raises, cost that sample alone (reward 0, counted as an error naming the environment and
the sample); advantages and the loss refuse non-finite values with an error that names the rewards, not
the learning rate; a tool call nested 1000 deep costs only its own sample."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms.advantages import NonFiniteRewardError, group_relative_advantages
from posttrain.algorithms.loss import ClippedPGLoss
from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn
from posttrain.environments.reward_check import (
    FAILED_KEY,
    RewardError,
    check_reward,
    parse_flag,
    step_isolated,
)
from posttrain.environments.tool_env import ToolEnvironment


def test_check_reward_accepts_finite_numbers_in_range_and_names_the_culprit_otherwise():
    assert check_reward(1, "env x", "sample 0") == 1.0
    assert check_reward(torch.tensor(0.25), "env x", "sample 0") == 0.25
    for bad in (math.nan, math.inf, -math.inf, "nan", "1", 1e308, True, None, [1.0]):
        with pytest.raises(RewardError, match=r"env x, sample idx=7: reward"):
            check_reward(bad, "env x", "sample idx=7")
    with pytest.raises(RewardError, match=r"not a finite number in \[0.0, 1.0\]"):
        check_reward(1.5, "judge", "sample 0", (0.0, 1.0))


def test_flags_parse_strictly():
    assert parse_flag(True, "terminated", "env", "s") is True
    for bad in ("false", "true", 0, 1, None):
        with pytest.raises(RewardError, match="terminated must be true or false"):
            parse_flag(bad, "terminated", "env", "s")


class Scripted(EnvironmentInterface):
    """Reward = the float in each reply; a reply "raise" raises for the whole batch call."""

    reward_range = (-10.0, 10.0)

    def step(self, message_logs, metadata):
        texts = [log[-1]["content"] for log in message_logs]
        if "raise" in texts:
            raise IndexError("list index out of range")
        count = len(texts)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""}] * count,
            metadata=metadata,
            next_stop_strings=[None] * count,
            rewards=torch.tensor([float(t) for t in texts]),
            terminateds=torch.ones(count, dtype=torch.bool),
            answers=[None] * count,
        )


def replies(texts):
    return [[{"role": "user", "content": "q"}, {"role": "assistant", "content": t}] for t in texts]


def test_a_bad_reward_or_a_raising_sample_costs_that_sample_alone():
    """[nan, 1, inf, 11 (out of [-10, 10]), 0.5] -> [0, 1, 0, 0, 0.5] with 3 errors; a batch where one
    sample raises is scored sample by sample, so [2, raise, 3] -> [2, 0, 3] with 1 error."""
    metadata = [{"idx": i} for i in range(5)]
    result = step_isolated(Scripted(), replies(["nan", "1", "inf", "11", "0.5"]), metadata, "environment 'x'")
    assert result.rewards.tolist() == [0.0, 1.0, 0.0, 0.0, 0.5] and result.num_errors == 3
    assert result.extra[FAILED_KEY] == [True, False, True, True, False]
    result = step_isolated(Scripted(), replies(["2", "raise", "3"]), [{}, {}, {}], "environment 'x'")
    assert result.rewards.tolist() == [2.0, 0.0, 3.0] and result.num_errors == 1
    assert result.terminateds.tolist() == [True, True, True]


def test_non_finite_rewards_and_advantages_are_refused_naming_the_rewards_not_the_learning_rate():
    """The group [inf, 1, 0, 0] gave advantages [nan, -inf, -inf, -inf]; now it is an error naming
    sample 0 and the environments."""
    with pytest.raises(
        NonFiniteRewardError, match=r"samples \[0\].*environments.*not from the learning rate"
    ):
        group_relative_advantages(torch.tensor([math.inf, 1.0, 0.0, 0.0]), 4)
    data = {
        "advantages": torch.tensor([[math.nan, 1.0]]),
        "token_mask": torch.ones(1, 2),
        "prev_logprobs": torch.zeros(1, 2),
    }
    with pytest.raises(NonFiniteRewardError, match=r"advantages are NaN or infinite at samples \[0\]"):
        ClippedPGLoss()(torch.zeros(1, 2), data, 1, 2)


def test_a_tool_call_nested_1000_deep_costs_only_its_own_sample():
    """~2 KB of nested JSON raised RecursionError out of step, and the batch's correct sample scored 0;
    now the deep call is a malformed-call tool error and the other sample scores 1."""
    deep = "<tool_call>" + '{"a":' * 1000 + "1" + "}" * 1000 + "</tool_call>"
    env = ToolEnvironment(tools=["calculator"])
    result = env.step(replies([deep, "The answer is 7."]), [{"ground_truth": "7"}, {"ground_truth": "7"}])
    assert result.rewards.tolist() == [0.0, 1.0]
    assert "nested too deeply" in result.observations[0]["content"]
    assert result.counts["tool_errors"] == 1.0
