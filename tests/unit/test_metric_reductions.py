"""Per-metric reductions over micro-batches and ranks (logger document: "Tracking distributed metrics
with specified reductions (mean, max, etc.)")."""

from __future__ import annotations

import pytest

from posttrain.algorithms.loss import ClippedPGLoss, NLLLoss
from posttrain.utils.metrics import metric_reductions, reduce_metrics, reduce_timing, reduction_of


def test_declared_reduction_wins_over_the_suffix_rule():
    """ "Tracking distributed metrics with specified reductions (mean, max, etc.)": a declared reduction
    is used; undeclared `*_min` / `*_max` keep min / max and everything else sums."""
    declared = {"tokens_per_second": "mean", "peak_len": "max", "ratio_max": "sum"}
    assert reduction_of("tokens_per_second", declared) == "mean"
    assert reduction_of("peak_len", declared) == "max"
    assert reduction_of("ratio_max", declared) == "sum"
    assert reduction_of("ratio_min", declared) == "min"
    assert reduction_of("loss", declared) == "sum"


def test_reduce_metrics_applies_each_metrics_reduction():
    """Three micro-batches: loss 0.1 + 0.2 + 0.3 = 0.6 (sum); tokens_per_second (10 + 20 + 60) / 3 = 30;
    peak_len max(4, 9, 7) = 9; shortest min(3, 2, 5) = 2."""
    parts = [
        {"loss": 0.1, "tokens_per_second": 10.0, "peak_len": 4.0, "shortest": 3.0},
        {"loss": 0.2, "tokens_per_second": 20.0, "peak_len": 9.0, "shortest": 2.0},
        {"loss": 0.3, "tokens_per_second": 60.0, "peak_len": 7.0, "shortest": 5.0},
    ]
    declared = {"tokens_per_second": "mean", "peak_len": "max", "shortest": "min"}
    assert reduce_metrics(parts, declared) == pytest.approx(
        {"loss": 0.6, "tokens_per_second": 30.0, "peak_len": 9.0, "shortest": 2.0}
    )


def test_loss_functions_declare_their_reductions_and_bad_names_are_refused():
    """The clipped policy gradient declares its ratio extremes; a plain function declares none; an unknown
    reduction names the loss class, the metric and the choices."""
    assert metric_reductions(ClippedPGLoss()) == {"probs_ratio_min": "min", "probs_ratio_max": "max"}
    assert metric_reductions(NLLLoss()) == {}

    class Median(NLLLoss):
        metric_reductions = {"loss": "median"}

    with pytest.raises(ValueError, match=r"Median.metric_reductions\['loss'\] = 'median'; use one of"):
        metric_reductions(Median())


def test_timing_is_reduced_across_ranks_with_max():
    """ "Tracking distributed timing with (usually) 'max' reduction across ranks": rank times 1.5 s and
    2.5 s of forward_backward -> 2.5; a stage only one rank ran keeps that rank's time."""
    per_rank = [{"forward_backward": 1.5, "optimizer_step": 0.2}, {"forward_backward": 2.5}]
    assert reduce_timing(per_rank) == {"forward_backward": 2.5, "optimizer_step": 0.2}
