"""What every algorithm's run shares: the typed config from the command line, the run directory, the
model directory (built from an architecture config for offline runs), and checkpoint save/restore of the
whole run state (policy, data-loader position, step counters)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from posttrain.config import ConfigError, config_to_dict, save_config
from posttrain.utils.checkpoint import CheckpointManager
from posttrain.utils.metrics import single_step_metrics


def default_log_dir(algorithm: str) -> str:
    return f"results/{algorithm}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare_run_dir(cfg: Any, algorithm: str, metric: tuple[str, bool] = ("val_loss", False)) -> Path:
    """Fill in defaults that depend on the run (log and checkpoint directories, the checkpoint ranking
    metric and its direction), create the run directory, and save the resolved config there."""
    if not cfg.logger.log_dir:
        cfg.logger.log_dir = default_log_dir(algorithm)
    log_dir = Path(cfg.logger.log_dir)
    if not cfg.checkpointing.checkpoint_dir:
        cfg.checkpointing.checkpoint_dir = str(log_dir / "checkpoints")
    if cfg.checkpointing.metric_name == "auto":
        cfg.checkpointing.metric_name = metric[0]
    if cfg.checkpointing.higher_is_better is None:
        cfg.checkpointing.higher_is_better = metric[1]
    log_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, log_dir / "config.yaml")
    return log_dir


def resolve_model_dir(policy_cfg: Any, log_dir: Path) -> None:
    """Offline runs: build `policy.model.from_config` into `<log_dir>/initial_model` once and point
    `policy.model_name` at it (a resumed run finds the same directory)."""
    from_config = policy_cfg.model.from_config if policy_cfg.model is not None else None
    if from_config is None:
        if not policy_cfg.model_name:
            raise ConfigError("policy.model_name", "set a model directory or hub name, or policy.model.from_config")
        return
    from posttrain.models.build import build_model_dir

    model_dir = log_dir / "initial_model"
    if not (model_dir / "config.json").exists():
        build_model_dir(from_config, model_dir)
    policy_cfg.model_name = str(model_dir)


def checkpoint_if_due(run: Any, val_loss: float | None, force: bool = False) -> None:
    """Every `checkpointing.save_period` steps (or when forced): the run's state at `run.step`, with its
    epoch and the latest validation loss (the default ranking metric) as training info."""
    cfg = run.cfg.checkpointing
    if not cfg.enabled or not (force or run.step % cfg.save_period == 0):
        return
    info = {"step": run.step, "epoch": run.train_loader.epoch}
    if val_loss is not None:
        info["val_loss"] = val_loss
    save_run_checkpoint(run.checkpoints, run.policy, run.step, info, run.train_loader.state_dict(), run.cfg)


def end_of_step(run: Any, metrics: dict[str, float], timer: Any, val_period: int, last_step: int,
                validate: Callable[[Any], dict[str, float]]) -> dict[str, float] | None:
    """The bookkeeping after an optimizer step of a supervised-style loop (SFT, DPO, RM): log the step's
    metrics and stage timings, validate every `val_period` steps and at `last_step`, checkpoint when due
    (always at the run's final step). Returns the validation metrics when it validated."""
    run.logger.log_metrics(metrics, run.step, prefix="train")
    run.logger.log_metrics(timer.get_timing_metrics(reduction="sum"), run.step, prefix="timing")
    timer.reset()
    val_metrics = None
    if run.step % val_period == 0 or run.step == last_step:
        val_metrics = validate(run)
        run.logger.log_metrics(val_metrics, run.step, prefix="val")
    val_loss = val_metrics["loss"] if val_metrics else None
    checkpoint_if_due(run, val_loss, force=run.step == last_step == run.total_steps)
    return val_metrics


@dataclass
class RunCheckpoint:
    """What a restored run needs besides the policy state: the step counters and the loader position."""

    path: Path
    training_info: dict[str, Any]
    loader_state: dict[str, Any]


def save_run_checkpoint(
    manager: CheckpointManager, policy: Any, step: int, training_info: dict[str, Any],
    loader_state: dict[str, Any], run_config: Any,
) -> Path:
    """tmp_step_N: training info + config, policy (DCP, RNG of every rank), loader; then finalize."""
    path = manager.init_tmp_checkpoint(step, training_info, run_config=config_to_dict(run_config))
    policy.save_checkpoint(str(path / "policy"))
    (path / "dataloader.json").write_text(json.dumps(loader_state))
    return manager.finalize_checkpoint(path)


def restore_run(manager: CheckpointManager, policy: Any) -> RunCheckpoint | None:
    """Remove partial checkpoints, then load the explicit `resume_from` or the latest finalized one."""
    manager.clean_partial_checkpoints()
    path = manager.get_resume_checkpoint_path()
    if path is None:
        return None
    path = Path(path)
    policy.load_checkpoint(str(path / "policy"))
    training_info = manager.load_training_info(path) or {}
    loader_file = path / "dataloader.json"
    loader_state = json.loads(loader_file.read_text()) if loader_file.exists() else {}
    print(f"resumed from {path} (step {training_info.get('step')})", file=sys.stderr)
    return RunCheckpoint(path, training_info, loader_state)


# -- preference pairs (DPO, RM) ----------------------------------------------------------------------
# A pair's chosen and rejected responses travel as adjacent rows (2i chosen, 2i+1 rejected), which the
# pairwise losses expect inside every micro-batch. Policy.train deals each global batch to the dp ranks in
# contiguous blocks of gbs/dp rows and cuts those into contiguous micro-batches of mbs rows, so pairs stay
# whole when gbs/dp and mbs are even and rows are not reordered (no dynamic batching or packing).


@dataclass
class PairLoopConfig:
    """The loop knobs of the algorithms that train on preference pairs (the `dpo` and `rm` sections)."""

    max_num_epochs: int = field(default=1, metadata={"help": "passes over the training pairs"})
    max_num_steps: int | None = field(default=None, metadata={"help": "optimizer steps (None: epochs decide)"})
    val_period: int = field(default=25, metadata={"help": "validation every this many steps (and at the end)"})
    val_global_batch_size: int = field(default=64, metadata={"help": "pairs per validation batch"})
    val_max_samples: int | None = field(default=256, metadata={"help": "validation pairs used (None: all)"})
    export_final_model: bool = field(default=True, metadata={"help": "write <log_dir>/hf_model at the end"})

    def validate(self) -> None:
        if self.val_period < 1:
            raise ValueError(f"val_period must be >= 1, got {self.val_period}")
        if self.val_global_batch_size < 1:
            raise ValueError(f"val_global_batch_size must be >= 1, got {self.val_global_batch_size}")


def check_pair_batching(policy_cfg: Any, cluster_cfg: Any) -> None:
    """ConfigError unless every rank's share of a global batch and every micro-batch hold whole pairs."""
    for key in ("dynamic_batching", "sequence_packing"):
        if getattr(policy_cfg, key).enabled:
            raise ConfigError(f"policy.{key}.enabled", "reorders rows and would split chosen/rejected pairs; turn it off")
    num_workers = cluster_cfg.num_nodes * cluster_cfg.workers_per_node
    num_ranks = max(1, num_workers // policy_cfg.tensor_parallel_size)
    if policy_cfg.train_global_batch_size % (2 * num_ranks):
        raise ConfigError(
            "policy.train_global_batch_size",
            f"must be a multiple of 2 x {num_ranks} data-parallel ranks (rows are chosen/rejected pairs and "
            f"each rank gets whole pairs), got {policy_cfg.train_global_batch_size}",
        )
    if policy_cfg.train_micro_batch_size % 2:
        raise ConfigError(
            "policy.train_micro_batch_size",
            f"must be even (a micro-batch holds whole chosen/rejected pairs), got {policy_cfg.train_micro_batch_size}",
        )


def pairs_to_train_data(records: list[dict], pad_token_id: int, num_masked_pairs: int = 0) -> Any:
    """Preference records -> a flat batch of 2 x len(records) rows: row 2i the chosen conversation of
    record i, row 2i+1 its rejected one; token_mask covers the final assistant turn (the response). The
    last `num_masked_pairs` pairs get sample_mask 0 (padding that counts nowhere)."""
    from posttrain.data import message_log_to_flat

    logs = []
    for i, record in enumerate(records):
        if "chosen_message_log" not in record or "rejected_message_log" not in record:
            raise ValueError(
                f"preference record {record.get('idx', i)} has no chosen_message_log/rejected_message_log "
                f"(keys {sorted(record)}); use data.format=preference or a preference task"
            )
        logs += [record["chosen_message_log"], record["rejected_message_log"]]
    data = message_log_to_flat(logs, pad_token_id, train_on="last_assistant")
    if num_masked_pairs:
        data["sample_mask"][-2 * num_masked_pairs:] = 0
    return data


def pair_batches(records: list[dict], pairs_per_batch: int, num_ranks: int, pad_token_id: int) -> list[Any]:
    """Evaluation batches of `pairs_per_batch` pairs, each padded with masked copies of its last pair to a
    multiple of `num_ranks` pairs, so that every data-parallel rank gets whole pairs."""
    batches = []
    for start in range(0, len(records), pairs_per_batch):
        chunk = records[start:start + pairs_per_batch]
        num_padding = -len(chunk) % num_ranks
        batches.append(pairs_to_train_data(chunk + [chunk[-1]] * num_padding, pad_token_id, num_padding))
    return batches


def evaluate_pairs(policy: Any, batches: list[Any], loss_fn: Any, micro_batch_size: int) -> dict[str, float]:
    """Forward-only `loss_fn` over evaluation batches: its metrics averaged with each batch weighted by
    its number of real (unmasked) pairs."""
    totals: dict[str, float] = {}
    num_pairs = 0.0
    for batch in batches:
        batch_pairs = float(batch["sample_mask"].sum()) / 2
        metrics = policy.train(batch, loss_fn, eval_mode=True, gbs=batch.size, mbs=micro_batch_size)
        for key, value in single_step_metrics(metrics).items():
            if key != "num_microbatches":
                totals[key] = totals.get(key, 0.0) + value * batch_pairs
        num_pairs += batch_pairs
    return {key: total / max(num_pairs, 1.0) for key, total in totals.items()}
