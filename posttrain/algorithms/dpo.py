"""Direct preference optimisation (DPO, Rafailov et al. 2023, arXiv:2305.18290).

Algorithm as implemented: each step takes `policy.train_global_batch_size / 2` preference pairs (a prompt
or conversation with a chosen and a rejected final assistant response), computes the responses' token
logprobs under the frozen initial policy (the reference), and takes one optimizer step on

    -log sigmoid(beta * ((log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r))))
        [ + sft_loss_weight * -log pi(y_c) ]

averaged over the pairs of the global batch, where log pi(y) sums (or, with
`loss.preference_average_log_probs`, averages) the logprobs of the final assistant turn. Chosen and
rejected rows are adjacent and always share a micro-batch. Validation every `dpo.val_period` steps: the
same loss and the implicit-reward accuracy (fraction of held-out pairs with r_c > r_r). Checkpoints,
exact resume and logging as in SFT. Departures from the paper: the reference is whatever model the run
starts from (the paper's pi_SFT when that is an SFT model, as in configs/dpo_tiny.yaml); the optional SFT
term on the chosen response is RPO's (arXiv:2404.19733).

Run: posttrain sft --config configs/sft_tiny.yaml, then posttrain dpo --config configs/dpo_tiny.yaml
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
from posttrain.algorithms.loss import DPOLoss, DPOLossConfig
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
class DPOConfig:
    """`posttrain dpo` configuration."""

    dpo: PairLoopConfig = field(default_factory=PairLoopConfig, metadata={"help": "the DPO loop"})
    loss: DPOLossConfig = field(default_factory=DPOLossConfig, metadata={"help": "DPO loss (beta, SFT term)"})
    policy: PolicyConfig = field(default_factory=PolicyConfig, metadata={"help": "the trained model"})
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
        if self.policy.model_kind != "causal_lm":
            raise ConfigError("policy.model_kind", f"DPO trains a causal LM, got {self.policy.model_kind!r}")
        check_pair_batching(self.policy, self.cluster)


@dataclass
class DPORun:
    """Everything one DPO run holds; `dpo_train` advances it."""

    cfg: DPOConfig
    log_dir: Path
    tokenizer: Any
    policy: Policy
    cluster: RayVirtualCluster
    train_loader: StatefulDataLoader
    val_data: list[BatchedDataDict]  # interleaved pairs with their reference logprobs
    logger: Logger
    checkpoints: CheckpointManager
    total_steps: int
    step: int = 0

    def shutdown(self) -> None:
        self.logger.finish()
        self.policy.shutdown()
        self.cluster.shutdown()


def add_reference_logprobs(policy: Policy, data: BatchedDataDict) -> BatchedDataDict:
    """`reference_policy_logprobs [B, T]` from the frozen initial policy, added to `data`."""
    data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(data)["reference_policy_logprobs"]
    return data


def setup(cfg: DPOConfig) -> DPORun:
    """Data, policy with its reference, logger and checkpoints; resumes from the latest checkpoint if any."""
    log_dir = prepare_run_dir(cfg, "dpo")
    resolve_model_dir(cfg.policy, log_dir)
    tokenizer = load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name)
    train_records, val_records, data_stats = load_datasets(cfg.data, tokenizer)
    gbs = cfg.policy.train_global_batch_size
    check_batch_fits(len(train_records), gbs // 2, "policy.train_global_batch_size", gbs, cfg.data.dataset)
    pairs_per_step = cfg.policy.train_global_batch_size // 2
    loader = StatefulDataLoader(train_records, pairs_per_step, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    epochs_steps = cfg.dpo.max_num_epochs * len(loader)
    total_steps = min(epochs_steps, cfg.dpo.max_num_steps or epochs_steps)
    cluster = RayVirtualCluster(cfg.cluster)
    # The reference is the weights the workers load now: the initial model, also when resuming below.
    policy = Policy(cluster, cfg.policy, init_reference_model=True)
    val_records = val_records[: cfg.dpo.val_max_samples] if cfg.dpo.val_max_samples else val_records
    val_data = [
        add_reference_logprobs(policy, batch)
        for batch in pair_batches(val_records, cfg.dpo.val_global_batch_size, policy.dp_size, tokenizer.pad_token_id)
    ]
    run = DPORun(
        cfg, log_dir, tokenizer, policy, cluster, loader, val_data, Logger(cfg.logger),
        CheckpointManager(cfg.checkpointing), total_steps,
    )
    restored = restore_run(run.checkpoints, policy) if cfg.checkpointing.enabled else None
    if restored is not None:
        run.step = int(restored.training_info["step"])
        loader.load_state_dict(restored.loader_state)
    run.logger.log_hyperparams({"dpo": cfg.dpo, "loss": cfg.loss, "policy": cfg.policy, "data": cfg.data})
    run.logger.log_metrics({f"data/{k}": v for k, v in data_stats.items()}, run.step)
    return run


def validate(run: DPORun) -> dict[str, float]:
    """DPO loss, preference accuracy and mean implicit rewards over the validation pairs."""
    return evaluate_pairs(run.policy, run.val_data, DPOLoss(run.cfg.loss), run.cfg.policy.train_micro_batch_size)


def train_step(run: DPORun, timer: Timer) -> dict[str, float]:
    """One optimizer step on the next global batch of pairs."""
    with timer.time("data"):
        batch = pairs_to_train_data(run.train_loader.next_batch(), run.tokenizer.pad_token_id)
    with timer.time("reference_logprobs"):
        add_reference_logprobs(run.policy, batch)
    with timer.time("train"):
        metrics = single_step_metrics(run.policy.train(batch, DPOLoss(run.cfg.loss)))
    metrics["num_trained_tokens"] = float(batch["token_mask"].sum())
    return metrics


def dpo_train(run: DPORun, num_steps: int | None = None) -> dict[str, float]:
    """Train until `run.total_steps` (or `num_steps` more steps); returns the last validation metrics."""
    last_step = run.total_steps if num_steps is None else min(run.total_steps, run.step + num_steps)
    val_metrics: dict[str, float] = {}
    timer = Timer()
    with StepProgress("dpo", last_step, start=run.step) as progress:
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
            if run.step % run.cfg.dpo.val_period == 0 or at_end:
                val_metrics = validate(run)
                val_loss = val_metrics["loss"]
                run.logger.log_metrics(val_metrics, run.step, prefix="val")
                log_supervised_samples(run.logger, run.policy, run.tokenizer, run.val_data, run.step, pairs=True)
            checkpoint_if_due(run, val_loss, force=at_end and run.step == run.total_steps)
            shown = {"loss": metrics["loss"], "acc": metrics["accuracy"]}
            progress.advance(run.step, shown | ({"val_acc": val_metrics["accuracy"]} if val_loss is not None else {}))
    if run.step == run.total_steps and run.cfg.dpo.export_final_model:
        run.policy.export_hf(str(run.log_dir / "hf_model"))
    return val_metrics


def main(args: Any) -> int:
    cfg = load_run_config(DPOConfig, args)
    run = setup(cfg)
    try:
        val_metrics = dpo_train(run)
    finally:
        run.shutdown()
    print(
        f"dpo finished at step {run.step}: val loss {val_metrics.get('loss', float('nan')):.4f}, "
        f"val accuracy {val_metrics.get('accuracy', float('nan')):.3f}; run directory {run.log_dir}"
    )
    return 0
