"""Supervised fine-tuning (SFT).

Algorithm as implemented: minimise the negative log-likelihood of the trained tokens (assistant turns,
or only the final assistant turn with `data.train_on: last_assistant`), normalised by the number of
trained tokens in the whole global batch, so the update does not depend on how the batch is split into
micro-batches or data-parallel ranks. One optimizer step per global batch of `policy.train_global_batch_size`
conversations. Validation loss every `sft.val_period` steps and at the end; checkpoints every
`checkpointing.save_period` steps (ranked by `val_loss`); a restarted run resumes from the latest
checkpoint in its checkpoint directory with the same model, optimizer, scheduler, data position and RNG.

Run: posttrain sft --config configs/sft_tiny.yaml
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.algorithms.common import (
    check_batch_fits,
    check_loop_lengths,
    check_parallelism,
    checkpoint_if_due,
    load_run_config,
    mean_over_global_batches,
    prepare_run_dir,
    resolve_model_dir,
    restore_run,
)
from posttrain.algorithms.loss import NLLLoss
from posttrain.data import DataConfig, StatefulDataLoader, load_datasets, message_log_to_flat
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.virtual_cluster import ClusterConfig, RayVirtualCluster
from posttrain.evals.supervised_samples import log_supervised_samples
from posttrain.models.build import load_tokenizer
from posttrain.models.policy import Policy, PolicyConfig
from posttrain.utils.checkpoint import CheckpointingConfig, CheckpointManager
from posttrain.utils.logger import Logger, LoggerConfig, step_timing
from posttrain.utils.progress import StepProgress
from posttrain.utils.timer import Timer


@dataclass
class SFTLoopConfig:
    """The SFT loop's own knobs."""

    max_num_epochs: int = field(default=1, metadata={"help": "passes over the training set"})
    max_num_steps: int | None = field(default=None, metadata={"help": "optimizer steps (None: epochs decide)"})
    val_period: int = field(default=25, metadata={"help": "validation loss every this many steps (and at the end)"})
    val_global_batch_size: int = field(default=64, metadata={"help": "conversations per validation batch"})
    val_max_samples: int | None = field(default=256, metadata={"help": "validation conversations used (None: all)"})
    export_final_model: bool = field(default=True, metadata={"help": "write <log_dir>/hf_model at the end"})

    def validate(self) -> None:
        if self.val_period < 1:
            raise ValueError(f"val_period must be >= 1, got {self.val_period}")
        check_loop_lengths(self)


@dataclass
class SFTConfig:
    """`posttrain sft` configuration."""

    sft: SFTLoopConfig = field(default_factory=SFTLoopConfig, metadata={"help": "the SFT loop"})
    policy: PolicyConfig = field(default_factory=PolicyConfig, metadata={"help": "the trained model"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "training and validation data"})
    cluster: ClusterConfig = field(default_factory=ClusterConfig, metadata={"help": "Ray cluster and placement"})
    logger: LoggerConfig = field(default_factory=LoggerConfig, metadata={"help": "logging"})
    checkpointing: CheckpointingConfig = field(
        default_factory=CheckpointingConfig, metadata={"help": "checkpoints (ranked by val_loss by default)"}
    )

    def validate(self) -> None:
        check_parallelism(self.policy, self.cluster)


@dataclass
class SFTRun:
    """Everything one SFT run holds; `sft_train` advances it."""

    cfg: SFTConfig
    log_dir: Path
    tokenizer: Any
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


def to_train_data(records: list[dict], pad_token_id: int, train_on: str) -> BatchedDataDict:
    return message_log_to_flat([r["message_log"] for r in records], pad_token_id, train_on=train_on)


