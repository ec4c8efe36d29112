"""The supervised loop, which SFT, DPO and reward-model training share: they differ only in how a batch
trains and how validation scores, which `sft` and `pairs` pass in as plain functions. This module sets
such a run up (run directory, model, data, workers, logger, resume) and runs it, as an explicit loop like
GRPO's, calling the same end-of-step helpers (`run.log_step`, `run.checkpoint_if_due`): train, log,
validate every `val_period` steps and at the end, checkpoint when due, export the final model."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generic

from transformers import PreTrainedTokenizerBase

from posttrain.algorithms.checks import check_batch_fits, check_loop_lengths
from posttrain.algorithms.run import (
    ConfigT,
    check_run_directories,
    checkpoint_if_due,
    log_step,
    prepare_run,
    restore_run,
    shutdown_on_error,
)
from posttrain.algorithms.teacher import check_same_tokenizer
from posttrain.config import ConfigError
from posttrain.data import StatefulDataLoader, load_datasets
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.virtual_cluster import RayVirtualCluster
from posttrain.evals.supervised_samples import log_supervised_samples
from posttrain.models.build import load_tokenizer
from posttrain.models.vlm import processor_for
from posttrain.utils.checkpoint import CheckpointManager
from posttrain.utils.logger import Logger
from posttrain.utils.progress import StepProgress
from posttrain.utils.timer import Timer
from posttrain.workers.policy import Policy, PolicyConfig


@dataclass
class LoopConfig:
    """The loop knobs of a supervised algorithm (the `sft`, `dpo` and `rm` sections)."""

    RENAMED: ClassVar[dict[str, str]] = {"val_max_samples": "max_val_samples"}

    max_num_epochs: int = 1
    """passes over the training set (when max_num_steps is null)"""
    max_num_steps: int | None = None
    """optimizer steps; wins over max_num_epochs, the data loops as needed (null: epochs)"""
    val_period: int = 25
    """validate every this many steps and after the last (0: never)"""
    val_global_batch_size: int = 64
    """validation examples (conversations, or pairs for dpo/rm) per batch"""
    max_val_samples: int | None = 256
    """validation examples used (None: all)"""
    export_final_model: bool = True
    """write <log_dir>/hf_model at the end"""

    def validate(self) -> None:
        if self.val_period < 0:
            raise ConfigError("val_period", f"must be >= 0 (0: never), got {self.val_period}")
        check_loop_lengths(self)


@dataclass
class SupervisedRun(Generic[ConfigT]):
    """Everything one SFT, DPO or RM run holds; the algorithm's `*_train` advances it."""

    cfg: ConfigT
    name: str  # the algorithm: run directory prefix and progress label
    loop: LoopConfig
    log_dir: Path
    tokenizer: PreTrainedTokenizerBase
    policy: Policy
    cluster: RayVirtualCluster
    train_loader: StatefulDataLoader
    val_data: list[BatchedDataDict]
    logger: Logger
    checkpoints: CheckpointManager
    total_steps: int
    step: int = 0
    teacher: Policy | None = None  # a frozen distillation teacher (SFT with distillation.enabled)

    def shutdown(self) -> None:
        self.logger.finish()
        self.policy.shutdown()
        if self.teacher is not None:
            self.teacher.shutdown()
        self.cluster.shutdown()


ValBatches = Callable[[SupervisedRun, list[dict]], list[BatchedDataDict]]


