"""Preference losses called by the training worker once per micro-batch: DPO (and its IPO and SimPO
variants) and the Bradley-Terry reward-model loss. Rows come in pairs (chosen, rejected) and keep their
order, so these losses are not `rows_independent`. The contract is `loss.py`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from posttrain.algorithms.loss import Count, Data, Loss, LossInputs, LossOutput, TokenInputs, _count
from posttrain.config import ConfigError


def _pair_halves(values: torch.Tensor, loss_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved pairs [2P, ...] -> (chosen rows 0, 2, 4..., rejected rows 1, 3, 5...), each [P, ...]."""
    if values.shape[0] % 2:
        raise ValueError(
            f"{loss_name}: pairs are interleaved (row 2i chosen, 2i+1 rejected), got an odd batch of "
            f"{values.shape[0]} rows"
        )
    return values[0::2], values[1::2]


@dataclass
class DPOLossConfig:
    """Options of the DPO loss and its one-loss-away variants (IPO, SimPO)."""

    preference_loss: Literal["dpo", "ipo", "simpo"] = "dpo"
    """dpo: -log sigmoid(r_c - r_r); ipo: (h - 1/(2 beta))^2 with h the difference of log ratios; simpo:
    reference-free, -log sigmoid(beta (mean log pi(y_c) - mean log pi(y_r)) - simpo_gamma)"""
    reference_policy_kl_penalty: float = 0.1
    """beta: scale of the implicit reward beta * (log pi - log pi_ref); IPO's tau; SimPO's beta"""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (preference_loss simpo)"""
    preference_average_log_probs: bool = False
    """sequence log-prob = mean (not sum) of the response's token logprobs in the preference term"""
    preference_loss_weight: float = 1.0
    """weight of the preference (DPO) term"""
    sft_loss_weight: float = 0.0
    """weight of an NLL term on the chosen response; 0 = off"""
    sft_average_log_probs: bool = False
    """the SFT term uses the mean (not sum) of the chosen token logprobs"""

    def validate(self) -> None:
        if self.preference_loss == "ipo" and self.reference_policy_kl_penalty <= 0:
            raise ConfigError(
                "reference_policy_kl_penalty", "IPO's target margin is 1 / (2 beta): beta must be > 0"
            )


def _sequence_logprobs(logprobs: torch.Tensor, token_mask: torch.Tensor, average: bool) -> torch.Tensor:
    """Sum (or mean) over trained tokens: [B, T] -> [B]."""
    total = (logprobs * token_mask).sum(dim=1)  # [B]
    return total / token_mask.sum(dim=1).clamp(min=1.0) if average else total


def _pair_mask(inputs: LossInputs, like: torch.Tensor, loss_name: str) -> torch.Tensor:
    """1 for pairs whose chosen and rejected rows are both valid: [P]."""
    chosen_mask, rejected_mask = _pair_halves(inputs.samples(like), loss_name)
    return chosen_mask * rejected_mask  # [P]


@dataclass(kw_only=True)
class DPOInputs(TokenInputs):
    reference_policy_logprobs: torch.Tensor | None = None  # [B, T] the reference's (all but SimPO)


