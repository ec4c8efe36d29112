"""RL where only a verifier exists: GRPO against rejection-sampling fine-tuning (RFT), the control a user
without RL would run, on the built-in `constrained_lists` task, from the released SmolLM2-135M-Instruct.

Arms: `posttrain grpo --config configs/grpo_lists_smollm2.yaml` and `--config configs/rft_lists_smollm2.yaml`
(the same loop, rollouts and settings; RFT keeps the replies meeting all four constraints and takes SFT's
step on them), and `rft_075`, RFT keeping the replies that meet three of the four or more. Each seed
sets the sampling seed and the training order. Every `--val-period` steps each arm is graded by its
validation on held-out topics and counts never trained on, greedy: the strict grade (all four
constraints), and what the reward cannot see, from the same replies: the share of items that belong to
the topic (its word list) and the strict grade with every item on topic.

After each run, forgetting: the exported model's strict accuracy on `math_words` (`posttrain eval --config
configs/eval_smollm2.yaml`, beside the start's), and its KL to the start, KL(trained || start) per reply
token, estimated on replies the trained model samples (temperature 1) to `--kl-prompts` held-out prompts.

Summarized (`summarize`): per arm and graded step the strict grade, mean over seeds with a 95% bootstrap
interval (seeds and questions resampled, questions paired), and the content grades; each arm's strict
gain within 20 minutes of training; and, at equal training time (the steps' own seconds, the largest
budget every arm reaches), each arm's last graded point within it and the difference GRPO - each RFT arm.

Run (the machine alone; 12-14 min per arm and seed at the defaults on a 2-core CPU):
  make real-model
  .venv/bin/python benchmarks/verifier_only.py --seeds 0,1,2 --out benchmarks/results/verifier_only.json
More arms or seeds into the same result: --add --arms rft --seeds 2.
Twenty minutes of training (100 steps; ~25 min per arm and seed):
  .venv/bin/python benchmarks/verifier_only.py --arms grpo,rft_075 --seeds 0 --steps 100 --val-period 25 \
      --log-root results/verifier_only_20min --out benchmarks/results/verifier_only_20min.json
Smoke run (minutes): --seeds 0 --steps 2 --val-period 1 --val 8 --math-val 8 --kl-prompts 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
from async_curves import run_stamped
from curve_stats import accuracy, bootstrap, mean_curve
from time_to_accuracy import new_log_dir, posttrain_bin, training_seconds
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.data.constraint_lists import constrained_list_rows  # noqa: E402
from posttrain.environments.constraint_lists import all_constraints_met_on_topic, on_topic_share  # noqa: E402

# arm -> (config, its own overrides). rft keeps the replies meeting all four constraints; from the
# released model none do at first (benchmarks/prescreen_lists.py), so rft_075 keeps three of four too.
ARMS = {
    "grpo": ("configs/grpo_lists_smollm2.yaml", []),
    "rft": ("configs/rft_lists_smollm2.yaml", []),
    "rft_075": ("configs/rft_lists_smollm2.yaml", ["grpo.rejection_sampling_min_reward=0.75"]),
}


def graded_samples(samples_file: Path) -> dict:
    """Per question (ordered by prompt): the strict grade, the on-topic share, strict and on topic."""
    rows = sorted((json.loads(x) for x in samples_file.read_text().splitlines()), key=lambda r: r["prompt"])
    return {
        "grades": [r["strict_grade"] for r in rows],
        "on_topic_share": [on_topic_share(r) for r in rows],
        "strict_on_topic": [all_constraints_met_on_topic(r) for r in rows],
        "replies": [{"prompt": r["prompt"], "reply": r["response"]} for r in rows[:4]],
    }


def math_words_accuracy(model_dir: Path, out_dir: Path, num_val: int) -> float:
    command = [
        posttrain_bin(),
        "eval",
        "--config",
        "configs/eval_smollm2.yaml",
        f"model.model_name={model_dir}",
        f"eval.save_path={out_dir}",
        f"eval.max_samples={num_val}",
        f"data.num_val={num_val}",
    ]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((out_dir / "summary.json").read_text())["strict_accuracy"]


def reply_logprobs(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probs of the tokens after the prompt [T] under `model`."""
    with torch.no_grad():
        logits = model(ids.unsqueeze(0)).logits[0, prompt_len - 1 : -1].float()  # [T, V]
    return torch.log_softmax(logits, dim=-1).gather(1, ids[prompt_len:].unsqueeze(1)).squeeze(1)


