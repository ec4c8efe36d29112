"""Losses against hand-derived values, and micro-batch additivity (sum of micro-batch losses = global
loss)."""

import math

import pytest
import torch

from posttrain.algorithms.loss import (
    ClippedPGLoss,
    ClippedPGLossConfig,
    KDLoss,
    KDLossConfig,
    NLLLoss,
    ValueLoss,
    ValueLossConfig,
)
from posttrain.algorithms.preference_loss import BradleyTerryLoss, DPOLoss, DPOLossConfig
from posttrain.config import ConfigError
from posttrain.utils.metrics import reduce_metrics

LN2 = math.log(2.0)


def one_token_batch(ratio: float, advantage: float, **extra: float) -> tuple[torch.Tensor, dict]:
    """One sample, T=2, one trained token at position 1 with prev_logprobs -1 and logprobs -1 + ln(ratio)."""
    logprobs = torch.tensor([[0.0, -1.0 + math.log(ratio)]], requires_grad=True)
    data = {
        "input_ids": torch.tensor([[1, 2]]),
        "token_mask": torch.tensor([[0, 1]]),
        "sample_mask": torch.tensor([1]),
        "advantages": torch.tensor([[0.0, advantage]]),
        "prev_logprobs": torch.tensor([[0.0, -1.0]]),
    }
    data.update({key: torch.tensor([[0.0, value]]) for key, value in extra.items()})
    return logprobs, data


def pg_loss(cfg: ClippedPGLossConfig, logprobs: torch.Tensor, data: dict) -> tuple[torch.Tensor, dict]:
    num_toks = (data["token_mask"] * data["sample_mask"].unsqueeze(1)).sum()
    return ClippedPGLoss(cfg)(logprobs, data, data["sample_mask"].sum(), num_toks)


def token_grad(loss: torch.Tensor, logprobs: torch.Tensor) -> float:
    loss.backward()
    return float(logprobs.grad[0, 1])


# -- NLL --------------------------------------------------------------------------------------------


def test_nll_is_negative_logprob_sum_over_global_tokens():
    """Trained logprobs -1, -2, -3: sum 6; 3 global tokens -> 2; if the global batch has 6 tokens -> 1."""
    logprobs = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, -9.0]])
    data = {"token_mask": torch.tensor([[0, 1, 1], [0, 1, 0]]), "sample_mask": torch.tensor([1, 1])}
    loss, metrics = NLLLoss()(logprobs, data, 2, 3)
    assert loss.item() == pytest.approx(2.0)
    assert metrics == {"loss": pytest.approx(2.0), "num_valid_tokens": 3.0}
    assert NLLLoss()(logprobs, data, 4, torch.tensor(6))[0].item() == pytest.approx(1.0)


def test_nll_missing_token_mask_names_the_key():
    with pytest.raises(KeyError, match="NLLLoss needs 'token_mask'"):
        NLLLoss()(torch.zeros(1, 2), {"input_ids": torch.zeros(1, 2)}, 1, 1)


# -- clipped policy gradient --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ratio, advantage, expected_loss, expected_grad",
    [
        (1.5, 1.0, -1.2, 0.0),  # max(-1.5, -1.2) = -1.2, clipped: no gradient
        (1.5, -1.0, 1.5, 1.5),  # max(1.5, 1.2) = 1.5, unclipped: d(-A r)/dlogp = -A r = 1.5
        (0.5, 1.0, -0.5, -0.5),  # max(-0.5, -0.8) = -0.5
        (0.5, -1.0, 0.8, 0.0),  # max(0.5, 0.8) = 0.8, clipped
        (1.1, 1.0, -1.1, -1.1),  # inside the range
    ],
)
def test_ratio_clipping_by_hand(ratio, advantage, expected_loss, expected_grad):
    """clip 0.2: L = max(-A r, -A clip(r, 0.8, 1.2)); gradient wrt logprob is -A r where unclipped."""
    logprobs, data = one_token_batch(ratio, advantage)
    loss, _ = pg_loss(ClippedPGLossConfig(), logprobs, data)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert token_grad(loss, logprobs) == pytest.approx(expected_grad, abs=1e-6)


def test_clip_higher_uses_separate_upper_bound():
    """ratio_clip_max 0.28: ratio 1.5, A=+1 -> -1.28; ratio 0.5, A=-1 still clipped at 0.8 -> 0.8."""
    cfg = ClippedPGLossConfig(ratio_clip_min=0.2, ratio_clip_max=0.28)
    assert pg_loss(cfg, *one_token_batch(1.5, 1.0))[0].item() == pytest.approx(-1.28)
    assert pg_loss(cfg, *one_token_batch(0.5, -1.0))[0].item() == pytest.approx(0.8)


