"""Direct preference optimisation (DPO, Rafailov et al. 2023, arXiv:2305.18290).

Algorithm as implemented: each step takes `policy.train_global_batch_size / 2` preference pairs (a prompt
or conversation with a chosen and a rejected final assistant response), computes the responses' token
logprobs under the frozen initial policy (the reference), and takes one optimizer step on

    -log sigmoid(beta * ((log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r))))
        [ + sft_loss_weight * -log pi(y_c) ]

averaged over the pairs of the global batch, where log pi(y) sums (or, with
`loss.preference_average_log_probs`, averages) the logprobs of the final assistant turn (pairs travel as rows:
`pairs.py`). Validation every `dpo.val_period` steps: the same loss and the implicit-reward accuracy (fraction
of held-out pairs with r_c > r_r). Checkpoints, exact resume and logging as in SFT. Departures from the paper:
the reference is whatever model the run starts from (the paper's pi_SFT when that is an SFT model, as in
configs/dpo_tiny.yaml); the optional SFT term on the chosen response is RPO's (arXiv:2404.19733).

`loss.preference_loss` swaps the pair loss for IPO's squared one or SimPO's reference-free one (formulas in
`loss.DPOLoss`); SimPO computes no reference logprobs and keeps no reference weights.

Run: posttrain sft --config configs/sft_tiny.yaml, then posttrain dpo --config configs/dpo_tiny.yaml"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.algorithms import pairs
from posttrain.algorithms.preference_loss import DPOLoss, DPOLossConfig
from posttrain.algorithms.supervised import LoopConfig
from posttrain.workers.policy import PolicyConfig
from posttrain.workers.policy.config import policy_with_lr

# DPO moves a pretrained policy a little away from its reference: TRL's DPOConfig default. The tiny
# recipe (configs/dpo_tiny.yaml) sets its own, larger rate.
DPO_LR = 1e-6


@dataclass
class DPOConfig(pairs.PairConfig):
    """`posttrain dpo` configuration."""

    command: ClassVar[str] = "dpo"
    model_kind: ClassVar[str] = "causal_lm"

    dpo: LoopConfig = field(default_factory=LoopConfig)
    """the DPO loop"""
    loss: DPOLossConfig = field(default_factory=DPOLossConfig)
    """DPO loss (beta, SFT term)"""
    policy: PolicyConfig = field(default_factory=lambda: policy_with_lr(DPO_LR))
    """the trained model (AdamW lr 1e-6 by default)"""

    def pair_loss(self) -> DPOLoss:
        return DPOLoss(self.loss)

    def uses_reference(self) -> bool:
        """Every pair loss but SimPO's compares with the frozen reference."""
        return self.loss.preference_loss != "simpo"


def main(args: Any) -> int:
    return pairs.main(DPOConfig, args)
