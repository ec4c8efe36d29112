"""What the logger promises (docs/logging.md), on real runs: worker stage timing
reaches the driver's
log (max over ranks), SFT and RM print their own validation samples, MLflow holds the run's artifacts."""

import json
from pathlib import Path

import pytest
from run_logs import finished_run

from posttrain.algorithms import pairs, rm, sft
from posttrain.config import load_typed_config

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

REPO = Path(__file__).resolve().parents[2]


def records(log_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]


def test_sft_logs_worker_timing_prints_greedy_samples_and_keeps_mlflow_artifacts(ray_session, tmp_path):
    """Tracking distributed timing with (usually) 'max' reduction across ranks; num_val_samples_to_print
    ... well-formatted text outputs for the specified number of validation samples; the MLflow UI shows
    model artifacts and checkpoints."""
    from mlflow.tracking import MlflowClient

    cfg = load_typed_config(
        sft.SFTConfig,
        str(REPO / "configs" / "sft_tiny.yaml"),
        [
            f"logger.log_dir={tmp_path}",
            "logger.tensorboard_enabled=false",
            "logger.mlflow_enabled=true",
            "logger.num_val_samples_to_print=3",
            "policy.model.from_config.hidden_size=64",
            "policy.model.from_config.num_layers=2",
            "policy.model.from_config.intermediate_size=128",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=8",
            "cluster.num_cpus_per_worker=0.5",
            "cluster.workers_per_node=2",
            "sft.max_val_samples=8",
            "data.num_train=64",
            "data.num_val=8",
            "sft.max_num_steps=2",
            "sft.val_period=2",
            "checkpointing.save_period=2",
        ],
    )
    run = finished_run(cfg, sft.setup, sft.sft_train)
    timing = {r["step"]: r for r in records(tmp_path) if "timing/policy_worker/train" in r}
    assert sorted(timing) == [1, 2]
    assert all(0 < r["timing/policy_worker/train"] <= r["timing/train"] for r in timing.values())
    samples = [
        json.loads(line) for line in (tmp_path / "val_samples" / "step_2.jsonl").read_text().splitlines()
    ]
    assert len(samples) == 3
    for sample in samples:
        roles = [m["role"] for m in sample["message_log"]]
        assert roles == ["user", "reference", "assistant"] and sample["reward"] in (0.0, 1.0)
        assert sample["message_log"][1]["content"]  # the reference answer, e.g. "092"
    mlflow = next(b for b in run.logger.backends if type(b).__name__ == "MLflowLogger")
    client = MlflowClient(mlflow.tracking_uri)
    top = sorted(a.path for a in client.list_artifacts(mlflow.run_id))
    assert top == ["checkpoints", "config.yaml", "hf_model"]
    assert [a.path for a in client.list_artifacts(mlflow.run_id, "checkpoints/step_2")] == [
        "checkpoints/step_2/config.yaml",
        "checkpoints/step_2/training_info.json",
    ]


def test_reward_model_prints_prompt_chosen_rejected_and_its_scores(arithmetic_sft_model, tmp_path):
    """SFT/DPO/RM print their own validation samples: for a reward model the prompt, the reference
    (chosen) and the rejected response with the model's score of each; reward = the margin."""
    cfg = load_typed_config(
        rm.RMConfig,
        str(REPO / "configs" / "rm_tiny.yaml"),
        [
            f"logger.log_dir={tmp_path}",
            "logger.tensorboard_enabled=false",
            "logger.num_val_samples_to_print=2",
            f"policy.model_name={arithmetic_sft_model}",
            "cluster.num_cpus_per_worker=0.5",
            "data.num_train=64",
            "data.num_val=8",
            "rm.max_val_samples=8",
            "rm.max_num_steps=1",
            "rm.val_period=1",
            "checkpointing.enabled=false",
            "rm.export_final_model=false",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=16",
        ],
    )
    finished_run(cfg, pairs.setup, pairs.train)
    samples = [
        json.loads(line) for line in (tmp_path / "val_samples" / "step_1.jsonl").read_text().splitlines()
    ]
    assert len(samples) == 2
    for sample in samples:
        log = sample["message_log"]
        assert [m["role"] for m in log] == ["user", "reference", "rejected"]
        chosen = float(log[1]["content"].split(")")[0].removeprefix("(score "))
        rejected = float(log[2]["content"].split(")")[0].removeprefix("(score "))
        assert abs(sample["reward"] - (chosen - rejected)) < 1e-3 * max(1.0, abs(chosen) + abs(rejected))