def test_dual_clip_caps_loss_for_negative_advantages():
    """c=3, ratio 5, A=-1: max(5, 1.2) = 5, capped at -c A = 3 (no gradient). A=+1 unaffected: -1.2."""
    cfg = ClippedPGLossConfig(ratio_clip_c=3.0)
    logprobs, data = one_token_batch(5.0, -1.0)
    loss, _ = pg_loss(cfg, logprobs, data)
    assert loss.item() == pytest.approx(3.0)
    assert token_grad(loss, logprobs) == 0.0
    assert pg_loss(cfg, *one_token_batch(5.0, 1.0))[0].item() == pytest.approx(-1.2)
    assert pg_loss(ClippedPGLossConfig(), *one_token_batch(5.0, -1.0))[0].item() == pytest.approx(5.0)


@pytest.mark.parametrize("kl_type, expected_kl", [("k1", 1.0), ("k2", 0.5), ("k3", math.exp(-1.0))])
def test_kl_penalty_adds_beta_times_estimate(kl_type, expected_kl):
    """ratio 1, A=0, logprob -1, ref -2: x = 1, k1 = 1, k2 = 0.5, k3 = e^-1; beta 0.5 -> loss 0.5 * k."""
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.5, kl_type=kl_type)
    loss, metrics = pg_loss(cfg, *one_token_batch(1.0, 0.0, reference_policy_logprobs=-2.0))
    assert loss.item() == pytest.approx(0.5 * expected_kl)
    assert metrics["kl_penalty"] == pytest.approx(expected_kl)
    assert metrics["kl_loss"] == pytest.approx(0.5 * expected_kl)


def test_kl_clamps_apply_inside_the_loss():
    """x = 1: input clamp 0.5 -> k3 = e^-0.5 - 0.5 = 0.106531; k2 = 0.5 with output clamp 0.2 -> 0.2."""
    batch = one_token_batch(1.0, 0.0, reference_policy_logprobs=-2.0)
    cfg_in = ClippedPGLossConfig(reference_policy_kl_penalty=1.0, kl_input_clamp_value=0.5)
    assert pg_loss(cfg_in, *batch)[0].item() == pytest.approx(math.exp(-0.5) - 0.5)
    cfg_out = ClippedPGLossConfig(reference_policy_kl_penalty=1.0, kl_type="k2", kl_output_clamp_value=0.2)
    assert pg_loss(cfg_out, *batch)[0].item() == pytest.approx(0.2)


def two_sequence_batch() -> tuple[torch.Tensor, dict]:
    """Ratio 1 everywhere. Sequence 0: 1 trained token with A=3; sequence 1: 3 trained tokens with A=1."""
    logprobs = torch.full((2, 4), -1.0, requires_grad=True)
    data = {
        "token_mask": torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1]]),
        "sample_mask": torch.tensor([1, 1]),
        "advantages": torch.tensor([[0.0, 3, 0, 0], [0, 1, 1, 1]]),
        "prev_logprobs": torch.full((2, 4), -1.0),
    }
    return logprobs, data


def test_token_level_reduction_averages_over_all_tokens():
    """Token losses -3, -1, -1, -1 over 4 tokens -> -1.5."""
    assert pg_loss(ClippedPGLossConfig(), *two_sequence_batch())[0].item() == pytest.approx(-1.5)


def test_sequence_level_reduction_averages_per_sequence_then_over_sequences():
    """Sequence means -3 and -1 over 2 sequences -> -2."""
    cfg = ClippedPGLossConfig(token_level_loss=False)
    assert pg_loss(cfg, *two_sequence_batch())[0].item() == pytest.approx(-2.0)


