"""The loop that SFT, DPO and reward-model training share. Each algorithm supplies its config, how a
batch of records becomes train data, its train step and its validation; this module sets the run up
(run directory, model, data, workers, logger, resume) and runs steps: train, log, validate every
`val_period` steps and at the end, checkpoint when due, export the final model."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from transformers import PreTrainedTokenizerBase

from posttrain.algorithms.checks import check_batch_fits, check_loop_lengths
from posttrain.algorithms.run import RunConfig, prepare_run, restore_run, save_run_checkpoint
from posttrain.data import DataConfig, StatefulDataLoader, load_datasets
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.virtual_cluster import ClusterConfig, RayVirtualCluster
from posttrain.evals.supervised_samples import log_supervised_samples
from posttrain.models.build import load_tokenizer
from posttrain.models.vlm import processor_for
from posttrain.utils.checkpoint import CheckpointManager
from posttrain.utils.logger import Logger, step_timing
from posttrain.utils.progress import StepProgress
from posttrain.utils.timer import Timer
from posttrain.workers.policy import Policy


@dataclass
class LoopConfig:
    """The loop knobs of a supervised algorithm (the `sft`, `dpo` and `rm` sections)."""

    max_num_epochs: int = field(default=1, metadata={"help": "passes over the training set"})
    max_num_steps: int | None = field(default=None, metadata={"help": "optimizer steps (None: epochs decide)"})
    val_period: int = field(default=25, metadata={"help": "validation every this many steps (and at the end)"})
    val_global_batch_size: int = field(
        default=64, metadata={"help": "validation examples (conversations, or pairs for dpo/rm) per batch"}
    )
    val_max_samples: int | None = field(default=256, metadata={"help": "validation examples used (None: all)"})
    export_final_model: bool = field(default=True, metadata={"help": "write <log_dir>/hf_model at the end"})

    def validate(self) -> None:
        if self.val_period < 1:
            raise ValueError(f"val_period must be >= 1, got {self.val_period}")
        check_loop_lengths(self)


class SupervisedConfig(RunConfig, Protocol):
    """What the shared loop reads of an algorithm's config (besides its loop section)."""

    data: DataConfig
    cluster: ClusterConfig


ConfigT = TypeVar("ConfigT", bound=SupervisedConfig)


@dataclass
class SupervisedRun(Generic[ConfigT]):
    """Everything one SFT, DPO or RM run holds; the algorithm's `*_train` advances it."""

    cfg: ConfigT
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
    data_stats: dict[str, Any] = field(default_factory=dict)

    def shutdown(self) -> None:
        self.logger.finish()
        self.policy.shutdown()
        self.cluster.shutdown()


@dataclass
class Recipe(Generic[ConfigT]):
    """One supervised algorithm, as the pieces the shared loop calls."""

    name: str  # run directory prefix and progress label
    loop: Callable[[ConfigT], LoopConfig]  # the config's loop section
    records_per_step: Callable[[ConfigT], int]  # training records (conversations or pairs) per step
    val_batches: Callable[[ConfigT, Policy, PreTrainedTokenizerBase, list[dict]], list[BatchedDataDict]]
    train_step: Callable[[SupervisedRun[ConfigT], Timer], dict[str, float]]  # one optimizer step
    validate: Callable[[SupervisedRun[ConfigT]], dict[str, float]]  # metrics over `run.val_data`
    hyperparams: Callable[[ConfigT], dict[str, Any]]  # the config sections logged as hyperparameters
    shown: Callable[[dict[str, float], dict[str, float] | None], dict[str, float]]  # progress line
    init_reference_model: bool = False  # keep the initial weights as a frozen reference
    pairs: bool = False  # the validation batches hold chosen/rejected rows (printed samples show both)


