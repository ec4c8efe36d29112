"""REINFORCE++ and Dr. GRPO advantages against hand-derived numbers, and GRPO's choice among the
estimators. Rewards [1, 0, 0 | 1, 1, 1]: two groups of three."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms import advantages as adv
from posttrain.algorithms.grpo import GRPOConfig, GRPOLoopConfig, compute_advantages
from posttrain.algorithms.loss import ClippedPGLossConfig
from posttrain.config import ConfigError

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])


def test_reinforce_pp_normalises_over_the_batch():
    """Batch mean 4/6 = 2/3; deviations 1/3 and -2/3; Bessel variance (4 x 1/9 + 2 x 4/9) / 5 = 4/15, std
    0.516398: A = 1/3 / 0.516398 = 0.645497 and -2/3 / 0.516398 = -1.290994. The all-correct group is not
    zeroed: its samples are better than the batch."""
    std = math.sqrt(4 / 15)
    expected = [1 / 3 / std, -2 / 3 / std, -2 / 3 / std, 1 / 3 / std, 1 / 3 / std, 1 / 3 / std]
    assert adv.reinforce_pp_advantages(REWARDS, 3).tolist() == pytest.approx(expected, rel=1e-5)


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_normalises_over_the_batch():
    """Group means 1/3 and 1: centred [2/3, -1/3, -1/3, 0, 0, 0] (batch mean 0); Bessel variance
    (4/9 + 1/9 + 1/9) / 5 = 2/15, std 0.365148: A = [1.825742, -0.912871, -0.912871, 0, 0, 0]. GRPO's
    per-group std (sqrt(1/3) = 0.57735) would give 1.1547 and -0.57735 instead."""
    std = math.sqrt(2 / 15)
    expected = [2 / 3 / std, -1 / 3 / std, -1 / 3 / std, 0.0, 0.0, 0.0]
    assert adv.reinforce_pp_advantages(REWARDS, 3, group_baseline=True).tolist() == pytest.approx(
        expected, rel=1e-5
    )
    grpo = adv.group_relative_advantages(REWARDS, 3).tolist()
    root = math.sqrt(1 / 3)
    assert grpo[:3] == pytest.approx([2 / 3 / root, -1 / 3 / root, -1 / 3 / root], rel=1e-5)


def test_a_batch_without_signal_gets_zero_advantages():
    assert adv.reinforce_pp_advantages(torch.ones(6), 3).tolist() == [0.0] * 6
    assert (
        adv.reinforce_pp_advantages(torch.tensor([1.0, 1, 1, 0, 0, 0]), 3, group_baseline=True).tolist()
        == [0.0] * 6
    )


def test_dr_grpo_subtracts_the_group_mean_without_dividing_by_its_std():
    """[2/3, -1/3, -1/3, 0, 0, 0]: the group mean off, nothing divided."""
    assert adv.dr_grpo_advantages(REWARDS, 3).tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])


@pytest.mark.parametrize(
    "estimator,expected",
    [
        ("grpo", adv.group_relative_advantages(REWARDS, 3)),
        ("reinforce_pp", adv.reinforce_pp_advantages(REWARDS, 3)),
        ("reinforce_pp_baseline", adv.reinforce_pp_advantages(REWARDS, 3, group_baseline=True)),
        ("dr_grpo", adv.dr_grpo_advantages(REWARDS, 3)),
    ],
)
def test_grpo_uses_the_configured_estimator(estimator, expected):
    cfg = GRPOLoopConfig(num_generations_per_prompt=3, advantage_estimator=estimator)
    torch.testing.assert_close(compute_advantages(cfg, REWARDS), expected)


def test_dr_grpo_without_its_loss_normaliser_is_a_config_error_naming_the_key():
    cfg = GRPOConfig(grpo=GRPOLoopConfig(advantage_estimator="dr_grpo"))
    with pytest.raises(ConfigError, match="loss.constant_length_normalizer"):
        cfg.validate()
    GRPOConfig(
        grpo=GRPOLoopConfig(advantage_estimator="dr_grpo"),
        loss=ClippedPGLossConfig(constant_length_normalizer=64),
    ).validate()
