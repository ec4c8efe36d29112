"""Supervised fine-tuning (SFT).

Algorithm as implemented: minimise the negative log-likelihood of the trained tokens (assistant turns,
or only the final assistant turn with `data.train_on: last_assistant`), normalised by the number of
trained tokens in the whole global batch, so the update does not depend on how the batch is split into
micro-batches or data-parallel ranks. One optimizer step per global batch of `policy.train_global_batch_size`
conversations. Validation loss every `sft.val_period` steps and at the end; checkpoints every
`checkpointing.save_period` steps (ranked by `val_loss`); a restarted run resumes from the latest
checkpoint in its checkpoint directory with the same model, optimizer, scheduler, data position and RNG.

Off-policy knowledge distillation (`distillation.enabled`): a frozen teacher (`distillation.teacher`, any
Hugging Face causal LM with the student's tokenizer, on workers of its own) gives its `distillation.top_k`
most likely next tokens at every trained position of each batch, and the loss is the forward KL from the
teacher's renormalised top-k to the student (`loss.KDLoss`), optionally beside the data's NLL. Validation
reports `kd_loss` (the student's KL to the teacher on held-out data) and `nll_loss`.

Run: posttrain sft --config configs/sft_tiny.yaml
     posttrain sft --config configs/kd_tiny.yaml      (distillation from the SFT model)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.algorithms import supervised
from posttrain.algorithms.checks import check_parallelism
from posttrain.algorithms.loss import KDLoss, KDLossConfig, NLLLoss
from posttrain.algorithms.recovery import train_with_restarts
from posttrain.algorithms.run import TrainingConfig
from posttrain.algorithms.supervised import LoopConfig, SupervisedRun
from posttrain.algorithms.teacher import topk_targets
from posttrain.config import ConfigError, load_run_config
from posttrain.data import message_log_to_flat
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.utils.metrics import mean_over_steps
from posttrain.utils.timer import Timer
from posttrain.workers.policy import PolicyConfig
from posttrain.workers.policy.config import policy_with_lr

# A full fine-tune of a pretrained model: TRL's SFTConfig default. The tiny recipes (configs/*_tiny.yaml,
# the demo) set their own, larger rates for a randomly initialised model of ~0.1M parameters.
SFT_LR = 2e-5


@dataclass
class DistillationConfig:
    """Off-policy knowledge distillation: SFT's data, a frozen teacher's top-k as the target."""

    enabled: bool = False
    """train on the teacher's top-k instead of only the data"""
    top_k: int = 20
    """the teacher's most likely next tokens kept per position"""
    loss: KDLossConfig = field(default_factory=KDLossConfig)
    """weights of the KL and NLL terms"""
    teacher: PolicyConfig = field(default_factory=PolicyConfig)
    """the teacher: a causal LM with the student's tokenizer (only its forward runs)"""

    def validate(self) -> None:
        if self.top_k < 1:
            raise ConfigError("top_k", f"{self.top_k} must be >= 1")
        if self.enabled and self.teacher.model_name is None:
            raise ConfigError(
                "teacher.model_name", "distillation needs a teacher: a model directory or hub name"
            )
        if self.teacher.model_kind != "causal_lm" or self.teacher.backend != "dtensor":
            raise ConfigError("teacher.backend", "the teacher is a causal_lm on the dtensor backend")


@dataclass
class SFTConfig(TrainingConfig):
    """`posttrain sft` configuration."""

    sft: LoopConfig = field(default_factory=LoopConfig)
    """the SFT loop"""
    policy: PolicyConfig = field(default_factory=lambda: policy_with_lr(SFT_LR))
    """the trained model (AdamW lr 2e-5 by default)"""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """off-policy knowledge distillation (off by default)"""

    def validate(self) -> None:
        check_parallelism(self.policy, self.cluster)
        if self.distillation.enabled:
            check_parallelism(self.distillation.teacher, self.cluster)
            if self.policy.backend != "dtensor" or self.policy.sequence_packing.enabled:
                raise ConfigError(
                    "policy.backend",
                    "distillation trains on the dtensor backend without sequence packing "
                    "(policy.sequence_packing.enabled: false)",
                )