class DPOLoss(Loss):
    """Direct preference optimisation (Rafailov et al. 2023, arXiv:2305.18290) and two variants that are one
    loss away, IPO and SimPO (`cfg.preference_loss`).

    Rows are interleaved pairs: row 2i is the chosen response of pair i and row 2i+1 its rejected one, and
    both rows of a pair carry the same sample_mask. log pi(y) is the sum (or, with
    preference_average_log_probs, the mean) of the response's token logprobs, beta
    `reference_policy_kl_penalty`, and per pair:

        dpo:    r = beta * (log pi(y) - log pi_ref(y)),   l = -log sigmoid(r_c - r_r)
        ipo:    h = (log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r)),
                l = (h - 1 / (2 beta))^2                  (Azar et al. 2023, arXiv:2310.12036; beta is tau)
        simpo:  r = beta * mean log pi(y), no reference,  l = -log sigmoid(r_c - r_r - gamma)
                                                          (Meng et al. 2024, arXiv:2405.14734)

        loss = sum over pairs of [w_pref * l + w_sft * -log pi(y_c)] / global pairs

    where global pairs = global_valid_seqs / 2. SimPO always uses the mean logprob (its length
    normalisation) and ignores reference_policy_logprobs. The reported rewards are r / beta, NeMo RL's
    meaning: the log ratio log pi(y) - log pi_ref(y) (SimPO: the mean log pi(y)); multiply by beta for DPO's
    implicit reward. Metrics (sums): loss, preference_loss, sft_loss, accuracy (fraction of pairs with
    r_c > r_r), rewards_chosen_mean, rewards_rejected_mean."""

    def __init__(self, cfg: DPOLossConfig | None = None) -> None:
        self.cfg = cfg or DPOLossConfig()

    def __call__(
        self, logprobs: torch.Tensor, data: Data, global_valid_seqs: Count, global_valid_toks: Count
    ) -> LossOutput:
        logprobs = logprobs.float()  # [B, T]
        needs = () if self.cfg.preference_loss == "simpo" else ("reference_policy_logprobs",)
        inputs = DPOInputs.read(data, logprobs, "DPOLoss", needs)
        token_mask = inputs.token_mask  # [B, T]
        pair_mask = _pair_mask(inputs, logprobs, "DPOLoss")  # [P]
        num_pairs = _count(torch.as_tensor(global_valid_seqs, dtype=torch.float32) / 2, logprobs)
        rewards_chosen, rewards_rejected, pair_losses = self._pair_losses(logprobs, token_mask, inputs)  # [P]
        preference_loss = (pair_losses * pair_mask).sum() / num_pairs
        chosen_logprobs, _ = _pair_halves(
            _sequence_logprobs(logprobs, token_mask, self.cfg.sft_average_log_probs), "DPOLoss"
        )  # [P]
        sft_loss = (-chosen_logprobs * pair_mask).sum() / num_pairs
        loss = self.cfg.preference_loss_weight * preference_loss + self.cfg.sft_loss_weight * sft_loss
        beta = self.cfg.reference_policy_kl_penalty
        metrics = _pair_metrics(
            rewards_chosen.detach() / beta, rewards_rejected.detach() / beta, pair_mask, num_pairs
        )
        metrics.update(
            loss=float(loss.detach()),
            preference_loss=float(preference_loss.detach()),
            sft_loss=float(sft_loss.detach()),
        )
        return loss, metrics

    def _pair_losses(
        self, logprobs: torch.Tensor, token_mask: torch.Tensor, inputs: DPOInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rewards of the chosen and rejected responses and the per-pair preference loss l, each [P]."""
        beta = self.cfg.reference_policy_kl_penalty
        if self.cfg.preference_loss == "simpo":
            chosen, rejected = _pair_halves(beta * _sequence_logprobs(logprobs, token_mask, True), "DPOLoss")
            return chosen, rejected, -F.logsigmoid(chosen - rejected - self.cfg.simpo_gamma)
        ref_logprobs = inputs.reference_policy_logprobs  # [B, T] (required but by SimPO)
        average = self.cfg.preference_average_log_probs
        log_ratio = _sequence_logprobs(logprobs, token_mask, average) - _sequence_logprobs(
            ref_logprobs, token_mask, average
        )  # [B]
        chosen, rejected = _pair_halves(beta * log_ratio, "DPOLoss")  # [P], [P]
        if self.cfg.preference_loss == "ipo":
            ratio_chosen, ratio_rejected = _pair_halves(log_ratio, "DPOLoss")
            return chosen, rejected, (ratio_chosen - ratio_rejected - 1.0 / (2.0 * beta)).square()
        return chosen, rejected, -F.logsigmoid(chosen - rejected)


def _pair_metrics(
    rewards_chosen: torch.Tensor,
    rewards_rejected: torch.Tensor,
    pair_mask: torch.Tensor,
    num_pairs: torch.Tensor,
) -> dict[str, float]:
    """accuracy, rewards_chosen_mean, rewards_rejected_mean as sums over this micro-batch / global pairs."""
    return {
        "accuracy": float(((rewards_chosen > rewards_rejected).float() * pair_mask).sum() / num_pairs),
        "rewards_chosen_mean": float((rewards_chosen * pair_mask).sum() / num_pairs),
        "rewards_rejected_mean": float((rewards_rejected * pair_mask).sum() / num_pairs),
    }


class BradleyTerryLoss(Loss):
    """Reward-model loss on interleaved pairs of scalar scores (row 2i chosen, 2i+1 rejected):

        loss = sum over pairs of -log sigmoid(s_c - s_r) / global pairs, global pairs = global_valid_seqs / 2

    The first argument is `scores [B]` (or [B, 1]), not logprobs. Metrics (sums): loss, accuracy (fraction
    of pairs with s_c > s_r), rewards_chosen_mean, rewards_rejected_mean."""

    def __call__(
        self, scores: torch.Tensor, data: Data, global_valid_seqs: Count, global_valid_toks: Count
    ) -> LossOutput:
        scores = scores.float().reshape(scores.shape[0])  # [B]
        pair_mask = _pair_mask(LossInputs.read(data, scores, "BradleyTerryLoss"), scores, "BradleyTerryLoss")
        num_pairs = _count(torch.as_tensor(global_valid_seqs, dtype=torch.float32) / 2, scores)
        scores_chosen, scores_rejected = _pair_halves(scores, "BradleyTerryLoss")  # [P], [P]
        loss = (-F.logsigmoid(scores_chosen - scores_rejected) * pair_mask).sum() / num_pairs
        metrics = _pair_metrics(scores_chosen.detach(), scores_rejected.detach(), pair_mask, num_pairs)
        metrics["loss"] = float(loss.detach())
        return loss, metrics
