"""`posttrain distill`: on-policy distillation, on GRPO's loop with
`grpo.advantage_estimator: on_policy_distillation`.

The loop, the rollouts and the clipped policy loss are GRPO's (`grpo.py`); the teacher and the
per-token advantage log pi_teacher - log pi_student are `teacher.py` and `advantages.py`, whose
docstrings state the algorithm as implemented. This command only insists on that estimator, so that a
distillation config cannot silently run without its teacher.

Run: posttrain distill --config configs/distill_tiny.yaml
"""

from __future__ import annotations

from typing import Any

from posttrain.algorithms.grpo import GRPOConfig, train_and_export
from posttrain.config import ConfigError, load_run_config


def main(args: Any) -> int:
    cfg = load_run_config(GRPOConfig, args)
    if cfg.grpo.advantage_estimator != "on_policy_distillation":
        raise ConfigError(
            "grpo.advantage_estimator",
            "posttrain distill scores the student's samples with a teacher and needs "
            f"'on_policy_distillation', got {cfg.grpo.advantage_estimator!r} (or run posttrain grpo)",
        )
    return train_and_export(cfg)
