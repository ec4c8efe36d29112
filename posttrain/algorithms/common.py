"""What every algorithm's run shares: the typed config from the command line, the run directory, the
model directory (built from an architecture config for offline runs), and checkpoint save/restore of the
whole run state (policy, data-loader position, step counters)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from posttrain.config import ConfigError, config_to_dict, format_config_help, load_typed_config, save_config
from posttrain.data.sources import looks_like_hub_name
from posttrain.utils.checkpoint import CheckpointManager

T = TypeVar("T")


def load_run_config(schema_cls: type[T], args: Any) -> T:
    """The validated config of `posttrain <algo> --config FILE overrides...`; `--help-config` lists keys."""
    if getattr(args, "help_config", False):
        print(format_config_help(schema_cls))
        sys.exit(0)
    return load_typed_config(schema_cls, args.config, args.overrides)


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
    resume_from = cfg.checkpointing.resume_from
    if resume_from and not Path(resume_from).is_dir():
        raise ConfigError("checkpointing.resume_from", f"{resume_from} does not exist (a run's checkpoints/step_N)")
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
        check_model_exists("policy.model_name", policy_cfg.model_name)
        if policy_cfg.tokenizer_name:
            check_model_exists("policy.tokenizer_name", policy_cfg.tokenizer_name)
        return
    from posttrain.models.build import build_model_dir

    model_dir = log_dir / "initial_model"
    if not (model_dir / "config.json").exists():
        build_model_dir(from_config, model_dir)
    policy_cfg.model_name = str(model_dir)


def check_model_exists(key: str, name: str) -> None:
    """ConfigError when `name` is neither an existing directory nor a plausible hub name (`org/model`,
    or one word); a `<run dir>/hf_model` path names the command of configs/ that writes it."""
    if Path(name).exists() or (looks_like_hub_name(name) and not name.startswith((".", "/"))):
        return
    message = f"{name} does not exist (nor is it a Hugging Face hub name)"
    command = command_writing(Path(name))
    raise ConfigError(key, message + (f"; `{command}` writes it" if command else ""))


def command_writing(model_dir: Path, configs_dir: Path = Path("configs")) -> str | None:
    """`posttrain <algo> --config configs/X.yaml` for the config of configs/ whose log_dir holds
    `model_dir` as its exported hf_model."""
    if model_dir.name != "hf_model" or not configs_dir.is_dir():
        return None
    for config in sorted(configs_dir.glob("*.yaml")):
        text = config.read_text(errors="replace")
        if f"log_dir: {model_dir.parent.as_posix()}\n" in text:
            return f"posttrain {config.stem.split('_')[0]} --config {config.as_posix()}"
    return None


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
    """tmp_step_N: training info + config, policy (DCP, RNG of every rank), loader; then finalize
    (which writes the sha256 manifest before the rename)."""
    path = manager.init_tmp_checkpoint(step, training_info, run_config=config_to_dict(run_config))
    policy.save_checkpoint(str(path / "policy"), save_optimizer=manager.save_optimizer)
    (path / "dataloader.json").write_text(json.dumps(loader_state))
    manager.finalize_checkpoint(path)
    return path.with_name(f"step_{step}")


def restore_run(manager: CheckpointManager, policy: Any) -> RunCheckpoint | None:
    """Remove partial checkpoints, then load the explicit `resume_from` or the newest checkpoint that
    matches its sha256 manifest (damaged newer ones are skipped with a warning)."""
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
        check_loop_lengths(self)


def check_loop_lengths(loop_cfg: Any) -> None:
    """ConfigError for a loop that would not train (max_num_steps/max_num_epochs < 1) or validate
    (val_global_batch_size < 1); keys are relative to the loop's section."""
    steps = getattr(loop_cfg, "max_num_steps", None)
    if steps is not None and steps < 1:
        raise ConfigError.at("max_num_steps", f"must be >= 1 (or null where epochs decide), got {steps}")
    for key in ("max_num_epochs", "val_global_batch_size", "num_prompts_per_step", "num_generations_per_prompt"):
        value = getattr(loop_cfg, key, 1)
        if value < 1:
            raise ConfigError.at(key, f"must be >= 1, got {value}")


def check_parallelism(policy_cfg: Any, cluster_cfg: Any) -> None:
    """ConfigError unless policy.tensor_parallel_size divides the cluster's workers."""
    num_workers = cluster_cfg.num_nodes * cluster_cfg.workers_per_node
    if num_workers % policy_cfg.tensor_parallel_size:
        raise ConfigError(
            "policy.tensor_parallel_size",
            f"{policy_cfg.tensor_parallel_size} does not divide the {num_workers} workers "
            f"(cluster.num_nodes x cluster.workers_per_node)",
        )


def check_batch_fits(num_records: int, batch_size: int, key: str, value: int, dataset: str) -> None:
    """ConfigError when one step needs more records (`batch_size`, set by `key`=`value`) than the data has."""
    if batch_size > num_records:
        raise ConfigError(key, f"{value} needs {batch_size} training records per step, but data.dataset={dataset} "
                               f"has {num_records} usable ones")


def check_pair_batching(policy_cfg: Any, cluster_cfg: Any) -> None:
    """ConfigError unless every rank's share of a global batch and every micro-batch hold whole pairs."""
    check_parallelism(policy_cfg, cluster_cfg)
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


def single_step_metrics(metrics: dict[str, list[float]]) -> dict[str, float]:
    """Policy.train's per-global-batch lists -> floats, for a call that trained exactly one global batch."""
    return {key: float(values[0]) for key, values in metrics.items()}


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


def mean_over_global_batches(metrics: dict[str, list[float]]) -> dict[str, float]:
    """Policy.train's per-global-batch lists -> one float each (mean; min/max for `*_min`/`*_max`)."""
    reduced = {}
    for key, values in metrics.items():
        if key.endswith("_min"):
            reduced[key] = float(min(values))
        elif key.endswith("_max"):
            reduced[key] = float(max(values))
        else:
            reduced[key] = float(sum(values) / len(values))
    return reduced
