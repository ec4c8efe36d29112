"""The logger's and evaluation's documented behaviour, taken at its word: each test's docstring states
the promise it checks."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, validate_config
from posttrain.evals.supervised_samples import pick_rows, split_row
from posttrain.utils.logger import Logger, LoggerConfig, run_artifacts, step_timing
from posttrain.utils.metrics import reduce_metrics, reduce_timing
from posttrain.utils.timer import Timer


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------ the document's configs
def test_usage_example_config_works_as_written(tmp_path, monkeypatch):
    """Initialize logger with wandb, tensorboard, and mlflow enabled ... logger = Logger(cfg=logger_config)
    ... Log metrics, will go to all enabled backends: logger.log_metrics({"loss": 0.123}, step=10)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    logging_config = {
        "wandb_enabled": True,
        "tensorboard_enabled": False,
        "mlflow_enabled": True,
        "wandb": {"project": "grpo-dev", "name": "grpo-dev-logging"},
        "tensorboard": {"log_dir": "logs"},
        "mlflow": {"experiment_name": "nemo-rl-experiment", "run_name": "grpo-dev-run", "tracking_uri": None},
    }
    logger = Logger(cfg=logging_config)
    logger.log_metrics({"loss": 0.123}, step=10)
    mlflow_backend = logger.backends[-1]
    logger.finish()
    (run_dir,) = (tmp_path / "results").iterdir()  # the default log_dir: results/run-<time>
    assert run_dir.name.startswith("run-")
    assert read_jsonl(run_dir / "metrics.jsonl") == [{"step": 10, "loss": 0.123}]
    history = MlflowClient(mlflow_backend.tracking_uri).get_metric_history(mlflow_backend.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(10, 0.123)]
    assert list((run_dir / "wandb").glob("offline-run-*"))


def test_validation_pretty_logging_example_config_works_without_log_dir(tmp_path, monkeypatch):
    """logger: wandb_enabled: false, tensorboard_enabled: false, mlflow_enabled: false,
    num_val_samples_to_print: 10 -- the logger will generate well-formatted text outputs for the
    specified number of validation samples."""
    monkeypatch.chdir(tmp_path)
    logger = Logger(
        {
            "wandb_enabled": False,
            "tensorboard_enabled": False,
            "mlflow_enabled": False,
            "num_val_samples_to_print": 10,
        }
    )
    samples = [
        {"reward": float(i), "message_log": [{"role": "assistant", "content": f"answer {i}"}]}
        for i in range(12)
    ]
    with logger.sample_printer.console.capture() as captured:
        logger.log_val_samples(samples, step=3)
    logger.finish()
    printed = captured.get()
    assert sorted(int(n) for n in re.findall(r"answer (\d+)\s", printed)) == [0, 1, 2, 3, 4, 7, 8, 9, 10, 11]
    assert len(read_jsonl(logger.log_dir / "val_samples" / "step_3.jsonl")) == 12


