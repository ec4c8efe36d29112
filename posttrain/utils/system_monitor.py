"""System metrics from Ray: a background thread scrapes every node's Prometheus endpoint (node CPU and
memory always, per-GPU utilisation and memory where present) and logs averages through a parent logger."""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from posttrain.utils.metrics import reduce_metrics

log = logging.getLogger(__name__)

_BYTES_PER_GB = 1024**3
# Ray's names (from its reporter agent) -> our names; memory in bytes, GPU memory in MB.
_NODE_METRICS = {
    "ray_node_cpu_utilization": "cpu_utilization",
    "ray_node_cpu_count": "cpu_count",
    "ray_node_mem_used": "mem_used_gb",
    "ray_node_mem_total": "mem_total_gb",
}
_GPU_METRICS = {
    "ray_node_gpus_utilization": "utilization",
    "ray_node_gram_used": "memory_used_mb",
    "ray_node_gram_available": "memory_available_mb",
}


def metrics_endpoints() -> list[tuple[str, str]]:
    """(node ip, metrics URL) of every alive Ray node, from `ray.nodes()`."""
    import ray

    nodes = [node for node in ray.nodes() if node.get("Alive") and node.get("MetricsExportPort")]
    urls = [f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics" for node in nodes]
    return [(node["NodeManagerAddress"], url) for node, url in zip(nodes, urls)]


def parse_node_metrics(exposition: str) -> dict[str, float]:
    """Node and per-GPU values from Prometheus text: cpu_utilization (%), cpu_count, mem_used_gb,
    mem_total_gb, mem_utilization (%), gpu{i}/utilization (%), gpu{i}/memory_used_mb,
    gpu{i}/memory_total_mb."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            name = _our_name(sample.name, sample.labels)
            if name is not None:
                values[name] = float(sample.value) / (_BYTES_PER_GB if name.startswith("mem_") else 1)
    if values.get("mem_total_gb"):
        values["mem_utilization"] = 100.0 * values.get("mem_used_gb", 0.0) / values["mem_total_gb"]
    for key in [k for k in values if k.endswith("/memory_available_mb")]:
        gpu = key.split("/")[0]
        values[f"{gpu}/memory_total_mb"] = values.pop(key) + values.get(f"{gpu}/memory_used_mb", 0.0)
    return values


def _our_name(sample_name: str, labels: dict[str, str]) -> str | None:
    if sample_name in _NODE_METRICS:
        return _NODE_METRICS[sample_name]
    if sample_name in _GPU_METRICS and "GpuIndex" in labels:
        return f"gpu{labels['GpuIndex']}/{_GPU_METRICS[sample_name]}"
    return None


class RaySystemMonitor:
    """Scrapes every `collection_interval` s; logs the averages under `system/` every `flush_interval` s
    with its own step counter. A failed scrape is a warning (once per node until it recovers)."""

    def __init__(
        self,
        parent_logger: Any,
        collection_interval: float = 10.0,
        flush_interval: float = 10.0,
        timeout: float = 5.0,
    ):
        if collection_interval <= 0 or flush_interval <= 0:
            raise ValueError(
                f"gpu_monitoring intervals must be > 0, got collection_interval={collection_interval}, "
                f"flush_interval={flush_interval}"
            )
        self.parent_logger, self.timeout, self.step = parent_logger, timeout, 0
        self.collection_interval, self.flush_interval = collection_interval, flush_interval
        self._buffer: list[dict[str, float]] = []
        self._failing: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ray-system-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and flush what it collected (one last scrape if it has nothing yet)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if not self._buffer:
            self.collect()
        self.flush()

    def _run(self) -> None:
        last_flush = time.monotonic()
        while not self._stop.is_set():
            self.collect()
            if time.monotonic() - last_flush >= self.flush_interval:
                self.flush()
                last_flush = time.monotonic()
            self._stop.wait(self.collection_interval)

    def collect(self) -> dict[str, float]:
        """Scrape every node once; buffer and return {"<node ip>/<metric>": value}."""
        try:
            endpoints = metrics_endpoints()
        except Exception as error:  # noqa: BLE001 - a monitor never takes the run down
            log.warning("system monitor: cannot list Ray nodes: %s", error)
            return {}
        sample: dict[str, float] = {}
        for node_ip, url in endpoints:
            node_values = self._scrape(url)
            sample.update({f"{node_ip}/{key}": value for key, value in node_values.items()})
        if sample:
            self._buffer.append(sample)
        return sample

    def _scrape(self, url: str) -> dict[str, float]:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as response:
                values = parse_node_metrics(response.read().decode("utf-8"))
        except Exception as error:  # noqa: BLE001 - network, HTTP and parse errors alike
            if url not in self._failing:
                log.warning("system monitor: scrape of %s failed: %s", url, error)
            self._failing.add(url)
            return {}
        self._failing.discard(url)
        return values

    def flush(self) -> None:
        """Log the per-key mean of the buffered samples (a key missing from some samples averages the
        rest) at the monitor's next step; nothing if empty."""
        if not self._buffer:
            return
        averaged = reduce_metrics(self._buffer, default="mean")
        self._buffer = []
        self.step += 1
        self.parent_logger.log_metrics(averaged, step=self.step, prefix="system")
