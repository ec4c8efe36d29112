"""Unified experiment logger: `LoggerInterface`, its TensorBoard / W&B / MLflow / JSONL backends, the
fan-out `Logger`, metric flattening and summaries, and a step's timing record."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.config import ConfigError, config_to_dict, validate_config
from posttrain.utils.metrics import as_number
from posttrain.utils.sample_printer import SamplePrinter

log = logging.getLogger(__name__)


@dataclass
class WandbConfig:
    """Weights & Biases run identity (offline unless an API key is set and WANDB_MODE allows online)."""

    project: str = "posttrain"
    """W&B project name."""
    name: str | None = None
    """W&B run name; None: the run directory's name."""


@dataclass
class TensorboardConfig:
    """Where TensorBoard event files go."""

    log_dir: str | None = None
    """Event file directory; None: <log_dir>/tensorboard."""


@dataclass
class MLflowConfig:
    """MLflow experiment and run; the store is local to the run directory unless tracking_uri is set."""

    experiment_name: str = "posttrain"
    """MLflow experiment (created if missing)."""
    run_name: str | None = None
    """MLflow run name; None: the run directory's name."""
    tracking_uri: str | None = None
    """MLflow server or store URI; None: file store <log_dir>/mlruns."""
    log_model: bool = True
    """At the end, copy the final model directory (<log_dir>/hf_model) as an artifact."""


@dataclass
class GPUMonitoringConfig:
    """Timing of the Ray system monitor (node CPU/memory always, GPUs where present)."""

    collection_interval: float = 10.0
    """Seconds between scrapes of every node."""
    flush_interval: float = 10.0
    """Seconds between logged (averaged) points."""


@dataclass
class LoggerConfig:
    """Where a run's metrics go: JSONL always, plus the enabled backends, all under `log_dir`."""

    log_dir: str | None = None
    """Run directory; every backend writes under it (None: results/<algorithm>-<time>)."""
    wandb_enabled: bool = False
    """Log to Weights & Biases (offline by default)."""
    tensorboard_enabled: bool = True
    """Write TensorBoard event files."""
    mlflow_enabled: bool = False
    """Log to MLflow (local store by default)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B settings."""
    tensorboard: TensorboardConfig = field(default_factory=TensorboardConfig)
    """TB settings."""
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    """MLflow settings."""
    num_val_samples_to_print: int = 0
    """Validation samples printed per validation (best and worst reward)."""
    monitor_gpus: bool = False
    """Log node CPU/memory and GPU metrics from Ray's metrics endpoints."""
    gpu_monitoring: GPUMonitoringConfig = field(default_factory=GPUMonitoringConfig)
    """System monitor intervals."""
    gpu_collection_interval: float | None = None
    """Alias of gpu_monitoring.collection_interval (a flat name some configs use)."""
    gpu_flush_interval: float | None = None
    """Alias of gpu_monitoring.flush_interval (a flat name some configs use)."""

    def __post_init__(self) -> None:
        """Fold the flat GPU-monitoring aliases into `gpu_monitoring` when the config is built; an alias that
        contradicts the nested key raises, naming the nested key to keep."""
        defaults = GPUMonitoringConfig()
        for alias, name in (
            ("gpu_collection_interval", "collection_interval"),
            ("gpu_flush_interval", "flush_interval"),
        ):
            value = getattr(self, alias)
            if value is None:
                continue
            nested = getattr(self.gpu_monitoring, name)
            if nested != getattr(defaults, name) and nested != value:
                raise ConfigError(
                    alias,
                    f"{value} contradicts gpu_monitoring.{name}={nested}; set only gpu_monitoring.{name}",
                )
            setattr(self.gpu_monitoring, name, float(value))
            setattr(self, alias, None)


def default_log_dir(name: str = "run") -> str:
    """`results/<name>-<YYYYmmdd-HHMMSS>`: where a run without `logger.log_dir` writes."""
    return f"results/{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become one level with "/"-joined keys: {"a": {"b": 1}} -> {"a/b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix.rstrip('/')}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, name))
        else:
            flat[name] = value
    return flat


