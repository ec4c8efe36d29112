"""Reward-model training with the Bradley-Terry loss.

Algorithm as implemented: the model is the policy backbone with a scalar head
(`AutoModelForSequenceClassification` with one label, read at each sequence's last token; built from
`policy.model_name` or `policy.model.from_config`, the head freshly initialised from `policy.seed`), in
the same FSDP2 workers as the policy. Each step takes `policy.train_global_batch_size / 2` preference
pairs, scores the chosen and the rejected conversation, and takes one optimizer step on
-log sigmoid(r_c - r_r) averaged over the pairs of the global batch (Bradley and Terry 1952; as in
InstructGPT, arXiv:2203.02155, without its K-way comparisons; pairs travel as rows: `pairs.py`).
Validation every `rm.val_period` steps: loss, accuracy (fraction of held-out pairs with r_c > r_r) and mean
scores. Checkpoints, exact resume and logging as in SFT; the final model is exported to
`<log_dir>/hf_model`, which the `reward_model` environment loads to score GRPO rollouts.

Run: posttrain sft --config configs/sft_tiny.yaml, then posttrain rm --config configs/rm_tiny.yaml"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.algorithms import pairs
from posttrain.algorithms.preference_loss import BradleyTerryLoss
from posttrain.algorithms.supervised import LoopConfig
from posttrain.workers.policy import PolicyConfig
from posttrain.workers.policy.config import policy_with_lr

# A reward model is a full fine-tune of a pretrained network with a new scalar head: a rate of SFT's order.
# The tiny recipe (configs/rm_tiny.yaml) sets its own, larger rate.
RM_LR = 1e-5


@dataclass
class RMConfig(pairs.PairConfig):
    """`posttrain rm` configuration."""

    command: ClassVar[str] = "rm"
    model_kind: ClassVar[str] = "reward_model"

    rm: LoopConfig = field(default_factory=LoopConfig)
    """the reward-model loop"""
    policy: PolicyConfig = field(default_factory=lambda: policy_with_lr(RM_LR, model_kind="reward_model"))
    """the trained reward model (model_kind: reward_model; AdamW lr 1e-5 by default)"""

    def pair_loss(self) -> BradleyTerryLoss:
        return BradleyTerryLoss()


def main(args: Any) -> int:
    return pairs.main(RMConfig, args)
