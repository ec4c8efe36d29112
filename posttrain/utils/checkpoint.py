"""Checkpoint policy: temporary directory, crash-safe finalize by rename, top-k by a metric, latest/best
lookup, saved training info, and a sha256 manifest of every file, written before a checkpoint is finalized
and verified before it is resumed from. What goes inside a checkpoint is `native_checkpoint.py`'s business.

Layout (the document's): checkpoint_dir/step_N/{training_info.json, config.yaml, checksums.json, policy/...}.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from posttrain.config import ConfigError, config_to_dict, validate_config

logger = logging.getLogger(__name__)

TRAINING_INFO_FILE = "training_info.json"
CONFIG_FILE = "config.yaml"
MANIFEST_FILE = "checksums.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = "tmp_step_"
# An existing step_N being replaced is first renamed to this; it is never read as a checkpoint.
_REPLACED_PREFIX = "replaced_step_"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, permission, a file in the way); names the path."""


@dataclass
class CheckpointingConfig:
    """Where checkpoints go, how often, and which ones are kept."""

    enabled: bool = True
    """Save checkpoints at all."""
    checkpoint_dir: str | None = None
    """Directory holding step_N/ checkpoint folders; None: <logger.log_dir>/checkpoints."""
    metric_name: str | None = "auto"
    """training_info key that ranks checkpoints; auto: the algorithm's validation metric (val_loss; GRPO:
    val_accuracy); None ranks by step only."""
    higher_is_better: bool | None = None
    """True if a larger metric is better; None: the algorithm's choice."""
    keep_top_k: int | None = None
    """Keep the k best checkpoints (plus the latest); None keeps all."""
    save_optimizer: bool = True
    """Save optimizer state; false: weights only (export-only checkpoints, resume with a fresh optimizer)."""
    save_period: int = 10
    """Save every this many steps."""
    resume_from: str | None = None
    """Explicit checkpoint directory to resume from; None: the latest one."""

    def validate(self) -> None:
        if self.keep_top_k is not None and self.keep_top_k < 1:
            raise ConfigError("keep_top_k", f"must be >= 1 or None, got {self.keep_top_k}")
        if self.save_period < 1:
            raise ConfigError("save_period", f"must be >= 1, got {self.save_period}")


