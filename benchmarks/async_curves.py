"""Asynchronous against synchronous GRPO on the step-by-step task: learning curves, graded strictly.

Runs `posttrain grpo --config configs/grpo_smollm2_steps.yaml` once per mode from the same SFT model,
the same seed and the same number of samples (steps x prompts x generations): synchronously (generation and
training take turns on all cores) and asynchronously (`grpo.async_grpo`, generation one step ahead on a
worker of its own; trainer and generator each get half of the machine's cores; max_trajectory_age_steps
1, the loss's importance-sampling correction for the older sampler); mode `async_lent` is the
asynchronous run with `grpo.async_grpo.lend_idle_cores` (the trainer's micro-batches borrow the
generator's threads once its batch is made; validation borrows the trainer's). Each run validates
greedily on the held-out questions every `grpo.val_period` steps; a reply counts when its last number
equals the answer (`val/strict_accuracy`, the reward cannot raise it).

Wall time: the script reads each run's `metrics.jsonl` while the run goes and stamps every record with
the seconds since the run's command started, so each validation point has the wall time at which it was
logged (start-up and the validations themselves included, the same for both). It also sums the steps'
own times (`train/step_time`, validation excluded).

Needs the SFT model first (`posttrain sft --config configs/sft_smollm2_steps.yaml`) and the machine
alone (the runs are timed).

Run:  .venv/bin/python benchmarks/async_curves.py [--steps 20] [--modes sync,async,async_lent]
      [--out benchmarks/results/async_curves.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/grpo_smollm2_steps.yaml"
ASYNC_OVERRIDES = [  # generation on a worker of its own, each side with half of the machine's cores
    "grpo.async_grpo.enabled=true",
    "grpo.async_grpo.max_trajectory_age_steps=1",
    "generation.colocated=false",
    "generation.num_workers=1",
]


BORROWED = "timing/policy_worker/borrowed_threads"  # training time run with the generator's threads


def half_cores() -> list[str]:
    cores = max(1, (os.cpu_count() or 2) // 2)
    return [f"cluster.num_cpus_per_worker={cores}", f"generation.num_cpus_per_worker={cores}"]


def run_stamped(command: list[str], metrics_file: Path, console: Path) -> tuple[list[dict], float]:
    """Run `command`, stamping each new line of `metrics_file` with the seconds since the start
    (`wall_s`); returns (records, the command's wall time); prints each validation as it comes. A failing
    command raises with its log's end."""
    records: list[dict] = []
    start = time.monotonic()
    with open(console, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        offset = 0
        while True:
            done = process.poll() is not None
            if metrics_file.exists():
                with open(metrics_file, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                complete = chunk[: chunk.rfind(b"\n") + 1]
                offset += len(complete)
                now = round(time.monotonic() - start, 1)
                new = [{**json.loads(line), "wall_s": now} for line in complete.decode().splitlines() if line]
                for record in new:  # progress: each validation as it is logged
                    if "val/strict_accuracy" in record:
                        print(
                            f"  step {record['step']}: strict accuracy {record['val/strict_accuracy']:.3f} "
                            f"at {now:.0f} s",
                            flush=True,
                        )
                records += new
            if done:
                break
            time.sleep(0.5)
    wall = time.monotonic() - start
    if process.returncode != 0:
        tail = console.read_text().splitlines()[-30:]
        raise RuntimeError(f"{' '.join(command)} exited {process.returncode}:\n" + "\n".join(tail))
    return records, wall


def summarize(records: list[dict], wall: float, log_dir: Path) -> dict:
    """Validation points (step, wall time, strict accuracy, reward accuracy), per-step rewards, lengths
    and times, and three validation replies at the first and the last validation."""
    val = [
        {
            "step": r["step"],
            "wall_s": r["wall_s"],
            "strict_accuracy": r["val/strict_accuracy"],
            "reward_accuracy": r["val/accuracy"],
        }
        for r in records
        if "val/strict_accuracy" in r
    ]
    train = [r for r in records if "train/reward_mean" in r]
    lengths = [round(r["train/rollout/mean_generated_length"], 1) for r in train]
    samples = {}
    for point in (val[0], val[-1]):
        path = log_dir / "val_samples" / f"step_{point['step']}.jsonl"
        if path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines()[:3]]
            samples[str(point["step"])] = [
                {k: row.get(k) for k in ("prompt", "response", "reward", "strict_grade")} for row in rows
            ]
    return {
        "validation": val,
        "train_reward_mean": [round(r["train/reward_mean"], 4) for r in train],
        "mean_generated_tokens": lengths,
        "step_time_s": [round(r["train/step_time"], 2) for r in train],
        "steps_time_s": round(sum(r["train/step_time"] for r in train), 1),
        "wall_s": round(wall, 1),
        "borrowed_threads_s": round(sum(r.get(BORROWED, 0.0) for r in records), 1),
        "samples": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default="sync,async,async_lent")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "async_curves.json"))
    parser.add_argument("--log-root", default=str(ROOT / "results" / "async_curves"))
    args = parser.parse_args()
    posttrain = str(Path(sys.executable).parent / "posttrain")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "config": args.config,
        "steps": args.steps,
        "modes": {},
    }
    for mode in args.modes.split(","):
        log_dir = Path(args.log_root) / mode
        if (log_dir / "metrics.jsonl").exists():
            raise SystemExit(f"{log_dir} holds an earlier run: remove it first")
        overrides = [
            f"grpo.max_num_steps={args.steps}",
            f"logger.log_dir={log_dir}",
            "checkpointing.enabled=false",
        ]
        if mode in ("async", "async_lent"):
            overrides += ASYNC_OVERRIDES + half_cores()
        if mode == "async_lent":
            overrides.append("grpo.async_grpo.lend_idle_cores=true")
        command = [posttrain, "grpo", "--config", args.config, *overrides]
        log_dir.mkdir(parents=True, exist_ok=True)
        print(f"{mode}: {' '.join(command)}", flush=True)
        records, wall = run_stamped(command, log_dir / "metrics.jsonl", log_dir / "console.log")
        result["modes"][mode] = {"overrides": overrides, **summarize(records, wall, log_dir)}
        points = result["modes"][mode]["validation"]
        print(
            f"{mode}: {wall:.0f} s; strict accuracy "
            + ", ".join(f"step {p['step']} {p['strict_accuracy']:.3f} ({p['wall_s']:.0f} s)" for p in points),
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
