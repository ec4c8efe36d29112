"""Preference pairs as train data, the batching rules that keep pairs whole, and what the pair commands
(`dpo`, `rm`) share: their config sections and checks, setup, step, validation and loop. A command's
module gives its loop section, its loss (`pair_loss`) and whether that loss needs the frozen reference.

A pair's chosen and rejected responses travel as adjacent rows (2i chosen, 2i+1 rejected), which the pairwise
losses expect inside every micro-batch. Policy.train deals each global batch to the dp ranks in contiguous
blocks of global_batch_size/dp rows and cuts those into contiguous micro-batches of micro_batch_size rows, so
pairs stay whole when both are even and rows are not reordered (no dynamic batching or packing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.algorithms import supervised
from posttrain.algorithms.checks import check_parallelism
from posttrain.algorithms.recovery import train_with_restarts
from posttrain.algorithms.run import TrainingConfig
from posttrain.algorithms.supervised import SupervisedRun
from posttrain.config import ConfigError, load_run_config
from posttrain.data import DataConfig, message_log_to_flat
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.utils.metrics import single_step_metrics
from posttrain.utils.timer import Timer
from posttrain.workers.policy import Policy
from posttrain.workers.policy.base import LossFn
from posttrain.workers.policy.config import model_parallel_size


@dataclass
class PairConfig(TrainingConfig):
    """The sections of a pair command's config; the command's class adds its loop section (`command`)."""

    command: ClassVar[str]  # the command, also its loop section's key
    model_kind: ClassVar[str]  # the policy.model_kind it trains

    data: DataConfig = field(
        default_factory=lambda: DataConfig(dataset="arithmetic_preference", format="preference")
    )
    """preference pairs (prompt, chosen, rejected)"""

    def validate(self) -> None:
        """The policy's model kind, and whole pairs in every rank's share of a global batch and in every
        micro-batch."""
        if self.policy.model_kind != self.model_kind:
            raise ConfigError(
                "policy.model_kind",
                f"posttrain {self.command} trains a {self.model_kind!r}, got {self.policy.model_kind!r}",
            )
        check_parallelism(self.policy, self.cluster)
        for key in ("dynamic_batching", "sequence_packing"):
            if getattr(self.policy, key).enabled:
                raise ConfigError(
                    f"policy.{key}.enabled",
                    "reorders rows and would split chosen/rejected pairs; turn it off",
                )
        num_workers = self.cluster.num_nodes * self.cluster.workers_per_node
        num_ranks = max(1, num_workers // model_parallel_size(self.policy))
        if self.policy.train_global_batch_size % (2 * num_ranks):
            raise ConfigError(
                "policy.train_global_batch_size",
                f"must be a multiple of 2 x {num_ranks} data-parallel ranks (rows are chosen/rejected pairs "
                f"and each rank gets whole pairs), got {self.policy.train_global_batch_size}",
            )
        if self.policy.train_micro_batch_size % 2:
            raise ConfigError(
                "policy.train_micro_batch_size",
                "must be even (a micro-batch holds whole chosen/rejected pairs), got "
                f"{self.policy.train_micro_batch_size}",
            )

    def pair_loss(self) -> LossFn:
        """The loss of a global batch of pairs (chosen and rejected rows adjacent)."""
        raise NotImplementedError

    def uses_reference(self) -> bool:
        """The loss compares with the frozen initial policy (its logprobs come with every batch)."""
        return False


PairRun = SupervisedRun[PairConfig]  # val_data: interleaved pairs (with their reference logprobs)


def pairs_to_train_data(records: list[dict], pad_token_id: int, num_masked_pairs: int = 0) -> BatchedDataDict:
    """Preference records -> a flat batch of 2 x len(records) rows: row 2i the chosen conversation of
    record i, row 2i+1 its rejected one; token_mask covers the final assistant turn (the response). The
    last `num_masked_pairs` pairs get sample_mask 0 (padding that counts nowhere)."""
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
        data["sample_mask"][-2 * num_masked_pairs :] = 0
    return data


def with_reference_logprobs(policy: Policy, data: BatchedDataDict) -> BatchedDataDict:
    """`reference_policy_logprobs [B, T]` from the frozen initial policy, added to `data`."""
    reference = policy.get_reference_policy_logprobs(data)
    data["reference_policy_logprobs"] = reference["reference_policy_logprobs"]
    return data


def val_batches(run: PairRun, records: list[dict]) -> list[BatchedDataDict]:
    """Validation batches of `val_global_batch_size` pairs, each padded with masked copies of its last pair
    to a multiple of the data-parallel ranks (so that every rank gets whole pairs), with the reference's
    logprobs when the loss needs them."""
    size, num_ranks = run.loop.val_global_batch_size, run.policy.dp_size
    batches = []
    for start in range(0, len(records), size):
        chunk = records[start : start + size]
        num_padding = -len(chunk) % num_ranks
        batch = pairs_to_train_data(
            chunk + [chunk[-1]] * num_padding, run.tokenizer.pad_token_id, num_padding
        )
        batches.append(with_reference_logprobs(run.policy, batch) if run.cfg.uses_reference() else batch)
    return batches


def setup(cfg: PairConfig) -> PairRun:
    """Data, policy (with its frozen reference when the loss needs one), logger and checkpoints; resumes from
    the latest checkpoint if any."""
    num_pairs = cfg.policy.train_global_batch_size // 2
    return supervised.setup_run(cfg, cfg.command, num_pairs, val_batches, cfg.uses_reference())


def train_step(run: PairRun, timer: Timer) -> dict[str, float]:
    """One optimizer step of the command's loss on the run's next global batch of pairs (with the
    reference's logprobs when the loss needs them), with the margin of the mean rewards (or scores)."""
    with timer.time("data"):
        batch = pairs_to_train_data(run.train_loader.next_batch(), run.tokenizer.pad_token_id)
    if run.cfg.uses_reference():
        with timer.time("reference_logprobs"):
            with_reference_logprobs(run.policy, batch)
    with timer.time("train"):
        metrics = single_step_metrics(run.policy.train(batch, run.cfg.pair_loss()))
    metrics["margin_mean"] = metrics["rewards_chosen_mean"] - metrics["rewards_rejected_mean"]
    metrics["num_trained_tokens"] = float(batch["token_mask"].sum())
    return metrics


def validate(run: PairRun) -> dict[str, float]:
    """Forward-only loss over the validation pairs (loss, accuracy, mean rewards or scores of chosen and
    rejected): its metrics averaged with each batch weighted by its number of real (unmasked) pairs."""
    totals: dict[str, float] = {}
    num_pairs = 0.0
    for batch in run.val_data:
        batch_pairs = float(batch["sample_mask"].sum()) / 2
        metrics = run.policy.evaluate(
            batch,
            run.cfg.pair_loss(),
            global_batch_size=batch.size,
            micro_batch_size=run.cfg.policy.train_micro_batch_size,
        )
        for key, value in single_step_metrics(metrics).items():
            if key != "num_microbatches":
                totals[key] = totals.get(key, 0.0) + value * batch_pairs
        num_pairs += batch_pairs
    return {key: total / max(num_pairs, 1.0) for key, total in totals.items()}


def pair_progress(metrics: dict[str, float], val_metrics: dict[str, float] | None) -> dict[str, float]:
    """The progress line of a pair loop: loss and accuracy, and the validation accuracy when validated."""
    shown = {"loss": metrics["loss"], "acc": metrics["accuracy"]}
    return shown | ({"val_acc": val_metrics["accuracy"]} if val_metrics else {})


def train(run: PairRun, num_steps: int | None = None) -> dict[str, float]:
    """Train until `run.total_steps` (or `num_steps` more steps); returns the last validation metrics."""
    return supervised.train(run, train_step, validate, pair_progress, pairs=True, num_steps=num_steps)


def main(schema: type[PairConfig], args: Any) -> int:
    """`posttrain dpo` / `posttrain rm`: train (rebuilding lost workers), then print the final metrics."""
    run, val_metrics = train_with_restarts(load_run_config(schema, args), setup, train)
    print(
        f"{run.name} finished at step {run.step}: val loss {val_metrics.get('loss', float('nan')):.4f}, "
        f"val accuracy {val_metrics.get('accuracy', float('nan')):.3f}; run directory {run.log_dir}"
    )
    return 0
