"""Metric reductions: the `*_min`/`*_max` rule over micro-batches and steps, and named rank reductions."""

import pytest

from posttrain.utils.metrics import mean_over_steps, reduce_metrics, reduce_timing, sum_metrics


def test_sum_metrics_sums_shares_and_keeps_extremes():
    parts = [{"loss": 0.25, "ratio_min": 0.5, "ratio_max": 1.5}, {"loss": 0.5, "ratio_min": 0.75, "ratio_max": 2.0}]
    assert sum_metrics(parts) == {"loss": 0.75, "ratio_min": 0.5, "ratio_max": 2.0}


def test_mean_over_steps_averages_except_extremes():
    per_step = {"loss": [1.0, 2.0, 6.0], "ratio_min": [0.5, 0.25, 0.75], "ratio_max": [1.0, 3.0, 2.0]}
    assert mean_over_steps(per_step) == {"loss": 3.0, "ratio_min": 0.25, "ratio_max": 3.0}


def test_reduce_metrics_uses_named_reduction_per_key_and_default_mean():
    per_rank = [{"loss": 1.0, "grad_norm": 3.0, "tokens": 10}, {"loss": 3.0, "grad_norm": 5.0, "tokens": 30}]
    assert reduce_metrics(per_rank, {"grad_norm": "max", "tokens": "sum"}) == {
        "loss": 2.0, "grad_norm": 5.0, "tokens": 40.0,
    }
    assert reduce_metrics(per_rank, default="min") == {"loss": 1.0, "grad_norm": 3.0, "tokens": 10.0}
    assert reduce_timing([{"train": 1.5, "gen": 2.0}, {"train": 2.5, "gen": 1.0}]) == {"train": 2.5, "gen": 2.0}


def test_reduce_metrics_rejects_unknown_reduction_naming_the_metric():
    with pytest.raises(ValueError, match="'loss'"):
        reduce_metrics([{"loss": 1.0}], {"loss": "median"})
