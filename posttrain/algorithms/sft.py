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

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from posttrain.algorithms import supervised
from posttrain.algorithms.checks import check_parallelism
from posttrain.algorithms.loss import NLLLoss
from posttrain.algorithms.supervised import LoopConfig, SupervisedRun
from posttrain.config import load_run_config
from posttrain.data import DataConfig, message_log_to_flat
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.virtual_cluster import ClusterConfig
from posttrain.utils.checkpoint import CheckpointingConfig
from posttrain.utils.logger import LoggerConfig
from posttrain.utils.metrics import mean_over_steps
from posttrain.utils.timer import Timer
from posttrain.workers.policy import Policy, PolicyConfig


@dataclass
class SFTConfig:
    """`posttrain sft` configuration."""

    sft: LoopConfig = field(default_factory=LoopConfig, metadata={"help": "the SFT loop"})
    policy: PolicyConfig = field(default_factory=PolicyConfig, metadata={"help": "the trained model"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "training and validation data"})
    cluster: ClusterConfig = field(
        default_factory=ClusterConfig, metadata={"help": "Ray cluster and placement"}
    )
    logger: LoggerConfig = field(default_factory=LoggerConfig, metadata={"help": "logging"})
    checkpointing: CheckpointingConfig = field(
        default_factory=CheckpointingConfig, metadata={"help": "checkpoints (ranked by val_loss by default)"}
    )

    def validate(self) -> None:
        check_parallelism(self.policy, self.cluster)


SFTRun = SupervisedRun[SFTConfig]


def to_train_data(records: list[dict], pad_token_id: int, train_on: str) -> BatchedDataDict:
    return message_log_to_flat([r["message_log"] for r in records], pad_token_id, train_on=train_on)


def val_batches(
    cfg: SFTConfig, policy: Policy, tokenizer: PreTrainedTokenizerBase, records: list[dict]
) -> list[BatchedDataDict]:
    size = cfg.sft.val_global_batch_size
    return [
        to_train_data(records[i : i + size], tokenizer.pad_token_id, cfg.data.train_on)
        for i in range(0, len(records), size)
    ]


def validate(run: SFTRun) -> dict[str, float]:
    """Token-weighted mean NLL over the validation batches."""
    total_loss, total_tokens = 0.0, 0.0
    for batch in run.val_data:
        num_tokens = float((batch["token_mask"] * batch["sample_mask"].unsqueeze(-1)).sum())
        metrics = run.policy.evaluate(
            batch,
            NLLLoss(),
            global_batch_size=batch.size,
            micro_batch_size=run.cfg.policy.train_micro_batch_size,
        )
        total_loss += float(metrics["loss"][0]) * num_tokens
        total_tokens += num_tokens
    return {"loss": total_loss / max(total_tokens, 1.0)}


def train_step(run: SFTRun, timer: Timer) -> dict[str, float]:
    """One optimizer step on the next global batch."""
    with timer.time("data"):
        batch = to_train_data(
            run.train_loader.next_batch(), run.tokenizer.pad_token_id, run.cfg.data.train_on
        )
    with timer.time("train"):
        metrics = mean_over_steps(run.policy.train(batch, NLLLoss()))
    num_tokens = float(batch["input_lengths"].sum())
    metrics["tokens_per_second"] = num_tokens / max(timer.get_latest("train"), 1e-9)
    metrics["num_trained_tokens"] = float(batch["token_mask"].sum())
    return metrics


def setup(cfg: SFTConfig) -> SFTRun:
    """Data, model, workers, logger and checkpoints; resumes from the latest checkpoint if there is one."""
    return supervised.setup_run(
        cfg,
        "sft",
        "sft",
        cfg.policy.train_global_batch_size,
        val_batches,
        hyperparams={"sft": cfg.sft, "policy": cfg.policy, "data": cfg.data},
    )


def sft_progress(metrics: dict[str, float], val_metrics: dict[str, float] | None) -> dict[str, float]:
    """The progress line: the step's loss, and the validation loss when it validated."""
    return {"loss": metrics["loss"], **({"val_loss": val_metrics["loss"]} if val_metrics else {})}


def sft_train(run: SFTRun, num_steps: int | None = None) -> dict[str, float]:
    """Train until `run.total_steps` (or `num_steps` more steps); returns the last validation metrics."""
    return supervised.train(run, train_step, validate, sft_progress, pairs=False, num_steps=num_steps)


def main(args: Any) -> int:
    run = setup(load_run_config(SFTConfig, args))
    try:
        val_metrics = sft_train(run)
    finally:
        run.shutdown()
    print(
        f"sft finished at step {run.step}: val loss {val_metrics.get('loss', float('nan')):.4f}; run "
        f"directory {run.log_dir}"
    )
    return 0
