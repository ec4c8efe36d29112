"""Peer parity, seed for seed: posttrain's GRPO against TRL's `GRPOTrainer`, every setting pinned alike.

From the released SmolLM2-135M-Instruct on `math_words` (2-digit addition and subtraction in words), both
arms run the objective and the data of `SETTINGS` (written into the result): the loss's aggregation and
the reward scaling (each named on both sides), no KL, the clip range, the learning rate and its schedule,
the optimizer, prompts and samples per step, one update per step, the sampling, the reply budget, the one
reward (`parity_reward.last_number_matches`) and the data order (posttrain's loader order, given to TRL
unshuffled). Each seed sets the sampling seed and the order. Every `--eval-every` steps each arm is graded
on the same held-out questions, greedy, strictly (the reply's last number; `final_number`): posttrain by
its own validation, TRL's saved model by `posttrain eval --config configs/eval_smollm2.yaml` (the same
generation and grader). Time axis: training seconds (the sum of the steps' own times).

Reported: per arm and step, the strict accuracy (mean over seeds) with a 95% bootstrap interval (seeds and
questions resampled, questions paired across arms); per step the difference posttrain - TRL; the
curves' area (mean accuracy over the steps) and final value, each difference with its interval and
whether it lies within +-`--margin`; the highest accuracy both arms reach and the training seconds each
takes to first reach it. Beside the held-out curves, the on-policy training reward around each graded
step (`on_policy_reward`): the mean reward of the replies each arm sampled at steps s-4 .. s+5, drawn by
its policies after s-5 .. s+4 updates (the same prompts in both arms, step for step), and the
difference posttrain - TRL with its interval (paired by seed and step).

Run (the machine alone; ~20 min per arm and seed at the defaults on a 2-core CPU):
  make real-model install-trl
  .venv/bin/python benchmarks/grpo_parity.py --seeds 0,1,2 --out benchmarks/results/grpo_parity.json
Smoke run (minutes): --seeds 0 --steps 2 --eval-every 1 --val 8
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from async_curves import run_stamped
from curve_stats import area, bootstrap, mean_curve, paired_difference, time_to_reach
from time_to_accuracy import eval_samples, new_log_dir, posttrain_bin, read_jsonl, training_seconds

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GRPO_CONFIG = "configs/grpo_smollm2.yaml"
DATA = {"num_digits": 2, "num_train": 4000, "seed": 0}

SETTINGS = {
    "loss_aggregation": "token mean over the step's batch (posttrain loss.token_level_loss=true; TRL "
    "loss_type='dapo')",
    "reward_scaling": "(r - group mean) / group std (posttrain grpo.normalize_rewards=true; TRL "
    "scale_rewards='group')",
    "kl_beta": 0.0,
    "clip_low": 0.2,
    "clip_high": 0.2,
    "lr": 1e-5,
    "lr_schedule": "constant, no warm-up",
    "adam_betas": [0.9, 0.99],
    "adam_eps": 1e-8,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "prompts_per_step": 8,
    "samples_per_prompt": 8,
    "updates_per_step": 1,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "max_new_tokens": 16,
    "reward": "benchmarks/parity_reward.py:last_number_matches",
    "importance_sampling_correction": False,
    "truncated_replies": "trained on (no overlong filter)",
    "precision": "fp32",
    "data_order": "posttrain's loader order (data.shuffle_seed = 1000 + seed), TRL unshuffled",
}


def posttrain_overrides(args, seed: int, log_dir: Path) -> list[str]:
    s = SETTINGS
    return [
        f"policy.model_name={args.model}",
        f"grpo.seed={seed}",
        f"data.seed={DATA['seed']}",
        f"data.shuffle_seed={1000 + seed}",
        f"data.num_val={args.val}",
        f"grpo.max_val_samples={args.val}",
        f"grpo.max_num_steps={args.steps}",
        f"grpo.val_period={args.eval_every}",
        f"logger.log_dir={log_dir}",
        "checkpointing.enabled=false",
        "loss.token_level_loss=true",
        "grpo.normalize_rewards=true",
        f"loss.reference_policy_kl_penalty={s['kl_beta']}",
        f"loss.ratio_clip_min={s['clip_low']}",
        f"loss.ratio_clip_max={s['clip_high']}",
        f"policy.optimizer.kwargs.lr={s['lr']}",
        f"policy.optimizer.kwargs.betas={s['adam_betas']}",
        f"policy.optimizer.kwargs.eps={s['adam_eps']}",
        f"policy.optimizer.kwargs.weight_decay={s['weight_decay']}",
        "+policy.scheduler=[]",  # constant: no scheduler
        f"policy.max_grad_norm={s['max_grad_norm']}",
        f"grpo.num_prompts_per_step={s['prompts_per_step']}",
        f"grpo.num_generations_per_prompt={s['samples_per_prompt']}",
        f"policy.train_global_batch_size={s['prompts_per_step'] * s['samples_per_prompt']}",
        f"generation.temperature={s['temperature']}",
        f"generation.top_p={s['top_p']}",
        "generation.top_k=null",
        f"generation.max_new_tokens={s['max_new_tokens']}",
        "loss.use_importance_sampling_correction=false",
        "grpo.overlong_filtering=false",
        "env.math.cls=reward_function",
        f"+env.math.reward={ROOT / s['reward'].split(':')[0]}:{s['reward'].split(':')[1]}",
    ]


def loader_order_rows(args, seed: int) -> list[dict]:
    """The training questions in the order posttrain's loader draws them (its first epoch)."""
    from posttrain.data.tasks import word_problem_row, word_problems

    train, _ = word_problems(DATA["num_digits"], DATA["num_train"], args.val, DATA["seed"])
    rows = [word_problem_row(*q) for q in train]
    generator = torch.Generator().manual_seed((1000 + seed) * 100_003)  # StatefulDataLoader, epoch 0
    return [rows[i] for i in torch.randperm(len(rows), generator=generator).tolist()]


