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

Run: posttrain sft --config configs/sft_tiny.yaml, then posttrain rm --config configs/rm_tiny.yaml"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from posttrain.algorithms import pairs, supervised
from posttrain.algorithms.checks import missing_run_files
from posttrain.algorithms.preference_loss import BradleyTerryLoss
from posttrain.algorithms.recovery import train_with_restarts
from posttrain.algorithms.supervised import LoopConfig, SupervisedRun
from posttrain.config import ConfigError, load_run_config
from posttrain.data import DataConfig
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.virtual_cluster import ClusterConfig
from posttrain.utils.checkpoint import CheckpointingConfig
from posttrain.utils.logger import LoggerConfig
from posttrain.utils.timer import Timer
from posttrain.workers.policy import Policy, PolicyConfig
from posttrain.workers.policy.config import policy_with_lr

# A reward model is a full fine-tune of a pretrained network with a new scalar head: a rate of SFT's order.
# The tiny recipe (configs/rm_tiny.yaml) sets its own, larger rate.
RM_LR = 1e-5


@dataclass
class RMConfig:
    """`posttrain rm` configuration."""

    rm: LoopConfig = field(default_factory=LoopConfig)
    """the reward-model loop"""
    policy: PolicyConfig = field(default_factory=lambda: policy_with_lr(RM_LR, model_kind="reward_model"))
    """the trained reward model (model_kind: reward_model; AdamW lr 1e-5 by default)"""
    data: DataConfig = field(
        default_factory=lambda: DataConfig(dataset="arithmetic_preference", format="preference")
    )
    """preference pairs (prompt, chosen, rejected)"""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Ray cluster and placement"""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """logging"""
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    """checkpoints (ranked by val_loss by default)"""

    def validate(self) -> None:
        if self.policy.model_kind != "reward_model":
            raise ConfigError(
                "policy.model_kind",
                f"reward-model training needs 'reward_model', got {self.policy.model_kind!r}",
            )
        pairs.check_pair_batching(self.policy, self.cluster)

    def missing_files(self) -> list[ConfigError]:
        """Missing data files and model directories, one error each (run before anything starts)."""
        return missing_run_files(self.policy, self.data)


RMRun = SupervisedRun[RMConfig]  # val_data: interleaved pairs


def val_batches(
    cfg: RMConfig, policy: Policy, tokenizer: PreTrainedTokenizerBase, records: list[dict]
) -> list[BatchedDataDict]:
    return pairs.val_pair_batches(
        policy, records, cfg.rm.val_global_batch_size, tokenizer.pad_token_id, False
    )


def validate(run: RMRun) -> dict[str, float]:
    """Bradley-Terry loss, accuracy and mean scores of chosen and rejected over the validation pairs."""
    loss_fn = BradleyTerryLoss()
    return pairs.evaluate_pairs(run.policy, run.val_data, loss_fn, run.cfg.policy.train_micro_batch_size)


def train_step(run: RMRun, timer: Timer) -> dict[str, float]:
    """One optimizer step on the next global batch of pairs."""
    metrics, _ = pairs.train_pairs(run, timer, BradleyTerryLoss(), reference=False)
    metrics["margin_mean"] = metrics["rewards_chosen_mean"] - metrics["rewards_rejected_mean"]
    return metrics


def setup(cfg: RMConfig) -> RMRun:
    """Data, reward model workers, logger and checkpoints; resumes from the latest checkpoint if any."""
    hyperparams = {"rm": cfg.rm, "policy": cfg.policy, "data": cfg.data}
    return supervised.setup_run(
        cfg, "rm", "rm", cfg.policy.train_global_batch_size // 2, val_batches, hyperparams
    )


def rm_train(run: RMRun, num_steps: int | None = None) -> dict[str, float]:
    """Train until `run.total_steps` (or `num_steps` more steps); returns the last validation metrics."""
    return supervised.train(run, train_step, validate, pairs.pair_progress, pairs=True, num_steps=num_steps)


def main(args: Any) -> int:
    run, val_metrics = train_with_restarts(load_run_config(RMConfig, args), setup, rm_train)
    print(pairs.pair_summary("rm", run.step, val_metrics, run.log_dir))
    return 0
