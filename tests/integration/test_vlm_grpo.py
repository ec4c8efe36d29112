"""GRPO of a tiny vision-language model on the red_squares pictures, end to end on real Ray workers: the
generation's and the trainer's per-token probabilities agree on every step's image rollouts, and a run
resumed from its step-2 checkpoint equals the uninterrupted run."""

from pathlib import Path

import pytest
from run_logs import as_overrides, metrics_by_step
from tiny_model import tiny_from_config

from posttrain.algorithms import grpo
from posttrain.config import load_typed_config

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "vlm_grpo_tiny.yaml")


def overrides(log_dir, **extra):
    values = {
        "logger.log_dir": str(log_dir),
        "logger.tensorboard_enabled": "false",
        "policy.model_name": "null",
        "policy.model.from_config": tiny_from_config(architecture="qwen2_vl", seed=3),
        "grpo.num_prompts_per_step": 2,
        "grpo.num_generations_per_prompt": 4,
        "grpo.max_val_samples": 4,
        "grpo.val_period": 2,
        "grpo.val_at_start": "false",
        "policy.train_global_batch_size": 4,
        "policy.train_micro_batch_size": 2,
        "policy.logprob_batch_size": 4,
        "policy.optimizer.kwargs.lr": 0.01,
        "generation.max_new_tokens": 4,
        "env.red_squares.cls": "test_grpo:DigitShareEnvironment",
        "data.num_train": 16,
        "data.num_val": 4,
        "cluster.num_cpus_per_worker": 0.5,
        "checkpointing.save_period": 2,
    }
    return as_overrides(values, extra)


def run_grpo(log_dir, **extra) -> dict[int, dict]:
    run = grpo.setup(load_typed_config(grpo.GRPOConfig, CONFIG, overrides(log_dir, **extra)))
    try:
        grpo.grpo_train(run)
    finally:
        run.shutdown()
    return metrics_by_step(log_dir)


def test_vlm_grpo_keeps_logprobs_consistent_and_resumes_exactly(ray_session, tmp_path):
    """Rewards are the share of digits in the answer (an untrained model already varies), so losses are not
    0."""
    uninterrupted = run_grpo(tmp_path / "full", **{"grpo.max_num_steps": 4})
    for step in (1, 2, 3, 4):
        assert 1.0 <= uninterrupted[step]["train/token_mult_prob_error"] <= 1.01
    assert "val/accuracy" in uninterrupted[2]
    run_grpo(tmp_path / "resumed", **{"grpo.max_num_steps": 2})
    resumed = run_grpo(tmp_path / "resumed", **{"grpo.max_num_steps": 4})  # continues from step_2
    for step in (3, 4):
        assert resumed[step]["train/reward_mean"] == uninterrupted[step]["train/reward_mean"]
        assert resumed[step]["train/loss"] == uninterrupted[step]["train/loss"]
    assert any(uninterrupted[step]["train/loss"] != 0.0 for step in (3, 4))