def kl_to_start(trained_dir: Path, start_dir: str, num_prompts: int, max_new_tokens: int = 48) -> float:
    """Mean over sampled reply tokens of log pi_trained - log pi_start (k1 estimate of KL(trained||start))."""
    tokenizer = AutoTokenizer.from_pretrained(trained_dir)
    trained = AutoModelForCausalLM.from_pretrained(trained_dir, dtype=torch.float32).eval()
    start = AutoModelForCausalLM.from_pretrained(start_dir, dtype=torch.float32).eval()
    _, val = constrained_list_rows(0, num_prompts, seed=0)
    torch.manual_seed(0)
    total, count = 0.0, 0
    for row in val:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        prompt = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            ids = trained.generate(
                prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens
            )[0]
        if len(ids) == prompt.shape[1]:
            continue
        difference = reply_logprobs(trained, ids, prompt.shape[1]) - reply_logprobs(
            start, ids, prompt.shape[1]
        )
        total, count = total + float(difference.sum()), count + len(difference)
    return total / max(count, 1)


def run_arm(args, arm: str, seed: int, log_dir: Path) -> dict:
    overrides = [
        f"policy.model_name={args.model}",
        f"grpo.seed={seed}",
        f"data.shuffle_seed={1000 + seed}",
        f"grpo.max_num_steps={args.steps}",
        f"grpo.val_period={args.val_period}",
        f"grpo.max_val_samples={args.val}",
        f"data.num_val={args.val}",
        f"logger.log_dir={log_dir}",
        "checkpointing.enabled=false",
        "grpo.health.kl_to_start_period=0",  # no reference forwards in either arm's time (KL: measured below)
        *ARMS[arm][1],
        *args.override,
    ]
    command = [posttrain_bin(), "grpo", "--config", ARMS[arm][0], *overrides]
    records, _ = run_stamped(command, log_dir / "metrics.jsonl", log_dir / "console.log")
    seconds = training_seconds(records)
    steps = sorted({r["step"] for r in records if "val/strict_accuracy" in r})
    points = [
        {
            "step": s,
            "train_s": round(seconds[s], 1),
            **graded_samples(log_dir / "val_samples" / f"step_{s}.jsonl"),
        }
        for s in steps
    ]
    exported = log_dir / "hf_model"
    forgetting = {
        "math_words_strict_accuracy": math_words_accuracy(
            exported, log_dir / "math_words_eval", args.math_val
        ),
        "kl_to_start_per_token": round(kl_to_start(exported, args.model, args.kl_prompts), 5),
    }
    train = [r for r in records if "train/reward_mean" in r]
    return {
        "overrides": overrides,
        "points": points,
        "forgetting": forgetting,
        "reward_mean": [round(r["train/reward_mean"], 3) for r in train],
        "accepted_share": [
            round(r.get("train/rejection_sampling/accepted_share", float("nan")), 3) for r in train
        ],
    }


def mean_grade(arm_curves: list[list[dict]], key: str, index: int) -> float:
    """The mean over an arm's seeds of grade `key` (a list per question) at its point `index`."""
    return round(sum(accuracy(c[index][key]) for c in arm_curves) / len(arm_curves), 4)


def equal_time(curves: dict[str, list[list[dict]]]) -> dict:
    """Each arm's last graded point within the largest budget every arm reaches, and GRPO - RFT there."""
    means = {arm: mean_curve(c) for arm, c in curves.items()}
    budget = min(m[-1]["train_s"] for m in means.values())
    index = {arm: max(i for i, p in enumerate(m) if p["train_s"] <= budget) for arm, m in means.items()}
    result: dict = {"budget_train_s": budget}
    for arm in curves:
        result[arm] = {
            "step": means[arm][index[arm]]["step"],
            "train_s": means[arm][index[arm]]["train_s"],
            "strict": bootstrap(curves, lambda v, a=arm: v(a, index[a])),
            "on_topic_share": mean_grade(curves[arm], "on_topic_share", index[arm]),
            "strict_on_topic": mean_grade(curves[arm], "strict_on_topic", index[arm]),
        }
    for rft in (arm for arm in curves if arm.startswith("rft") and "grpo" in curves):
        result[f"strict_difference_grpo_minus_{rft}"] = bootstrap(
            curves, lambda v, r=rft: v("grpo", index["grpo"]) - v(r, index[r])
        )
    return result