def test_dr_grpo_constant_length_normaliser_does_not_weight_tokens_by_response_length():
    """Dr. GRPO with L = 4: token losses -3, -1, -1, -1 summed, -6, over 2 sequences x 4 -> -0.75. Each
    token's gradient is -A / (2 * 4): -3/8 = -0.375 for sequence 0's token, -1/8 = -0.125 for each of
    sequence 1's, whatever the lengths (token mean: -3/4 and -1/4; sequence mean: -3/2 and -1/6)."""
    logprobs, data = two_sequence_batch()
    loss, _ = pg_loss(ClippedPGLossConfig(constant_length_normalizer=4), logprobs, data)
    assert loss.item() == pytest.approx(-0.75)
    loss.backward()
    expected = torch.tensor([[0.0, -0.375, 0, 0], [0, -0.125, -0.125, -0.125]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_dr_grpo_normaliser_with_sequence_level_loss_is_a_config_error():
    with pytest.raises(ValueError, match="constant_length_normalizer.*pick one"):
        ClippedPGLossConfig(constant_length_normalizer=8, token_level_loss=False).validate()
    with pytest.raises(ValueError, match="constant_length_normalizer.*>= 1"):
        ClippedPGLossConfig(constant_length_normalizer=0).validate()


def test_gspo_uses_one_sequence_ratio_from_mean_log_ratio():
    """Log ratios [ln 2, 0] -> sequence ratio exp(ln 2 / 2) = sqrt 2 for both tokens (clip 0.5: inside),
    A=1 -> loss -sqrt 2; d/dlogp_t = -sqrt 2 / 2 each. Per-token ratios instead: 2 (clipped to 1.5) and 1,
    mean of -1.5 and -1 = -1.25."""
    logprobs = torch.tensor([[0.0, -1.0 + LN2, -1.0]], requires_grad=True)
    data = {
        "token_mask": torch.tensor([[0, 1, 1]]),
        "sample_mask": torch.tensor([1]),
        "advantages": torch.tensor([[0.0, 1.0, 1.0]]),
        "prev_logprobs": torch.tensor([[0.0, -1.0, -1.0]]),
    }
    clip = {"ratio_clip_min": 0.5, "ratio_clip_max": 0.5, "token_level_loss": False}
    gspo_cfg = ClippedPGLossConfig(sequence_level_importance_ratios=True, **clip)
    loss, metrics = pg_loss(gspo_cfg, logprobs, data)
    assert loss.item() == pytest.approx(-math.sqrt(2))
    assert metrics["probs_ratio_mean"] == pytest.approx(math.sqrt(2))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -math.sqrt(0.5), -math.sqrt(0.5)]]))
    assert pg_loss(ClippedPGLossConfig(**clip), logprobs, data)[0].item() == pytest.approx(-1.25)


def test_gspo_with_token_level_loss_is_a_config_error():
    with pytest.raises(ValueError, match="token_level_loss=False"):
        ClippedPGLossConfig(sequence_level_importance_ratios=True).validate()


def test_importance_sampling_correction_weights_by_prev_over_generation_and_truncates():
    """prev -1, generation -1.5: weight e^0.5 = 1.6487; ratio 1, A=1 -> loss -1.6487 (gradient -1.6487, the
    weight is a constant). Truncated at 1.2 -> -1.2. token_mult_prob_error = e^0.5 either way."""
    cfg = ClippedPGLossConfig(use_importance_sampling_correction=True)
    logprobs, data = one_token_batch(1.0, 1.0, generation_logprobs=-1.5)
    loss, metrics = pg_loss(cfg, logprobs, data)
    assert loss.item() == pytest.approx(-math.exp(0.5))
    assert token_grad(loss, logprobs) == pytest.approx(-math.exp(0.5))
    assert metrics["token_mult_prob_error"] == pytest.approx(math.exp(0.5))
    truncated = ClippedPGLossConfig(
        use_importance_sampling_correction=True, truncated_importance_sampling_ratio=1.2
    )
    truncated_loss, _ = pg_loss(truncated, *one_token_batch(1.0, 1.0, generation_logprobs=-1.5))
    assert truncated_loss.item() == pytest.approx(-1.2)


def test_force_on_policy_ratio_ignores_prev_logprobs():
    """logprob -1 + 4 vs prev -1: ratio e^4 would clip to 1.2 (loss -2.4 with A=2, no gradient); forced,
    ratio is exactly 1: loss -2, gradient -A = -2, ratio metrics 1."""
    logprobs, data = one_token_batch(math.exp(4.0), 2.0)
    loss, metrics = pg_loss(ClippedPGLossConfig(force_on_policy_ratio=True), logprobs, data)
    assert loss.item() == pytest.approx(-2.0)
    assert metrics["probs_ratio_max"] == 1.0 and metrics["clip_fraction"] == 0.0
    assert token_grad(loss, logprobs) == pytest.approx(-2.0)
    assert pg_loss(ClippedPGLossConfig(), *one_token_batch(math.exp(4.0), 2.0))[0].item() == pytest.approx(
        -2.4
    )


def test_ratio_clip_and_entropy_metrics_by_hand():
    """Ratios 0.5, 1, 1.5 (prev -1, so logprobs -1.693, -1, -0.595) with clip 0.2: mean 1, min 0.5, max 1.5,
    clip fraction 2/3; approx_entropy = -mean of r * logprob (each token weighted by pi / pi_prev) =
    (0.5 (1 + ln 2) + 1 + 1.5 (1 - ln 1.5)) / 3 = 0.912813; no generation logprobs ->
    token_mult_prob_error 1."""
    ratios = torch.tensor([0.5, 1.0, 1.5])
    logprobs = torch.cat([torch.zeros(1), -1.0 + ratios.log()]).unsqueeze(0)
    data = {
        "token_mask": torch.tensor([[0, 1, 1, 1]]),
        "advantages": torch.zeros(1, 4),
        "prev_logprobs": torch.tensor([[0.0, -1, -1, -1]]),
    }
    _, metrics = ClippedPGLoss()(logprobs, data, 1, 3)
    assert metrics["probs_ratio_mean"] == pytest.approx(1.0)
    assert (metrics["probs_ratio_min"], metrics["probs_ratio_max"]) == pytest.approx((0.5, 1.5))
    assert metrics["clip_fraction"] == pytest.approx(2 / 3)
    assert metrics["approx_entropy"] == pytest.approx(
        (0.5 * (1 + LN2) + 1 + 1.5 * (1 - math.log(1.5))) / 3, abs=1e-6
    )
    assert metrics["token_mult_prob_error"] == pytest.approx(1.0)