def setup_run(
    cfg: ConfigT,
    name: str,
    records_per_step: int,
    val_batches: ValBatches,
    init_reference_model: bool = False,
    teacher: PolicyConfig | None = None,
) -> SupervisedRun[ConfigT]:
    """Data, model, workers, logger and checkpoints for algorithm `name` (also its loop section's key;
    `records_per_step` training records per step, validation batches from `val_batches`); resumes from the
    latest checkpoint if there is one, and logs every section but the run plumbing as hyperparameters. With
    `init_reference_model` the workers keep the initial weights as a frozen reference; with `teacher`, a
    frozen teacher model shares each bundle with the policy (half of it each) and must have the policy's
    tokenizer."""
    cfg = prepare_run(cfg, name)
    loop = getattr(cfg, name)
    tokenizer = load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name)
    processor = processor_for(cfg.policy.model_name, cfg.policy.tokenizer_name)  # None unless vision-language
    train_records, val_records, data_stats = load_datasets(cfg.data, tokenizer, processor)
    batch_size = cfg.policy.train_global_batch_size
    check_batch_fits(
        len(train_records), records_per_step, "policy.train_global_batch_size", batch_size, cfg.data.dataset
    )
    loader = StatefulDataLoader(
        train_records, records_per_step, shuffle=cfg.data.shuffle, seed=cfg.data.training_order_seed
    )
    total_steps = loop.max_num_steps or loop.max_num_epochs * len(loader)  # steps win; the data loops
    cluster = RayVirtualCluster(cfg.cluster)
    with shutdown_on_error(cluster):  # a failed start leaves no placement group or worker behind
        check_run_directories(cfg, cluster.bundle_node_ids())
        # A reference is the weights the workers load now: the initial model, also when resuming below.
        policy = Policy(cluster, cfg.policy, init_reference_model=init_reference_model)
        teacher_policy = None
        if teacher is not None:
            check_same_tokenizer(tokenizer, teacher, "distillation.teacher")
            teacher_policy = Policy(cluster, teacher, name_prefix="teacher")
        run = SupervisedRun(
            cfg,
            name,
            loop,
            Path(cfg.logger.log_dir),
            tokenizer,
            policy,
            cluster,
            loader,
            [],
            Logger(cfg.logger),
            CheckpointManager(cfg.checkpointing),
            total_steps,
            teacher=teacher_policy,
        )
        val_records = val_records[: loop.max_val_samples] if loop.max_val_samples else val_records
        run.val_data = val_batches(run, val_records)
        restored = restore_run(run.checkpoints, {"policy": policy}, loader)
        run.step = int(restored["step"]) if restored is not None else 0
        plumbing = ("cluster", "logger", "checkpointing")
        sections = [item.name for item in dataclasses.fields(cfg) if item.name not in plumbing]
        run.logger.log_hyperparams({key: getattr(cfg, key) for key in sections})
        run.logger.log_metrics({f"data/{k}": v for k, v in data_stats.items()}, run.step)
        return run


StepFn = Callable[[SupervisedRun, Timer], dict[str, float]]
ValidateFn = Callable[[SupervisedRun], dict[str, float]]
ShownFn = Callable[[dict[str, float], dict[str, float] | None], dict[str, float]]


def train(
    run: SupervisedRun,
    train_step: StepFn,
    validate: ValidateFn,
    shown: ShownFn,
    pairs: bool = False,
    num_steps: int | None = None,
) -> dict[str, float]:
    """Train until `run.total_steps` (or `num_steps` more steps), one `train_step` per optimizer step, then
    log its metrics and stage timings, validate (`validate(run)`) every `val_period` steps and at the last
    step and log samples (chosen and rejected with `pairs`), checkpoint when due (always at the run's final
    step); `shown` picks the progress line's numbers. Exports `<log_dir>/hf_model` at the run's end (unless
    `export_final_model` is off). Returns the last validation metrics."""
    last_step = run.total_steps if num_steps is None else min(run.total_steps, run.step + num_steps)
    val_metrics: dict[str, float] = {}
    timer = Timer()
    with StepProgress(run.name, last_step, start=run.step) as progress:
        while run.step < last_step:
            start = time.perf_counter()
            metrics = train_step(run, timer)
            run.step += 1
            metrics["step_time"] = time.perf_counter() - start
            log_step(run.logger, run.policy, metrics, timer, run.step)
            info: dict[str, float] = {"step": run.step, "epoch": run.train_loader.epoch}
            step_val = None
            period = run.loop.val_period
            if period and (run.step % period == 0 or run.step == last_step):
                step_val = val_metrics = validate(run)
                run.logger.log_metrics(val_metrics, run.step, prefix="val")
                log_supervised_samples(
                    run.logger, run.policy, run.tokenizer, run.val_data, run.step, pairs=pairs
                )
                info["val_loss"] = val_metrics["loss"]  # the default ranking metric
            force = run.step == last_step == run.total_steps
            loader_state = run.train_loader.state_dict()
            models = {"policy": run.policy}
            checkpoint_if_due(run.checkpoints, models, run.step, info, loader_state, run.cfg, force)
            progress.advance(run.step, shown(metrics, step_val))
    if run.step == run.total_steps and run.loop.export_final_model:
        run.policy.export_hf(str(run.log_dir / "hf_model"))
    return val_metrics
