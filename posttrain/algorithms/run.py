"""The plumbing every algorithm's loop calls: the config sections every training command has, the run
directory, the model directory (built from an architecture config for offline runs), checkpoint
save/restore of the whole run state (policy, data-loader position, step counters), and the end of a step
(log its metrics and stage times; checkpoint when due)."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from posttrain.algorithms.checks import check_model_exists, missing_run_files
from posttrain.config import ConfigError, config_to_dict, save_config
from posttrain.data import DataConfig, StatefulDataLoader
from posttrain.distributed.shared_dir import check_shared_directories
from posttrain.distributed.virtual_cluster import ClusterConfig
from posttrain.models.build import build_model_dir
from posttrain.models.gguf import gguf_model_dir
from posttrain.utils.checkpoint import CheckpointingConfig, CheckpointManager
from posttrain.utils.logger import Logger, LoggerConfig, default_log_dir, step_timing
from posttrain.utils.timer import Timer
from posttrain.workers.policy import Policy, PolicyConfig


@dataclass
class TrainingConfig:
    """The sections every training command's config has; `sft`, `dpo`, `rm` and `grpo` add their own and
    may change the defaults of `policy` and `data`."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """the trained model"""
    data: DataConfig = field(default_factory=DataConfig)
    """training and validation data"""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Ray cluster and placement"""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """logging"""
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    """checkpoints (ranked by val_loss by default, grpo's by val_accuracy)"""

    def missing_files(self) -> list[ConfigError]:
        """Missing data files and model directories, one error each (run before anything starts)."""
        return missing_run_files(self.policy, self.data)


ConfigT = TypeVar("ConfigT", bound=TrainingConfig)


def prepare_run(cfg: ConfigT, algorithm: str, metric: tuple[str, bool] = ("val_loss", False)) -> ConfigT:
    """The run's config: a copy of `cfg` (left as validated) with the values that depend on the run
    filled in (log and checkpoint directories, the checkpoint ranking metric and its direction, the
    model directory of an offline model). Creates the run directory and saves that config there."""
    resume_from = cfg.checkpointing.resume_from
    if resume_from and not Path(resume_from).is_dir():
        raise ConfigError(
            "checkpointing.resume_from", f"{resume_from} does not exist (a run's checkpoints/step_N)"
        )
    log_dir_text = cfg.logger.log_dir or default_log_dir(algorithm)
    log_dir = Path(log_dir_text)
    chosen = cfg.checkpointing
    checkpointing = dataclasses.replace(
        chosen,
        checkpoint_dir=chosen.checkpoint_dir or str(log_dir / "checkpoints"),
        metric_name=metric[0] if chosen.metric_name == "auto" else chosen.metric_name,
        higher_is_better=metric[1] if chosen.higher_is_better is None else chosen.higher_is_better,
    )
    logger = dataclasses.replace(cfg.logger, log_dir=log_dir_text)
    run_cfg = dataclasses.replace(cfg, logger=logger, checkpointing=checkpointing)
    log_dir.mkdir(parents=True, exist_ok=True)
    run_cfg = dataclasses.replace(run_cfg, policy=resolve_model_dir(cfg.policy, log_dir))
    save_config(run_cfg, log_dir / "config.yaml")
    return run_cfg


@contextmanager
def shutdown_on_error(cluster: Any) -> Iterator[None]:
    """Remove the cluster's placement group (and so every actor placed in it) when the block raises."""
    try:
        yield
    except BaseException:
        cluster.shutdown()
        raise


def check_run_directories(cfg: TrainingConfig, node_ids: list[str]) -> None:
    """The log directory (and the checkpoint directory, when checkpointing) must be the same on every node
    that runs workers: checkpoints written there are read back wherever a resumed run's workers land."""
    directories = {"logger.log_dir": cfg.logger.log_dir}
    if cfg.checkpointing.enabled:
        directories["checkpointing.checkpoint_dir"] = cfg.checkpointing.checkpoint_dir
    check_shared_directories(directories, node_ids)


def resolve_model_dir(policy_cfg: PolicyConfig, log_dir: Path) -> PolicyConfig:
    """Offline runs: build `policy.model.from_config` into `<log_dir>/initial_model` once and return the
    policy config pointing `model_name` at it (a resumed run finds the same directory); a `.gguf`
    model_name is replaced by its dequantized directory (posttrain.models.gguf)."""
    from_config = policy_cfg.model.from_config if policy_cfg.model is not None else None
    if from_config is None:
        if not policy_cfg.model_name:
            raise ConfigError(
                "policy.model_name", "set a model directory or hub name, or policy.model.from_config"
            )
        check_model_exists("policy.model_name", policy_cfg.model_name)
        if policy_cfg.tokenizer_name:
            check_model_exists("policy.tokenizer_name", policy_cfg.tokenizer_name)
        return dataclasses.replace(
            policy_cfg, model_name=gguf_model_dir(policy_cfg.model_name)
        )  # .gguf: plain

    model_dir = log_dir / "initial_model"
    if not (model_dir / "config.json").exists():
        build_model_dir(from_config, model_dir)
    return dataclasses.replace(policy_cfg, model_name=str(model_dir))


def restore_run(
    manager: CheckpointManager, models: dict[str, Policy], loader: StatefulDataLoader | None = None
) -> dict[str, Any] | None:
    """With checkpointing on: remove partial checkpoints, then load the explicit `resume_from` or the newest
    checkpoint that matches its sha256 manifest (damaged newer ones are skipped with a warning) into each
    of `models` (the policy, and a PPO critic, by directory name) and the loader. Returns its training info
    (None when nothing was restored)."""
    if not manager.enabled:
        return None
    manager.clean_partial_checkpoints()
    path = manager.get_resume_checkpoint_path()
    if path is None:
        return None
    path = Path(path)
    for name, model in models.items():
        model.load_checkpoint(str(path / name))
    if loader is not None:
        loader.load_state_dict(json.loads((path / "dataloader.json").read_text()))
    training_info = manager.load_training_info(path) or {}
    print(f"resumed from {path} (step {training_info.get('step')})", file=sys.stderr)
    return training_info


def log_step(logger: Logger, policy: Policy, metrics: dict[str, float], timer: Timer, step: int) -> None:
    """The step's metrics (`train/`) and the stage times of the driver and the policy workers (`timing/`);
    the timer restarts."""
    logger.log_metrics(metrics, step, prefix="train")
    logger.log_metrics(
        step_timing(timer, {"policy_worker": policy.get_timing_metrics()}), step, prefix="timing"
    )
    timer.reset()


def checkpoint_if_due(
    manager: CheckpointManager,
    models: dict[str, Policy],
    step: int,
    training_info: dict[str, Any],
    loader_state: dict[str, Any],
    run_config: Any,
    force: bool = False,
) -> None:
    """Save the run's state at `step` every `checkpointing.save_period` steps, or when forced (a run's
    last step); nothing when checkpointing is off. Into tmp_step_N: training info + config, each of `models`
    (the policy: DCP and the RNG of every rank; a PPO critic) in a directory of its name, loader; then
    finalize (which writes the sha256 manifest before the rename to step_N)."""
    cfg = run_config.checkpointing
    if not (cfg.enabled and (force or step % cfg.save_period == 0)):
        return
    path = manager.init_tmp_checkpoint(step, training_info, run_config=config_to_dict(run_config))
    for name, model in models.items():
        model.save_checkpoint(str(path / name), save_optimizer=manager.save_optimizer)
    (path / "dataloader.json").write_text(json.dumps(loader_state))
    manager.finalize_checkpoint(path)