def strict_grades(rows: list[dict]) -> list:
    """Strict grades of sample rows, ordered by prompt (both arms are graded on the same questions)."""
    return [r["strict_grade"] for r in sorted(rows, key=lambda r: r["prompt"])]


def evaluate(model_dir: Path, out_dir: Path, num_val: int) -> list:
    return strict_grades(eval_samples(model_dir, out_dir, num_val))


def run_posttrain(args, seed: int, log_dir: Path, start: list) -> list[dict]:
    command = [posttrain_bin(), "grpo", "--config", GRPO_CONFIG, *posttrain_overrides(args, seed, log_dir)]
    records, _ = run_stamped(command, log_dir / "metrics.jsonl", log_dir / "console.log")
    seconds = training_seconds(records)
    steps = sorted({r["step"] for r in records if "val/strict_accuracy" in r})
    return [
        {
            "step": step,
            "train_s": round(seconds[step], 1),
            "grades": strict_grades(read_jsonl(log_dir / "val_samples" / f"step_{step}.jsonl")),
        }
        for step in steps
    ]


def run_trl(args, seed: int, log_dir: Path, start: list) -> list[dict]:
    s = SETTINGS
    data_file = log_dir / "prompts.jsonl"
    data_file.write_text(
        "".join(
            json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n"
            for r in loader_order_rows(args, seed)
        )
    )
    job = {
        "model_dir": str(args.model),
        "data_file": str(data_file),
        "output_dir": str(log_dir / "trl"),
        "device": "cpu",
        "torch_threads": None,
        "seed": seed,
        "num_prompts": s["prompts_per_step"],
        "num_generations": s["samples_per_prompt"],
        "max_completion_length": s["max_new_tokens"],
        "temperature": s["temperature"],
        "epsilon": s["clip_low"],
        "epsilon_high": s["clip_high"],
        "beta": s["kl_beta"],
        "loss_type": "dapo",
        "scale_rewards": "group",
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "numeric_answers": True,
        "optimizer": {
            "lr": s["lr"],
            "weight_decay": s["weight_decay"],
            "betas": s["adam_betas"],
            "eps": s["adam_eps"],
        },
        "max_grad_norm": s["max_grad_norm"],
        "warmup": 0,
        "steps": args.steps,
        "save_steps": args.eval_every,
    }
    (log_dir / "job.json").write_text(json.dumps(job, indent=1))
    out = log_dir / "trl_steps.json"
    with open(log_dir / "console.log", "w") as console:
        subprocess.run(
            [args.trl_python, str(ROOT / "benchmarks" / "trl_grpo.py"), str(log_dir / "job.json"), str(out)],
            cwd=ROOT,
            check=True,
            stdout=console,
            stderr=subprocess.STDOUT,
        )
    points, total = [{"step": 0, "train_s": 0.0, "grades": start}], 0.0
    for step, record in enumerate(json.loads(out.read_text())["steps"], start=1):
        total += record["step"]
        if step % args.eval_every == 0:
            graded = evaluate(log_dir / "trl" / f"checkpoint-{step}", log_dir / f"eval_{step}", args.val)
            points.append({"step": step, "train_s": round(total, 1), "grades": graded})
    return points


def quote_replies(log_root: Path, seed: int, step: int, count: int = 4) -> dict[str, list[dict]]:
    """The first `count` held-out replies at the start and of each arm's seed-`seed` run at `step`."""
    files = {
        "start": log_root / "start_eval" / "samples.jsonl",
        "posttrain": log_root / f"posttrain_seed{seed}" / "val_samples" / f"step_{step}.jsonl",
        "trl": log_root / f"trl_seed{seed}" / f"eval_{step}" / "samples.jsonl",
    }
    keys = ("prompt", "response", "ground_truth", "strict_grade")
    return {
        arm: [{k: row[k] for k in keys} for row in read_jsonl(path)[:count]] for arm, path in files.items()
    }


