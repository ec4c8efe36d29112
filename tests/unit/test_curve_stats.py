"""The learning-curve statistics of the comparison benchmarks (benchmarks/curve_stats.py): means over
seeds, paired bootstrap intervals, the curve's area and the time to a level, on hand-made curves."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "curve_stats.py"
spec = importlib.util.spec_from_file_location("curve_stats", SCRIPT)
curve_stats = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = curve_stats
spec.loader.exec_module(curve_stats)


def curve(*grades, seconds=10.0):
    return [{"step": 10 * i, "train_s": seconds * i, "grades": g} for i, g in enumerate(grades)]


def test_identical_arms_differ_by_exactly_zero_in_every_draw():
    """Questions are resampled once per draw for both arms (paired): equal grades give 0, interval [0, 0]."""
    a = curve([0, 1, 1, 0], [1, 1, 1, 0])
    result = curve_stats.bootstrap({"a": [a], "b": [a]}, lambda v: v("a", 1) - v("b", 1), draws=200)
    assert result == {"value": 0.0, "low": 0.0, "high": 0.0}


def test_the_mean_over_seeds_its_area_and_the_time_to_a_level():
    """Seeds at steps 0/10/20: (1/4, 2/4, 4/4) and, None being ungraded rather than wrong, (1/3, 0, 2/3):
    means 0.2917, 0.25, 0.8333. A curve 0.25, 0.25, 0.75 at steps 0, 10, 20 has the area
    (10 * (0.25 + 0.25) / 2 + 10 * (0.25 + 0.75) / 2) / 20 = 0.375."""
    one = curve([1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1])
    two = curve([0, 0, 1, None], [0, 0, 0, None], [0, 1, 1, None], seconds=20.0)
    means = curve_stats.mean_curve([one, two])
    assert [p["accuracy"] for p in means] == [0.2917, 0.25, 0.8333]
    assert [p["train_s"] for p in means] == [0.0, 15.0, 30.0]
    value = lambda arm, i: [0.25, 0.25, 0.75][i]  # noqa: E731
    assert curve_stats.area(value, "a", [0, 10, 20]) == 0.375
    assert curve_stats.time_to_reach(means, 0.8) == 30.0 and curve_stats.time_to_reach(means, 0.9) is None


def test_a_paired_difference_keeps_each_pair_together():
    """Two seeds whose every pair differs by 0.25: the mean difference is 0.25 and so is every draw's. One
    seed with differences 1 and 0: the mean is 0.5, and a draw holds two of them, so it is 0, 0.5 or 1."""
    constant = [[(0.5, 0.25), (1.0, 0.75)], [(0.25, 0.0), (0.75, 0.5)]]
    assert curve_stats.paired_difference(constant, draws=200) == {"value": 0.25, "low": 0.25, "high": 0.25}
    mixed = curve_stats.paired_difference([[(1.0, 0.0), (0.0, 0.0)]], draws=400)
    assert mixed == {"value": 0.5, "low": 0.0, "high": 1.0}