def setup_run(cfg: ConfigT, recipe: Recipe[ConfigT]) -> SupervisedRun[ConfigT]:
    """Data, model, workers, logger and checkpoints; resumes from the latest checkpoint if there is one."""
    cfg = prepare_run(cfg, recipe.name)
    loop = recipe.loop(cfg)
    log_dir = Path(cfg.logger.log_dir)
    tokenizer = load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name)
    processor = processor_for(cfg.policy.model_name, cfg.policy.tokenizer_name)  # None unless vision-language
    train_records, val_records, data_stats = load_datasets(cfg.data, tokenizer, processor)
    records_per_step = recipe.records_per_step(cfg)
    batch_size = cfg.policy.train_global_batch_size
    check_batch_fits(len(train_records), records_per_step, "policy.train_global_batch_size", batch_size, cfg.data.dataset)
    loader = StatefulDataLoader(train_records, records_per_step, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    epochs_steps = loop.max_num_epochs * len(loader)
    total_steps = min(epochs_steps, loop.max_num_steps or epochs_steps)
    cluster = RayVirtualCluster(cfg.cluster)
    # A reference is the weights the workers load now: the initial model, also when resuming below.
    policy = Policy(cluster, cfg.policy, init_reference_model=recipe.init_reference_model)
    val_records = val_records[: loop.val_max_samples] if loop.val_max_samples else val_records
    val_data = recipe.val_batches(cfg, policy, tokenizer, val_records)
    run = SupervisedRun(
        cfg, loop, log_dir, tokenizer, policy, cluster, loader, val_data, Logger(cfg.logger),
        CheckpointManager(cfg.checkpointing), total_steps, data_stats=data_stats,
    )
    restored = restore_run(run.checkpoints, policy) if cfg.checkpointing.enabled else None
    if restored is not None:
        run.step = int(restored.training_info["step"])
        loader.load_state_dict(restored.loader_state)
    run.logger.log_hyperparams(recipe.hyperparams(cfg))
    run.logger.log_metrics({f"data/{k}": v for k, v in data_stats.items()}, run.step)
    return run


def checkpoint_if_due(run: SupervisedRun, val_loss: float | None, force: bool = False) -> None:
    """Every `checkpointing.save_period` steps (or when forced): the run's state at `run.step`, with its
    epoch and the latest validation loss (the default ranking metric) as training info."""
    cfg = run.cfg.checkpointing
    if not cfg.enabled or not (force or run.step % cfg.save_period == 0):
        return
    info = {"step": run.step, "epoch": run.train_loader.epoch}
    if val_loss is not None:
        info["val_loss"] = val_loss
    save_run_checkpoint(run.checkpoints, run.policy, run.step, info, run.train_loader.state_dict(), run.cfg)


def end_of_step(run: SupervisedRun[ConfigT], recipe: Recipe[ConfigT], metrics: dict[str, float], timer: Timer,
                last_step: int) -> dict[str, float] | None:
    """Log the step's metrics and stage timings, validate every `val_period` steps and at `last_step`,
    checkpoint when due (always at the run's final step). Returns the validation metrics when it validated."""
    run.logger.log_metrics(metrics, run.step, prefix="train")
    timing = step_timing(timer, {"policy_worker": run.policy.get_timing_metrics()})
    run.logger.log_metrics(timing, run.step, prefix="timing")
    timer.reset()
    val_metrics = None
    if run.step % run.loop.val_period == 0 or run.step == last_step:
        val_metrics = recipe.validate(run)
        run.logger.log_metrics(val_metrics, run.step, prefix="val")
        log_supervised_samples(run.logger, run.policy, run.tokenizer, run.val_data, run.step, pairs=recipe.pairs)
    val_loss = val_metrics["loss"] if val_metrics else None
    checkpoint_if_due(run, val_loss, force=run.step == last_step == run.total_steps)
    return val_metrics


def train(run: SupervisedRun[ConfigT], recipe: Recipe[ConfigT], num_steps: int | None = None) -> dict[str, float]:
    """Train until `run.total_steps` (or `num_steps` more steps); returns the last validation metrics."""
    last_step = run.total_steps if num_steps is None else min(run.total_steps, run.step + num_steps)
    val_metrics: dict[str, float] = {}
    timer = Timer()
    with StepProgress(recipe.name, last_step, start=run.step) as progress:
        while run.step < last_step:
            start = time.perf_counter()
            metrics = recipe.train_step(run, timer)
            run.step += 1
            metrics["step_time"] = time.perf_counter() - start
            step_val = end_of_step(run, recipe, metrics, timer, last_step)
            val_metrics = step_val or val_metrics
            progress.advance(run.step, recipe.shown(metrics, step_val))
    if run.step == run.total_steps and run.loop.export_final_model:
        run.policy.export_hf(str(run.log_dir / "hf_model"))
    return val_metrics


def run_to_end(cfg: ConfigT, recipe: Recipe[ConfigT]) -> tuple[SupervisedRun[ConfigT], dict[str, float]]:
    """Set up, train to the end, shut the workers down: the run and its last validation metrics."""
    run = setup_run(cfg, recipe)
    try:
        val_metrics = train(run, recipe)
    finally:
        run.shutdown()
    return run, val_metrics
