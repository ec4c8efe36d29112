"""Metric reductions: the `*_min`/`*_max` rule over micro-batches and steps."""

from posttrain.utils.metrics import mean_over_steps, reduce_metrics


def test_micro_batch_metrics_sum_shares_and_keep_extremes():
    parts = [
        {"loss": 0.25, "ratio_min": 0.5, "ratio_max": 1.5},
        {"loss": 0.5, "ratio_min": 0.75, "ratio_max": 2.0},
    ]
    assert reduce_metrics(parts) == {"loss": 0.75, "ratio_min": 0.5, "ratio_max": 2.0}


def test_mean_over_steps_averages_except_extremes():
    per_step = {"loss": [1.0, 2.0, 6.0], "ratio_min": [0.5, 0.25, 0.75], "ratio_max": [1.0, 3.0, 2.0]}
    assert mean_over_steps(per_step) == {"loss": 3.0, "ratio_min": 0.25, "ratio_max": 3.0}
