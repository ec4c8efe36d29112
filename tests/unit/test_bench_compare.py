"""The regression report's figures (benchmarks/compare.py): which figures it compares, and which it marks."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compare.py"
spec = importlib.util.spec_from_file_location("bench_compare", SCRIPT)
compare = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = compare  # dataclasses look their module up
spec.loader.exec_module(compare)


def grpo_result(step: float, trl_step: float, floor_ratio: float, rate: float) -> dict:
    stages = {"generation": step * 0.3, "training": step * 0.7, "refit": step * 0.001}
    return {
        "posttrain": {"step_time_median_s": step, "stage_time_median_s": stages},
        "trl": {"step_time_median_s": trl_step, "stage_time_median_s": {"generation": trl_step}},
        "ratio_posttrain_over_trl": step / trl_step,
        "ratio_posttrain_over_floor": floor_ratio,
        "ratio_trl_over_floor": 5.0,
        "floor": {"measured_matmul_gflops": rate},
    }


def by_name(figures: list) -> dict:
    return {f.name: f for f in figures}


def test_a_ratio_12_percent_worse_is_marked_and_8_percent_is_not() -> None:
    reference = grpo_result(step=10.0, trl_step=25.0, floor_ratio=1.5, rate=160.0)
    new = grpo_result(step=11.2, trl_step=25.0, floor_ratio=1.62, rate=160.0)  # 0.448 vs 0.400; 1.08x floor
    figures = by_name(compare.grpo_step_figures("short", reference, new, with_peer=True))
    assert figures["posttrain_over_trl"].ratio == pytest.approx(1.12)
    assert figures["posttrain_over_trl"].worse and figures["posttrain_over_trl"].equal_work
    assert figures["posttrain_over_floor"].ratio == pytest.approx(1.08)
    assert not figures["posttrain_over_floor"].worse
    # Absolute times are compared and marked, but they are not equal-work figures.
    assert figures["posttrain step (s)"].worse and not figures["posttrain step (s)"].equal_work
    # The refit stage is under 5% of the step: not a figure; TRL's own floor ratio is the peer's figure.
    assert "posttrain refit (s)" not in figures and "trl_over_floor" not in figures


def test_a_slower_machine_is_marked_by_its_rate_and_the_ratios_stay_clean() -> None:
    reference = grpo_result(step=10.0, trl_step=25.0, floor_ratio=1.5, rate=160.0)
    new = grpo_result(step=15.0, trl_step=37.5, floor_ratio=1.5, rate=100.0)  # everything 1.5x slower
    figures = compare.grpo_step_figures("short", reference, new, with_peer=True)
    marked = {f.name for f in figures if f.worse}
    assert "matmul rate (GFLOP/s)" in marked  # a lower rate is worse
    assert not [f for f in figures if f.worse and f.equal_work]


def test_without_the_peer_no_trl_figure_is_compared() -> None:
    reference = grpo_result(step=10.0, trl_step=25.0, floor_ratio=1.5, rate=160.0)
    new = {key: value for key, value in reference.items() if not key.endswith("over_trl") and key != "trl"}
    names = set(by_name(compare.grpo_step_figures("long", reference, new, with_peer=False)))
    assert names == {
        "posttrain step (s)",
        "posttrain generation (s)",
        "posttrain training (s)",
        "posttrain_over_floor",
        "matmul rate (GFLOP/s)",
    }


def test_memory_rows_are_matched_by_model_and_mode() -> None:
    row = {"model": "m", "mode": "lora", "param_bytes": 100, "optimizer_state_bytes": 200, "refit_bytes": 10}
    grown = {**row, "refit_bytes": 12}
    figures = by_name(compare.lora_figures("lora", {"rows": [row]}, {"rows": [grown]}))
    assert figures["m lora refit_bytes"].worse and figures["m lora refit_bytes"].equal_work
    assert not figures["m lora param_bytes"].worse


def test_an_unknown_check_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(SystemExit):
        compare.parse_args(["--checks", "grpo_step_huge"])
