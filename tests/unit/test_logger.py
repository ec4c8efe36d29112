"""Unified logger: flattening and summaries, JSONL content, real TensorBoard / MLflow / W&B files read
back, validation sample printing, and the system monitor's parsing."""

from __future__ import annotations

import json
import logging
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from posttrain.config import validate_config
from posttrain.utils.logger import (
    JsonlLogger,
    Logger,
    LoggerConfig,
    flatten_hyperparams,
    flatten_metrics,
    mlflow_key,
    summarize_values,
)
from posttrain.utils.sample_printer import choose_samples, render_sample
from posttrain.utils.system_monitor import RaySystemMonitor, parse_node_metrics


def jsonl_only(tmp_path: Path, **overrides) -> Logger:
    return Logger(
        validate_config(
            LoggerConfig, {"log_dir": str(tmp_path / "run"), "tensorboard_enabled": False} | overrides
        )
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------- flatten and summarise
def test_flatten_joins_nested_keys_with_slash_under_prefix():
    metrics = {"a": {"b": 1, "c": {"d": 2}}, "e": 3}
    assert flatten_metrics(metrics, "train") == {"train/a/b": 1, "train/a/c/d": 2, "train/e": 3}
    assert flatten_metrics(metrics, "train/") == flatten_metrics(metrics, "train")


def test_summary_of_1_2_3_4_is_mean_2_5_p50_2_5_p90_3_7_max_4():
    """Linear interpolation: p90 sits at index 0.9 * 3 = 2.7, i.e. 3 + 0.7 * (4 - 3) = 3.7."""
    summary = summarize_values([1, 2, 3, 4])
    assert summary == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "max": 4.0})


def test_jsonl_line_is_step_plus_prefixed_metrics_with_list_summary(tmp_path):
    logger = jsonl_only(tmp_path)
    logger.log_metrics(
        {"loss": 0.5, "lens": [1, 2, 3, 4], "nested": {"x": np.int64(1)}}, step=3, prefix="train"
    )
    logger.log_metrics({"loss": torch.tensor(0.25)}, step=4, prefix="train")
    logger.finish()
    assert read_jsonl(logger.log_dir / "metrics.jsonl") == [
        {
            "step": 3,
            "train/loss": 0.5,
            "train/lens": [1.0, 2.0, 3.0, 4.0],
            "train/lens/mean": 2.5,
            "train/lens/p50": 2.5,
            "train/lens/p90": pytest.approx(3.7),
            "train/lens/max": 4.0,
            "train/nested/x": 1.0,
        },
        {"step": 4, "train/loss": 0.25},
    ]


def test_non_numeric_values_are_skipped_with_one_warning_per_key(tmp_path, caplog):
    logger = jsonl_only(tmp_path)
    with caplog.at_level(logging.WARNING, logger="posttrain.utils.logger"):
        for step in range(3):
            logger.log_metrics({"text": "hello", "none": None, "ok": 1.0}, step=step, prefix="val")
    logger.finish()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "'val/text'" in w]) == 1
    assert len([w for w in warnings if "'val/none'" in w]) == 1
    assert read_jsonl(logger.log_dir / "metrics.jsonl") == [{"step": s, "val/ok": 1.0} for s in range(3)]


def test_jsonl_logger_appends_across_instances(tmp_path):
    for step in (1, 2):
        backend = JsonlLogger(tmp_path)
        backend.log_metrics({"a": step}, step)
        backend.finish()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]


def test_hyperparams_flatten_nested_dataclasses_inside_dicts():
    cfg = LoggerConfig(log_dir="runs/a")
    flat = flatten_hyperparams({"logger": cfg, "seed": 3})
    assert flat["logger/log_dir"] == "runs/a" and flat["logger/gpu_monitoring/flush_interval"] == 10.0
    assert flat["logger/wandb/name"] is None and flat["seed"] == 3


# ------------------------------------------------------------------------------------ real backends
def test_tensorboard_scalars_and_hparams_read_back_with_event_accumulator(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    logger = Logger(LoggerConfig(log_dir=str(tmp_path / "run")))
    logger.log_hyperparams({"optim": {"lr": 0.001}, "name": "toy"})
    logger.log_metrics({"loss": 0.5, "lens": [1, 2, 3, 4]}, step=1, prefix="train")
    logger.log_metrics({"loss": 0.25}, step=2, prefix="train")
    logger.finish()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.5), (2, 0.25)]
    assert events.Scalars("train/lens/p90")[0].value == pytest.approx(3.7)
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["optim/lr"].number_value == pytest.approx(0.001)
    assert hparams["name"].string_value == "toy"


