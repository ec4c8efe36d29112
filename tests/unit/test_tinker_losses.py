"""The Tinker losses of the serve-tinker service against hand-derived numbers."""

import math

import pytest
import torch

from posttrain.tinker.model import Datum, UserError, check_datum, token_loss

# Two tokens: the model's logprobs log(0.5), log(0.2); the sampler's log(0.25), log(0.4); advantages 1, -2.
LOGPROBS = torch.log(torch.tensor([0.5, 0.2]))
INPUTS = {
    "weights": torch.tensor([1.0, 0.5]),
    "logprobs": torch.log(torch.tensor([0.25, 0.4])),
    "advantages": torch.tensor([1.0, -2.0]),
}


def test_cross_entropy_is_the_weighted_negative_logprob():
    """-1 * log 0.5 = 0.6931; -0.5 * log 0.2 = 0.8047."""
    loss = token_loss("cross_entropy", LOGPROBS, INPUTS, {})
    torch.testing.assert_close(loss, torch.tensor([math.log(2), -0.5 * math.log(0.2)]))


def test_importance_sampling_weighs_the_advantage_by_the_probability_ratio():
    """ratios 0.5 / 0.25 = 2 and 0.2 / 0.4 = 0.5: -(2 * 1) = -2, -(0.5 * -2) = 1."""
    torch.testing.assert_close(
        token_loss("importance_sampling", LOGPROBS, INPUTS, {}), torch.tensor([-2.0, 1.0])
    )


def test_ppo_takes_the_pessimistic_clipped_term():
    """ratio 2 clipped to 1.2: -min(2, 1.2) = -1.2; ratio 0.5 clipped to 0.8, A = -2: -min(-1, -1.6) = 1.6.
    With clip thresholds 0.5: -min(2, 1.5) = -1.5 and -min(-1, -1) = 1."""
    torch.testing.assert_close(token_loss("ppo", LOGPROBS, INPUTS, {}), torch.tensor([-1.2, 1.6]))
    wide = {"clip_low_threshold": 0.5, "clip_high_threshold": 0.5}
    torch.testing.assert_close(token_loss("ppo", LOGPROBS, INPUTS, wide), torch.tensor([-1.5, 1.0]))


def test_cispo_weighs_the_logprob_by_the_clipped_ratio_without_its_gradient():
    """-1.2 * 1 * log 0.5 = 0.8318, -0.8 * -2 * log 0.2 = -2.5751; d/dlogp = -1.2 * 1 and -0.8 * -2."""
    logprobs = LOGPROBS.clone().requires_grad_(True)
    loss = token_loss("cispo", logprobs, INPUTS, {})
    torch.testing.assert_close(loss, torch.tensor([-1.2 * math.log(0.5), 1.6 * math.log(0.2)]))
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([-1.2, 1.6]))


def test_a_datum_without_a_needed_input_or_too_long_is_a_user_error():
    short = Datum([1, 2], {"target_tokens": torch.tensor([2, 3])})
    with pytest.raises(UserError, match=r"needs loss_fn_inputs\['weights'\]"):
        check_datum(short, "cross_entropy", 4)
    with pytest.raises(UserError, match="this server takes 1 to 1"):
        check_datum(short, None, 1)
    uneven = Datum([1, 2], {"target_tokens": torch.tensor([2, 3]), "weights": torch.ones(3)})
    with pytest.raises(UserError, match="has 3 values for 2 tokens"):
        check_datum(uneven, "cross_entropy", 4)