def test_gpu_monitoring_example_config_and_flat_interval_names():
    """monitor_gpus: true, gpu_monitoring: collection_interval: 10, flush_interval: 10 -- the frequency of
    data collection and flushing to the loggers is controlled by the gpu_collection_interval and
    gpu_flush_interval parameters, both specified in seconds."""
    nested = validate_config(
        LoggerConfig,
        {"monitor_gpus": True, "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10}},
    )
    assert (nested.gpu_monitoring.collection_interval, nested.gpu_monitoring.flush_interval) == (10, 10)
    flat = validate_config(
        LoggerConfig, {"monitor_gpus": True, "gpu_collection_interval": 3, "gpu_flush_interval": 6}
    )
    assert (flat.gpu_monitoring.collection_interval, flat.gpu_monitoring.flush_interval) == (3.0, 6.0)
    assert flat.gpu_collection_interval is None  # folded: one place holds the value
    with pytest.raises(ValueError, match=r"gpu_flush_interval: .*set only gpu_monitoring\.flush_interval"):
        validate_config(LoggerConfig, {"gpu_flush_interval": 6, "gpu_monitoring": {"flush_interval": 2}})


@dataclass
class _Run:
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def test_flat_gpu_names_through_the_yaml_schema_and_the_conflict_names_the_nested_key():
    """This feature is enabled with the monitor_gpus configuration parameter ... gpu_collection_interval
    and gpu_flush_interval parameters, both specified in seconds."""
    cfg = validate_config(_Run, {"logger": {"monitor_gpus": True, "gpu_collection_interval": 5}})
    assert cfg.logger.gpu_monitoring.collection_interval == 5.0
    with pytest.raises(ConfigError, match=r"gpu_monitoring\.collection_interval"):
        validate_config(
            _Run, {"logger": {"gpu_collection_interval": 5, "gpu_monitoring": {"collection_interval": 1}}}
        )


# ------------------------------------------------------------------------------- reductions and timing
def test_metric_reductions_are_chosen_per_metric():
    """Tracking distributed metrics with specified reductions (mean, max, etc.).

    Ranks report loss 1, 3; peak_mem 5, 9; lr 0.1, 0.1; tokens 10, 30; err_max 2, 1. Chosen:
    loss mean = 2, peak_mem max = 9, lr min = 0.1, tokens by default (no suffix) sum = 40, err_max by its
    suffix max = 2."""
    per_rank = [
        {"loss": 1.0, "peak_mem": 5.0, "lr": 0.1, "tokens": 10.0, "err_max": 2.0},
        {"loss": 3.0, "peak_mem": 9.0, "lr": 0.1, "tokens": 30.0, "err_max": 1.0},
    ]
    reduced = reduce_metrics(per_rank, {"loss": "mean", "peak_mem": "max", "lr": "min"})
    assert reduced == pytest.approx({"loss": 2.0, "peak_mem": 9.0, "lr": 0.1, "tokens": 40.0, "err_max": 2.0})
    with pytest.raises(ValueError, match="'median' for metric 'loss'"):
        reduce_metrics(per_rank, {"loss": "median"})


def test_timing_is_reduced_across_ranks_with_max_and_logged_beside_the_driver_timing():
    """Tracking distributed timing with (usually) 'max' reduction across ranks.

    Workers' train times 1.5 s and 2.5 s -> 2.5 s; logprobs 0.25 s and 0.5 s -> 0.5 s; the driver's own
    stage keeps its own name, the workers' go under policy_worker/."""
    workers = reduce_timing([{"train": 1.5, "logprobs": 0.25}, {"train": 2.5, "logprobs": 0.5}])
    assert workers == {"train": 2.5, "logprobs": 0.5}
    driver = Timer()
    driver._records["generation"] = [0.75, 0.25]  # two intervals of one stage in this step
    assert step_timing(driver, {"policy_worker": workers}) == {
        "generation": 1.0,
        "policy_worker/train": 2.5,
        "policy_worker/logprobs": 0.5,
    }


# ------------------------------------------------------------------------------------ MLflow artifacts
def test_mlflow_shows_model_artifacts_and_checkpoints(tmp_path):
    """Then access the UI at http://127.0.0.1:5000/ to view: ... Hyperparameters; Model artifacts and
    checkpoints."""
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    (run_dir / "checkpoints" / "tmp_step_4").mkdir(parents=True)  # unfinished: not an artifact
    (run_dir / "checkpoints" / "tmp_step_4" / "training_info.json").write_text("{}")
    (run_dir / "hf_model").mkdir()
    (run_dir / "config.yaml").write_text("logger: {}\n")
    (run_dir / "checkpoints" / "step_2" / "training_info.json").write_text('{"step": 2, "val_loss": 0.5}')
    (run_dir / "hf_model" / "config.json").write_text("{}")
    logger = Logger({"log_dir": str(run_dir), "tensorboard_enabled": False, "mlflow_enabled": True})
    backend = logger.backends[-1]
    logger.finish()
    client = MlflowClient(backend.tracking_uri)
    top = sorted(a.path for a in client.list_artifacts(backend.run_id))
    assert top == ["checkpoints", "config.yaml", "hf_model"]
    assert [a.path for a in client.list_artifacts(backend.run_id, "checkpoints/step_2")] == [
        "checkpoints/step_2/training_info.json"
    ]
    assert [a.path for a in client.list_artifacts(backend.run_id, "hf_model")] == ["hf_model/config.json"]
    assert [pair[1] for pair in run_artifacts(run_dir, include_model=False)] == [None, "checkpoints/step_2"]


# ------------------------------------------------------------------------------------------ evaluation
def test_eval_logs_its_outcomes_to_the_unified_logger(tmp_path):
    """EvaluationRunner -- "logs evaluation outcomes to" --> UnifiedLogger."""
    from posttrain.evals.run import EvalConfig, log_results
    from posttrain.evals.validate import ValidationResult

    cfg = EvalConfig()
    cfg.logger.log_dir = str(tmp_path / "eval")
    summary = {"model": "m", "score": 0.75, "k": 1, "greedy": True, "accuracy": 0.75}
    samples = [{"reward": 1.0, "message_log": []}, {"reward": 0.0, "message_log": []}]
    log_results(
        cfg,
        summary,
        ValidationResult({"accuracy": 0.75}, samples, torch.tensor([1.0, 0.0])),
        tmp_path / "other",
    )
    assert read_jsonl(tmp_path / "eval" / "metrics.jsonl") == [
        {"step": 0, "eval/score": 0.75, "eval/k": 1.0, "eval/accuracy": 0.75}
    ]
    assert list((tmp_path / "eval" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(read_jsonl(tmp_path / "eval" / "val_samples" / "step_0.jsonl")) == 2


# ---------------------------------------------------------------------- supervised validation samples
def test_a_validation_row_splits_into_prompt_and_reference():
    """Comparing inputs and outputs side-by-side: row [5 6 7 8 9 0] of length 5 with token_mask
    [0 0 1 1 0 0] -> prompt [5 6], reference [7 8]."""
    cut = split_row(torch.tensor([5, 6, 7, 8, 9, 0]), torch.tensor([0, 0, 1, 1, 0, 0]), 5)
    assert (cut.prompt_ids, cut.reference_ids) == ([5, 6], [7, 8])


def test_pick_rows_takes_real_rows_and_whole_pairs():
    """the specified number of validation samples: masked padding rows are skipped; pairs come as
    chosen row 2i with rejected row 2i+1."""
    from posttrain.distributed.batched_data_dict import BatchedDataDict

    batch = BatchedDataDict(
        {
            "input_ids": torch.arange(12).reshape(6, 2),
            "token_mask": torch.ones(6, 2, dtype=torch.long),
            "input_lengths": torch.full((6,), 2),
            "sample_mask": torch.tensor([1, 1, 0, 0, 1, 1]),
        }
    )
    singles = pick_rows([batch], 3, stride=1)
    assert [row["input_ids"].tolist() for row in singles] == [[0, 1], [2, 3], [8, 9]]
    pairs = pick_rows([batch], 5, stride=2)
    assert [(p["input_ids"][0].item(), p["rejected_input_ids"][0].item()) for p in pairs] == [(0, 2), (8, 10)]