def test_mlflow_run_in_local_store_read_back_with_mlflow_client(tmp_path):
    from mlflow.tracking import MlflowClient

    logger = Logger(
        validate_config(
            LoggerConfig,
            {
                "log_dir": str(tmp_path / "run"),
                "tensorboard_enabled": False,
                "mlflow_enabled": True,
                "mlflow": {"experiment_name": "exp", "run_name": "r1"},
            },
        )
    )
    logger.log_hyperparams({"optim": {"lr": 0.001}})
    logger.log_metrics({"loss": 0.5}, step=1, prefix="train")
    logger.log_metrics({"loss": 0.25, "lens": [1, 2, 3, 4]}, step=2, prefix="train")
    backend = logger.backends[-1]
    logger.finish()
    assert backend.tracking_uri == (tmp_path / "run" / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    run = client.get_run(backend.run_id)
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert run.data.params == {"optim/lr": "0.001"}
    history = client.get_metric_history(backend.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.25)]
    assert client.get_metric_history(backend.run_id, "train/lens/mean")[0].value == 2.5


def test_mlflow_key_replaces_characters_mlflow_rejects():
    assert mlflow_key("val/pass@k=4 (math):x.y-z") == "val/pass_k_4 _math_:x.y-z"


def read_wandb_records(path: Path) -> list[bytes]:
    """Records of W&B's transaction log: a 7-byte header, then LevelDB-style 32 KiB blocks of
    (crc32 u32, length u16, type u8, data); type 1 is a whole record, 2/3/4 first/middle/last pieces."""
    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    records, pending, offset = [], b"", 7
    while offset + 7 <= len(raw):
        if 32768 - offset % 32768 < 7:  # block trailer too small for a header: padding
            offset += 32768 - offset % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[offset : offset + 7])
        data, offset = raw[offset + 7 : offset + 7 + length], offset + 7 + length
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):
            records.append(pending)
    return records


def wandb_history_and_config(run_file: Path) -> tuple[list[dict], dict]:
    from wandb.proto import wandb_internal_pb2

    rows, config = [], {}
    for data in read_wandb_records(run_file):
        record = wandb_internal_pb2.Record.FromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
        if kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return rows, config