def _json_default(value: Any) -> Any:
    """Tensor and numpy scalars (anything with `.item()`) become plain numbers; arrays become lists."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"training_info value of type {type(value).__name__} is not JSON serialisable")


def _fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable (best effort: not every platform opens directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


class CheckpointManager:
    """Creates, finalizes, ranks and prunes `step_N/` checkpoint directories under `checkpoint_dir`."""

    def __init__(self, config: CheckpointingConfig | Mapping[str, Any]):
        if isinstance(config, Mapping):  # the document's plain dict, through the one typed loader
            config = validate_config(CheckpointingConfig, dict(config))
        if config.checkpoint_dir is None:
            raise ValueError("checkpointing.checkpoint_dir is not set")
        # Nothing chose a ranking: the library's default (a copy; the caller's config stays as it was).
        self.config = dataclasses.replace(
            config,
            metric_name="val_loss" if config.metric_name == "auto" else config.metric_name,
            higher_is_better=bool(config.higher_is_better),
        )
        self.checkpoint_dir = Path(self.config.checkpoint_dir)

    # The document's attributes, "derived from the CheckpointingConfig" (read live from the config).
    @property
    def enabled(self) -> bool:
        return self.config.enabled

    @property
    def metric_name(self) -> str | None:
        return self.config.metric_name

    @property
    def higher_is_better(self) -> bool:
        return bool(self.config.higher_is_better)

    @property
    def keep_top_k(self) -> int | None:
        return self.config.keep_top_k

    @property
    def save_optimizer(self) -> bool:
        return self.config.save_optimizer

    def init_tmp_checkpoint(self, step: int, training_info: dict[str, Any], run_config: Any = None) -> Path:
        """Create `tmp_step_{step}` (replacing a stale one) with training_info.json and config.yaml."""
        tmp_path = self.checkpoint_dir / f"{_TMP_PREFIX}{step}"
        try:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            if tmp_path.exists() or tmp_path.is_symlink():
                _remove_path(tmp_path)
            tmp_path.mkdir()
        except OSError as error:
            raise CheckpointWriteError(f"cannot create checkpoint directory {tmp_path}: {error}") from error
        info_text = json.dumps(training_info, default=_json_default, indent=2, sort_keys=True)
        _write_text(tmp_path / TRAINING_INFO_FILE, info_text)
        if run_config is not None:
            dump = getattr(run_config, "model_dump", None)  # a pydantic model's
            plain = dump(mode="json") if dump is not None else config_to_dict(run_config)
            _write_text(tmp_path / CONFIG_FILE, yaml.safe_dump(plain, sort_keys=False))
        return tmp_path

    def finalize_checkpoint(self, checkpoint_path: str | Path) -> None:
        """Write the sha256 manifest, then rename `tmp_step_N` to `step_N` atomically, replacing an existing
        `step_N` without mixing files; then prune to `keep_top_k`.

        Replacing goes: step_N -> replaced_step_N, tmp_step_N -> step_N, delete replaced_step_N. A crash
        between the first two renames is repaired by `clean_partial_checkpoints` (it renames it back)."""
        tmp_path = Path(checkpoint_path)
        if not tmp_path.name.startswith(_TMP_PREFIX):
            raise ValueError(f"finalize_checkpoint expects a {_TMP_PREFIX}N directory, got {tmp_path}")
        step_text = tmp_path.name[len(_TMP_PREFIX) :]
        final_path = tmp_path.with_name(f"step_{step_text}")
        replaced_path = tmp_path.with_name(f"{_REPLACED_PREFIX}{step_text}")
        try:
            write_manifest(tmp_path)
            if final_path.exists():
                if replaced_path.exists():
                    shutil.rmtree(replaced_path)
                os.rename(final_path, replaced_path)
            os.rename(tmp_path, final_path)
            _fsync_dir(final_path.parent)
        except OSError as error:
            raise CheckpointWriteError(
                f"cannot finalize checkpoint {tmp_path} -> {final_path}: {error}"
            ) from error
        if replaced_path.exists():
            shutil.rmtree(replaced_path, ignore_errors=True)
        self.remove_old_checkpoints()

    def clean_partial_checkpoints(self) -> list[Path]:
        """Delete stale `tmp_step_*` dirs; restore a `replaced_step_N` whose `step_N` never arrived."""
        if not self.checkpoint_dir.is_dir():
            return []
        removed = []
        for child in sorted(self.checkpoint_dir.iterdir()):
            if child.name.startswith(_TMP_PREFIX):
                _remove_path(child)
                removed.append(child)
            elif child.name.startswith(_REPLACED_PREFIX):
                final_path = child.with_name("step_" + child.name[len(_REPLACED_PREFIX) :])
                if final_path.exists():
                    _remove_path(child)
                    removed.append(child)
                else:
                    os.rename(child, final_path)
                    logger.warning("restored %s from %s (interrupted replacement)", final_path, child)
        if removed:
            logger.warning("removed partial checkpoint(s): %s", ", ".join(str(p) for p in removed))
        return removed

    def list_checkpoints(self) -> list[tuple[int, Path]]:
        """Finalized checkpoints as (step, path), sorted by step number; other names are ignored."""
        return _list_step_dirs(self.checkpoint_dir)

    def _metric_of(self, checkpoint_path: Path) -> float | None:
        if self.config.metric_name is None:
            return None
        value = (self.load_training_info(checkpoint_path) or {}).get(self.config.metric_name)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def _ranked(self) -> list[tuple[int, Path, float | None]]:
        """Best first: checkpoints with the metric by direction (ties: more recent first), then the rest."""
        entries = [(step, path, self._metric_of(path)) for step, path in self.list_checkpoints()]
        sign = 1.0 if self.config.higher_is_better else -1.0

        def rank_key(entry: tuple[int, Path, float | None]) -> tuple[bool, float, int]:
            step, _, metric = entry
            return (metric is not None, sign * metric if metric is not None else 0.0, step)

        return sorted(entries, key=rank_key, reverse=True)

    def remove_old_checkpoints(self, exclude_latest: bool = True) -> None:
        """Keep the top-k by metric, plus the latest when `exclude_latest`; delete the rest."""
        if self.config.keep_top_k is None:
            return
        ranked = self._ranked()
        keep = {path for _, path, _ in ranked[: self.config.keep_top_k]}
        checkpoints = self.list_checkpoints()
        if exclude_latest and checkpoints:
            keep.add(checkpoints[-1][1])
        for _, path, _ in ranked:
            if path not in keep:
                shutil.rmtree(path)

    def get_best_checkpoint_path(self) -> str | None:
        """The best checkpoint by metric; the latest (with a warning) when none has the metric."""
        ranked = self._ranked()
        if not ranked:
            return None
        if self.config.metric_name is None:
            return self.get_latest_checkpoint_path()
        missing = [str(path) for _, path, metric in ranked if metric is None]
        if len(missing) == len(ranked):
            metric = self.config.metric_name
            logger.warning("no checkpoint in %s has metric %r; using the latest", self.checkpoint_dir, metric)
            return self.get_latest_checkpoint_path()
        if missing:
            logger.warning(
                "checkpoint(s) without metric %r ignored: %s", self.config.metric_name, ", ".join(missing)
            )
        return str(ranked[0][1])

    def get_latest_checkpoint_path(self) -> str | None:
        """The checkpoint with the highest step number (`step_10` after `step_9`), or None."""
        checkpoints = self.list_checkpoints()
        return str(checkpoints[-1][1]) if checkpoints else None

    def get_latest_intact_checkpoint_path(self) -> Path | None:
        """The newest checkpoint whose files match its sha256 manifest; each newer damaged one is skipped
        with a warning that names what is wrong."""
        for _, path in reversed(self.list_checkpoints()):
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            logger.warning("skipping damaged checkpoint %s: %s", path, problem)
        return None

    def get_resume_checkpoint_path(self) -> Path | None:
        """`resume_from` when set (it must verify: an explicit choice never falls back), else the newest
        intact checkpoint."""
        if self.config.resume_from is None:
            return self.get_latest_intact_checkpoint_path()
        path = Path(self.config.resume_from)
        if not (path / TRAINING_INFO_FILE).is_file():
            raise FileNotFoundError(f"checkpointing.resume_from={path}: no {TRAINING_INFO_FILE} in it")
        problem = verify_checkpoint(path)
        if problem is not None:
            raise ValueError(f"checkpointing.resume_from={path} is damaged: {problem}")
        return path

    def load_training_info(self, checkpoint_path: str | Path | None = None) -> dict[str, Any] | None:
        """The training_info dict saved in `checkpoint_path`; None when it is None, a tmp dir, or has no
        readable training_info.json (garbage is warned about, never raised: old checkpoints must not
        crash a running job's bookkeeping)."""
        if checkpoint_path is None:
            return None
        path = Path(checkpoint_path)
        if path.name.startswith(_TMP_PREFIX):
            return None
        return _read_training_info(path)


def _list_step_dirs(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    if not checkpoint_dir.is_dir():
        return []
    found = [(_STEP_DIR.match(child.name), child) for child in checkpoint_dir.iterdir() if child.is_dir()]
    return sorted((int(match.group(1)), path) for match, path in found if match)


def _read_training_info(checkpoint_path: Path) -> dict[str, Any] | None:
    info_file = checkpoint_path / TRAINING_INFO_FILE
    if not info_file.is_file():
        return None
    try:
        info = json.loads(info_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        logger.warning("ignoring unreadable %s: %s", info_file, exc)
        return None
    if not isinstance(info, dict):
        logger.warning("ignoring %s: holds a %s, not an object", info_file, type(info).__name__)
        return None
    return info


def _load_checkpoint_history(checkpoint_dir: str | Path) -> list[tuple[int, str, dict[str, Any]]]:
    """Load the history of checkpoints and their metrics: (step_number, checkpoint_path, info) for each
    finalized checkpoint, by step; an unreadable training_info.json gives {}."""
    steps = _list_step_dirs(Path(checkpoint_dir))
    return [(step, str(path), _read_training_info(path) or {}) for step, path in steps]


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _write_text(path: Path, text: str) -> None:
    """Write `text` and fsync it; a failure is a CheckpointWriteError naming the file."""
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise CheckpointWriteError(f"cannot write checkpoint file {path}: {error}") from error


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files_under(directory: Path) -> list[Path]:
    """Every regular file below `directory` (relative), the manifest itself excepted."""
    files = []
    for root, _, names in os.walk(directory):
        for name in names:
            relative = (Path(root) / name).relative_to(directory)
            if relative.as_posix() != MANIFEST_FILE:
                files.append(relative)
    return sorted(files)


def write_manifest(directory: str | Path) -> Path:
    """Write `checksums.json`: {"files": {relative path: {"sha256", "size"}}} for every file below."""
    directory = Path(directory)
    files = {
        relative.as_posix(): {
            "sha256": _sha256(directory / relative),
            "size": (directory / relative).stat().st_size,
        }
        for relative in _files_under(directory)
    }
    _write_text(
        directory / MANIFEST_FILE, json.dumps({"version": 1, "files": files}, indent=1, sort_keys=True)
    )
    return directory / MANIFEST_FILE


def verify_checkpoint(directory: str | Path) -> str | None:
    """None when every file listed in the manifest is present with its size and sha256 and no file was
    added; otherwise a sentence naming what is wrong (the first problem found)."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        return f"{manifest_path} is missing (incomplete, or written before checksums existed)"
    try:
        files = json.loads(manifest_path.read_text(encoding="utf-8"))["files"]
        expected = {name: (entry["sha256"], int(entry["size"])) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        return f"{manifest_path} is not a valid manifest ({type(exc).__name__}: {exc})"
    present = {relative.as_posix() for relative in _files_under(directory)}
    missing, unlisted = sorted(expected.keys() - present), sorted(present - expected.keys())
    if missing:
        return f"{directory / missing[0]} is missing"
    if unlisted:
        return f"{directory / unlisted[0]} is not in the manifest"
    for name, (sha256, size) in sorted(expected.items()):
        actual_size = (directory / name).stat().st_size
        if actual_size != size:
            return f"{directory / name} has {actual_size} bytes, the manifest says {size} (truncated?)"
        if _sha256(directory / name) != sha256:
            return f"{directory / name} does not match its sha256 (corrupted)"
    return None