SFTRun = SupervisedRun[SFTConfig]


def to_train_data(records: list[dict], pad_token_id: int, train_on: str) -> BatchedDataDict:
    return message_log_to_flat([r["message_log"] for r in records], pad_token_id, train_on=train_on)


def val_batches(run: SFTRun, records: list[dict]) -> list[BatchedDataDict]:
    size, pad_id = run.loop.val_global_batch_size, run.tokenizer.pad_token_id
    return [
        to_train_data(records[i : i + size], pad_id, run.cfg.data.train_on)
        for i in range(0, len(records), size)
    ]


def loss_function(cfg: SFTConfig) -> NLLLoss | KDLoss:
    return KDLoss(cfg.distillation.loss) if cfg.distillation.enabled else NLLLoss()


def validate(run: SFTRun) -> dict[str, float]:
    """Token-weighted means over the validation batches: the loss (NLL, or with distillation the KD loss),
    and with distillation its `kd_loss` (the KL to the teacher) and `nll_loss`."""
    loss_fn = loss_function(run.cfg)
    totals: dict[str, float] = {}
    total_tokens = 0.0
    for batch in run.val_data:
        num_tokens = float((batch["token_mask"] * batch["sample_mask"].unsqueeze(-1)).sum())
        micro_batch_size = run.cfg.policy.train_micro_batch_size
        metrics = run.policy.evaluate(
            batch, loss_fn, global_batch_size=batch.size, micro_batch_size=micro_batch_size
        )
        for key in ("loss", "kd_loss", "nll_loss"):
            if key in metrics:
                totals[key] = totals.get(key, 0.0) + float(metrics[key][0]) * num_tokens
        total_tokens += num_tokens
    return {key: value / max(total_tokens, 1.0) for key, value in totals.items()}


def train_step(run: SFTRun, timer: Timer) -> dict[str, float]:
    """One optimizer step on the next global batch."""
    with timer.time("data"):
        batch = to_train_data(
            run.train_loader.next_batch(), run.tokenizer.pad_token_id, run.cfg.data.train_on
        )
    if run.teacher is not None:
        with timer.time("teacher_topk"):
            batch.update(topk_targets(run.teacher, batch, run.cfg.distillation.top_k))
    with timer.time("train"):
        metrics = mean_over_steps(run.policy.train(batch, loss_function(run.cfg)))
    num_tokens = float(batch["input_lengths"].sum())
    metrics["tokens_per_second"] = num_tokens / max(timer.get_latest("train"), 1e-9)
    metrics["num_trained_tokens"] = float(batch["token_mask"].sum())
    return metrics


def setup(cfg: SFTConfig) -> SFTRun:
    """Data, model, workers (and the teacher's, with distillation), logger and checkpoints; resumes from the
    latest checkpoint if there is one."""
    teacher = cfg.distillation.teacher if cfg.distillation.enabled else None
    batch_size = cfg.policy.train_global_batch_size
    run = supervised.setup_run(cfg, "sft", batch_size, val_batches, teacher=teacher)
    if run.teacher is not None:  # the validation targets, once
        for batch in run.val_data:
            batch.update(topk_targets(run.teacher, batch, cfg.distillation.top_k))
    return run


def sft_progress(metrics: dict[str, float], val_metrics: dict[str, float] | None) -> dict[str, float]:
    """The progress line: the step's loss, and the validation loss when it validated."""
    return {"loss": metrics["loss"], **({"val_loss": val_metrics["loss"]} if val_metrics else {})}


def sft_train(run: SFTRun, num_steps: int | None = None) -> dict[str, float]:
    """Train until `run.total_steps` (or `num_steps` more steps); returns the last validation metrics."""
    return supervised.train(run, train_step, validate, sft_progress, pairs=False, num_steps=num_steps)


def main(args: Any) -> int:
    run, val_metrics = train_with_restarts(load_run_config(SFTConfig, args), setup, sft_train)
    print(
        f"sft finished at step {run.step}: val loss {val_metrics.get('loss', float('nan')):.4f}; run "
        f"directory {run.log_dir}"
    )
    return 0