def test_wandb_offline_run_writes_history_and_config_and_system_rows_survive(tmp_path, monkeypatch):
    """The system monitor's step 1 comes after train step 7: it rides on its own axis `system/step`
    instead of being dropped for going backwards."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    logger = Logger(
        LoggerConfig(log_dir=str(tmp_path / "run"), tensorboard_enabled=False, wandb_enabled=True)
    )
    logger.log_hyperparams({"optim": {"lr": 0.001}})
    logger.log_metrics({"loss": 0.5}, step=7, prefix="train")
    logger.log_metrics({"node": {"cpu": 12.5}}, step=1, prefix="system")
    logger.log_metrics({"loss": 0.25}, step=8, prefix="train")
    assert logger.backends[-1].mode == "offline"
    logger.finish()
    run_files = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    # W&B's service process may still be writing the file when finish() returns on a loaded machine.
    for _ in range(40):
        rows, config = wandb_history_and_config(run_files[0])
        if len(rows) >= 3 and config:
            break
        time.sleep(0.5)
    assert [(row["_step"], row["train/loss"]) for row in rows if "train/loss" in row] == [(7, 0.5), (8, 0.25)]
    assert [(row["system/step"], row["system/node/cpu"]) for row in rows if "system/node/cpu" in row] == [
        (1, 12.5)
    ]
    assert config["optim/lr"] == 0.001


# ------------------------------------------------------------------------------- validation samples
SAMPLES = [
    {
        "message_log": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
        "reward": r,
    }
    for i, r in enumerate([0.1, 0.9, 0.5, 0.0, 0.7])
]


def test_choose_samples_takes_highest_then_lowest_rewards():
    assert [s["reward"] for s in choose_samples(SAMPLES, 3)] == [0.9, 0.7, 0.0]
    assert [s["reward"] for s in choose_samples(SAMPLES, 10)] == [0.9, 0.7, 0.5, 0.1, 0.0]


def test_val_samples_panel_shows_stats_and_chosen_samples_and_file_has_all(tmp_path):
    logger = jsonl_only(tmp_path, num_val_samples_to_print=3)
    console = Console(record=True, width=100)
    logger.sample_printer.console = console
    path = logger.log_val_samples(SAMPLES, step=5)
    logger.finish()
    text = console.export_text()
    assert "reward mean 0.44  min 0  max 0.9  n 5" in text
    assert all(f"[assistant] a{i}" in text for i in (1, 4, 3)) and "a0" not in text and "a2" not in text
    assert path == tmp_path / "run" / "val_samples" / "step_5.jsonl"
    assert read_jsonl(path) == SAMPLES


def test_sample_without_reward_is_named_in_the_error(tmp_path):
    logger = jsonl_only(tmp_path)
    with pytest.raises(ValueError, match="sample 1 has no 'reward'"):
        logger.log_val_samples([SAMPLES[0], {"message_log": []}], step=1)
    logger.finish()


def test_messages_are_coloured_by_role_and_content_is_not_markup():
    sample = {
        "message_log": [{"role": "user", "content": "[red]x[/red]"}, {"role": "assistant", "content": "y"}],
        "reward": 1.0,
    }
    text = render_sample(sample)
    styles = {text.plain[span.start : span.end]: str(span.style) for span in text.spans}
    assert styles["[red]x[/red]\n"] == "cyan" and styles["y\n"] == "green"


# -------------------------------------------------------------------------------- system monitor
EXPOSITION = """# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{ip="10.0.0.1"} 37.5
ray_node_mem_used{ip="10.0.0.1"} 2147483648
ray_node_mem_total{ip="10.0.0.1"} 8589934592
ray_node_gpus_utilization{GpuIndex="0",ip="10.0.0.1"} 80
ray_node_gram_used{GpuIndex="0",ip="10.0.0.1"} 1000
ray_node_gram_available{GpuIndex="0",ip="10.0.0.1"} 3000
ray_node_disk_free{ip="10.0.0.1"} 5
"""


def test_parse_node_metrics_converts_units_and_adds_gpu_totals():
    assert parse_node_metrics(EXPOSITION) == {
        "cpu_utilization": 37.5,
        "mem_used_gb": 2.0,
        "mem_total_gb": 8.0,
        "mem_utilization": 25.0,
        "gpu0/utilization": 80.0,
        "gpu0/memory_used_mb": 1000.0,
        "gpu0/memory_total_mb": 4000.0,
    }


def test_monitor_flush_means_each_key_over_samples_that_have_it(tmp_path):
    """Samples {a: 1, b: 4} and {a: 3}: a = (1 + 3) / 2 = 2, b = 4 (only one sample has it)."""
    logger = jsonl_only(tmp_path)
    monitor = RaySystemMonitor(parent_logger=logger, collection_interval=1, flush_interval=1)
    monitor._buffer = [{"a": 1.0, "b": 4.0}, {"a": 3.0}]
    monitor.flush()
    logger.finish()
    assert read_jsonl(logger.log_dir / "metrics.jsonl") == [{"step": 1, "system/a": 2.0, "system/b": 4.0}]


def test_failed_scrape_warns_once_and_returns_nothing(caplog):
    monitor = RaySystemMonitor(parent_logger=None, collection_interval=1, flush_interval=1, timeout=1)
    with caplog.at_level(logging.WARNING, logger="posttrain.utils.system_monitor"):
        assert monitor._scrape("http://127.0.0.1:1/metrics") == {}
        assert monitor._scrape("http://127.0.0.1:1/metrics") == {}
    assert len([r for r in caplog.records if "127.0.0.1:1" in r.getMessage()]) == 1


def test_monitor_gpus_without_ray_warns_and_runs_without_monitor(tmp_path, caplog, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # the integration tests' Ray may be up
    with caplog.at_level(logging.WARNING, logger="posttrain.utils.logger"):
        logger = jsonl_only(tmp_path, monitor_gpus=True)
    logger.finish()
    assert logger.system_monitor is None and "Ray is not initialized" in caplog.text


def test_nan_inf_and_a_one_element_tensor_reach_jsonl_tensorboard_and_mlflow_as_they_are(tmp_path):
    """A diverged loss stays visible: NaN and inf are logged as such in every backend, and a one-element
    tensor is the plain scalar `name` (no `name/mean` summary)."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = {"log_dir": str(tmp_path / "run"), "mlflow_enabled": True, "mlflow": {"experiment_name": "e"}}
    logger = Logger(validate_config(LoggerConfig, settings))
    metrics = {"loss": float("nan"), "grad_norm": float("inf"), "kl": torch.tensor([0.25])}
    logger.log_metrics(metrics, step=3, prefix="train")
    mlflow_backend = logger.backends[-1]
    logger.finish()
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert np.isnan(record["train/loss"]) and record["train/grad_norm"] == float("inf")
    assert record["train/kl"] == 0.25 and "train/kl/mean" not in record
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert np.isnan(events.Scalars("train/loss")[0].value)
    assert events.Scalars("train/grad_norm")[0].value == float("inf")
    assert events.Scalars("train/kl")[0].value == 0.25
    client = MlflowClient(tracking_uri=mlflow_backend.tracking_uri)
    assert np.isnan(client.get_metric_history(mlflow_backend.run_id, "train/loss")[0].value)
    assert client.get_metric_history(mlflow_backend.run_id, "train/grad_norm")[0].value == float("inf")
    assert client.get_metric_history(mlflow_backend.run_id, "train/kl")[0].value == 0.25