def summarize(result: dict, budget_s: float = 1200.0) -> dict:
    """Per arm and graded step: the strict grade (mean over seeds, 95% bootstrap) and the means of the
    on-topic share and of strict-and-on-topic; each arm's strict gain from its start to its last point
    within `budget_s` training seconds, with the on-topic share there over the start's; the forgetting
    (means over seeds); and the equal-time comparison."""
    curves = {arm: [run["points"] for run in runs] for arm, runs in result["runs"].items()}
    summary: dict = {"by_step": {}, "gain_within_budget": {}, "forgetting": {}, "budget_train_s": budget_s}
    for arm, arm_curves in curves.items():
        means = mean_curve(arm_curves)
        summary["by_step"][arm] = [
            {
                "step": m["step"],
                "train_s": m["train_s"],
                "strict": bootstrap({arm: arm_curves}, lambda v, i=i, a=arm: v(a, i)),
                "on_topic_share": mean_grade(arm_curves, "on_topic_share", i),
                "strict_on_topic": mean_grade(arm_curves, "strict_on_topic", i),
            }
            for i, m in enumerate(means)
        ]
        last = max(i for i, m in enumerate(means) if m["train_s"] <= budget_s)
        start_topic, end_topic = (mean_grade(arm_curves, "on_topic_share", i) for i in (0, last))
        summary["gain_within_budget"][arm] = {
            "step": means[last]["step"],
            "train_s": means[last]["train_s"],
            "strict_gain": bootstrap({arm: arm_curves}, lambda v, a=arm, j=last: v(a, j) - v(a, 0)),
            "on_topic_share_over_start": round(end_topic / start_topic, 3) if start_topic else None,
        }
        runs = result["runs"][arm]
        summary["forgetting"][arm] = {
            key: round(sum(r["forgetting"][key] for r in runs) / len(runs), 5)
            for key in ("math_words_strict_accuracy", "kl_to_start_per_token")
        }
    summary["equal_time"] = equal_time(curves)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--arms", default="grpo,rft,rft_075")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--val-period", type=int, default=10)
    parser.add_argument("--val", type=int, default=200, help="held-out prompts")
    parser.add_argument("--math-val", type=int, default=400, help="math_words questions for forgetting")
    parser.add_argument("--kl-prompts", type=int, default=64)
    parser.add_argument("--override", action="append", default=[], help="another posttrain override")
    parser.add_argument("--log-root", default=str(ROOT / "results" / "verifier_only"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "verifier_only.json"))
    parser.add_argument("--add", action="store_true", help="add the runs to the result already in --out")
    args = parser.parse_args()
    if args.add and Path(args.out).exists():  # more arms or seeds into an earlier result
        result = json.loads(Path(args.out).read_text())
    else:
        result = start_result(args)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in args.arms.split(","):
            log_dir = new_log_dir(args.log_root, arm, seed)
            result["runs"].setdefault(arm, []).append(run_arm(args, arm, seed, log_dir))
            result["summary"] = summarize(result)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")  # after every run: nothing lost
    print(json.dumps(result["summary"]["equal_time"], indent=1))
    print(f"wrote {args.out}")
    return 0


def start_result(args: argparse.Namespace) -> dict:
    """The result's header: date, machine, model, and the start's math_words accuracy."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "model": str(args.model),
        "held_out_prompts": args.val,
        "start_math_words_strict_accuracy": math_words_accuracy(
            Path(args.model), Path(args.log_root) / "start_math_words", args.math_val
        ),
        "runs": {},
    }


if __name__ == "__main__":
    sys.exit(main())
