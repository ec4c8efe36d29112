"""benchmarks/gpu_check.py: its arguments, the peak and MFU arithmetic, the CPU references it finds, and a
`--dry-run` on the CPU that runs every row at a toy size for one step and writes the table's JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def test_unknown_rows_and_a_missing_gpu_are_refused_with_the_fix(capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--dry-run", "--rows", "grpo_tiny,mfu"])
    assert (
        "--rows: unknown ['mfu']; choose from decode_tiny, decode_0.5b, grpo_tiny, grpo_0.5b, train_mfu_1b, "
        "moe_ep" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--dry-run", "--steps", "0"])
    assert "--steps must be >= 1, got 0" in capsys.readouterr().err
    if not gpu_check.torch.cuda.is_available():
        with pytest.raises(SystemExit):
            gpu_check.parse_args([])
        assert (
            "no CUDA device visible to torch: run on a GPU machine, or pass --dry-run"
            in capsys.readouterr().err
        )
    args = gpu_check.parse_args(["--dry-run", "--rows", "moe_ep,grpo_tiny"])
    assert args.rows == ["moe_ep", "grpo_tiny"] and args.dry_run


def test_peak_lookup_and_mfu_arithmetic():
    """42,000 tokens/s x 6 x 1.07e9 parameters = 2.6964e14 FLOP/s, over 989e12: 27.26%."""
    assert gpu_check.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_check.peak_bf16_flops("NVIDIA H200") == 989e12
    assert gpu_check.peak_bf16_flops("Tesla T4") is None
    assert gpu_check.model_flops_utilization(42_000, 1_070_000_000, 989e12) == pytest.approx(
        0.27264, abs=1e-5
    )
    assert gpu_check.model_flops_utilization(42_000, 1_070_000_000, None) is None


def test_the_plan_takes_full_sizes_on_the_gpu_and_toy_sizes_in_a_dry_run():
    toy = gpu_check.make_plan(gpu_check.argparse.Namespace(dry_run=True, steps=3))
    assert (toy.device, toy.warmup, toy.steps) == ("cpu", 0, 1)
    assert toy.grpo_workloads["0.5b"].model.hidden_size == 64
    full = gpu_check.make_plan(gpu_check.argparse.Namespace(dry_run=False, steps=3))
    assert full.grpo_workloads["0.5b"].model.hidden_size == 896 and full.train_model.hidden_size == 2048
    # the 1B shape: 16 x (4 x 2048^2 + 3 x 2048 x 8192) matmul parameters in the blocks, 1.074e9
    blocks = 16 * (4 * 2048**2 + 3 * 2048 * 8192)
    assert gpu_check.train_generate.matmul_params(full.train_model, 0) == blocks == 1_073_741_824


def test_cpu_references_come_from_the_reference_files():
    step_s, source = gpu_check.cpu_reference_step_time("tiny")
    report = json.loads((ROOT / "benchmarks" / "reference" / source).read_text())
    assert report["machine"]["device"] == "cpu" and report["model"]["workload"] == "tiny"
    assert step_s == report["posttrain"]["step_time_median_s"] > 0
    assert gpu_check.cpu_reference_step_time("0.5b") == (None, "no CPU reference for workload 0.5b")


def test_the_decode_row_profiles_both_loops_on_the_workload_shape():
    """A dry-run decode row: the tiny workload's 2 x 8 rows x 64 tokens (no stop token: every row runs to the
    end) with the toy model, both loops timed and profiled; no host sync count on a CPU."""
    plan = gpu_check.make_plan(gpu_check.argparse.Namespace(dry_run=True, steps=1))
    row = gpu_check.decode_row(plan, "tiny")
    assert (row.name, row.unit) == ("decode_tiny", "ms/step") and row.value > 0
    result = row.profile
    assert (result["rows"], result["new_tokens"]) == (16, 64)
    for loop in ("eager", "static"):
        assert result["tokens_per_s"][loop] > 0 and result["profile"][loop]["host_syncs_per_step"] is None
        assert result["profile"][loop]["cpu_op_ms_per_step"] > 0


@pytest.mark.slow  # a Ray instance, two GRPO setups and a policy: ~200 s on 2 loaded cores, 19 s of CPU
def test_dry_run_runs_every_row_on_the_cpu_and_writes_the_table(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and report["device"] == "cpu"
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows) == list(gpu_check.ROWS)
    for name in ("grpo_tiny", "grpo_0.5b"):
        assert rows[name]["unit"] == "s/step" and rows[name]["value"] > 0
        assert rows[name]["note"].startswith("refit ")
    for name in ("decode_tiny", "decode_0.5b"):
        assert rows[name]["unit"] == "ms/step" and rows[name]["value"] > 0
        assert set(rows[name]["profile"]["tokens_per_s"]) == {"eager", "static"}
    assert rows["grpo_tiny"]["cpu_reference"] == gpu_check.cpu_reference_step_time("tiny")[0]
    assert rows["train_mfu_1b"]["value"] > 0 and rows["train_mfu_1b"]["mfu"] is None
    missing = gpu_check.moe_available()
    if missing is None:
        assert rows["moe_ep"]["value"] > 0
    else:
        assert rows["moe_ep"]["value"] is None and rows["moe_ep"]["note"] == f"not available: {missing}"
    table = result.stdout
    assert "row" in table and "grpo_0.5b" in table and f"wrote {out}" in table