def summarize_values(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90 (linear interpolation, numpy's default) and max of a list of numbers."""
    array = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(array.mean()),
        "p50": float(np.percentile(array, 50)),
        "p90": float(np.percentile(array, 90)),
        "max": float(array.max()),
    }


def prepare_scalars(
    metrics: Mapping[str, Any], prefix: str = "", warned: set[str] | None = None
) -> dict[str, Any]:
    """Flat scalars; a non-empty list (tuple, 1-d array or tensor) of numbers `k` stays as itself beside
    `k/mean`, `k/p50`, `k/p90` and `k/max`; anything else non-numeric is dropped with one warning per key
    (the keys already warned about are kept in `warned`)."""
    warned = set() if warned is None else warned
    scalars: dict[str, Any] = {}
    for key, value in flatten_metrics(metrics, prefix).items():
        number = as_number(value)
        if number is not None:
            scalars[key] = number
            continue
        if hasattr(value, "tolist") and getattr(value, "ndim", None) == 1:
            value = value.tolist()
        numbers = [as_number(item) for item in value] if isinstance(value, (list, tuple)) else []
        if not numbers or None in numbers:
            if key not in warned:
                warned.add(key)
                log.warning(
                    "metric %r is %s, not a number or a non-empty list of numbers; skipped (warned once)",
                    key,
                    type(value).__name__,
                )
            continue
        scalars[key] = numbers
        scalars.update({f"{key}/{stat}": v for stat, v in summarize_values(numbers).items()})
    return scalars


def flatten_hyperparams(params: Any) -> dict[str, Any]:
    """Hyperparameters flattened with "/" after dataclasses become dicts."""
    return flatten_metrics(config_to_dict(params))


def _hparam_value(value: Any) -> int | float | str | bool:
    """A value TensorBoard/MLflow accept: numbers and strings stay, everything else is its str()."""
    if isinstance(value, (bool, int, float, str)):
        return value
    number = as_number(value)
    return number if number is not None else str(value)


def step_timing(driver_timer: Any, worker_timings: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """One step's timing record: the driver's own stages (seconds summed over the step) as `<stage>`, and
    each worker group's stages, already reduced over its ranks with max, as `<group>/<stage>`."""
    timing = dict(driver_timer.get_timing_metrics(reduction="sum"))
    for group, stages in worker_timings.items():
        timing.update({f"{group}/{stage}": float(seconds) for stage, seconds in stages.items()})
    return timing


class LoggerInterface(ABC):
    """What every backend and the fan-out `Logger` implement. The `Logger` prepares each record once
    (`prepare_scalars`) and hands every backend the same flat record."""

    @abstractmethod
    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record the flat `metrics` (names -> numbers; JSONL also keeps number lists) at `step`."""

    @abstractmethod
    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters (nested dicts are flattened with "/")."""

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:  # noqa: B027
        """Keep a file or directory with the run (under `artifact_path`); backends without artifact
        storage (JSONL, TensorBoard, W&B here) ignore it."""

    def finish(self) -> None:  # noqa: B027 - optional hook, most backends need it
        """Flush and close; the default has nothing to close."""


class JsonlLogger(LoggerInterface):
    """Always on: one JSON line per call in `<log_dir>/metrics.jsonl`: {"step": N, "<prefix>/<name>": ...}.
    A number list keeps its raw values beside its summary; hyperparameters go to hyperparams.json."""

    def __init__(self, log_dir: str | Path):
        self.path = Path(log_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish()

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        self._file.write(json.dumps({"step": int(step), **metrics}) + "\n")
        self._file.flush()

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        flat = {
            k: _hparam_value(v) if v is not None else None for k, v in flatten_hyperparams(params).items()
        }
        (self.path.parent / "hyperparams.json").write_text(json.dumps(flat, indent=2, sort_keys=True))

    def finish(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorboardLogger(LoggerInterface):
    """Scalars and hparams as TensorBoard event files (readable by TensorBoard's EventAccumulator)."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        flat = {k: _hparam_value(v) for k, v in flatten_hyperparams(params).items()}
        # run_name="." keeps the hparams in this directory instead of a timestamped sub-directory.
        self._writer.add_hparams(flat, {}, run_name=".")
        self._writer.flush()

    def finish(self) -> None:
        self._writer.close()


class WandbLogger(LoggerInterface):
    """A W&B run under `<log_dir>/wandb`, offline unless an API key is present and WANDB_MODE allows.

    W&B drops rows whose step goes backwards, so namespaces with their own step counter (`system/`, the
    system monitor's) are logged against their own x-axis `<ns>/step`, attached to the current row."""

    OWN_STEP_NAMESPACES = ("system",)

    def __init__(self, cfg: WandbConfig, log_dir: str | Path):
        import wandb

        Path(log_dir).mkdir(parents=True, exist_ok=True)
        # WANDB_MODE when set; else online only with an API key; else offline (never waits for a login).
        self.mode = os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
        name = cfg.name or Path(log_dir).name
        self._run = wandb.init(
            project=cfg.project, name=name, dir=str(log_dir), mode=self.mode, reinit="create_new"
        )
        for namespace in self.OWN_STEP_NAMESPACES:
            self._run.define_metric(f"{namespace}/*", step_metric=f"{namespace}/step")

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        scalars = dict(metrics)
        for namespace in self.OWN_STEP_NAMESPACES:
            own = {key: value for key, value in scalars.items() if key.startswith(f"{namespace}/")}
            if own:
                self._run.log({**own, f"{namespace}/step": int(step)}, commit=False)
                scalars = {key: value for key, value in scalars.items() if key not in own}
        if scalars:
            self._run.log(scalars, step=int(step))

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._run.config.update(flatten_hyperparams(params), allow_val_change=True)

    def finish(self) -> None:
        self._run.finish()


_MLFLOW_PARAM_LIMIT = 6000  # MLflow rejects longer parameter values
_MLFLOW_KEY_INVALID = re.compile(r"[^\w\-. :/]")


def mlflow_key(key: str) -> str:
    """MLflow accepts letters, digits, _ - . space : / in names; anything else becomes "_"."""
    return _MLFLOW_KEY_INVALID.sub("_", key)


class MLflowLogger(LoggerInterface):
    """An MLflow run; with no tracking_uri the store is the file store `<log_dir>/mlruns`."""

    def __init__(self, cfg: MLflowConfig, log_dir: str | Path):
        from mlflow.tracking import MlflowClient

        log_dir = Path(log_dir).resolve()
        self.tracking_uri = cfg.tracking_uri or (log_dir / "mlruns").as_uri()
        if cfg.tracking_uri is None:
            # MLflow 3 refuses file stores unless told; this one is ours, inside the run directory.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self.client.get_experiment_by_name(cfg.experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = None if cfg.tracking_uri else (log_dir / "mlartifacts").as_uri()
            experiment_id = self.client.create_experiment(cfg.experiment_name, artifact_location=artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=cfg.run_name or log_dir.name).info.run_id

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        entries = [Metric(mlflow_key(key), value, now_ms, int(step)) for key, value in metrics.items()]
        if entries:
            self.client.log_batch(self.run_id, metrics=entries)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = flatten_hyperparams(params)
        entries = [
            Param(mlflow_key(key), str(_hparam_value(value))[:_MLFLOW_PARAM_LIMIT])
            for key, value in flat.items()
        ]
        for start in range(0, len(entries), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=entries[start : start + 100])

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        local_path = Path(local_path)
        if local_path.is_dir():
            self.client.log_artifacts(self.run_id, str(local_path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(local_path), artifact_path)

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


def run_artifacts(log_dir: Path, include_model: bool = True) -> list[tuple[Path, str | None]]:
    """(local path, artifact directory) pairs of a run directory's lasting files: config.yaml at the top,
    each finalized checkpoint's training_info.json and config.yaml under checkpoints/step_N, and the
    final model directory hf_model (when `include_model`)."""
    pairs: list[tuple[Path, str | None]] = []
    if (log_dir / "config.yaml").is_file():
        pairs.append((log_dir / "config.yaml", None))
    for step_dir in sorted((log_dir / "checkpoints").glob("step_*")):
        files = [step_dir / name for name in ("training_info.json", "config.yaml")]
        pairs.extend((path, f"checkpoints/{step_dir.name}") for path in files if path.is_file())
    if include_model and (log_dir / "hf_model").is_dir():
        pairs.append((log_dir / "hf_model", "hf_model"))
    return pairs


class Logger(LoggerInterface):
    """Fans every call out to JSONL and the enabled backends; prints and saves validation samples;
    runs the Ray system monitor when `monitor_gpus` is set and Ray is up."""

    def __init__(self, cfg: LoggerConfig | Mapping[str, Any]):
        if isinstance(cfg, Mapping):  # a plain dict, through the one typed loader
            cfg = validate_config(LoggerConfig, dict(cfg))
        self.cfg = cfg
        log_dir = cfg.log_dir  # the config stays as given; a missing directory is derived here
        if not log_dir:
            log_dir = default_log_dir()
            log.info("logger.log_dir not set; writing to %s", log_dir)
        self._log_dir = Path(log_dir)
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self.backends: list[LoggerInterface] = [JsonlLogger(self._log_dir), *self._make_backends()]
        self._warned: set[str] = set()  # metric names already warned about by `prepare_scalars`
        self._lock = threading.Lock()
        self.sample_printer = SamplePrinter(self._log_dir / "val_samples", self.cfg.num_val_samples_to_print)
        self.system_monitor = self._maybe_start_monitor()
        self._finished = False

    @property
    def log_dir(self) -> Path:
        return self._log_dir

    def _make_backends(self) -> list[LoggerInterface]:
        backends: list[LoggerInterface] = []
        if self.cfg.tensorboard_enabled:
            backends.append(TensorboardLogger(self.cfg.tensorboard.log_dir or self._log_dir / "tensorboard"))
        if self.cfg.wandb_enabled:
            backends.append(WandbLogger(self.cfg.wandb, self._log_dir))
        if self.cfg.mlflow_enabled:
            backends.append(MLflowLogger(self.cfg.mlflow, self._log_dir))
        return backends

    def _maybe_start_monitor(self) -> Any:
        if not self.cfg.monitor_gpus:
            return None
        import ray

        if not ray.is_initialized():
            log.warning("logger.monitor_gpus is set but Ray is not initialized; no system metrics")
            return None
        from posttrain.utils.system_monitor import RaySystemMonitor

        monitor = RaySystemMonitor(
            self, self.cfg.gpu_monitoring.collection_interval, self.cfg.gpu_monitoring.flush_interval
        )
        monitor.start()
        return monitor

    def log_metrics(self, metrics: Mapping[str, Any], step: int, prefix: str = "") -> None:
        """Flatten and summarise once (`prepare_scalars`), then hand the same record to every backend (JSONL
        keeps the number lists; thread-safe)."""
        with self._lock:
            record = prepare_scalars(metrics, prefix, self._warned)
            scalars = {key: value for key, value in record.items() if not isinstance(value, list)}
            for backend in self.backends:
                backend.log_metrics(record if isinstance(backend, JsonlLogger) else scalars, step)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        with self._lock:
            for backend in self.backends:
                backend.log_hyperparams(params)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        with self._lock:
            for backend in self.backends:
                backend.log_artifact(local_path, artifact_path)

    def log_val_samples(self, samples: Sequence[Mapping[str, Any]], step: int) -> Path:
        """Write all samples to val_samples/step_N.jsonl and print the chosen ones; returns the file."""
        return self.sample_printer.log(samples, step)

    def finish(self) -> None:
        """Stop (and flush) the system monitor, hand MLflow the run's lasting files (`run_artifacts`; the
        model unless `mlflow.log_model` is off), then close every backend; safe to call twice."""
        if self._finished:
            return
        self._finished = True
        if self.system_monitor is not None:
            self.system_monitor.stop()
        if self.cfg.mlflow_enabled:
            for local, artifact_dir in run_artifacts(self._log_dir, include_model=self.cfg.mlflow.log_model):
                self.log_artifact(local, artifact_dir)
        for backend in self.backends:
            backend.finish()

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()