def test_missing_advantages_names_the_key():
    logprobs, data = one_token_batch(1.0, 1.0)
    del data["advantages"]
    with pytest.raises(KeyError, match="ClippedPGLoss needs 'advantages'"):
        pg_loss(ClippedPGLossConfig(), logprobs, data)


def test_the_pg_loss_names_the_inputs_its_options_need():
    """prev_logprobs unless the trained forward is pi_prev; generation_logprobs for the importance weight;
    the reference's for a KL penalty; a missing one is a KeyError naming it."""
    assert ClippedPGLoss().needs() == ("prev_logprobs",)
    assert ClippedPGLoss(prev_is_current=True).needs() == ()
    corrected = ClippedPGLossConfig(use_importance_sampling_correction=True, reference_policy_kl_penalty=0.1)
    assert ClippedPGLoss(corrected).needs() == (
        "prev_logprobs",
        "generation_logprobs",
        "reference_policy_logprobs",
    )
    logprobs, data = one_token_batch(1.0, 1.0)
    with pytest.raises(KeyError, match="ClippedPGLoss needs 'generation_logprobs'"):
        pg_loss(corrected, logprobs, data)


# -- DPO and Bradley-Terry ----------------------------------------------------------------------------


def preference_batch() -> tuple[torch.Tensor, dict]:
    """One pair, 2 response tokens each. Chosen logprobs [-1,-1] (ref [-1.5,-1.5]): sum log ratio +1, mean
    +0.5. Rejected [-2,-2] (ref [-1.5,-1.5]): sum -1, mean -0.5."""
    logprobs = torch.tensor([[0.0, -1, -1], [0, -2, -2]], requires_grad=True)
    data = {
        "token_mask": torch.tensor([[0, 1, 1], [0, 1, 1]]),
        "sample_mask": torch.tensor([1, 1]),
        "reference_policy_logprobs": torch.tensor([[0.0, -1.5, -1.5], [0, -1.5, -1.5]]),
    }
    return logprobs, data


def test_dpo_with_zero_beta_is_ln2():
    loss, metrics = DPOLoss(DPOLossConfig(reference_policy_kl_penalty=0.0))(*preference_batch(), 2, 4)
    assert loss.item() == pytest.approx(LN2)
    assert metrics["accuracy"] == 0.0  # equal implicit rewards are not counted as correct


def test_dpo_summed_and_averaged_logprobs_by_hand():
    """beta 0.5 on sums: r_c = 0.5, r_r = -0.5, -log sigmoid(1) = log(1 + e^-1) = 0.313262; the reported
    rewards are the log ratios r / beta = 1 and -1. beta 1 on means: the same loss."""
    expected = math.log1p(math.exp(-1.0))
    loss, metrics = DPOLoss(DPOLossConfig(reference_policy_kl_penalty=0.5))(*preference_batch(), 2, 4)
    assert loss.item() == pytest.approx(expected)
    assert metrics["accuracy"] == 1.0
    assert (metrics["rewards_chosen_mean"], metrics["rewards_rejected_mean"]) == pytest.approx((1.0, -1.0))
    averaged = DPOLossConfig(reference_policy_kl_penalty=1.0, preference_average_log_probs=True)
    assert DPOLoss(averaged)(*preference_batch(), 2, 4)[0].item() == pytest.approx(expected)


def test_dpo_sft_term_is_nll_of_chosen_response():
    """sft weight 1: chosen sum logprob -2 -> sft 2, loss 0.313262 + 2; averaged -> sft 1."""
    preference = math.log1p(math.exp(-1.0))
    cfg = DPOLossConfig(reference_policy_kl_penalty=0.5, sft_loss_weight=1.0)
    loss, metrics = DPOLoss(cfg)(*preference_batch(), 2, 4)
    assert loss.item() == pytest.approx(preference + 2.0)
    assert (metrics["preference_loss"], metrics["sft_loss"]) == pytest.approx((preference, 2.0))
    cfg.sft_average_log_probs = True
    assert DPOLoss(cfg)(*preference_batch(), 2, 4)[1]["sft_loss"] == pytest.approx(1.0)


