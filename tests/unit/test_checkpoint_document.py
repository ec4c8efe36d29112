"""The checkpoint API behaves as its reference document (nemo_rl.utils.checkpoint) says; each test's
docstring quotes the document."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from posttrain.utils.checkpoint import (
    CheckpointingConfig,
    CheckpointManager,
    _load_checkpoint_history,
)


def make_manager(tmp_path: Path, **overrides) -> CheckpointManager:
    config = {"checkpoint_dir": str(tmp_path / "ckpt"), "metric_name": "val_loss", "higher_is_better": False}
    return CheckpointManager(config | overrides)


def save(manager: CheckpointManager, step: int, info: dict) -> str:
    tmp = manager.init_tmp_checkpoint(step, info, run_config={"seed": 1})
    (tmp / "policy").mkdir()
    (tmp / "policy" / "weights.bin").write_bytes(bytes([step]) * 16)
    assert manager.finalize_checkpoint(tmp) is None
    return str(manager.checkpoint_dir / f"step_{step}")


def test_attributes_are_derived_from_the_checkpointing_config(tmp_path):
    """ "Attributes: Derived from the CheckpointingConfig" (enabled, checkpoint_dir, metric_name,
    higher_is_better, keep_top_k)."""
    config = CheckpointingConfig(
        enabled=False,
        checkpoint_dir=str(tmp_path / "c"),
        metric_name="val_reward",
        higher_is_better=True,
        keep_top_k=3,
    )
    manager = CheckpointManager(config)
    assert manager.enabled is False
    assert manager.checkpoint_dir == tmp_path / "c"
    assert manager.metric_name == "val_reward"
    assert manager.higher_is_better is True
    assert manager.keep_top_k == 3
    assert CheckpointManager({"checkpoint_dir": str(tmp_path)}).keep_top_k is None


def test_load_training_info_of_none_returns_none(tmp_path):
    """ "checkpoint_path (Optional[os.PathLike]) - Path to the checkpoint. If None, returns None.\""""
    manager = make_manager(tmp_path)
    path = save(manager, 1, {"val_loss": 0.5})
    assert manager.load_training_info(None) is None
    assert manager.load_training_info() is None
    assert manager.load_training_info(path) == {"val_loss": 0.5}
    assert manager.load_training_info(Path(path)) == {"val_loss": 0.5}


def test_best_checkpoint_warns_and_returns_latest_when_the_metric_is_missing(tmp_path, caplog):
    """ "If no checkpoints exist, returns None. If the metric isn't found, we warn and return the latest
    checkpoint.\""""
    manager = make_manager(tmp_path, metric_name="val_reward")
    assert manager.get_best_checkpoint_path() is None
    save(manager, 1, {"val_loss": 0.1})
    latest = save(manager, 2, {"val_loss": 0.9})
    with caplog.at_level(logging.WARNING):
        assert manager.get_best_checkpoint_path() == latest
    assert "val_reward" in caplog.text


def test_paths_are_str_out_and_str_or_path_in_and_none_returns(tmp_path):
    """get_best_checkpoint_path() -> Optional[str]; get_latest_checkpoint_path() -> str ("or None if no
    checkpoints exist"); finalize_checkpoint(checkpoint_path: os.PathLike) -> None;
    remove_old_checkpoints(exclude_latest: bool = True) -> None."""
    manager = make_manager(tmp_path, keep_top_k=1)
    assert manager.get_latest_checkpoint_path() is None
    tmp = manager.init_tmp_checkpoint(1, {"val_loss": 0.2})
    assert manager.finalize_checkpoint(str(tmp)) is None  # a str in works like a Path
    save(manager, 2, {"val_loss": 0.4})
    best, latest = manager.get_best_checkpoint_path(), manager.get_latest_checkpoint_path()
    assert (type(best), type(latest)) == (str, str)
    assert best == str(tmp_path / "ckpt" / "step_1") and latest == str(tmp_path / "ckpt" / "step_2")
    assert manager.remove_old_checkpoints(exclude_latest=False) is None
    assert manager.get_latest_checkpoint_path() == best


