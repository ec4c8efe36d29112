"""Timer: named records, reductions and misuse errors."""

import time

import pytest

from posttrain.utils.timer import Timer


def test_reductions_over_records():
    timer = Timer()
    timer._records["gen"] = [1.0, 2.0, 6.0]
    assert timer.get_timing_metrics("sum") == {"gen": 9.0}
    assert timer.get_timing_metrics("mean") == {"gen": 3.0}
    assert timer.get_timing_metrics("median") == {"gen": 2.0}
    assert timer.get_timing_metrics("max") == {"gen": 6.0}
    assert timer.get_timing_metrics("count") == {"gen": 3.0}
    assert abs(timer.get_timing_metrics("std")["gen"] - 2.1602) < 1e-4


def test_context_manager_records_elapsed_time():
    timer = Timer()
    with timer.time("train"):
        time.sleep(0.02)
    assert 0.015 < timer.get_latest("train") < 0.5
    timer.reset()
    assert timer.get_timing_metrics() == {}


def test_double_start_and_stop_without_start_raise():
    timer = Timer()
    timer.start("a")
    with pytest.raises(RuntimeError, match="timer 'a' is already running"):
        timer.start("a")
    with pytest.raises(RuntimeError, match="timer 'b' is not running"):
        timer.stop("b")
    with pytest.raises(ValueError, match="unknown reduction"):
        timer.get_timing_metrics("p99")
