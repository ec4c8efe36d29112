"""Time to accuracy on the real model: GRPO against SFT continued for the same time, and against TRL.

From one SFT model of SmolLM2-135M-Instruct (`configs/sft_smollm2.yaml`), on the `math_words` questions
(2-digit addition and subtraction in words), each arm trains for a number of steps and is graded on the
same held-out questions (400 by default, never trained on), greedy, strictly: a reply counts when its last
number equals the answer (`final_number`; the reward cannot raise it). Arms:

- `grpo`: `posttrain grpo --config configs/grpo_smollm2.yaml` from the SFT model; graded by its own
  validation every `--grpo-val-period` steps.
- `sft`: `posttrain sft --config configs/sft_smollm2.yaml` continued from the SFT model on the same
  training questions with their answers; a checkpoint every `--sft-save-period` steps, each graded by
  `posttrain eval --config configs/eval_smollm2.yaml` (the same questions, generation and grader).
- `trl`: TRL's `GRPOTrainer` (`benchmarks/trl_grpo.py`, in `.venv-trl`: `make install-trl`) with the
  same prompts per step, samples per prompt, reply budget, temperature, clip range and learning rate
  (`--trl-lr default` for TRL's own 1e-6), fp32 on the CPU, rewarded by the reply's last number; a
  model saved every `--trl-save-steps` steps, graded by `posttrain eval` as the SFT arm.

Time axis: each arm's training time, the sum of its steps' own times (start-up, validation and
evaluation excluded, for every arm alike). Each arm runs once per seed (`--seeds`): the seed of the
sampling (GRPO, TRL) and of the training order (`data.shuffle_seed`, every arm; the held-out split is
fixed by `data.seed`).

Run (the machine alone; ~1 h for the defaults):
  make real-model install-trl
  .venv/bin/posttrain sft --config configs/sft_smollm2.yaml
  .venv/bin/python benchmarks/time_to_accuracy.py --out benchmarks/results/time_to_accuracy.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
from pathlib import Path

from async_curves import run_stamped

ROOT = Path(__file__).resolve().parents[1]
GRPO_CONFIG = "configs/grpo_smollm2.yaml"
SFT_CONFIG = "configs/sft_smollm2.yaml"
EVAL_CONFIG = "configs/eval_smollm2.yaml"
DATA = {"num_digits": 2, "num_train": 4000, "seed": 0}  # the recipes' split (the held-out count is --val)


def posttrain_bin() -> str:
    return str(Path(sys.executable).parent / "posttrain")


def data_overrides(num_val: int, seed: int) -> list[str]:
    return [f"data.num_val={num_val}", f"data.seed={DATA['seed']}", f"data.shuffle_seed={1000 + seed}"]


def training_seconds(records: list[dict]) -> dict[int, float]:
    """Step -> the summed `train/step_time` of steps 1..step (0 at step 0)."""
    total, out = 0.0, {0: 0.0}
    for record in sorted((r for r in records if "train/step_time" in r), key=lambda r: r["step"]):
        total += record["train/step_time"]
        out[record["step"]] = total
    return out


def eval_samples(model_dir: Path, out_dir: Path, num_val: int) -> list[dict]:
    """`posttrain eval` of one model directory or checkpoint on the held-out questions: its sample rows
    (its summary.json is beside them in out_dir)."""
    command = [
        posttrain_bin(),
        "eval",
        "--config",
        EVAL_CONFIG,
        f"model.model_name={model_dir}",
        f"eval.save_path={out_dir}",
        f"eval.max_samples={num_val}",
        f"data.num_val={num_val}",
    ]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return read_jsonl(out_dir / "samples.jsonl")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def evaluate(model_dir: Path, out_dir: Path, num_val: int) -> dict:
    """Strict accuracy and three replies of one model directory or checkpoint."""
    rows = eval_samples(model_dir, out_dir, num_val)
    summary = json.loads((out_dir / "summary.json").read_text())
    return {"strict_accuracy": summary["strict_accuracy"], "samples": rows[:3]}


def new_log_dir(log_root: str, arm: str, seed: int) -> Path:
    """The run directory of one arm and seed, refused if it holds an earlier run."""
    log_dir = Path(log_root) / f"{arm}_seed{seed}"
    if (log_dir / "console.log").exists():
        raise SystemExit(f"{log_dir} holds an earlier run: remove it first")
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"{arm}, seed {seed}", flush=True)
    return log_dir


def run_grpo(args, seed: int, log_dir: Path) -> dict:
    overrides = [
        f"policy.model_name={args.sft_model}",
        f"grpo.seed={seed}",
        f"grpo.max_num_steps={args.grpo_steps}",
        f"grpo.val_period={args.grpo_val_period}",
        f"grpo.max_val_samples={args.val}",
        f"logger.log_dir={log_dir}",
        "checkpointing.enabled=false",
        *data_overrides(args.val, seed),
        *args.grpo_override,
    ]
    command = [posttrain_bin(), "grpo", "--config", GRPO_CONFIG, *overrides]
    records, _ = run_stamped(command, log_dir / "metrics.jsonl", log_dir / "console.log")
    seconds = training_seconds(records)
    points = [
        {
            "step": r["step"],
            "train_s": round(seconds[r["step"]], 1),
            "strict_accuracy": r["val/strict_accuracy"],
        }
        for r in records
        if "val/strict_accuracy" in r
    ]
    last = points[-1]["step"]
    samples = [
        json.loads(x) for x in (log_dir / "val_samples" / f"step_{last}.jsonl").read_text().splitlines()
    ]
    train = [r for r in records if "train/reward_mean" in r]
    return {
        "overrides": overrides,
        "points": points,
        "reward_mean": [round(r["train/reward_mean"], 3) for r in train],
        "zero_signal_share": [round(r.get("train/health/zero_signal_share", float("nan")), 3) for r in train],
        "samples": samples[:3],
    }


def run_sft(args, seed: int, log_dir: Path) -> dict:
    overrides = [
        f"policy.model_name={args.sft_model}",
        f"sft.max_num_steps={args.sft_steps}",
        "sft.max_num_epochs=100",
        f"sft.val_period={args.sft_steps}",  # a validation loss at the end only
        "sft.export_final_model=false",
        f"checkpointing.save_period={args.sft_save_period}",
        "checkpointing.keep_top_k=null",
        f"logger.log_dir={log_dir}",
        *data_overrides(args.val, seed),
        *args.sft_override,
    ]
    command = [posttrain_bin(), "sft", "--config", SFT_CONFIG, *overrides]
    records, _ = run_stamped(command, log_dir / "metrics.jsonl", log_dir / "console.log")
    seconds = training_seconds(records)
    points, samples = [], []
    for step in range(args.sft_save_period, args.sft_steps + 1, args.sft_save_period):
        graded = evaluate(log_dir / "checkpoints" / f"step_{step}", log_dir / f"eval_{step}", args.val)
        points.append(
            {
                "step": step,
                "train_s": round(seconds[step], 1),
                **{"strict_accuracy": graded["strict_accuracy"]},
            }
        )
        samples = graded["samples"]
        print(f"  sft step {step}: strict accuracy {graded['strict_accuracy']:.3f}", flush=True)
    return {"overrides": overrides, "points": points, "samples": samples}


def trl_job(args, seed: int, log_dir: Path) -> Path:
    """The job file of benchmarks/trl_grpo.py: the training questions in this seed's order."""
    sys.path.insert(0, str(ROOT))
    from posttrain.data.tasks import word_problem_row, word_problems

    train, _ = word_problems(DATA["num_digits"], DATA["num_train"], args.val, DATA["seed"])
    rows = [word_problem_row(*q) for q in train]
    random.Random(1000 + seed).shuffle(rows)
    data_file = log_dir / "prompts.jsonl"
    data_file.write_text(
        "".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows)
    )
    lr = 1e-6 if args.trl_lr == "default" else float(args.trl_lr)
    job = {
        "model_dir": str(args.sft_model),
        "data_file": str(data_file),
        "output_dir": str(log_dir / "trl"),
        "device": "cpu",
        "torch_threads": None,
        "seed": seed,
        "num_prompts": 8,
        "num_generations": 8,
        "max_completion_length": 16,
        "temperature": 1.0,
        "epsilon": 0.2,
        "numeric_answers": True,
        "optimizer": {"lr": lr, "weight_decay": 0.0, "betas": [0.9, 0.99], "eps": 1e-8},
        "max_grad_norm": 1.0,
        "warmup": 0,
        "steps": args.trl_steps,
        "save_steps": args.trl_save_steps,
    }
    path = log_dir / "job.json"
    path.write_text(json.dumps(job, indent=1))
    return path


