"""`posttrain demo` end to end with a short schedule: every promised file is written and readable."""

import json
import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast


def test_short_demo_writes_run_directory_plot_and_summary(ray_session, tmp_path):
    out = tmp_path / "demo"
    command = [
        sys.executable,
        "-m",
        "posttrain.cli",
        "demo",
        "--out",
        str(out),
        "sft_max_steps=10",
        "sft_check_every=5",
        "grpo_steps=2",
        "grpo_val_period=1",
        "num_val=16",
        "num_prompts_per_step=4",
        "num_generations_per_prompt=4",
    ]
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "validation accuracy: untrained" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    for key in ("untrained_accuracy", "sft_accuracy", "grpo_accuracy", "grpo_gain_points"):
        assert 0.0 <= summary[key] <= 1.0 or key == "grpo_gain_points"
    assert summary["sft_steps"] == 10 and summary["grpo_steps"] == 2
    assert set(summary["wall_time_s"]) == {"build_model", "sft", "grpo", "total"}
    # The control: SFT continued for at least GRPO's training time, graded on the same prompts.
    assert "control: SFT continued for GRPO's" in result.stdout
    assert summary["sft_control_train_s"] >= summary["grpo_train_s"] > 0
    assert summary["sft_control_steps"] > 0 and 0.0 <= summary["sft_control_accuracy"] <= 1.0
    # The plot's after-SFT panel: GRPO's and the control's validation accuracy against training seconds.
    grpo_curve, control_curve = summary["grpo_accuracy_by_time"], summary["sft_control_accuracy_by_time"]
    assert grpo_curve[0] == [0.0, summary["grpo_start_accuracy"]] and len(grpo_curve) == 3  # val at 0, 1, 2
    assert (
        grpo_curve[-1][0] == pytest.approx(summary["grpo_train_s"])
        and grpo_curve[-1][1] == summary["grpo_accuracy"]
    )
    assert control_curve[0][0] == 0.0 and control_curve[-1] == [
        summary["sft_control_train_s"],
        summary["sft_control_accuracy"],
    ]
    assert [t for t, _ in control_curve] == sorted(t for t, _ in control_curve) and len(control_curve) >= 2
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for stage in ("sft", "grpo", "sft_control"):
        assert (out / stage / "config.yaml").exists() and (out / stage / "metrics.jsonl").exists()
    assert (out / "grpo" / "val_samples" / "step_2.jsonl").exists()
    assert (out / "grpo" / "checkpoints" / "step_2" / "training_info.json").exists()
    events = EventAccumulator(str(out / "grpo" / "tensorboard"))
    events.Reload()
    assert "train/reward_mean" in events.Tags()["scalars"]
