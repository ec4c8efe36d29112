"""The plumbing of every algorithm's run: the run directory, the model directory (built from an
architecture config for offline runs), and checkpoint save/restore of the whole run state (policy,
data-loader position, step counters)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config import ConfigError, config_to_dict, save_config
from posttrain.models.policy import Policy, PolicyConfig
from posttrain.utils.checkpoint import CheckpointManager


def default_log_dir(algorithm: str) -> str:
    return f"results/{algorithm}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare_run_dir(cfg: Any, algorithm: str, metric: tuple[str, bool] = ("val_loss", False)) -> Path:
    """Fill in defaults that depend on the run (log and checkpoint directories, the checkpoint ranking
    metric and its direction), create the run directory, and save the resolved config there."""
    if not cfg.logger.log_dir:
        cfg.logger.log_dir = default_log_dir(algorithm)
    log_dir = Path(cfg.logger.log_dir)
    if not cfg.checkpointing.checkpoint_dir:
        cfg.checkpointing.checkpoint_dir = str(log_dir / "checkpoints")
    if cfg.checkpointing.metric_name == "auto":
        cfg.checkpointing.metric_name = metric[0]
    if cfg.checkpointing.higher_is_better is None:
        cfg.checkpointing.higher_is_better = metric[1]
    log_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, log_dir / "config.yaml")
    return log_dir


def resolve_model_dir(policy_cfg: PolicyConfig, log_dir: Path) -> None:
    """Offline runs: build `policy.model.from_config` into `<log_dir>/initial_model` once and point
    `policy.model_name` at it (a resumed run finds the same directory)."""
    from_config = policy_cfg.model.from_config if policy_cfg.model is not None else None
    if from_config is None:
        if not policy_cfg.model_name:
            raise ConfigError("policy.model_name", "set a model directory or hub name, or policy.model.from_config")
        return
    from posttrain.models.build import build_model_dir

    model_dir = log_dir / "initial_model"
    if not (model_dir / "config.json").exists():
        build_model_dir(from_config, model_dir)
    policy_cfg.model_name = str(model_dir)


@dataclass
class RunCheckpoint:
    """What a restored run needs besides the policy state: the step counters and the loader position."""

    path: Path
    training_info: dict[str, Any]
    loader_state: dict[str, Any]


def save_run_checkpoint(
    manager: CheckpointManager, policy: Policy, step: int, training_info: dict[str, Any],
    loader_state: dict[str, Any], run_config: Any,
) -> Path:
    """tmp_step_N: training info + config, policy (DCP, RNG of every rank), loader; then finalize."""
    path = manager.init_tmp_checkpoint(step, training_info, run_config=config_to_dict(run_config))
    policy.save_checkpoint(str(path / "policy"))
    (path / "dataloader.json").write_text(json.dumps(loader_state))
    return manager.finalize_checkpoint(path)


def restore_run(manager: CheckpointManager, policy: Policy) -> RunCheckpoint | None:
    """Remove partial checkpoints, then load the explicit `resume_from` or the latest finalized one."""
    manager.clean_partial_checkpoints()
    path = manager.get_resume_checkpoint_path()
    if path is None:
        return None
    path = Path(path)
    policy.load_checkpoint(str(path / "policy"))
    training_info = manager.load_training_info(path) or {}
    loader_file = path / "dataloader.json"
    loader_state = json.loads(loader_file.read_text()) if loader_file.exists() else {}
    print(f"resumed from {path} (step {training_info.get('step')})", file=sys.stderr)
    return RunCheckpoint(path, training_info, loader_state)
