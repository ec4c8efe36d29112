"""Every documented API that takes a path takes a `pathlib.Path` as well as a str: config fields that hold
a path store its text (so that config.yaml stays plain YAML), and the checkpoint functions typed
`os.PathLike` take one."""

from __future__ import annotations

from pathlib import Path

import yaml

from posttrain.algorithms.sft import SFTConfig
from posttrain.config import load_typed_config, save_config, validate_config
from posttrain.utils.checkpoint import CheckpointingConfig, CheckpointManager, _load_checkpoint_history
from posttrain.utils.logger import Logger, LoggerConfig

REPO = Path(__file__).resolve().parents[2]


def manager_config(directory: Path) -> dict:
    return {
        "enabled": True,
        "checkpoint_dir": directory,
        "metric_name": "val_loss",
        "higher_is_better": False,
        "keep_top_k": 1,
    }


def test_a_checkpoint_manager_takes_a_path_and_its_methods_take_paths(tmp_path):
    manager = CheckpointManager(manager_config(tmp_path / "checkpoints"))
    assert manager.config.checkpoint_dir == str(tmp_path / "checkpoints")
    for step, loss in ((1, 0.5), (2, 0.7)):
        tmp = manager.init_tmp_checkpoint(step, {"val_loss": loss}, run_config={"step": step})
        manager.finalize_checkpoint(Path(tmp))
    best, latest = manager.get_best_checkpoint_path(), manager.get_latest_checkpoint_path()
    assert (Path(best).name, Path(latest).name) == ("step_1", "step_2")  # top-1 kept, the latest beside it
    assert manager.load_training_info(Path(best)) == {"val_loss": 0.5}
    assert manager.load_training_info(None) is None
    history = _load_checkpoint_history(tmp_path / "checkpoints")
    assert [(step, info) for step, _, info in history] == [(1, {"val_loss": 0.5}), (2, {"val_loss": 0.7})]


def test_a_typed_checkpointing_config_takes_a_path(tmp_path):
    config = validate_config(CheckpointingConfig, manager_config(tmp_path))
    assert config.checkpoint_dir == str(tmp_path)
    assert CheckpointManager(config).checkpoint_dir == tmp_path


def test_a_logger_takes_a_path_as_its_log_dir(tmp_path):
    logger = Logger({"log_dir": tmp_path / "logs", "tensorboard_enabled": False, "wandb_enabled": False})
    logger.log_metrics({"loss": 1.5}, step=3)
    logger.finish()
    assert (tmp_path / "logs" / "metrics.jsonl").read_text().count('"loss": 1.5') == 1
    assert validate_config(LoggerConfig, {"log_dir": tmp_path}).log_dir == str(tmp_path)


def test_a_run_config_loads_from_a_path_and_saves_to_one(tmp_path):
    cfg = load_typed_config(SFTConfig, REPO / "configs" / "sft_tiny.yaml")
    nested = validate_config(
        SFTConfig, {"logger": {"log_dir": tmp_path / "run"}, "checkpointing": {"checkpoint_dir": tmp_path}}
    )
    assert nested.logger.log_dir == str(tmp_path / "run") and nested.checkpointing.checkpoint_dir == str(
        tmp_path
    )
    save_config(cfg, tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["sft"]["val_period"] == cfg.sft.val_period
