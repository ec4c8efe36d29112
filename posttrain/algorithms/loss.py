"""Loss functions called by the training worker once per micro-batch: NLL (SFT), the clipped policy
gradient (GRPO/DAPO/GSPO options), PPO's clipped value loss (critic); the preference losses (DPO,
Bradley-Terry) are in `preference_loss.py` and follow the same contract.

Contract: `loss_fn(logprobs, data, global_valid_seqs, global_valid_toks) -> (loss, metrics)`.
- `logprobs [B, T]`: position t holds log p(token t | tokens < t), position 0 is 0 (`scores [B]` for the
  reward model). `data` is the micro-batch; each loss reads it through a dataclass that names the tensors
  it needs with their shapes (`TokenInputs`, `PGInputs`, ...: `<Inputs>.read(data, ...)`), and a KeyError
  names the loss and the key it needs that the micro-batch lacks.
- `global_valid_toks` = sum of token_mask * sample_mask over the GLOBAL batch, `global_valid_seqs` = sum
  of sample_mask over the global batch. Every loss divides by these, so the sum of the micro-batch losses
  over micro-batches and data-parallel ranks is the loss of the global batch (and so is the gradient).
- Metrics are floats already divided by the global counts, so that SUMMING them over micro-batches and
  ranks gives the global value; the only exceptions are keys ending in `_min` / `_max`, this micro-batch's
  extremes, which must be reduced with min / max (`posttrain.utils.metrics.reduce_metrics` does both).
- What the training worker asks a loss is the `Loss` base's attributes: `metric_reductions` (another
  reduction per metric, {"name": "mean" | "max" | "min" | "sum"}), `rows_independent` (a micro-batch's
  loss is a sum of its rows' own terms, so the worker may put any rows together, `policy.length_bucketing`;
  DPO and Bradley-Terry read rows in pairs and keep the order) and `candidate_ids_key`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping, Self

import torch

from posttrain.algorithms.advantages import check_finite, kl_estimate
from posttrain.config import ConfigError

Count = torch.Tensor | float | int
LossOutput = tuple[torch.Tensor, dict[str, float]]
Data = Mapping[str, Any]  # a micro-batch: data key -> tensor


class Loss:
    """Base of the losses: the attributes the training worker reads (`workers/policy/base.LossFn`)."""

    rows_independent: ClassVar[bool] = False  # True: the micro-batch loss is a sum of per-row terms
    metric_reductions: ClassVar[Mapping[str, str]] = {}  # metric -> "mean" / "max" / "min" / "sum"
    candidate_ids_key: ClassVar[str | None] = None  # data key of token ids [B, T, k] scored beside logprobs


@dataclass(kw_only=True)
class LossInputs:
    """The micro-batch tensors a loss reads; each field is a data key (None: optional and absent)."""

    sample_mask: torch.Tensor | None = None  # [B] 0 drops a sample; absent: all ones

    @classmethod
    def read(
        cls, data: Mapping[str, Any], like: torch.Tensor, loss: str, needs: tuple[str, ...] = ()
    ) -> Self:
        """The fields found in `data`, as float on like's device; KeyError naming `loss` and the key when a
        field without a default, or one named in `needs`, is missing."""
        values = {}
        for item in dataclasses.fields(cls):
            if item.name in data:
                values[item.name] = data[item.name].to(like.device).float()
            elif item.default is dataclasses.MISSING or item.name in needs:
                raise KeyError(f"{loss} needs '{item.name}' in the micro-batch; it has {sorted(data.keys())}")
        return cls(**values)

    def samples(self, like: torch.Tensor) -> torch.Tensor:
        """sample_mask [B] (all ones when absent)."""
        return torch.ones(like.shape[0], device=like.device) if self.sample_mask is None else self.sample_mask


@dataclass(kw_only=True)
class TokenInputs(LossInputs):
    """What every per-token loss reads."""

    token_mask: torch.Tensor  # [B, T] 1 on trained tokens

    def valid_tokens(self) -> torch.Tensor:
        """token_mask * sample_mask [B, T]."""
        return self.token_mask * self.samples(self.token_mask).unsqueeze(1)


@dataclass(kw_only=True)
class KDInputs(TokenInputs):
    teacher_topk_logprobs: torch.Tensor  # [B, T, k] the teacher's top-k next-token logprobs


@dataclass(kw_only=True)
class PGInputs(TokenInputs):
    advantages: torch.Tensor  # [B, T]
    prev_logprobs: torch.Tensor | None = None  # [B, T] pi_prev (the trainer's logprobs of the data)
    generation_logprobs: torch.Tensor | None = None  # [B, T] the generation engine's
    reference_policy_logprobs: torch.Tensor | None = None  # [B, T] the frozen reference's


@dataclass(kw_only=True)
class ValueInputs(TokenInputs):
    returns: torch.Tensor  # [B, T]
    prev_values: torch.Tensor  # [B, T] the values that computed the advantages


def _count(value: Count, like: torch.Tensor) -> torch.Tensor:
    """A global count as a float tensor, at least 1 so that an empty batch gives 0 rather than NaN."""
    return torch.as_tensor(value, dtype=torch.float32, device=like.device).clamp(min=1.0)


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


class NLLLoss(Loss):
    """Supervised fine-tuning: -sum(logprobs * mask) / global_valid_toks.

    Metrics (sums): loss; num_valid_tokens, this micro-batch's count of trained tokens."""

    rows_independent = True

    def __call__(
        self, logprobs: torch.Tensor, data: Data, global_valid_seqs: Count, global_valid_toks: Count
    ) -> LossOutput:
        mask = TokenInputs.read(data, logprobs, "NLLLoss").valid_tokens()  # [B, T]
        loss = -_masked_sum(logprobs.float(), mask) / _count(global_valid_toks, logprobs)
        return loss, {"loss": float(loss.detach()), "num_valid_tokens": float(mask.sum())}


