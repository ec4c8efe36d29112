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

`loss.preference_loss` swaps the pair loss for IPO's squared one or SimPO's reference-free one (formulas in
`loss.DPOLoss`); SimPO computes no reference logprobs and keeps no reference weights.

Run: posttrain sft --config configs/sft_tiny.yaml, then posttrain dpo --config configs/dpo_tiny.yaml"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from posttrain.algorithms import pairs, supervised
from posttrain.algorithms.checks import missing_run_files
from posttrain.algorithms.preference_loss import DPOLoss, DPOLossConfig
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

# DPO moves a pretrained policy a little away from its reference: TRL's DPOConfig default. The tiny
# recipe (configs/dpo_tiny.yaml) sets its own, larger rate.
DPO_LR = 1e-6


@dataclass
class DPOConfig:
    """`posttrain dpo` configuration."""

    dpo: LoopConfig = field(default_factory=LoopConfig)
    """the DPO loop"""
    loss: DPOLossConfig = field(default_factory=DPOLossConfig)
    """DPO loss (beta, SFT term)"""
    policy: PolicyConfig = field(default_factory=lambda: policy_with_lr(DPO_LR))
    """the trained model (AdamW lr 1e-6 by default)"""
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
        if self.policy.model_kind != "causal_lm":
            raise ConfigError("policy.model_kind", f"DPO trains a causal LM, got {self.policy.model_kind!r}")
        pairs.check_pair_batching(self.policy, self.cluster)

    def missing_files(self) -> list[ConfigError]:
        """Missing data files and model directories, one error each (run before anything starts)."""
        return missing_run_files(self.policy, self.data)


DPORun = SupervisedRun[DPOConfig]  # val_data: interleaved pairs with their reference logprobs


def uses_reference(cfg: DPOConfig) -> bool:
    """Every pair loss but SimPO's compares with the frozen reference."""
    return cfg.loss.preference_loss != "simpo"


def val_batches(
    cfg: DPOConfig, policy: Policy, tokenizer: PreTrainedTokenizerBase, records: list[dict]
) -> list[BatchedDataDict]:
    size, pad_id = cfg.dpo.val_global_batch_size, tokenizer.pad_token_id
    return pairs.val_pair_batches(policy, records, size, pad_id, uses_reference(cfg))


def validate(run: DPORun) -> dict[str, float]:
    """DPO loss, preference accuracy and mean implicit rewards over the validation pairs."""
    loss_fn = DPOLoss(run.cfg.loss)
    return pairs.evaluate_pairs(run.policy, run.val_data, loss_fn, run.cfg.policy.train_micro_batch_size)


def train_step(run: DPORun, timer: Timer) -> dict[str, float]:
    """One optimizer step on the next global batch of pairs."""
    metrics, batch = pairs.train_pairs(run, timer, DPOLoss(run.cfg.loss), uses_reference(run.cfg))
    metrics["num_trained_tokens"] = float(batch["token_mask"].sum())
    return metrics


def setup(cfg: DPOConfig) -> DPORun:
    """Data, policy with its reference, logger and checkpoints; resumes from the latest checkpoint if any."""
    hyperparams = {"dpo": cfg.dpo, "loss": cfg.loss, "policy": cfg.policy, "data": cfg.data}
    num_pairs = cfg.policy.train_global_batch_size // 2
    return supervised.setup_run(cfg, "dpo", "dpo", num_pairs, val_batches, hyperparams, uses_reference(cfg))


def dpo_train(run: DPORun, num_steps: int | None = None) -> dict[str, float]:
    """Train until `run.total_steps` (or `num_steps` more steps); returns the last validation metrics."""
    return supervised.train(run, train_step, validate, pairs.pair_progress, pairs=True, num_steps=num_steps)


def main(args: Any) -> int:
    run, val_metrics = train_with_restarts(load_run_config(DPOConfig, args), setup, dpo_train)
    print(pairs.pair_summary("dpo", run.step, val_metrics, run.log_dir))
    return 0
