"""Resume through real SFT runs on Ray workers: bit-identical through dropout (every rank's RNG state is
in the checkpoint), a corrupted latest checkpoint is skipped for the newest intact one, and a non-finite
loss stops the run without writing a checkpoint."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from run_logs import as_overrides

from posttrain.algorithms import sft
from posttrain.config import load_typed_config
from posttrain.workers.policy.handle import NonFiniteLossError

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "sft_tiny.yaml")
SHARD = Path("policy") / "model" / "__0_0.distcp"


def overrides(log_dir: Path, **extra) -> list[str]:
    values = {
        "logger.log_dir": str(log_dir),
        "logger.tensorboard_enabled": "false",
        "policy.model.from_config.hidden_size": 32,
        "policy.model.from_config.num_layers": 2,
        "policy.model.from_config.intermediate_size": 64,
        "policy.model.from_config.attention_dropout": 0.3,
        "policy.train_global_batch_size": 8,
        "policy.train_micro_batch_size": 8,
        "cluster.num_cpus_per_worker": 0.5,
        "sft.max_val_samples": 8,
        "sft.val_period": 100,
        "data.num_train": 64,
        "data.num_val": 8,
        "sft.max_num_steps": 4,
        "checkpointing.save_period": 2,
        "sft.export_final_model": "false",
    }
    return as_overrides(values, extra)


def train(log_dir: Path, num_steps: int | None = None, **extra) -> None:
    run = sft.setup(load_typed_config(sft.SFTConfig, CONFIG, overrides(log_dir, **extra)))
    try:
        sft.sft_train(run, num_steps=num_steps)
    finally:
        run.shutdown()


def losses(log_dir: Path) -> dict[int, float]:
    with open(log_dir / "metrics.jsonl") as handle:
        records = [json.loads(line) for line in handle]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}  # a resumed step overwrites


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tmp_path_factory) -> Path:
    log_dir = tmp_path_factory.mktemp("uninterrupted")
    train(log_dir)
    return log_dir


def test_resume_with_dropout_is_bit_identical(uninterrupted, tmp_path):
    """Attention dropout 0.3 draws from each worker's torch RNG every step: steps 3-4 after a restart from
    step_2 equal the uninterrupted run's exactly only if that RNG state was saved and restored."""
    train(tmp_path, num_steps=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]
    assert (tmp_path / "checkpoints" / "step_2" / "policy" / "rng" / "rank_0.safetensors").is_file()
    train(tmp_path)
    expected, resumed = losses(uninterrupted), losses(tmp_path)
    assert [resumed[step] for step in (1, 2, 3, 4)] == [expected[step] for step in (1, 2, 3, 4)]


def test_corrupted_latest_checkpoint_is_skipped_and_resume_takes_the_previous_one(
    uninterrupted, tmp_path, caplog
):
    """256 corrupted bytes in step_4's weight shard: the sha256 check skips it (naming the file), the run
    resumes from step_2 and repeats the uninterrupted losses of steps 3 and 4, never a NaN."""
    log_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, log_dir)
    (log_dir / "metrics.jsonl").write_text("")
    shard = log_dir / "checkpoints" / "step_4" / SHARD
    data = bytearray(shard.read_bytes())
    data[-1024:-768] = bytes(b ^ 0xFF for b in data[-1024:-768])
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="posttrain.utils.checkpoint"):
        train(log_dir, **{"sft.max_num_steps": 4})
    assert f"skipping damaged checkpoint {log_dir / 'checkpoints' / 'step_4'}" in caplog.text
    assert f"{shard} does not match its sha256" in caplog.text
    assert losses(log_dir) == {step: losses(uninterrupted)[step] for step in (3, 4)}


def test_nonfinite_loss_stops_the_run_and_writes_no_checkpoint(ray_session, tmp_path):
    """lr 1e30 blows the weights up within a few steps: the first step whose loss is not finite raises
    NonFiniteLossError; every step before it was logged and checkpointed (save_period 1), that step never."""
    settings = {
        "policy.optimizer.kwargs.lr": 1e30,
        "checkpointing.save_period": 1,
        "sft.max_num_steps": 8,
        "policy.model.from_config.attention_dropout": 0.0,
        "checkpointing.keep_top_k": "null",
    }
    with pytest.raises(NonFiniteLossError, match="training loss is (nan|inf|-inf)"):
        train(tmp_path, **settings)
    finite_steps = sorted(losses(tmp_path))
    assert 1 <= len(finite_steps) < 8 and finite_steps == list(range(1, len(finite_steps) + 1))
    checkpoints = sorted(
        (p.name for p in (tmp_path / "checkpoints").iterdir()), key=lambda name: int(name[5:])
    )
    assert checkpoints == [f"step_{step}" for step in finite_steps]
