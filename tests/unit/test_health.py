"""Learning-health signals and warnings on hand-made steps."""

import pytest
import torch

from posttrain.algorithms.health import HealthConfig, HealthMonitor, step_signals, zero_signal_share


def signals(zero_share=0.2, entropy=0.5, length=10.0, truncation=0.0, reward=0.5):
    return {
        "reward_mean": reward,
        "zero_signal_share": zero_share,
        "entropy": entropy,
        "clip_fraction": 0.0,
        "mean_reply_length": length,
        "truncation_rate": truncation,
    }


def test_zero_signal_share_counts_groups_whose_rewards_are_all_equal():
    """Groups of 4: [1,1,1,1] and [0,0,0,0] have no signal, [1,0,0,0] has: 2 of 3."""
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0])
    assert zero_signal_share(rewards, 4) == pytest.approx(2 / 3)


def test_step_signals_take_the_loss_and_rollout_metrics_and_kl_only_when_measured():
    train = {"approx_entropy": 0.7, "clip_fraction": 0.05, "kl_penalty": 0.01}
    rollout = {"mean_generated_length": 12.5, "truncation_rate": 0.25}
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    measured = step_signals(rewards, 2, train, rollout, kl_measured=True)
    assert measured == {
        "reward_mean": 0.75,
        "zero_signal_share": 0.5,
        "entropy": 0.7,
        "clip_fraction": 0.05,
        "mean_reply_length": 12.5,
        "truncation_rate": 0.25,
        "kl_to_start": 0.01,
    }
    assert "kl_to_start" not in step_signals(rewards, 2, train, rollout, kl_measured=False)


def test_a_batch_whose_groups_all_share_one_reward_warns_of_a_stall_after_stall_steps():
    monitor = HealthMonitor(HealthConfig(stall_steps=3))
    assert monitor.observe(1, signals(zero_share=1.0)) == []
    assert monitor.observe(2, signals(zero_share=1.0)) == []
    (warning,) = monitor.observe(3, signals(zero_share=1.0))
    assert warning.startswith("step 3: learning has stalled") and "since step 1" in warning
    assert monitor.observe(4, signals(zero_share=1.0)) == []  # once per episode
    assert monitor.observe(5, signals(zero_share=0.5)) == []  # cleared
    assert monitor.observe(6, signals(zero_share=0.95)) == []
    assert monitor.observe(7, signals(zero_share=0.95)) == []
    assert "since step 6" in monitor.observe(8, signals(zero_share=0.95))[0]


def test_a_collapsing_entropy_warns_once_it_falls_below_the_ratio_of_the_first_step():
    monitor = HealthMonitor(HealthConfig(entropy_collapse_ratio=0.1))
    assert monitor.observe(1, signals(entropy=0.8)) == []
    assert monitor.observe(2, signals(entropy=0.081)) == []  # 0.081 > 0.08
    (warning,) = monitor.observe(3, signals(entropy=0.05))
    assert warning.startswith("step 3: the policy's entropy collapsed") and "0.0500" in warning


def test_a_runaway_length_warns_only_when_replies_also_hit_the_budget():
    monitor = HealthMonitor(HealthConfig(length_growth_ratio=2.0, runaway_truncation_rate=0.5))
    assert monitor.observe(1, signals(length=10.0)) == []
    assert monitor.observe(2, signals(length=25.0, truncation=0.1)) == []  # long, but not cut
    (warning,) = monitor.observe(3, signals(length=25.0, truncation=0.6))
    assert warning.startswith("step 3: the replies run away") and "25.0" in warning


def test_a_falling_reward_warns_when_its_recent_mean_drops_below_the_ratio_of_the_first():
    """Window 3: first mean (0.6 + 0.7 + 0.5) / 3 = 0.6; the warning needs a recent mean below 0.3."""
    monitor = HealthMonitor(HealthConfig(reward_window=3, reward_drop_ratio=0.5))
    rewards = [0.6, 0.7, 0.5, 0.4, 0.3, 0.25, 0.3, 0.2]  # recent means: 0.533, 0.4, 0.317, 0.283 (step 7)
    raised = {i + 1: monitor.observe(i + 1, signals(reward=r)) for i, r in enumerate(rewards)}
    assert all(raised[s] == [] for s in range(1, 7))
    (warning,) = raised[7]
    assert (
        warning.startswith("step 7: the training reward fell") and "0.283" in warning and "0.600" in warning
    )
    assert raised[8] == []


def test_a_healthy_run_raises_no_warning():
    monitor = HealthMonitor(HealthConfig())
    steps = [signals(zero_share=0.4 - 0.02 * i, entropy=0.5 - 0.01 * i, length=10 + i) for i in range(20)]
    assert [w for i, s in enumerate(steps) for w in monitor.observe(i + 1, s)] == []


@pytest.mark.parametrize(
    "key, value",
    [
        ("stall_zero_signal_share", 1.5),
        ("stall_steps", 0),
        ("length_growth_ratio", 0.5),
        ("reward_drop_ratio", 2.0),
        ("reward_window", 0),
    ],
)
def test_thresholds_out_of_range_are_config_errors(key, value):
    with pytest.raises(ValueError, match=key):
        HealthConfig(**{key: value}).validate()