def test_dpo_normalises_by_global_pairs():
    """The micro-batch holds 1 of 2 global pairs (global_valid_seqs 4): half the pair's loss."""
    cfg = DPOLossConfig(reference_policy_kl_penalty=0.5)
    assert DPOLoss(cfg)(*preference_batch(), 4, 8)[0].item() == pytest.approx(math.log1p(math.exp(-1.0)) / 2)


def test_ipo_by_hand():
    """h = (1) - (-1) = 2 on sums. beta 0.1: target 1/(2 beta) = 5, loss (2 - 5)^2 = 9, dl/dh = 2 (2 - 5) = -6
    on each chosen token and +6 on each rejected one. beta 0.5: (2 - 1)^2 = 1. On means (h = 1), beta 0.5:
    0; the reported rewards are the log ratios, 1 and -1."""
    logprobs, data = preference_batch()
    loss, metrics = DPOLoss(DPOLossConfig(preference_loss="ipo", reference_policy_kl_penalty=0.1))(
        logprobs, data, 2, 4
    )
    assert loss.item() == pytest.approx(9.0)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -6.0, -6.0], [0.0, 6.0, 6.0]]))
    assert (metrics["rewards_chosen_mean"], metrics["rewards_rejected_mean"]) == pytest.approx((1.0, -1.0))
    half = DPOLossConfig(preference_loss="ipo", reference_policy_kl_penalty=0.5)
    assert DPOLoss(half)(*preference_batch(), 2, 4)[0].item() == pytest.approx(1.0)
    half.preference_average_log_probs = True
    assert DPOLoss(half)(*preference_batch(), 2, 4)[0].item() == pytest.approx(0.0)


def test_simpo_by_hand_needs_no_reference():
    """beta 2, gamma 0.5, mean logprobs -1 and -2: r_c = -2, r_r = -4, loss -log sigmoid(2 - 0.5) =
    log(1 + e^-1.5) = 0.201413; dl/dlogp = -sigmoid(-1.5) * beta / 2 tokens = -0.182426 per chosen token,
    +0.182426 per rejected one; reported rewards r / beta = the mean logprobs -1 and -2. No reference
    logprobs in the batch."""
    logprobs, data = preference_batch()
    del data["reference_policy_logprobs"]
    cfg = DPOLossConfig(preference_loss="simpo", reference_policy_kl_penalty=2.0, simpo_gamma=0.5)
    loss, metrics = DPOLoss(cfg)(logprobs, data, 2, 4)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.5)))
    loss.backward()
    g = 1.0 / (1.0 + math.exp(1.5))
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -g, -g], [0.0, g, g]]))
    assert (metrics["rewards_chosen_mean"], metrics["rewards_rejected_mean"]) == pytest.approx((-1.0, -2.0))
    assert metrics["accuracy"] == 1.0


def test_ipo_with_beta_zero_is_a_config_error():
    with pytest.raises(ConfigError, match="reference_policy_kl_penalty"):
        DPOLossConfig(preference_loss="ipo", reference_policy_kl_penalty=0.0).validate()


def kd_batch() -> tuple[torch.Tensor, dict]:
    """One row, T=2, position 1 trained: token logprob -1; the teacher's top 2 at position 1 have
    probabilities 0.6 and 0.2 (renormalised: 0.75, 0.25); the student gives them 0.5 and 0.25."""
    outputs = torch.tensor([[[0.0, 0.0, 0.0], [-1.0, math.log(0.5), math.log(0.25)]]], requires_grad=True)
    data = {
        "token_mask": torch.tensor([[0, 1]]),
        "sample_mask": torch.tensor([1]),
        "teacher_topk_logprobs": torch.tensor([[[0.0, 0.0], [math.log(0.6), math.log(0.2)]]]),
    }
    return outputs, data


def test_kd_loss_by_hand():
    """KL = 0.75 ln(0.75 / 0.5) + 0.25 ln(0.25 / 0.25) = 0.75 ln 1.5 = 0.304099; with NLL weight 0.5 the
    loss adds 0.5 * 1. Gradients: -q = (-0.75, -0.25) on the student's candidate logprobs, -0.5 on the
    token's logprob, none at the untrained position. The teacher's top-2 mass is 0.8."""
    outputs, data = kd_batch()
    loss, metrics = KDLoss(KDLossConfig(kd_weight=1.0, nll_weight=0.5))(outputs, data, 1, 1)
    assert metrics["kd_loss"] == pytest.approx(0.75 * math.log(1.5))
    assert loss.item() == pytest.approx(0.75 * math.log(1.5) + 0.5)
    assert (metrics["nll_loss"], metrics["teacher_topk_mass"]) == pytest.approx((1.0, 0.8))
    loss.backward()
    torch.testing.assert_close(outputs.grad, torch.tensor([[[0.0, 0.0, 0.0], [-0.5, -0.75, -0.25]]]))
    assert KDLoss.candidate_ids_key == "teacher_topk_ids"