def test_top_k_ties_prefer_more_recent_checkpoints(tmp_path):
    """ "When multiple checkpoints have the same metric value, more recent checkpoints (higher step numbers)
    are preferred." (exclude_latest "may result in K+1 checkpoints")"""
    manager = make_manager(tmp_path, keep_top_k=1)
    save(manager, 1, {"val_loss": 0.3})
    save(manager, 2, {"val_loss": 0.3})
    save(manager, 3, {"val_loss": 0.5})
    assert [step for step, _, _ in _load_checkpoint_history(manager.checkpoint_dir)] == [2, 3]


def test_checkpoint_history_is_step_path_info_triples(tmp_path):
    """_load_checkpoint_history(checkpoint_dir) returns "List of tuples containing (step_number,
    checkpoint_path, info) for each checkpoint.\""""
    manager = make_manager(tmp_path)
    first = save(manager, 1, {"val_loss": 0.5})
    second = save(manager, 10, {"val_loss": 0.25})
    (manager.checkpoint_dir / "tmp_step_11").mkdir()
    assert _load_checkpoint_history(manager.checkpoint_dir) == [
        (1, first, {"val_loss": 0.5}),
        (10, second, {"val_loss": 0.25}),
    ]
    assert _load_checkpoint_history(str(tmp_path / "nowhere")) == []


def test_layout_is_step_dir_with_training_info_config_and_policy(tmp_path):
    """ "checkpoint_dir/ step_0/ training_info.json config.yaml policy... (up to the algorithm loop to save
    here)"; we add checksums.json (the sha256 manifest checked before resuming)."""
    manager = make_manager(tmp_path)
    path = Path(save(manager, 0, {"val_loss": 1.0}))
    assert sorted(p.name for p in path.iterdir()) == [
        "checksums.json",
        "config.yaml",
        "policy",
        "training_info.json",
    ]
    assert yaml.safe_load((path / "config.yaml").read_text()) == {"seed": 1}
    assert set(json.loads((path / "checksums.json").read_text())["files"]) == {
        "config.yaml",
        "policy/weights.bin",
        "training_info.json",
    }


def test_save_optimizer_false_is_accepted_in_the_config(tmp_path):
    """`save_optimizer: false`: weights without optimizer state (export-only checkpoints)."""
    manager = CheckpointManager({"checkpoint_dir": str(tmp_path), "save_optimizer": False})
    assert manager.save_optimizer is False
    assert CheckpointManager({"checkpoint_dir": str(tmp_path)}).save_optimizer is True


@dataclass
class RunConfig:
    lr: float = 0.5


class PydanticLike:
    """Any object with model_dump() (pydantic v2 models), without needing pydantic installed."""

    def model_dump(self, mode: str = "python") -> dict:
        return {"lr": 0.25, "mode": mode}


def test_init_tmp_checkpoint_accepts_dict_dataclass_or_model_dump_run_configs(tmp_path):
    """init_tmp_checkpoint(step, training_info, run_config: Optional[Dict[str, Any]] = None) "Creates a
    temporary directory for a new checkpoint and saves training info and configuration. The directory is
    named tmp_step_{step}"."""
    manager = make_manager(tmp_path)
    for step, run_config, expected in [
        (1, {"lr": 1.0}, {"lr": 1.0}),
        (2, RunConfig(), {"lr": 0.5}),
        (3, PydanticLike(), {"lr": 0.25, "mode": "json"}),
    ]:
        tmp = manager.init_tmp_checkpoint(step, {}, run_config=run_config)
        assert tmp.name == f"tmp_step_{step}"
        assert yaml.safe_load((tmp / "config.yaml").read_text()) == expected
    assert not (manager.init_tmp_checkpoint(4, {}) / "config.yaml").exists()


def test_tensor_and_numpy_scalars_in_training_info_become_plain_numbers(tmp_path):
    """ "training_info (Dict[str, Any]) - Dictionary containing training metrics and info": tensor and numpy
    scalars are written as plain JSON numbers."""
    manager = make_manager(tmp_path)
    info = {
        "step": np.int64(7),
        "val_loss": torch.tensor(0.125),
        "acc": np.float32(0.75),
        "n": torch.tensor(3),
    }
    loaded = manager.load_training_info(save(manager, 7, info))
    assert loaded == {"step": 7, "val_loss": 0.125, "acc": 0.75, "n": 3}
    assert [type(loaded[k]) for k in ("step", "val_loss", "acc", "n")] == [int, float, float, int]
