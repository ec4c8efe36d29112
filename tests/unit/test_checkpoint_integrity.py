"""Damaged checkpoints are found by the sha256 manifest and skipped: resume takes the newest intact one,
with a warning naming what is wrong; garbage training_info never crashes the bookkeeping."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from posttrain.utils.checkpoint import CheckpointManager, verify_checkpoint

SHARD = "policy/model/__0_0.distcp"


def make_manager(tmp_path: Path, **overrides) -> CheckpointManager:
    return CheckpointManager(
        {"checkpoint_dir": str(tmp_path / "ckpt"), "metric_name": "val_loss"} | overrides
    )


def save(manager: CheckpointManager, step: int, val_loss: float = 0.5) -> Path:
    tmp = manager.init_tmp_checkpoint(step, {"step": step, "val_loss": val_loss})
    (tmp / "policy" / "model").mkdir(parents=True)
    (tmp / SHARD).write_bytes(bytes(range(256)) * 8)  # 2048 bytes of "weights"
    (tmp / "dataloader.json").write_text('{"epoch": 0}')
    manager.finalize_checkpoint(tmp)
    return manager.checkpoint_dir / f"step_{step}"


def truncate_shard(path: Path) -> str:
    shard = path / SHARD
    shard.write_bytes(shard.read_bytes()[:1000])
    return f"{shard} has 1000 bytes, the manifest says 2048"


def remove_shard(path: Path) -> str:
    (path / SHARD).unlink()
    return f"{path / SHARD} is missing"


def garbage_training_info(path: Path) -> str:
    size = (path / "training_info.json").stat().st_size
    (path / "training_info.json").write_text("{" + "x" * (size - 1))  # same size, not JSON
    return f"{path / 'training_info.json'} does not match its sha256"


def corrupt_256_bytes(path: Path) -> str:
    shard = path / SHARD
    data = bytearray(shard.read_bytes())
    data[512:768] = bytes(255 - b for b in data[512:768])  # same size, 256 bytes changed
    shard.write_bytes(bytes(data))
    return f"{shard} does not match its sha256"


def garbage_manifest(path: Path) -> str:
    (path / "checksums.json").write_text("[1, 2")
    return f"{path / 'checksums.json'} is not a valid manifest"


def extra_file(path: Path) -> str:
    (path / "policy" / "evil.pt").write_bytes(b"x")
    return f"{path / 'policy' / 'evil.pt'} is not in the manifest"


@pytest.mark.parametrize(
    "damage",
    [truncate_shard, remove_shard, garbage_training_info, corrupt_256_bytes, garbage_manifest, extra_file],
)
def test_resume_skips_a_damaged_latest_checkpoint_naming_the_problem(tmp_path, caplog, damage):
    manager = make_manager(tmp_path)
    save(manager, 1)
    intact = save(manager, 2)
    damaged = save(manager, 3)
    assert verify_checkpoint(damaged) is None
    expected_message = damage(damaged)
    assert expected_message in verify_checkpoint(damaged)
    with caplog.at_level(logging.WARNING, logger="posttrain.utils.checkpoint"):
        assert manager.get_resume_checkpoint_path() == intact
    assert f"skipping damaged checkpoint {damaged}" in caplog.text and expected_message in caplog.text


def test_no_intact_checkpoint_means_a_fresh_start(tmp_path):
    manager = make_manager(tmp_path)
    remove_shard(save(manager, 1))
    assert manager.get_resume_checkpoint_path() is None


def test_an_explicit_damaged_resume_from_is_an_error_not_a_fallback(tmp_path):
    manager = make_manager(tmp_path)
    save(manager, 1)
    damaged = save(manager, 2)
    corrupt_256_bytes(damaged)
    explicit = make_manager(tmp_path, resume_from=str(damaged))
    with pytest.raises(ValueError, match=f"resume_from={damaged} is damaged: .*does not match its sha256"):
        explicit.get_resume_checkpoint_path()


def test_a_checkpoint_without_manifest_is_not_resumed_from(tmp_path):
    manager = make_manager(tmp_path)
    intact = save(manager, 1)
    legacy = save(manager, 2)
    (legacy / "checksums.json").unlink()
    assert "checksums.json is missing" in verify_checkpoint(legacy)
    assert manager.get_resume_checkpoint_path() == intact


@pytest.mark.parametrize(
    "garbage", ["{not json", "[1, 2, 3]", "\udcff".encode("utf-8", "surrogatepass").decode("latin-1")]
)
def test_garbage_training_info_of_an_old_checkpoint_never_crashes_top_k(tmp_path, caplog, garbage):
    """An old checkpoint's unreadable training_info ranks as 'no metric' (worst) and is pruned; saving,
    ranking and history keep working."""
    manager = make_manager(tmp_path, keep_top_k=1)
    old = save(manager, 1, val_loss=0.1)
    (old / "training_info.json").write_text(garbage, encoding="latin-1")
    with caplog.at_level(logging.WARNING, logger="posttrain.utils.checkpoint"):
        assert manager.load_training_info(old) is None
        save(manager, 2, val_loss=0.3)
        save(manager, 3, val_loss=0.2)
    assert [path.name for _, path in manager.list_checkpoints()] == ["step_3"]
    assert "training_info.json" in caplog.text
    assert json.loads((manager.checkpoint_dir / "step_3" / "training_info.json").read_text())["step"] == 3