def test_student_equal_to_the_renormalised_teacher_has_zero_kd_loss():
    outputs, data = kd_batch()
    with torch.no_grad():
        outputs[0, 1, 1:] = torch.log(torch.tensor([0.75, 0.25]))
    assert KDLoss()(outputs, data, 1, 1)[1]["kd_loss"] == pytest.approx(0.0, abs=1e-7)


def test_pair_losses_reject_odd_batches():
    with pytest.raises(ValueError, match="odd batch of 3 rows"):
        BradleyTerryLoss()(torch.zeros(3), {}, 3, 3)


def test_bradley_terry_by_hand():
    """Equal scores -> ln 2. Scores (2, 0) -> log(1 + e^-2) = 0.126928, accuracy 1, means 2 and 0."""
    assert BradleyTerryLoss()(torch.tensor([1.5, 1.5]), {}, 2, 0)[0].item() == pytest.approx(LN2)
    loss, metrics = BradleyTerryLoss()(torch.tensor([[2.0], [0.0]]), {"sample_mask": torch.ones(2)}, 2, 0)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-2.0)))
    assert metrics["accuracy"] == 1.0
    assert (metrics["rewards_chosen_mean"], metrics["rewards_rejected_mean"]) == pytest.approx((2.0, 0.0))


# -- value loss ---------------------------------------------------------------------------------------


def test_clipped_value_loss_by_hand():
    """eps .2, three tokens (V, V_old, R):
    a (1, .5, 2): V_clip = .7, errors (1 - 2)^2 = 1 and (.7 - 2)^2 = 1.69 -> 1.69, clipped: no gradient;
    b (1, .9, 0): V_clip = 1 (inside), both 1 -> 1, gradient 2 * (1 - 0) * .5 / 3 = 1/3;
    c (0, .5, .4): V_clip = .3, errors .16 and .01 -> .16, gradient 2 * (0 - .4) * .5 / 3 = -.133333.
    loss = .5 * (1.69 + 1 + .16) / 3 = .475; clip fraction 1/3; values mean 2/3, returns mean .8.
    Without clipping: .5 * (1 + 1 + .16) / 3 = .36, and a's gradient is (1 - 2) / 3."""
    data = {
        "token_mask": torch.tensor([[0, 1, 1, 1]]),
        "prev_values": torch.tensor([[0.0, 0.5, 0.9, 0.5]]),
        "returns": torch.tensor([[0.0, 2.0, 0.0, 0.4]]),
    }
    values = torch.tensor([[7.0, 1.0, 1.0, 0.0]], requires_grad=True)
    loss, metrics = ValueLoss(ValueLossConfig(value_clip=0.2))(values, data, 1, 3)
    assert loss.item() == pytest.approx(0.475)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, 1 / 3, -0.4 / 3]]))
    assert metrics["value_clip_fraction"] == pytest.approx(1 / 3)
    assert (metrics["values_mean"], metrics["returns_mean"]) == pytest.approx((2 / 3, 0.8))
    values.grad = None
    unclipped, _ = ValueLoss(ValueLossConfig(value_clip=None))(values, data, 1, 3)
    assert unclipped.item() == pytest.approx(0.36)
    unclipped.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -1 / 3, 1 / 3, -0.4 / 3]]))


def test_value_loss_needs_returns_and_a_positive_clip():
    with pytest.raises(KeyError, match="returns"):
        ValueLoss()(
            torch.zeros(1, 2), {"token_mask": torch.ones(1, 2), "prev_values": torch.zeros(1, 2)}, 1, 2
        )
    with pytest.raises(ValueError, match="value_clip"):
        ValueLossConfig(value_clip=0.0).validate()


# -- micro-batch additivity ---------------------------------------------------------------------------


