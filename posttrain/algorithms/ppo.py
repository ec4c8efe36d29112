"""`posttrain ppo`: PPO with a value model, on GRPO's loop with `grpo.advantage_estimator: gae`.

The loop, the rollouts and the clipped policy loss are GRPO's (`grpo.py`); the critic, its GAE
advantages and its value loss are `critic.py`, whose docstring states the algorithm as implemented. This
command only insists on the gae estimator, so that a PPO config cannot silently run without its critic.

Run: posttrain ppo --config configs/ppo_tiny.yaml
"""

from __future__ import annotations

from typing import Any

from posttrain.algorithms.grpo import GRPOConfig, train_and_export
from posttrain.config import ConfigError, load_run_config


def main(args: Any) -> int:
    cfg = load_run_config(GRPOConfig, args)
    if cfg.grpo.advantage_estimator != "gae":
        raise ConfigError(
            "grpo.advantage_estimator",
            f"posttrain ppo trains a critic and needs 'gae', got {cfg.grpo.advantage_estimator!r} "
            "(or run posttrain grpo)",
        )
    return train_and_export(cfg)