@dataclass
class KDLossConfig:
    """Weights of off-policy knowledge distillation's loss."""

    kd_weight: float = 1.0
    """weight of the KL to the teacher's top-k"""
    nll_weight: float = 0.0
    """weight of the data's own NLL (SFT's loss) beside it; 0 = off"""

    def validate(self) -> None:
        if self.kd_weight < 0 or self.nll_weight < 0 or self.kd_weight + self.nll_weight == 0:
            raise ConfigError("kd_weight", "kd_weight and nll_weight must be >= 0, not both 0")


class KDLoss(Loss):
    """Off-policy knowledge distillation on the teacher's top-k (Hinton et al. 2015, arXiv:1503.02531, with
    the top-k truncation of large-vocabulary distillation). At each trained token t the teacher's k most
    likely next tokens j with logprobs l_j are renormalised, q_j = exp(l_j) / sum_i exp(l_i), and with the
    student's full-vocabulary logprobs s_j of the same ids:

        KL_t = sum_j q_j (log q_j - s_j)          (forward KL on the teacher's top-k support)
        loss = [w_kd * sum_t KL_t + w_nll * sum_t -log p(y_t)] / global trained tokens

    Its first argument is [B, T, 1 + k]: each token's logprob, then the student's logprobs of the teacher's
    k ids (`candidate_ids_key` tells the worker which ids). Needs `teacher_topk_logprobs` [B, T, k].
    Metrics (sums): loss, kd_loss, nll_loss, teacher_topk_mass (the teacher's probability inside its top k,
    summed over tokens / global tokens), num_valid_tokens."""

    rows_independent = True

    candidate_ids_key = "teacher_topk_ids"

    def __init__(self, cfg: KDLossConfig | None = None) -> None:
        self.cfg = cfg or KDLossConfig()

    def __call__(
        self, outputs: torch.Tensor, data: Data, global_valid_seqs: Count, global_valid_toks: Count
    ) -> LossOutput:
        logprobs, student = outputs[..., 0].float(), outputs[..., 1:].float()  # [B, T], [B, T, k]
        inputs = KDInputs.read(data, logprobs, "KDLoss")
        teacher, mask = inputs.teacher_topk_logprobs, inputs.valid_tokens()  # [B, T, k], [B, T]
        tokens = _count(global_valid_toks, logprobs)
        target = torch.log_softmax(teacher, dim=-1)  # log q [B, T, k]
        kl = (target.exp() * (target - student)).sum(dim=-1)  # [B, T]
        kd_loss = _masked_sum(kl, mask) / tokens
        nll_loss = -_masked_sum(logprobs, mask) / tokens
        loss = self.cfg.kd_weight * kd_loss + self.cfg.nll_weight * nll_loss
        topk_mass = _masked_sum(teacher.exp().sum(dim=-1), mask) / tokens
        return loss, {
            "loss": float(loss.detach()),
            "kd_loss": float(kd_loss.detach()),
            "nll_loss": float(nll_loss.detach()),
            "teacher_topk_mass": float(topk_mass),
            "num_valid_tokens": float(mask.sum()),
        }