def random_batch(seed: int) -> tuple[torch.Tensor, dict]:
    """8 rows (4 interleaved pairs), T=6, varied lengths; the second pair is masked out (sample_mask 0)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 6, 4, 5, 2, 6, 5, 3])
    token_mask = (torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)).long()
    token_mask[:, 0] = 0
    logprobs = -torch.rand(8, 6, generator=gen) * 2
    data = {
        "input_ids": torch.randint(0, 10, (8, 6), generator=gen),
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1, 1, 0, 0, 1, 1, 1, 1]),
        "advantages": torch.randn(8, 1, generator=gen).expand(8, 6) * token_mask,
        "prev_logprobs": logprobs + 0.3 * torch.randn(8, 6, generator=gen),
        "generation_logprobs": logprobs + 0.1 * torch.randn(8, 6, generator=gen),
        "reference_policy_logprobs": logprobs + 0.5 * torch.randn(8, 6, generator=gen),
        "prev_values": logprobs + 0.2 * torch.randn(8, 6, generator=gen),
        "returns": torch.randn(8, 6, generator=gen),
    }
    return logprobs.requires_grad_(), data


LOSSES = {
    "nll": NLLLoss(),
    "pg_token": ClippedPGLoss(ClippedPGLossConfig(reference_policy_kl_penalty=0.1, ratio_clip_c=3.0)),
    "pg_sequence_is": ClippedPGLoss(
        ClippedPGLossConfig(
            token_level_loss=False,
            use_importance_sampling_correction=True,
            truncated_importance_sampling_ratio=1.1,
        )
    ),
    "gspo": ClippedPGLoss(ClippedPGLossConfig(token_level_loss=False, sequence_level_importance_ratios=True)),
    "dr_grpo": ClippedPGLoss(ClippedPGLossConfig(constant_length_normalizer=6)),
    "value": ValueLoss(ValueLossConfig(value_clip=0.1)),
    "dpo_sft": DPOLoss(DPOLossConfig(sft_loss_weight=0.5, preference_average_log_probs=True)),
    "ipo": DPOLoss(DPOLossConfig(preference_loss="ipo")),
    "simpo": DPOLoss(DPOLossConfig(preference_loss="simpo", reference_policy_kl_penalty=2.0)),
    "bradley_terry": BradleyTerryLoss(),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_two_micro_batches_sum_to_whole_batch_loss_metrics_and_gradient(name):
    """Rows 0-3 and 4-7 as micro-batches with the global counts give the whole batch's loss, metrics
    (summed, `_min`/`_max` reduced) and gradient."""
    loss_fn = LOSSES[name]
    logprobs, data = random_batch(seed=0)
    inputs = logprobs[:, -1] if name == "bradley_terry" else logprobs  # scores [B] for the reward model
    num_seqs = data["sample_mask"].sum()
    num_toks = (data["token_mask"] * data["sample_mask"].unsqueeze(1)).sum()
    whole_loss, whole_metrics = loss_fn(inputs, data, num_seqs, num_toks)
    (whole_grad,) = torch.autograd.grad(whole_loss, logprobs)
    parts = [
        loss_fn(inputs[rows], {k: v[rows] for k, v in data.items()}, num_seqs, num_toks)
        for rows in (slice(0, 4), slice(4, 8))
    ]
    summed_loss = parts[0][0] + parts[1][0]
    (summed_grad,) = torch.autograd.grad(summed_loss, logprobs)
    torch.testing.assert_close(summed_loss, whole_loss)
    torch.testing.assert_close(summed_grad, whole_grad)
    summed_metrics = reduce_metrics([parts[0][1], parts[1][1]])
    assert summed_metrics == pytest.approx(whole_metrics, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 2.0},
        {"token_level_loss": False, "sequence_level_importance_ratios": True},
    ],
)
def test_prev_is_current_equals_recorded_prev_logprobs_of_the_same_weights(options):
    """A single optimizer step per batch: taking pi_prev from the trained forward (gradient stopped) gives
    the loss, gradient and metrics of recording the same numbers beforehand as prev_logprobs."""
    generator = torch.Generator().manual_seed(0)
    current = -torch.rand(3, 5, generator=generator) * 2  # [B, T]
    data = {
        "token_mask": torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]),
        "advantages": torch.randn(3, 5, generator=generator),
        "generation_logprobs": current + 0.05 * torch.randn(3, 5, generator=generator),
    }
    cfg = ClippedPGLossConfig(**options)
    recorded = current.clone().requires_grad_(True)
    loss, metrics = ClippedPGLoss(cfg)(recorded, data | {"prev_logprobs": current.clone()}, 3, 10)
    loss.backward()
    shortcut = current.clone().requires_grad_(True)
    shortcut_loss, shortcut_metrics = ClippedPGLoss(cfg, prev_is_current=True)(shortcut, data, 3, 10)
    shortcut_loss.backward()
    assert shortcut_loss.item() == pytest.approx(loss.item(), abs=1e-7)
    torch.testing.assert_close(shortcut.grad, recorded.grad, atol=1e-7, rtol=0)
    assert shortcut_metrics == pytest.approx(metrics, abs=1e-7)
    assert metrics["token_mult_prob_error"] > 1.0


def test_stale_data_in_one_update_weight_by_truncated_prev_over_generation_and_match_recomputed_prev():
    """Async GRPO, one optimizer step on data generated by older weights. Current logprobs of the two
    trained tokens log 0.5 and log 0.25, generation logprobs log 0.25 and log 0.5, A = 1: IS weights
    0.5/0.25 = 2 -> truncated to 1.5, and 0.25/0.5 = 0.5; ratio 1, so the loss is -(1.5 + 0.5) / 2 = -1
    and its gradient -w / 2 = (-0.75, -0.25), whether pi_prev comes from the trained forward or was
    recomputed with the same weights."""
    current = torch.tensor([[0.0, math.log(0.5), math.log(0.25)]])
    data = {
        "token_mask": torch.tensor([[0, 1, 1]]),
        "advantages": torch.ones(1, 3),
        "generation_logprobs": torch.tensor([[0.0, math.log(0.25), math.log(0.5)]]),
    }
    cfg = ClippedPGLossConfig(
        use_importance_sampling_correction=True, truncated_importance_sampling_ratio=1.5
    )
    for prev_is_current, extra in ((True, {}), (False, {"prev_logprobs": current.clone()})):
        logprobs = current.clone().requires_grad_(True)
        loss, metrics = ClippedPGLoss(cfg, prev_is_current=prev_is_current)(logprobs, data | extra, 1, 2)
        loss.backward()
        assert loss.item() == pytest.approx(-1.0)
        assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -0.75, -0.25])
        assert metrics["is_weight_mean"] == pytest.approx(1.0)


# -- the KL penalty's gradient and GSPO's importance weight ------------------------------------------


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_each_kl_estimator_has_the_expected_gradient_of_kl_pi_to_ref(kl_type):
    """A categorical policy over 5 tokens, pi = softmax(theta), pi_ref fixed. The expected gradient of the
    penalty, sum_a pi(a) * grad_theta loss(a) (exact enumeration: pi(a) is the probability of sampling a,
    held constant), equals grad_theta KL(pi || pi_ref) = grad sum_a pi(a) (log pi(a) - log pi_ref(a))."""
    torch.manual_seed(0)
    theta = torch.randn(5, dtype=torch.float64, requires_grad=True)
    ref_logprobs = torch.log_softmax(torch.randn(5, dtype=torch.float64), dim=0)
    cfg = ClippedPGLossConfig(
        reference_policy_kl_penalty=1.0,
        kl_type=kl_type,
        kl_input_clamp_value=None,
        kl_output_clamp_value=None,
    )
    expected_grad = torch.zeros(5, dtype=torch.float64)
    for token in range(5):
        policy_logprobs = torch.log_softmax(theta, dim=0)
        logprobs = torch.stack([torch.zeros((), dtype=torch.float64), policy_logprobs[token]]).unsqueeze(0)
        batch = one_token_batch(1.0, 0.0, reference_policy_logprobs=float(ref_logprobs[token]))[1]
        batch["prev_logprobs"] = logprobs.detach()
        loss, _ = pg_loss(cfg, logprobs, batch)
        (grad,) = torch.autograd.grad(loss, theta)
        expected_grad += policy_logprobs[token].exp().detach() * grad
    policy_logprobs = torch.log_softmax(theta, dim=0)
    exact_kl = (policy_logprobs.exp() * (policy_logprobs - ref_logprobs)).sum()
    (exact_grad,) = torch.autograd.grad(exact_kl, theta)
    assert torch.allclose(expected_grad, exact_grad, rtol=1e-5, atol=1e-6), (expected_grad, exact_grad)


def test_gspo_importance_correction_is_one_weight_per_sequence():
    """GSPO, one sequence of 2 trained tokens, ratio 1, A = 1: each token's loss is -1. prev - generation
    logprobs = [0.2, -0.1]: one weight exp(0.2 - 0.1) = exp(0.1) for the sequence, so the sequence's token
    mean is -exp(0.1) = -1.105171 (per-token weights would give -(e^0.2 + e^-0.1) / 2 = -1.063106)."""
    logprobs = torch.tensor([[0.0, -1.0, -1.0]], requires_grad=True)
    data = {
        "token_mask": torch.tensor([[0, 1, 1]]),
        "sample_mask": torch.tensor([1]),
        "advantages": torch.tensor([[0.0, 1.0, 1.0]]),
        "prev_logprobs": torch.tensor([[0.0, -1.0, -1.0]]),
        "generation_logprobs": torch.tensor([[0.0, -1.2, -0.9]]),
    }
    cfg = ClippedPGLossConfig(
        token_level_loss=False, sequence_level_importance_ratios=True, use_importance_sampling_correction=True
    )
    loss, metrics = pg_loss(cfg, logprobs, data)
    assert loss.item() == pytest.approx(-math.exp(0.1), abs=1e-6)
    assert metrics["is_weight_mean"] == pytest.approx(math.exp(0.1), abs=1e-6)
