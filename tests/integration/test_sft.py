"""SFT end to end on real Ray workers: learning on the built-in task, 1 vs 2 FSDP2 workers, exact resume
after SIGKILL, and a clear error for bad data."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_logs import as_overrides

from posttrain.algorithms import sft
from posttrain.config import load_typed_config
from posttrain.demo import AccuracyProbe, DemoConfig
from posttrain.utils.checkpoint import CheckpointManager

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "sft_tiny.yaml")


def tiny_overrides(log_dir, **extra):
    values = {
        "logger.log_dir": str(log_dir),
        "logger.tensorboard_enabled": "false",
        "policy.model.from_config.hidden_size": 64,
        "policy.model.from_config.num_layers": 2,
        "policy.model.from_config.intermediate_size": 128,
        "policy.train_global_batch_size": 16,
        "policy.train_micro_batch_size": 8,
        "cluster.num_cpus_per_worker": 0.5,
        "sft.max_val_samples": 32,
        "data.num_train": 400,
        "data.num_val": 32,
    }
    return as_overrides(values, extra)


def losses(log_dir) -> dict[int, float]:
    records = [json.loads(line) for line in open(Path(log_dir) / "metrics.jsonl")]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def run_sft(log_dir, **extra):
    cfg = load_typed_config(sft.SFTConfig, CONFIG, tiny_overrides(log_dir, **extra))
    run = sft.setup(cfg)
    try:
        sft.sft_train(run)
    finally:
        run.shutdown()
    return losses(log_dir)


def test_one_and_two_fsdp2_workers_give_the_same_losses(ray_session, tmp_path):
    settings = {
        "sft.max_num_steps": 3,
        "sft.val_period": 3,
        "checkpointing.enabled": "false",
        "sft.export_final_model": "false",
    }
    one = run_sft(tmp_path / "one", **settings)
    two = run_sft(tmp_path / "two", **settings, **{"cluster.workers_per_node": 2})
    assert list(one) == [1, 2, 3]
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-5)


def test_a_run_in_kept_worker_processes_gives_the_losses_of_a_run_in_new_ones(
    ray_session, tmp_path, monkeypatch
):
    """The suite keeps worker processes (POSTTRAIN_KEEP_WORKERS, tests/conftest.py): a run in the processes
    of the runs before it computes exactly what a run in new processes does."""
    settings = {
        "sft.max_num_steps": 3,
        "sft.val_period": 3,
        "checkpointing.enabled": "false",
        "sft.export_final_model": "false",
        "cluster.workers_per_node": 2,
    }
    pids = []

    def run(log_dir):
        cfg = load_typed_config(sft.SFTConfig, CONFIG, tiny_overrides(log_dir, **settings))
        run = sft.setup(cfg)
        pids.append({info["pid"] for info in run.policy.worker_group.info})
        try:
            sft.sft_train(run)
        finally:
            run.shutdown()
        return losses(log_dir)

    monkeypatch.setenv("POSTTRAIN_KEEP_WORKERS", "0")
    new = run(tmp_path / "new")
    monkeypatch.setenv("POSTTRAIN_KEEP_WORKERS", "2")
    run(tmp_path / "first")
    kept = run(tmp_path / "kept")
    assert pids[2] == pids[1] and not pids[0] & pids[1]
    assert kept == new


def test_sigkill_after_a_checkpoint_then_restart_reproduces_the_uninterrupted_losses(ray_session, tmp_path):
    """The run is killed as soon as its first checkpoint lands; on a fast machine it may have saved a few
    more by then (every checkpoint is kept), so the comparison starts after whichever one is the latest."""
    settings = {
        "sft.val_period": 1000,
        "checkpointing.save_period": 3,
        "checkpointing.keep_top_k": 1000,
        "sft.export_final_model": "false",
    }
    log_dir = tmp_path / "killed"
    command = [
        sys.executable,
        "-m",
        "posttrain.cli",
        "sft",
        "--config",
        CONFIG,
        *tiny_overrides(log_dir, **{**settings, "sft.max_num_steps": 1000}),
    ]
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 180
    while not (log_dir / "checkpoints" / "step_3").exists() and time.monotonic() < deadline:
        assert process.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    checkpoints = CheckpointManager({"checkpoint_dir": str(log_dir / "checkpoints")})
    saved = [step for step, _ in checkpoints.list_checkpoints()]  # finalized ones, by step
    assert saved[0] == 3
    last = saved[-1] + 3
    uninterrupted = run_sft(tmp_path / "uninterrupted", **settings, **{"sft.max_num_steps": last})
    resumed_losses = run_sft(log_dir, **settings, **{"sft.max_num_steps": last})  # resumes from the latest
    for step in range(last - 2, last + 1):
        assert resumed_losses[step] == pytest.approx(uninterrupted[step], abs=1e-6)


def test_bad_data_stops_the_command_naming_file_and_line(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "response": "2"}\n{"prompt": "2+2="\n')
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "posttrain.cli",
            "sft",
            "--config",
            CONFIG,
            *tiny_overrides(
                tmp_path / "run", **{"data.dataset": str(data), "data.format": "prompt_response"}
            ),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert f"{data}:2: malformed JSON line" in result.stderr


def test_sft_learns_the_arithmetic_task(ray_session, tmp_path):
    """The demo's model and schedule: loss falls well below its start and greedy accuracy on held-out
    sums rises from 0 to a clearly non-trivial value within 250 steps (measured: loss 4.68 -> 0.22 over
    the last 10 steps, accuracy 0 -> 0.515; it takes off between steps 175 and 225: 0.11, 0.205, 0.515)."""
    num_steps = 250
    cfg = load_typed_config(
        sft.SFTConfig,
        CONFIG,
        [
            f"logger.log_dir={tmp_path}",
            "logger.tensorboard_enabled=false",
            f"sft.max_num_steps={num_steps}",
            f"sft.val_period={num_steps}",
            "checkpointing.enabled=false",
            "sft.export_final_model=false",
            "data.num_val=200",
        ],
    )
    run = sft.setup(cfg)
    probe = AccuracyProbe(run, DemoConfig(num_val=200))
    try:
        initial_accuracy = probe.accuracy(refit=False)
        sft.sft_train(run)
        final_accuracy = probe.accuracy()
    finally:
        probe.shutdown()
        run.shutdown()
    curve = losses(tmp_path)
    first, last = curve[1], sum(curve[s] for s in range(num_steps - 9, num_steps + 1)) / 10
    print(
        f"SFT loss {first:.3f} -> {last:.3f}; greedy accuracy {initial_accuracy:.3f} -> {final_accuracy:.3f}"
    )
    assert last < 0.4 * first
    assert initial_accuracy < 0.02 and final_accuracy > 0.2
