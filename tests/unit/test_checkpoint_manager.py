"""CheckpointManager rules: top-k by metric, latest/best lookup, crash-safe finalize, write errors."""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from posttrain.config import validate_config
from posttrain.utils.checkpoint import CheckpointingConfig, CheckpointManager, CheckpointWriteError


def make_manager(tmp_path: Path, **overrides) -> CheckpointManager:
    config = {"checkpoint_dir": str(tmp_path / "ckpt"), "metric_name": "val/loss", "keep_top_k": None}
    return CheckpointManager(validate_config(CheckpointingConfig, config | overrides))


def save(manager: CheckpointManager, step: int, info: dict | None = None, payload: str = "") -> Path:
    tmp = manager.init_tmp_checkpoint(step, info if info is not None else {"step": step})
    (tmp / "model.txt").write_text(payload or f"weights of step {step}")
    manager.finalize_checkpoint(tmp)
    return manager.checkpoint_dir / f"step_{step}"


def step_names(manager: CheckpointManager) -> list[str]:
    return [path.name for _, path in manager.list_checkpoints()]


def test_top3_lower_is_better_keeps_steps_2_4_5_and_latest_6(tmp_path):
    """losses 0.5,0.3,0.7,0.2,0.4,0.8 at steps 1..6: best three are 0.2 (4), 0.3 (2), 0.4 (5); 6 is latest."""
    manager = make_manager(tmp_path, keep_top_k=3, higher_is_better=False)
    for step, loss in enumerate([0.5, 0.3, 0.7, 0.2, 0.4, 0.8], start=1):
        save(manager, step, {"step": step, "val/loss": loss})
    assert step_names(manager) == ["step_2", "step_4", "step_5", "step_6"]
    assert manager.get_best_checkpoint_path() == str(manager.checkpoint_dir / "step_4")
    assert manager.get_latest_checkpoint_path() == str(manager.checkpoint_dir / "step_6")


def test_top2_higher_is_better_ties_prefer_recent_and_missing_metric_ranks_worst(tmp_path):
    """acc 0.9 (1), none (2), 0.9 (3), 0.5 (4): the ties at 0.9 rank step 3 first; keep 3, 1 and latest 4."""
    manager = make_manager(tmp_path, keep_top_k=2, higher_is_better=True, metric_name="val/acc")
    save(manager, 1, {"val/acc": 0.9})
    save(manager, 2, {})
    save(manager, 3, {"val/acc": 0.9})
    save(manager, 4, {"val/acc": 0.5})
    assert step_names(manager) == ["step_1", "step_3", "step_4"]
    assert manager.get_best_checkpoint_path().endswith("/step_3")


def test_remove_old_checkpoints_without_exclude_latest_drops_the_latest_if_not_top_k(tmp_path):
    manager = make_manager(tmp_path, keep_top_k=None)
    for step, loss in [(1, 0.1), (2, 0.2), (3, 0.3)]:
        save(manager, step, {"val/loss": loss})
    manager.config.keep_top_k = 1
    assert manager.remove_old_checkpoints(exclude_latest=False) is None
    assert step_names(manager) == ["step_1"]


def test_latest_orders_numerically_and_ignores_other_names(tmp_path):
    manager = make_manager(tmp_path)
    save(manager, 9)
    save(manager, 10)
    (manager.checkpoint_dir / "step_30-hf").mkdir()
    (manager.checkpoint_dir / "tmp_step_40").mkdir()
    (manager.checkpoint_dir / "step_50").write_text("a file, not a checkpoint")
    assert manager.get_latest_checkpoint_path().endswith("/step_10")
    assert step_names(manager) == ["step_9", "step_10"]


def test_tmp_step_directories_are_never_read(tmp_path):
    manager = make_manager(tmp_path)
    tmp = manager.init_tmp_checkpoint(7, {"val/loss": 0.0})
    assert manager.get_latest_checkpoint_path() is None
    assert manager.get_best_checkpoint_path() is None
    assert manager.load_training_info() is None
    assert manager.load_training_info(tmp) is None


def test_best_ignores_checkpoints_without_metric_with_warning(tmp_path, caplog):
    manager = make_manager(tmp_path)
    save(manager, 1, {"val/loss": 0.4})
    save(manager, 2, {"train/loss": 0.1})
    with caplog.at_level(logging.WARNING):
        assert manager.get_best_checkpoint_path().endswith("/step_1")
    assert "step_2" in caplog.text


def test_best_without_any_metric_warns_and_returns_latest(tmp_path, caplog):
    manager = make_manager(tmp_path)
    save(manager, 1, {})
    save(manager, 2, {})
    with caplog.at_level(logging.WARNING):
        assert manager.get_best_checkpoint_path().endswith("/step_2")
    assert "val/loss" in caplog.text


def test_without_metric_name_top_k_keeps_the_most_recent(tmp_path):
    manager = make_manager(tmp_path, metric_name=None, keep_top_k=2)
    for step in range(1, 5):
        save(manager, step, {"val/loss": 1.0 / step})
    assert step_names(manager) == ["step_3", "step_4"]
    assert manager.get_best_checkpoint_path().endswith("/step_4")


def test_empty_directory_gives_none_everywhere(tmp_path):
    manager = make_manager(tmp_path)
    assert manager.get_latest_checkpoint_path() is None
    assert manager.get_best_checkpoint_path() is None
    assert manager.load_training_info() is None
    assert manager.clean_partial_checkpoints() == []


