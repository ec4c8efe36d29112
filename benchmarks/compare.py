"""Regression report: rerun the benchmark workloads that have a CPU reference in benchmarks/reference/ on
this machine, and print every figure beside its reference with the ratio, marking those more than 10% worse.

Each check reruns its benchmark as the reference was made (the same script, workload and posttrain modes;
TRL alternating with posttrain in the same invocation where the reference has a TRL column), then reads:
- equal-work figures, which the machine's speed cancels out of: posttrain's step over TRL's measured in
  the same invocation (`ratio_*_over_trl`), over TRL's at equal work and over the compute floor of its own
  work (`ratio_*_equal_work`, `ratio_*_over_floor`: the floor is the step's FLOPs at the matmul rate
  measured at the start of that invocation), and memory in bytes (LoRA);
- absolute figures: each side's median step and stage times, and the measured matmul rate. These move with
  the machine (the same 2-core VM has measured an SFT step at 3.9 s and 7.3 s on different days), so they
  are shown, and marked, but only the equal-work figures decide the verdict.

A figure is "worse" when it is more than 10% worse than its reference (higher for times, ratios and bytes;
lower for a rate). The exit status is 1 when an equal-work figure is worse. The long-reply check takes
~50 minutes with TRL (its step is ~10 minutes); `--skip-peer` reruns posttrain only and compares its
floor ratio, leaving the TRL figures as the reference has them.

Run:  .venv/bin/python benchmarks/compare.py [--checks grpo_step_tiny,grpo_step_smollm2,...] [--skip-peer]
      (make bench-compare: the checks other than the long-reply one)
Writes benchmarks/results/compare_<check>.json for each rerun and benchmarks/results/compare.json (the
table, with date and machine); a reference copy of it lives in benchmarks/reference/ with its date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "benchmarks" / "reference"
RESULTS = ROOT / "benchmarks" / "results"
WORSE_BY = 0.10  # a figure more than 10% worse than its reference is marked


@dataclass(frozen=True)
class Check:
    """A benchmark workload to rerun and the reference it is compared with."""

    name: str
    reference: str  # file in benchmarks/reference/
    command: tuple[str, ...]  # the benchmark script and its arguments (the output path is appended)
    peer: bool = False  # the reference has a TRL column measured in the same invocation


CHECKS = {
    check.name: check
    for check in (
        Check(
            "grpo_step_tiny",
            "grpo_step_cpu.json",
            ("benchmarks/grpo_step.py", "--model", "tiny", "--modes", "sync,async", "--runs", "2"),
            peer=True,
        ),
        Check(
            "grpo_step_smollm2",
            "grpo_step_smollm2_cpu_sync_async.json",
            (
                "benchmarks/grpo_step.py",
                "--model",
                "smollm2",
                "--modes",
                "sync,async",
                "--runs",
                "2",
                "--warmup",
                "1",
                "--steps",
                "3",
            ),
            peer=True,
        ),
        Check(
            "grpo_step_smollm2_long",
            "grpo_step_smollm2_long_3steps_trl_cpu.json",
            (
                "benchmarks/grpo_step.py",
                "--model",
                "smollm2_long",
                "--modes",
                "sync,async_lent",
                "--warmup",
                "1",
                "--steps",
                "3",
            ),
            peer=True,
        ),
        Check("lora_memory", "lora_memory.json", ("benchmarks/lora_memory.py",)),
    )
}
QUICK = ("grpo_step_tiny", "grpo_step_smollm2", "lora_memory")


@dataclass
class Figure:
    """One figure of a check: its reference and new values, and whether the machine's speed cancels out."""

    check: str
    name: str
    reference: float
    value: float
    equal_work: bool
    higher_is_worse: bool = True

    @property
    def ratio(self) -> float:
        return self.value / self.reference if self.reference else float("nan")

    @property
    def worse(self) -> bool:
        change = self.ratio - 1.0 if self.higher_is_worse else 1.0 - self.ratio
        return change > WORSE_BY


def grpo_step_figures(check: str, reference: dict, new: dict, with_peer: bool) -> list[Figure]:
    """Step and stage medians per side (absolute), the matmul rate, and the ratios (equal work)."""
    figures = []
    for side, ref_side in reference.items():
        if not (isinstance(ref_side, dict) and "step_time_median_s" in ref_side) or side not in new:
            continue
        if side == "trl" and not with_peer:
            continue
        figures.append(
            Figure(
                check,
                f"{side} step (s)",
                ref_side["step_time_median_s"],
                new[side]["step_time_median_s"],
                equal_work=False,
            )
        )
        for stage, seconds in ref_side.get("stage_time_median_s", {}).items():
            if seconds >= 0.05 * ref_side["step_time_median_s"]:  # stages that matter to the step
                figures.append(
                    Figure(
                        check,
                        f"{side} {stage} (s)",
                        seconds,
                        new[side]["stage_time_median_s"].get(stage, 0.0),
                        equal_work=False,
                    )
                )
    for key, value in reference.items():
        if not key.startswith("ratio_") or value is None or new.get(key) is None:
            continue
        if "over_trl" in key and not with_peer:
            continue
        if key.startswith("ratio_trl"):  # TRL's own floor ratio: the peer's figure, not ours
            continue
        figures.append(Figure(check, key.removeprefix("ratio_"), value, new[key], equal_work=True))
    rate = reference.get("floor", {}).get("measured_matmul_gflops")
    if rate and "floor" in new:
        figures.append(
            Figure(
                check,
                "matmul rate (GFLOP/s)",
                rate,
                new["floor"]["measured_matmul_gflops"],
                equal_work=False,
                higher_is_worse=False,
            )
        )
    return figures