def run_trl(args, seed: int, log_dir: Path) -> dict:
    job = trl_job(args, seed, log_dir)
    out = log_dir / "trl_steps.json"
    with open(log_dir / "console.log", "w") as console:
        subprocess.run(
            [args.trl_python, str(ROOT / "benchmarks" / "trl_grpo.py"), str(job), str(out)],
            cwd=ROOT,
            check=True,
            stdout=console,
            stderr=subprocess.STDOUT,
        )
    steps = json.loads(out.read_text())["steps"]
    points, samples, total = [], [], 0.0
    for step, record in enumerate(steps, start=1):
        total += record["step"]
        if step % args.trl_save_steps == 0:
            graded = evaluate(log_dir / "trl" / f"checkpoint-{step}", log_dir / f"eval_{step}", args.val)
            points.append(
                {"step": step, "train_s": round(total, 1), "strict_accuracy": graded["strict_accuracy"]}
            )
            samples = graded["samples"]
            print(f"  trl step {step}: strict accuracy {graded['strict_accuracy']:.3f}", flush=True)
    return {"lr": json.loads(job.read_text())["optimizer"]["lr"], "points": points, "samples": samples}


ARMS = {"grpo": run_grpo, "sft": run_sft, "trl": run_trl}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sft-model", default=str(ROOT / "results" / "sft_smollm2" / "hf_model"))
    parser.add_argument("--arms", default="grpo,sft,trl")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--val", type=int, default=400, help="held-out questions")
    parser.add_argument("--grpo-steps", type=int, default=60)
    parser.add_argument("--grpo-val-period", type=int, default=20)
    parser.add_argument("--grpo-override", action="append", default=[], help="another posttrain override")
    parser.add_argument("--sft-steps", type=int, default=180)
    parser.add_argument("--sft-save-period", type=int, default=60)
    parser.add_argument("--sft-override", action="append", default=[])
    parser.add_argument("--trl-steps", type=int, default=30)
    parser.add_argument("--trl-save-steps", type=int, default=10)
    parser.add_argument(
        "--trl-lr", default="recipe", help="'recipe' (the GRPO recipe's), 'default' or a value"
    )
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--log-root", default=str(ROOT / "results" / "time_to_accuracy"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "time_to_accuracy.json"))
    args = parser.parse_args()
    if args.trl_lr == "recipe":
        args.trl_lr = recipe_lr(args.grpo_override)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "sft_model": str(args.sft_model),
        "held_out_questions": args.val,
        "start": evaluate(Path(args.sft_model), Path(args.log_root) / "start_eval", args.val),
        "arms": {},
    }
    print(f"start: strict accuracy {result['start']['strict_accuracy']:.3f}", flush=True)
    for seed in [int(s) for s in args.seeds.split(",")]:  # arms alternate within a seed
        for arm in args.arms.split(","):
            log_dir = new_log_dir(args.log_root, arm, seed)
            result["arms"].setdefault(arm, {})[str(seed)] = ARMS[arm](args, seed, log_dir)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")  # after every run: nothing lost
    print(f"wrote {args.out}")
    return 0


def recipe_lr(grpo_overrides: list[str]) -> str:
    """The GRPO arm's learning rate: an override's, else the recipe's."""
    for override in grpo_overrides:
        if override.startswith("policy.optimizer.kwargs.lr="):
            return override.split("=", 1)[1]
    import yaml

    return str(yaml.safe_load((ROOT / GRPO_CONFIG).read_text())["policy"]["optimizer"]["kwargs"]["lr"])


if __name__ == "__main__":
    sys.exit(main())