def setup(cfg: SFTConfig) -> SFTRun:
    """Data, model, workers, logger and checkpoints; resumes from the latest checkpoint if there is one."""
    log_dir = prepare_run_dir(cfg, "sft")
    resolve_model_dir(cfg.policy, log_dir)
    tokenizer = load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name)
    train_records, val_records, data_stats = load_datasets(cfg.data, tokenizer)
    gbs = cfg.policy.train_global_batch_size
    check_batch_fits(len(train_records), gbs, "policy.train_global_batch_size", gbs, cfg.data.dataset)
    loader = StatefulDataLoader(
        train_records, cfg.policy.train_global_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed
    )
    val_records = val_records[: cfg.sft.val_max_samples] if cfg.sft.val_max_samples else val_records
    val_size = cfg.sft.val_global_batch_size
    val_data = [
        to_train_data(val_records[i:i + val_size], tokenizer.pad_token_id, cfg.data.train_on)
        for i in range(0, len(val_records), val_size)
    ]
    epochs_steps = cfg.sft.max_num_epochs * len(loader)
    total_steps = min(epochs_steps, cfg.sft.max_num_steps or epochs_steps)
    cluster = RayVirtualCluster(cfg.cluster)
    policy = Policy(cluster, cfg.policy)
    run = SFTRun(
        cfg, log_dir, tokenizer, policy, cluster, loader, val_data, Logger(cfg.logger),
        CheckpointManager(cfg.checkpointing), total_steps, data_stats=data_stats,
    )
    restored = restore_run(run.checkpoints, policy) if cfg.checkpointing.enabled else None
    if restored is not None:
        run.step = int(restored.training_info["step"])
        loader.load_state_dict(restored.loader_state)
    run.logger.log_hyperparams({"sft": cfg.sft, "policy": cfg.policy, "data": cfg.data})
    run.logger.log_metrics({f"data/{k}": v for k, v in data_stats.items()}, run.step)
    return run


def validate(run: SFTRun) -> dict[str, float]:
    """Token-weighted mean NLL over the validation batches."""
    total_loss, total_tokens = 0.0, 0.0
    for batch in run.val_data:
        num_tokens = float((batch["token_mask"] * batch["sample_mask"].unsqueeze(-1)).sum())
        metrics = run.policy.train(
            batch, NLLLoss(), eval_mode=True, gbs=batch.size, mbs=run.cfg.policy.train_micro_batch_size
        )
        total_loss += float(metrics["loss"][0]) * num_tokens
        total_tokens += num_tokens
    return {"loss": total_loss / max(total_tokens, 1.0)}


def train_step(run: SFTRun, timer: Timer) -> dict[str, float]:
    """One optimizer step on the next global batch."""
    with timer.time("data"):
        batch = to_train_data(run.train_loader.next_batch(), run.tokenizer.pad_token_id, run.cfg.data.train_on)
    with timer.time("train"):
        metrics = mean_over_global_batches(run.policy.train(batch, NLLLoss()))
    num_tokens = float(batch["input_lengths"].sum())
    metrics["tokens_per_second"] = num_tokens / max(timer.get_latest("train"), 1e-9)
    metrics["num_trained_tokens"] = float(batch["token_mask"].sum())
    return metrics


def sft_train(run: SFTRun, num_steps: int | None = None) -> dict[str, float]:
    """Train until `run.total_steps` (or `num_steps` more steps); returns the last validation metrics."""
    last_step = run.total_steps if num_steps is None else min(run.total_steps, run.step + num_steps)
    val_metrics: dict[str, float] = {}
    timer = Timer()
    with StepProgress("sft", last_step, start=run.step) as progress:
        while run.step < last_step:
            start = time.perf_counter()
            metrics = train_step(run, timer)
            run.step += 1
            metrics["step_time"] = time.perf_counter() - start
            run.logger.log_metrics(metrics, run.step, prefix="train")
            run.logger.log_metrics(step_timing(timer, {"policy_worker": run.policy.get_timing_metrics()}), run.step, "timing")
            timer.reset()
            at_end = run.step == last_step
            val_loss = None
            if run.step % run.cfg.sft.val_period == 0 or at_end:
                val_metrics = validate(run)
                val_loss = val_metrics["loss"]
                run.logger.log_metrics(val_metrics, run.step, prefix="val")
                log_supervised_samples(run.logger, run.policy, run.tokenizer, run.val_data, run.step)
            checkpoint_if_due(run, val_loss, force=at_end and run.step == run.total_steps)
            progress.advance(run.step, {"loss": metrics["loss"], **({"val_loss": val_loss} if val_loss else {})})
    if run.step == run.total_steps and run.cfg.sft.export_final_model:
        run.policy.export_hf(str(run.log_dir / "hf_model"))
    return val_metrics


def main(args: Any) -> int:
    cfg = load_run_config(SFTConfig, args)
    run = setup(cfg)
    try:
        val_metrics = sft_train(run)
    finally:
        run.shutdown()
    print(f"sft finished at step {run.step}: val loss {val_metrics.get('loss', float('nan')):.4f}; run directory {run.log_dir}")
    return 0
