"""Reward-model training with the Bradley-Terry loss.

Algorithm as implemented: the model is the policy backbone with a scalar head
(`AutoModelForSequenceClassification` with one label, read at each sequence's last token; built from
`policy.model_name` or `policy.model.from_config`, the head freshly initialised from `policy.seed`), in
the same FSDP2 workers as the policy. Each step takes `policy.train_global_batch_size / 2` preference
pairs, scores the chosen and the rejected conversation, and takes one optimizer step on
-log sigmoid(r_c - r_r) averaged over the pairs of the global batch (Bradley and Terry 1952; as in
InstructGPT, arXiv:2203.02155, without its K-way comparisons). Chosen and rejected rows are adjacent and
always share a micro-batch. Validation every `rm.val_period` steps: loss, accuracy (fraction of held-out
pairs with r_c > r_r) and mean scores. Checkpoints, exact resume and logging as in SFT; the final model is
exported to `<log_dir>/hf_model`, which the `reward_model` environment loads to score GRPO rollouts.

Run: posttrain sft --config configs/sft_tiny.yaml, then posttrain rm --config configs/rm_tiny.yaml
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.algorithms.common import (
    PairLoopConfig,
    check_batch_fits,
    check_pair_batching,
    checkpoint_if_due,
    evaluate_pairs,
    load_run_config,
    pair_batches,
    pairs_to_train_data,
    prepare_run_dir,
    resolve_model_dir,
    restore_run,
    single_step_metrics,
)
from posttrain.algorithms.loss import BradleyTerryLoss
from posttrain.config import ConfigError
from posttrain.data import DataConfig, StatefulDataLoader, load_datasets
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
class RMConfig:
    """`posttrain rm` configuration."""

    rm: PairLoopConfig = field(default_factory=PairLoopConfig, metadata={"help": "the reward-model loop"})
    policy: PolicyConfig = field(
        default_factory=lambda: PolicyConfig(model_kind="reward_model"),
        metadata={"help": "the trained reward model (model_kind: reward_model)"},
    )
    data: DataConfig = field(
        default_factory=lambda: DataConfig(dataset="arithmetic_preference", format="preference"),
        metadata={"help": "preference pairs (prompt, chosen, rejected)"},
    )
    cluster: ClusterConfig = field(default_factory=ClusterConfig, metadata={"help": "Ray cluster and placement"})
    logger: LoggerConfig = field(default_factory=LoggerConfig, metadata={"help": "logging"})
    checkpointing: CheckpointingConfig = field(
        default_factory=CheckpointingConfig, metadata={"help": "checkpoints (ranked by val_loss by default)"}
    )

    def validate(self) -> None:
        if self.policy.model_kind != "reward_model":
            raise ConfigError(
                "policy.model_kind", f"reward-model training needs 'reward_model', got {self.policy.model_kind!r}"
            )
        check_pair_batching(self.policy, self.cluster)


@dataclass
class RMRun:
    """Everything one reward-model run holds; `rm_train` advances it."""

    cfg: RMConfig
    log_dir: Path
    tokenizer: Any
    policy: Policy
    cluster: RayVirtualCluster
    train_loader: StatefulDataLoader
    val_data: list[BatchedDataDict]  # interleaved pairs
    logger: Logger
    checkpoints: CheckpointManager
    total_steps: int
    step: int = 0

    def shutdown(self) -> None:
        self.logger.finish()
        self.policy.shutdown()
        self.cluster.shutdown()


def setup(cfg: RMConfig) -> RMRun:
    """Data, reward model workers, logger and checkpoints; resumes from the latest checkpoint if any."""
    log_dir = prepare_run_dir(cfg, "rm")
    resolve_model_dir(cfg.policy, log_dir)
    tokenizer = load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name)
    train_records, val_records, data_stats = load_datasets(cfg.data, tokenizer)
    gbs = cfg.policy.train_global_batch_size
    check_batch_fits(len(train_records), gbs // 2, "policy.train_global_batch_size", gbs, cfg.data.dataset)
    loader = StatefulDataLoader(
        train_records, cfg.policy.train_global_batch_size // 2, shuffle=cfg.data.shuffle, seed=cfg.data.seed
    )
    epochs_steps = cfg.rm.max_num_epochs * len(loader)
    total_steps = min(epochs_steps, cfg.rm.max_num_steps or epochs_steps)
    cluster = RayVirtualCluster(cfg.cluster)
    policy = Policy(cluster, cfg.policy)
    val_records = val_records[: cfg.rm.val_max_samples] if cfg.rm.val_max_samples else val_records
    val_data = pair_batches(val_records, cfg.rm.val_global_batch_size, policy.dp_size, tokenizer.pad_token_id)
    run = RMRun(
        cfg, log_dir, tokenizer, policy, cluster, loader, val_data, Logger(cfg.logger),
        CheckpointManager(cfg.checkpointing), total_steps,
    )
    restored = restore_run(run.checkpoints, policy) if cfg.checkpointing.enabled else None
    if restored is not None:
        run.step = int(restored.training_info["step"])
        loader.load_state_dict(restored.loader_state)
    run.logger.log_hyperparams({"rm": cfg.rm, "policy": cfg.policy, "data": cfg.data})
    run.logger.log_metrics({f"data/{k}": v for k, v in data_stats.items()}, run.step)
    return run


def validate(run: RMRun) -> dict[str, float]:
    """Bradley-Terry loss, accuracy and mean scores of chosen and rejected over the validation pairs."""
    return evaluate_pairs(run.policy, run.val_data, BradleyTerryLoss(), run.cfg.policy.train_micro_batch_size)


def train_step(run: RMRun, timer: Timer) -> dict[str, float]:
    """One optimizer step on the next global batch of pairs."""
    with timer.time("data"):
        batch = pairs_to_train_data(run.train_loader.next_batch(), run.tokenizer.pad_token_id)
    with timer.time("train"):
        metrics = single_step_metrics(run.policy.train(batch, BradleyTerryLoss()))
    metrics["margin_mean"] = metrics["rewards_chosen_mean"] - metrics["rewards_rejected_mean"]
    return metrics


def rm_train(run: RMRun, num_steps: int | None = None) -> dict[str, float]:
    """Train until `run.total_steps` (or `num_steps` more steps); returns the last validation metrics."""
    last_step = run.total_steps if num_steps is None else min(run.total_steps, run.step + num_steps)
    val_metrics: dict[str, float] = {}
    timer = Timer()
    with StepProgress("rm", last_step, start=run.step) as progress:
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
            if run.step % run.cfg.rm.val_period == 0 or at_end:
                val_metrics = validate(run)
                val_loss = val_metrics["loss"]
                run.logger.log_metrics(val_metrics, run.step, prefix="val")
                log_supervised_samples(run.logger, run.policy, run.tokenizer, run.val_data, run.step, pairs=True)
            checkpoint_if_due(run, val_loss, force=at_end and run.step == run.total_steps)
            shown = {"loss": metrics["loss"], "acc": metrics["accuracy"]}
            progress.advance(run.step, shown | ({"val_acc": val_metrics["accuracy"]} if val_loss is not None else {}))
    if run.step == run.total_steps and run.cfg.rm.export_final_model:
        run.policy.export_hf(str(run.log_dir / "hf_model"))
    return val_metrics


def main(args: Any) -> int:
    cfg = load_run_config(RMConfig, args)
    run = setup(cfg)
    try:
        val_metrics = rm_train(run)
    finally:
        run.shutdown()
    print(
        f"rm finished at step {run.step}: val loss {val_metrics.get('loss', float('nan')):.4f}, "
        f"val accuracy {val_metrics.get('accuracy', float('nan')):.3f}; run directory {run.log_dir}"
    )
    return 0