def summarize(curves: dict[str, list[list[dict]]], margin: float) -> dict:
    """Per-step accuracy and difference with intervals, area and final value, time to a shared level."""
    arms = list(curves)
    steps = [p["step"] for p in curves[arms[0]][0]]
    per_step = {
        arm: [bootstrap(curves, lambda v, i=i, arm=arm: v(arm, i)) | {"step": s} for i, s in enumerate(steps)]
        for arm in arms
    }
    summary: dict = {
        "accuracy_by_step": per_step,
        "mean_curves": {a: mean_curve(c) for a, c in curves.items()},
    }
    if len(arms) == 2:
        a, b = arms
        last = len(steps) - 1
        summary["difference_by_step"] = [
            bootstrap(curves, lambda v, i=i: v(a, i) - v(b, i)) | {"step": s} for i, s in enumerate(steps)
        ]
        for name, stat in (
            ("area_difference", lambda v: area(v, a, steps) - area(v, b, steps)),
            ("final_difference", lambda v: v(a, last) - v(b, last)),
        ):
            result = bootstrap(curves, stat)
            summary[name] = result | {"within_margin": -margin <= result["low"] and result["high"] <= margin}
        means = summary["mean_curves"]
        level = min(max(p["accuracy"] for p in means[a]), max(p["accuracy"] for p in means[b]))
        summary["highest_level_both_reach"] = {
            "accuracy": level,
            **{f"{arm}_train_s": time_to_reach(means[arm], level) for arm in arms},
        }
    summary["margin"] = margin
    return summary


def training_rewards(log_root: Path, seeds: list[int]) -> dict[str, list[list[float]]]:
    """Per arm and seed, the mean training reward of each step's sampled replies: posttrain's from its
    metrics.jsonl, TRL's from the log dicts its trainer prints to console.log."""
    rewards: dict[str, list[list[float]]] = {"posttrain": [], "trl": []}
    for seed in seeds:
        records = read_jsonl(log_root / f"posttrain_seed{seed}" / "metrics.jsonl")
        rewards["posttrain"].append([r["train/reward_mean"] for r in records if "train/reward_mean" in r])
        lines = (log_root / f"trl_seed{seed}" / "console.log").read_text().splitlines()
        logs = [ast.literal_eval(x) for x in lines if x.startswith("{'loss'")]
        rewards["trl"].append([float(d["reward"]) for d in logs])
    return rewards


def on_policy_reward(rewards: dict[str, list[list[float]]], steps: list[int]) -> list:
    """Per graded step s > 0 (of `steps`): each arm's mean training reward over steps s-4 .. s+5 (those it
    has; the replies of step k are sampled by the policy after k-1 updates) and the difference posttrain -
    TRL, paired by seed and step (both arms see the same prompts at a step; `paired_difference`)."""
    posttrain, trl, result = rewards["posttrain"], rewards["trl"], []
    for s in [s for s in steps if s > 0]:
        window = [k for k in range(s - 4, s + 6) if 1 <= k <= len(posttrain[0])]
        pairs = [[(p[k - 1], t[k - 1]) for k in window] for p, t in zip(posttrain, trl)]  # [seed][step]
        flat = [pair for run in pairs for pair in run]
        result.append(
            {
                "step": s,
                "window": [window[0], window[-1]],
                "posttrain": round(statistics.mean(a for a, _ in flat), 4),
                "trl": round(statistics.mean(b for _, b in flat), 4),
                "difference": paired_difference(pairs),
            }
        )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--arms", default="posttrain,trl")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--val", type=int, default=400, help="held-out questions")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--margin", type=float, default=0.03, help="equivalence margin (accuracy)")
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--log-root", default=str(ROOT / "results" / "grpo_parity"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grpo_parity.json"))
    args = parser.parse_args()
    runs = {"posttrain": run_posttrain, "trl": run_trl}
    start = evaluate(Path(args.model), Path(args.log_root) / "start_eval", args.val)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "model": str(args.model),
        "held_out_questions": args.val,
        "settings": SETTINGS,
        "posttrain_overrides": posttrain_overrides(args, 0, Path("LOG_DIR")),
        "curves": {},
    }
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in args.arms.split(","):
            log_dir = new_log_dir(args.log_root, arm, seed)
            result["curves"].setdefault(arm, []).append(runs[arm](args, seed, log_dir, start))
            result["summary"] = summarize(result["curves"], args.margin)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")  # after every run: nothing lost
    result["samples"] = quote_replies(Path(args.log_root), int(args.seeds.split(",")[0]), args.steps)
    if sorted(args.arms.split(",")) == ["posttrain", "trl"]:
        seeds = [int(s) for s in args.seeds.split(",")]
        rewards = training_rewards(Path(args.log_root), seeds)
        steps = [p["step"] for p in result["curves"]["trl"][0]]
        result["on_policy_reward"] = on_policy_reward(rewards, steps)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result["summary"].items() if k != "accuracy_by_step"}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