@dataclass
class RunConfig:
    lr: float = 1e-3
    name: str = "toy"


def test_training_info_converts_tensor_and_numpy_scalars_and_config_is_written(tmp_path):
    manager = make_manager(tmp_path)
    info = {"step": np.int64(3), "val/loss": torch.tensor(0.25), "acc": np.float32(0.5), "lst": np.arange(2)}
    tmp = manager.init_tmp_checkpoint(3, info, run_config={"run": RunConfig(), "out": Path("/x")})
    assert manager.finalize_checkpoint(tmp) is None
    final = manager.checkpoint_dir / "step_3"
    loaded = manager.load_training_info(final)
    assert loaded == {"step": 3, "val/loss": 0.25, "acc": 0.5, "lst": [0, 1]}
    assert type(loaded["step"]) is int
    assert yaml.safe_load((final / "config.yaml").read_text()) == {
        "run": {"lr": 1e-3, "name": "toy"},
        "out": "/x",
    }
    assert manager.load_training_info(manager.get_latest_checkpoint_path()) == loaded


def test_init_replaces_a_stale_tmp_directory(tmp_path):
    manager = make_manager(tmp_path)
    stale = manager.init_tmp_checkpoint(5, {"old": 1})
    (stale / "half_written.bin").write_text("x")
    fresh = manager.init_tmp_checkpoint(5, {"new": 2})
    assert sorted(p.name for p in fresh.iterdir()) == ["training_info.json"]


def test_finalize_replaces_existing_step_without_mixing_files(tmp_path):
    manager = make_manager(tmp_path)
    first = manager.init_tmp_checkpoint(4, {"run": "old"})
    (first / "only_in_old.txt").write_text("old")
    manager.finalize_checkpoint(first)
    second = manager.init_tmp_checkpoint(4, {"run": "new"})
    (second / "only_in_new.txt").write_text("new")
    manager.finalize_checkpoint(second)
    final = manager.checkpoint_dir / "step_4"
    assert sorted(p.name for p in final.iterdir()) == [
        "checksums.json",
        "only_in_new.txt",
        "training_info.json",
    ]
    assert manager.load_training_info(final) == {"run": "new"}
    assert sorted(p.name for p in manager.checkpoint_dir.iterdir()) == ["step_4"]


def test_clean_partial_removes_tmp_and_restores_an_interrupted_replacement(tmp_path):
    """A crash after step_3 was moved aside but before the new one was renamed in: step_3 comes back."""
    manager = make_manager(tmp_path)
    save(manager, 2)
    save(manager, 3)
    os.rename(manager.checkpoint_dir / "step_3", manager.checkpoint_dir / "replaced_step_3")
    manager.init_tmp_checkpoint(3, {"new": True})
    manager.init_tmp_checkpoint(4, {})
    removed = manager.clean_partial_checkpoints()
    assert sorted(p.name for p in removed) == ["tmp_step_3", "tmp_step_4"]
    assert sorted(p.name for p in manager.checkpoint_dir.iterdir()) == ["step_2", "step_3"]
    assert (manager.checkpoint_dir / "step_3" / "model.txt").read_text() == "weights of step 3"


def test_resume_from_points_at_an_explicit_checkpoint(tmp_path):
    manager = make_manager(tmp_path)
    first = save(manager, 1, {"step": 1})
    save(manager, 2, {"step": 2})
    explicit = make_manager(tmp_path, resume_from=str(first))
    assert explicit.get_resume_checkpoint_path() == first
    assert explicit.load_training_info(explicit.get_resume_checkpoint_path()) == {"step": 1}
    missing = make_manager(tmp_path, resume_from=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="nope"):
        missing.get_resume_checkpoint_path()


def test_disk_full_during_write_raises_naming_the_path_and_keeps_earlier_checkpoints(tmp_path):
    """RLIMIT_FSIZE makes writes fail with EFBIG, like a full disk, even as root."""
    manager = make_manager(tmp_path)
    save(manager, 1, {"val/loss": 0.5})
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8, hard))
    try:
        with pytest.raises(CheckpointWriteError, match="tmp_step_2/training_info.json"):
            manager.init_tmp_checkpoint(2, {"val/loss": 0.25, "padding": "x" * 100})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert step_names(manager) == ["step_1"]
    assert manager.load_training_info(manager.get_latest_checkpoint_path()) == {"val/loss": 0.5}
    assert (manager.checkpoint_dir / "step_1" / "model.txt").read_text() == "weights of step 1"


def test_unwritable_target_raises_naming_the_path(tmp_path):
    """As root chmod does not block, so the target directory is a file instead; both name the path."""
    blocked = tmp_path / "blocked"
    blocked.write_text("not a directory")
    manager = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(blocked)))
    with pytest.raises(CheckpointWriteError, match=str(blocked)):
        manager.init_tmp_checkpoint(1, {})


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_raises_naming_the_path_and_keeps_earlier_checkpoints(tmp_path):
    manager = make_manager(tmp_path)
    save(manager, 1, {"val/loss": 0.5})
    os.chmod(manager.checkpoint_dir, 0o555)
    try:
        with pytest.raises(CheckpointWriteError, match="tmp_step_2"):
            manager.init_tmp_checkpoint(2, {})
    finally:
        os.chmod(manager.checkpoint_dir, 0o755)
    assert json.loads((manager.checkpoint_dir / "step_1" / "training_info.json").read_text()) == {
        "val/loss": 0.5
    }
