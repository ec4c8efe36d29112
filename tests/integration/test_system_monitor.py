"""The Ray system monitor against the real local Ray instance: node CPU and memory values arrive in the
run's metrics.jsonl under `system/`, with the monitor's own step counter, and finish() stops it."""

from __future__ import annotations

import json
import os
import time

from posttrain.config import validate_config
from posttrain.utils.logger import Logger, LoggerConfig
from posttrain.utils.system_monitor import RaySystemMonitor


def wait_for_node_metrics(monitor: RaySystemMonitor, timeout_s: float = 30.0) -> dict[str, float]:
    """Ray's reporter publishes node stats a few seconds after start: scrape until they are there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sample = monitor.collect()
        if any(key.endswith("/mem_total_gb") for key in sample):
            return sample
        time.sleep(0.5)
    raise AssertionError(f"no node metrics from Ray's metrics endpoint within {timeout_s}s")


def test_real_node_cpu_and_memory_arrive_under_system_prefix(ray_session, tmp_path):
    logger = Logger(
        validate_config(
            LoggerConfig,
            {
                "log_dir": str(tmp_path / "run"),
                "tensorboard_enabled": False,
                "monitor_gpus": True,
                "gpu_monitoring": {"collection_interval": 0.5, "flush_interval": 1.0},
            },
        )
    )
    monitor = logger.system_monitor
    assert monitor is not None
    wait_for_node_metrics(monitor)
    metrics_file = logger.log_dir / "metrics.jsonl"
    deadline = time.monotonic() + 30  # at least one flush from the background thread (every second)

    def flushed() -> bool:
        return metrics_file.exists() and "system/" in metrics_file.read_text()

    while not flushed() and time.monotonic() < deadline:
        time.sleep(0.2)
    logger.log_metrics({"loss": 1.0}, step=1, prefix="train")
    logger.finish()
    assert monitor._thread is None

    records = [json.loads(line) for line in (logger.log_dir / "metrics.jsonl").read_text().splitlines()]
    system_records = [r for r in records if any(k.startswith("system/") for k in r)]
    assert len(system_records) >= 2, "one flush while running and one on finish()"
    assert [r["step"] for r in system_records] == list(range(1, len(system_records) + 1))

    node_ip = ray_session.nodes()[0]["NodeManagerAddress"]
    last = system_records[-1]
    total_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    assert abs(last[f"system/{node_ip}/mem_total_gb"] - total_gb) / total_gb < 0.05
    assert 0 < last[f"system/{node_ip}/mem_used_gb"] < total_gb
    assert 0 <= last[f"system/{node_ip}/cpu_utilization"] <= 100
    assert 1 <= last[f"system/{node_ip}/cpu_count"] <= os.cpu_count()
    assert {"step": 1, "train/loss": 1.0} in records