@dataclass
class ClippedPGLossConfig:
    """Options of the clipped policy-gradient loss (PPO/GRPO, with DAPO and GSPO variants)."""

    ratio_clip_min: float = 0.2
    """epsilon_low: the ratio is clipped below at 1 - ratio_clip_min"""
    ratio_clip_max: float = 0.2
    """epsilon_high: the ratio is clipped above at 1 + ratio_clip_max (DAPO clip-higher: > min)"""
    ratio_clip_c: float | None = None
    """dual clip for negative advantages: per-token loss capped at -c * A (c > 1); None = off"""
    reference_policy_kl_penalty: float = 0.0
    """beta: weight of the per-token KL(pi || pi_ref) added to the loss; 0 = off"""
    kl_type: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator: k1 = log ratio, k2 = squared/2, k3 = exp(-x) + x - 1; in the loss each has the
    expected gradient of KL(pi || pi_ref) (see ClippedPGLoss)"""
    kl_input_clamp_value: float | None = 20.0
    """clamp the log ratio to [-v, v] before the KL estimator; None = off"""
    kl_output_clamp_value: float | None = 10.0
    """clamp the per-token KL estimate to [-v, v]; None = off"""
    token_level_loss: bool = True
    """True: mean over all valid tokens of the global batch; False: mean over tokens per sequence, then
    mean over sequences"""
    constant_length_normalizer: int | None = None
    """Dr. GRPO: divide the summed token loss by global sequences x this constant (e.g. the generation
    budget, generation.max_new_tokens) instead of by the token count; None = off"""
    sequence_level_importance_ratios: bool = False
    """GSPO: one ratio per sequence, exp(mean over its tokens of logprobs - prev_logprobs); needs
    token_level_loss=False"""
    use_importance_sampling_correction: bool = False
    """weight each token's loss by exp(prev_logprobs - generation_logprobs) (training vs generation engine
    mismatch)"""
    truncated_importance_sampling_ratio: float | None = None
    """upper bound of that importance weight (truncated IS); None = no bound"""
    force_on_policy_ratio: bool = False
    """use ratio = exp(logprobs - logprobs.detach()) (== 1, gradient of plain REINFORCE), ignoring
    prev_logprobs"""

    def validate(self) -> None:
        if self.ratio_clip_min < 0 or self.ratio_clip_max < 0:
            both = f"{self.ratio_clip_min} and ratio_clip_max={self.ratio_clip_max}"
            raise ConfigError("ratio_clip_min", f"{both} must be >= 0")
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            raise ConfigError("ratio_clip_c", f"{self.ratio_clip_c} must be > 1 (or None: no dual clip)")
        if self.sequence_level_importance_ratios and self.token_level_loss:
            raise ConfigError("sequence_level_importance_ratios", "GSPO needs token_level_loss=False")
        if self.constant_length_normalizer is not None:
            if self.constant_length_normalizer < 1:
                raise ConfigError("constant_length_normalizer", "must be >= 1")
            if not self.token_level_loss:
                raise ConfigError(
                    "constant_length_normalizer",
                    "Dr. GRPO's constant normaliser replaces the per-sequence token mean of "
                    "token_level_loss=false: pick one",
                )


class ClippedPGLoss(Loss):
    """Clipped policy gradient, per token t of sample i with ratio r = pi(t) / pi_prev(t), advantage A:

        L_t = w_t * (max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) + beta * KL_t)

    PPO (Schulman et al. 2017, arXiv:1707.06347) as GRPO uses it (arXiv:2402.03300), with: dual clip for
    A < 0 (L capped at -c A, arXiv:1912.09729); DAPO's clip-higher (arXiv:2503.14476); GSPO's
    sequence-level ratio (arXiv:2507.18071); w_t the optional truncated importance weight
    exp(prev - generation logprobs), which also weights the KL term. The reduction is a mean over the
    global batch's valid tokens (token_level_loss), a mean over tokens per sequence then over sequences,
    or Dr. GRPO's constant normaliser (arXiv:2503.20783) with L a fixed length (the generation budget):

        loss = sum over sequences i and their tokens t of L_{i,t} / (num_sequences * L)

    which, unlike a per-sequence or per-batch token mean, does not weight a token by the length of the
    response it belongs to.

    KL_t is the estimate k(x), x = log pi(t) - log pi_ref(t), of KL(pi || pi_ref), differentiated through
    log pi only. For k2 the expected gradient E_pi[x grad log pi] is already that of KL(pi || pi_ref); k1 and
    k3 get the score-function term sg(k) * (log pi - sg(log pi)), zero in value, so that their expected
    gradient E_pi[grad k + k grad log pi] = grad E_pi[k] = grad KL(pi || pi_ref) too (without it k1's
    expected gradient is zero and k3's is that of KL(pi_ref || pi)).

    Metrics (sums unless noted): loss; probs_ratio_mean (over valid tokens); probs_ratio_min and
    probs_ratio_max (micro-batch extremes, reduce with min/max); clip_fraction (tokens with r outside the
    clip range); kl_penalty (mean KL estimate, NeMo RL's meaning); kl_loss (beta * kl_penalty, the term
    added to the loss); approx_entropy (-mean logprob of the sampled tokens, each weighted by pi /
    pi_sampler, so that tokens drawn by the generation policy estimate the entropy of pi; pi_sampler is the
    generation logprobs when the data hold them, else pi_prev); is_weight_mean; token_mult_prob_error (mean
    exp(|prev - generation logprobs|), 1.0 when the micro-batch has no generation_logprobs).

    `prev_is_current`: the batch is trained in a single optimizer step, so pi_prev is the policy being
    trained, before its update: prev_logprobs are this forward's logprobs with the gradient stopped,
    and the data need no `prev_logprobs` (the trainer skips a forward pass over the batch)."""

    rows_independent = True

    metric_reductions = {"probs_ratio_min": "min", "probs_ratio_max": "max"}

    def __init__(self, cfg: ClippedPGLossConfig | None = None, prev_is_current: bool = False) -> None:
        self.cfg = cfg or ClippedPGLossConfig()
        self.prev_is_current = prev_is_current

    def __call__(
        self, logprobs: torch.Tensor, data: Data, global_valid_seqs: Count, global_valid_toks: Count
    ) -> LossOutput:
        logprobs = logprobs.float()  # [B, T]
        inputs = PGInputs.read(data, logprobs, "ClippedPGLoss", self.needs())
        mask, advantages = inputs.valid_tokens(), inputs.advantages  # [B, T], [B, T]
        check_finite(advantages, "advantages")
        prev_logprobs = inputs.prev_logprobs  # [B, T]
        if self.prev_is_current or prev_logprobs is None:
            prev_logprobs = logprobs.detach()
        ratio = self._ratio(logprobs, prev_logprobs, mask)  # [B, T]
        clipped_ratio = ratio.clamp(1.0 - self.cfg.ratio_clip_min, 1.0 + self.cfg.ratio_clip_max)
        pg_loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)  # [B, T]
        if self.cfg.ratio_clip_c is not None:
            dual_clipped = torch.minimum(pg_loss, -advantages * self.cfg.ratio_clip_c)
            pg_loss = torch.where(advantages < 0, dual_clipped, pg_loss)
        kl = self._kl(logprobs, inputs.reference_policy_logprobs)  # [B, T]
        is_weight = self._importance_weight(inputs.generation_logprobs, prev_logprobs, mask)  # [B, T]
        token_loss = is_weight * (pg_loss + self.cfg.reference_policy_kl_penalty * kl)  # [B, T]
        loss = self._reduce(token_loss, mask, inputs, global_valid_seqs, global_valid_toks)
        num_toks = _count(global_valid_toks, logprobs)

        def token_mean(values: torch.Tensor) -> float:  # over the global batch's valid tokens
            return float(_masked_sum(values, mask) / num_toks)

        metrics = self._ratio_metrics(ratio.detach(), mask, num_toks)
        metrics["kl_penalty"] = token_mean(kl.detach())
        metrics["kl_loss"] = self.cfg.reference_policy_kl_penalty * metrics["kl_penalty"]
        sampler_logprobs = inputs.generation_logprobs
        sampler_logprobs = prev_logprobs if sampler_logprobs is None else sampler_logprobs.float()
        entropy_weight = torch.exp(logprobs.detach() - sampler_logprobs)  # [B, T]
        metrics["approx_entropy"] = -token_mean(entropy_weight * logprobs.detach())
        metrics["is_weight_mean"] = token_mean(is_weight)
        metrics["token_mult_prob_error"] = token_mean(
            token_mult_prob_error(prev_logprobs, inputs.generation_logprobs)
        )
        metrics["loss"] = float(loss.detach())
        return loss, metrics

    def needs(self) -> tuple[str, ...]:
        """The optional `PGInputs` this configuration reads: prev_logprobs unless pi_prev is the trained
        forward's own, generation_logprobs for the importance weight, the reference's for the KL term."""
        cfg = self.cfg
        needs = () if self.prev_is_current or cfg.force_on_policy_ratio else ("prev_logprobs",)
        needs += ("generation_logprobs",) if cfg.use_importance_sampling_correction else ()
        return needs + (("reference_policy_logprobs",) if cfg.reference_policy_kl_penalty else ())

    def _ratio(self, logprobs: torch.Tensor, prev_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Importance ratio pi / pi_prev per token [B, T] (per sequence, broadcast, for GSPO)."""
        if self.cfg.force_on_policy_ratio:
            return torch.exp(logprobs - logprobs.detach())  # [B, T], == 1 with the policy's gradient
        log_ratio = logprobs - prev_logprobs  # [B, T]
        if self.cfg.sequence_level_importance_ratios:
            num_tokens = mask.sum(dim=1).clamp(min=1.0)  # [B]
            sequence_log_ratio = (log_ratio * mask).sum(dim=1) / num_tokens  # [B]
            log_ratio = sequence_log_ratio.unsqueeze(1).expand_as(log_ratio)  # [B, T]
        return torch.exp(log_ratio)  # [B, T]

    def _kl(self, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None) -> torch.Tensor:
        """Per-token KL estimate to the reference policy [B, T]; zeros without reference logprobs."""
        if ref_logprobs is None:
            return torch.zeros_like(logprobs)
        cfg = self.cfg
        kl = kl_estimate(
            logprobs, ref_logprobs, cfg.kl_type, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value
        )
        if cfg.kl_type == "k2":
            return kl
        return kl + kl.detach() * (logprobs - logprobs.detach())  # score-function term: zero in value

    def _importance_weight(
        self, generation_logprobs: torch.Tensor | None, prev_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Detached exp(prev - generation logprobs), truncated above [B, T]; ones when the correction is
        off. GSPO (sequence-level ratios): one weight per sequence, exp of the log ratio summed over its
        trained tokens, broadcast over them."""
        if not self.cfg.use_importance_sampling_correction or generation_logprobs is None:
            return torch.ones_like(prev_logprobs)
        log_weight = (prev_logprobs - generation_logprobs).detach()  # [B, T]
        if self.cfg.sequence_level_importance_ratios:
            log_weight = (log_weight * mask).sum(dim=1, keepdim=True).expand_as(log_weight)  # [B, T]
        weight = torch.exp(log_weight)  # [B, T]
        if self.cfg.truncated_importance_sampling_ratio is not None:
            weight = weight.clamp(max=self.cfg.truncated_importance_sampling_ratio)
        return weight

    def _reduce(
        self,
        token_loss: torch.Tensor,
        mask: torch.Tensor,
        inputs: PGInputs,
        global_valid_seqs: Count,
        global_valid_toks: Count,
    ) -> torch.Tensor:
        """Token level: sum / global tokens. Sequence level: per-sequence token mean, summed / global seqs.
        Constant length (Dr. GRPO): sum / (global seqs * constant_length_normalizer)."""
        if self.cfg.constant_length_normalizer is not None:
            normalizer = _count(global_valid_seqs, token_loss) * self.cfg.constant_length_normalizer
            return _masked_sum(token_loss, mask) / normalizer
        if self.cfg.token_level_loss:
            return _masked_sum(token_loss, mask) / _count(global_valid_toks, token_loss)
        num_tokens = mask.sum(dim=1).clamp(min=1.0)  # [B]
        sequence_loss = (token_loss * mask).sum(dim=1) / num_tokens  # [B]
        sample_mask = inputs.samples(token_loss)  # [B]
        return (sequence_loss * sample_mask).sum() / _count(global_valid_seqs, token_loss)

    def _ratio_metrics(
        self, ratio: torch.Tensor, mask: torch.Tensor, num_toks: torch.Tensor
    ) -> dict[str, float]:
        valid = mask > 0  # [B, T]
        outside = (ratio < 1.0 - self.cfg.ratio_clip_min) | (ratio > 1.0 + self.cfg.ratio_clip_max)
        has_tokens = bool(valid.any())
        return {
            "probs_ratio_mean": float(_masked_sum(ratio, mask) / num_toks),
            "probs_ratio_min": float(ratio[valid].min()) if has_tokens else float("inf"),
            "probs_ratio_max": float(ratio[valid].max()) if has_tokens else float("-inf"),
            "clip_fraction": float(_masked_sum(outside.float(), mask) / num_toks),
        }


def token_mult_prob_error(
    prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor | None
) -> torch.Tensor:
    """exp(|prev_logprobs - generation_logprobs|) per token [B, T]; ones without generation logprobs."""
    if generation_logprobs is None:
        return torch.ones_like(prev_logprobs)
    difference = prev_logprobs - generation_logprobs.to(prev_logprobs.device).float()
    return torch.exp(difference.abs())  # [B, T]


@dataclass
class ValueLossConfig:
    """Options of PPO's value (critic) loss."""

    value_clip: float | None = 0.2
    """clip the new value to within this of the value that computed the advantages; None = off"""

    def validate(self) -> None:
        if self.value_clip is not None and self.value_clip <= 0:
            raise ConfigError("value_clip", f"{self.value_clip} must be > 0 (or null to turn clipping off)")


class ValueLoss(Loss):
    """PPO's clipped value loss (Schulman et al. 2017, arXiv:1707.06347, as in its reference code), per
    trained token t with value V_t, the value V_old_t that computed the advantages and the return R_t:

        V_clip = V_old + clip(V - V_old, -eps, eps),   L_t = 0.5 * max((V - R)^2, (V_clip - R)^2)

    averaged over the global batch's valid tokens (no clipping: L_t = 0.5 * (V - R)^2). The first argument
    is `values [B, T]` (a value model's), not logprobs; data hold `returns` and `prev_values` [B, T].
    Metrics (sums): loss; values_mean, returns_mean; value_clip_fraction (tokens where the clipped term is
    the larger, so the gradient is cut)."""

    rows_independent = True

    def __init__(self, cfg: ValueLossConfig | None = None) -> None:
        self.cfg = cfg or ValueLossConfig()

    def __call__(
        self, values: torch.Tensor, data: Data, global_valid_seqs: Count, global_valid_toks: Count
    ) -> LossOutput:
        values = values.float()  # [B, T]
        inputs = ValueInputs.read(data, values, "ValueLoss")
        mask, returns, prev_values = inputs.valid_tokens(), inputs.returns, inputs.prev_values  # [B, T]
        squared_error = (values - returns).square()  # [B, T]
        clipped_error = squared_error
        if self.cfg.value_clip is not None:
            eps = self.cfg.value_clip
            clipped_values = prev_values + (values - prev_values).clamp(-eps, eps)  # [B, T]
            clipped_error = (clipped_values - returns).square()
        num_toks = _count(global_valid_toks, values)
        loss = 0.5 * _masked_sum(torch.maximum(squared_error, clipped_error), mask) / num_toks
        clipped = (clipped_error > squared_error).float()  # [B, T]
        return loss, {
            "loss": float(loss.detach()),
            "values_mean": float(_masked_sum(values.detach(), mask) / num_toks),
            "returns_mean": float(_masked_sum(returns, mask) / num_toks),
            "value_clip_fraction": float(_masked_sum(clipped, mask) / num_toks),
        }