def lora_figures(check: str, reference: dict, new: dict) -> list[Figure]:
    """Bytes of parameters, optimizer state and refit per model and mode (equal work: counts, not times)."""
    new_rows = {(row["model"], row["mode"]): row for row in new["rows"]}
    figures = []
    for row in reference["rows"]:
        match = new_rows.get((row["model"], row["mode"]))
        if match is None:
            continue
        for key in ("param_bytes", "optimizer_state_bytes", "refit_bytes"):
            figures.append(Figure(check, f"{row['model']} {row['mode']} {key}", row[key], match[key], True))
    return figures


def rerun(check: Check, skip_peer: bool) -> dict:
    """Run the check's benchmark as a subprocess (its own Ray instance and threads); returns its JSON."""
    out = RESULTS / f"compare_{check.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, *check.command, "--out", str(out)]
    if check.peer and skip_peer:
        command.append("--skip-trl")
    print(f"== {check.name}: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, cwd=ROOT, check=True)
    return json.loads(out.read_text())


def figures_of(check: Check, new: dict, skip_peer: bool) -> list[Figure]:
    reference = json.loads((REFERENCE / check.reference).read_text())
    if check.name == "lora_memory":
        return lora_figures(check.name, reference, new)
    return grpo_step_figures(check.name, reference, new, with_peer=check.peer and not skip_peer)


def table(figures: list[Figure]) -> list[str]:
    lines = ["| check | figure | reference | now | now / reference | |", "|---|---|---|---|---|---|"]
    for f in figures:
        mark = ("**worse**" if f.equal_work else "slower (absolute)") if f.worse else ""
        lines.append(f"| {f.check} | {f.name} | {f.reference:.4g} | {f.value:.4g} | {f.ratio:.2f} | {mark} |")
    return lines


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_start": os.getloadavg(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", default=",".join(QUICK), help=f"comma list of {sorted(CHECKS)}")
    parser.add_argument("--skip-peer", action="store_true", help="rerun posttrain only (no TRL)")
    parser.add_argument(
        "--from-results",
        action="store_true",
        help="compare the last reruns in benchmarks/results/ without running anything",
    )
    parser.add_argument("--out", default=str(RESULTS / "compare.json"), help="the report's JSON")
    args = parser.parse_args(argv)
    unknown = [name for name in args.checks.split(",") if name not in CHECKS]
    if unknown:
        parser.error(f"--checks: unknown {unknown}; choose from {sorted(CHECKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "skip_peer": args.skip_peer,
        "checks": {},
    }
    figures: list[Figure] = []
    other_cpu: list[str] = []
    for name in args.checks.split(","):
        check = CHECKS[name]
        if args.from_results:
            new = json.loads((RESULTS / f"compare_{name}.json").read_text())
        else:
            new = rerun(check, args.skip_peer)
        found = figures_of(check, new, args.skip_peer)
        figures += found
        reference = json.loads((REFERENCE / check.reference).read_text())
        processors = [data.get("machine", {}).get("processor") for data in (reference, new)]
        report["checks"][name] = {
            "reference": check.reference,
            "reference_date": reference.get("date"),
            "processors": processors,  # the reference's and this run's
            "figures": [{**vars(f), "ratio": f.ratio, "worse": f.worse} for f in found],
        }
        if None not in processors and processors[0] != processors[1]:
            other_cpu.append(f"{name}: reference on {processors[0]}, now on {processors[1]}")
    report["machine"]["load_average_end"] = os.getloadavg()
    regressions = [f for f in figures if f.equal_work and f.worse]
    report["regressions"] = [f"{f.check}: {f.name} {f.ratio:.2f}x its reference" for f in regressions]
    lines = table(figures)
    print("\n".join(lines))
    print(
        f"{len(regressions)} equal-work figure(s) more than {WORSE_BY:.0%} worse than the reference"
        + "".join(f"\n  {line}" for line in report["regressions"])
    )
    if other_cpu:  # a ratio to TRL moves with the CPU's balance of matmul rate and per-call overhead
        print(
            "another CPU than the reference's: its ratios to TRL are not equal work across machines; compare "
            "posttrain's commits on this machine (old/new A/B, benchmarks/reference/lean_up_ab_cpu.json)\n  "
            + "\n  ".join(other_cpu)
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
