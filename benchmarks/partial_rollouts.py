"""Partial rollouts against whole-batch rollouts in asynchronous GRPO, on a long-tail batch.

The workload: a tiny random Qwen2-shaped policy (hidden 64, 2 layers, `create-model` defaults otherwise)
on the built-in addition prompts. Its final norm is scaled by `--norm-scale` (0.05), so its logits are
nearly uniform over its V = 105 tokens, and `generation.stop_token_ids` holds EOS and the next
`--num-stop-tokens` - 1 ids: each token ends the reply with probability ~num_stop_tokens / V (7/105,
1/15). Reply lengths are then roughly geometric: most replies are short and the longest of a batch of 64
is several times the mean (the script reports the measured mean and longest lengths). The rewards are
exact match (always 0 here): the benchmark measures the schedule, not learning.

Modes (the same seed, prompts and steps):
- `age0`: asynchronous, `max_trajectory_age_steps=0`: every token on-policy, the trainer waits for each
  whole batch (the synchronous loop's schedule);
- `age1`: bound 1, whole-batch rollouts: the next batch generates while the policy trains, every token
  one step old;
- `age1_partial`: bound 1 with `partial_rollouts` in chunks of `--chunk` tokens: a reply still running
  when the trainer publishes new weights continues with them.

Per mode: mean step time (steps 3.., after start-up), the trainer's idle share (time waiting for a batch
over step time), the mean per-token age, mid-batch refits, tokens generated before a refit by replies
that continued after it (what restarting those replies at the refit would discard), and tokens
discarded (always 0 here: no mode regenerates tokens; stale batches would be dropped whole, and none is).

With `--runs N` the modes alternate N times and every figure is the median over the runs.

Run: .venv/bin/python benchmarks/partial_rollouts.py [--steps 12] [--chunk 8] [--runs 2]
     [--out benchmarks/reference/partial_rollouts_cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo_tiny.yaml"

BASE = {
    "grpo.num_prompts_per_step": 8,
    "grpo.num_generations_per_prompt": 8,
    "grpo.max_seq_len": 160,
    "grpo.val_period": 0,
    "grpo.val_at_start": "false",
    "data.num_train": 512,
    "data.num_val": 8,
    "policy.train_global_batch_size": 64,
    "policy.train_micro_batch_size": 16,
    "policy.logprob_batch_size": 64,
    "generation.max_new_tokens": 128,
    "generation.colocated": "false",
    "grpo.async_grpo.enabled": "true",
    "checkpointing.enabled": "false",
    "logger.tensorboard_enabled": "false",
    "cluster.num_cpus_per_worker": 1,
    "generation.num_cpus_per_worker": 1,
}
MODES = {
    "age0": {"grpo.async_grpo.max_trajectory_age_steps": 0},
    "age1": {"grpo.async_grpo.max_trajectory_age_steps": 1},
    "age1_partial": {
        "grpo.async_grpo.max_trajectory_age_steps": 1,
        "grpo.async_grpo.partial_rollouts": "true",
    },
}


def long_tail_model(out_dir: Path, norm_scale: float) -> Path:
    """The tiny policy with its final norm scaled (near-uniform logits: geometric reply lengths)."""
    import torch

    from posttrain.models.build import ModelFromConfig, build_model_dir, load_model

    path = build_model_dir(
        ModelFromConfig(hidden_size=64, num_layers=2, num_attention_heads=2, intermediate_size=128), out_dir
    )
    model = load_model(path)
    with torch.no_grad():
        model.model.norm.weight.mul_(norm_scale)
    model.save_pretrained(path)
    return path


def run_mode(mode: str, args: argparse.Namespace, model_dir: Path, log_dir: Path) -> list[dict]:
    """One GRPO run in this process; returns its per-step metrics."""
    from posttrain.algorithms import grpo
    from posttrain.config import load_typed_config

    values = {**BASE, **MODES[mode], "grpo.max_num_steps": args.steps, "logger.log_dir": str(log_dir)}
    values["policy.model_name"] = str(model_dir)
    values["grpo.async_grpo.partial_rollout_chunk_tokens"] = args.chunk
    eos = 2  # the built-in character tokenizer's EOS id
    values["generation.stop_token_ids"] = str(list(range(eos, eos + args.num_stop_tokens)))
    cfg = load_typed_config(grpo.GRPOConfig, str(CONFIG), [f"{k}={v}" for k, v in values.items()])
    run = grpo.setup(cfg)
    try:
        grpo.grpo_train(run)
    finally:
        run.shutdown()
    by_step: dict[int, dict] = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], {}).update(record)
    return [by_step[s] for s in sorted(by_step) if "train/step_time" in by_step[s]]


def summarize(records: list[dict], skip: int = 2) -> dict[str, float]:
    """Figures over the steps after the first `skip` (start-up, first refits), sums over all steps."""
    timed = records[skip:]
    step_s = sum(r["train/step_time"] for r in timed)
    wait_s = sum(r.get("timing/rollout_wait", 0.0) for r in timed)
    dropped = float(sum(r.get("train/async/dropped_stale_trajectories", 0.0) for r in records))

    def total(key: str) -> float:
        return float(sum(r.get(key, 0.0) for r in records))

    return {
        "steps_timed": len(timed),
        "step_time_mean_s": round(step_s / len(timed), 3),
        "trainer_idle_fraction": round(wait_s / step_s, 3),
        "token_age_mean": round(sum(r["train/async/trajectory_age_mean"] for r in timed) / len(timed), 3),
        "mean_generated_length": round(
            sum(r["train/rollout/mean_generated_length"] for r in records) / len(records), 1
        ),
        "longest_reply_mean": round(
            sum(r["train/rollout/max_total_length"] for r in records) / len(records), 1
        ),
        "refits_mid_batch": total("train/rollout/partial/refits_mid_batch"),
        "tokens_kept_across_refit": total("train/rollout/partial/tokens_kept_across_refit"),
        "dropped_trajectories": dropped,
        # No mode regenerates tokens; a dropped (stale) batch would discard its tokens, which the logs do
        # not count: None then.
        "tokens_discarded": 0.0 if dropped == 0 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=8, help="partial_rollout_chunk_tokens")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--runs", type=int, default=1, help="runs per mode, alternating (medians reported)")
    parser.add_argument("--norm-scale", type=float, default=0.05, help="the policy's final norm x this")
    parser.add_argument("--num-stop-tokens", type=int, default=7, help="ids that end a reply (EOS first)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "reference" / "partial_rollouts_cpu.json"))
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    results = {}
    runs: dict[str, list[dict]] = {mode: [] for mode in args.modes.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = long_tail_model(Path(tmp) / "model", args.norm_scale)
        for run in range(args.runs):  # modes alternate, so a change of machine load hits all of them
            for mode in runs:
                start = time.perf_counter()
                records = run_mode(mode, args, model_dir, Path(tmp) / f"{mode}_{run}")
                runs[mode].append({**summarize(records), "wall_s": round(time.perf_counter() - start, 1)})
                print(mode, json.dumps(runs[mode][-1]), flush=True)
    for mode, summaries in runs.items():  # medians over the runs, and each run's step time
        medians = {key: [s[key] for s in summaries if s[key] is not None] for key in summaries[0]}
        results[mode] = {key: round(statistics.median(v), 3) if v else None for key, v in medians.items()}
        results[mode]["step_time_mean_s_per_run"] = [s["step_time_mean_s"] for s in summaries]
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU; shared with other jobs "
        "while measured, so timings are noisy",
        "workload": {
            "runs": args.runs,
            "steps": args.steps,
            "chunk_tokens": args.chunk,
            "norm_scale": args.norm_scale,
            "num_stop_tokens": args.num_stop_tokens,
            **BASE,
        },
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
