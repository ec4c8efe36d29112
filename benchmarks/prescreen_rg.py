"""Pre-screen of reasoning-gym tasks on a model, before any RL: which tasks give GRPO signal toward full
marks?

For each task, `--prompts` training rows built as `data.dataset: reasoning_gym:<task>` builds them (the
recipe's prompt template and options), each answered greedily once and sampled `--samples` times
(temperature 1, no top-k/top-p cut), every reply scored as the run scores it (`ReasoningGymEnvironment`:
the task's own `score_answer`, full marks 1.0). Reported per task: the sampled full-mark rate and mean
score, the share of groups whose scores differ (GRPO learns from those) and of groups with at least one
full mark and one miss (the signal toward full marks), the greedy full-mark rate, and a few replies.

  .venv/bin/python benchmarks/prescreen_rg.py --tasks leg_counting,basic_arithmetic \
      --out benchmarks/reference/prescreen_rg_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from prescreen_lists import generate  # noqa: E402
from step_report import machine_description  # noqa: E402

from posttrain.data.reasoning_gym import reasoning_gym_rows  # noqa: E402
from posttrain.environments.reasoning_gym import ReasoningGymEnvironment  # noqa: E402


def screen(model, tokenizer, task: str, args: argparse.Namespace) -> dict:
    options = json.loads(args.options).get(task, {})
    rows, _ = reasoning_gym_rows(f"reasoning_gym:{task}", options, args.prompts, 0, seed=0)
    prompts = [args.template.format(prompt=row["prompt"]) for row in rows]
    env = ReasoningGymEnvironment()
    scored = lambda row, reply: env.score(env.extract(reply), row)  # noqa: E731
    settings = (args.max_new_tokens, args.system, json.loads(args.few_shot))
    greedy = generate(model, tokenizer, prompts, True, 1, *settings)
    sampled = generate(model, tokenizer, prompts, False, args.samples, *settings)
    greedy_scores = [scored(row, reply) for row, reply in zip(rows, greedy)]
    scores = [scored(rows[i // args.samples], reply) for i, reply in enumerate(sampled)]
    groups = [scores[i : i + args.samples] for i in range(0, len(scores), args.samples)]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {
        "options": options,
        "sampled_full_marks": mean([float(s == 1.0) for s in scores]),
        "sampled_score_mean": mean(scores),
        "groups_with_score_spread": mean([float(len(set(g)) > 1) for g in groups]),
        "groups_with_full_marks_and_a_miss": mean([float(max(g) == 1.0 and min(g) < 1.0) for g in groups]),
        "greedy_full_marks": mean([float(s == 1.0) for s in greedy_scores]),
        "replies": [
            {
                "prompt": prompts[i],
                "answer": rows[i]["answer"],
                "greedy": greedy[i],
                "score": greedy_scores[i],
            }
            for i in range(min(4, len(rows)))
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--tasks", required=True, help="comma list of reasoning-gym tasks")
    parser.add_argument(
        "--options", default="{}", help='JSON: task -> data.options, e.g. {"chain_sum": {...}}'
    )
    parser.add_argument("--template", default="{prompt}", help="data.prompt_template")
    parser.add_argument("--system", default=None, help="data.system_prompt")
    parser.add_argument("--few-shot", default="[]", help="data.few_shot as JSON: messages before each prompt")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="sampled replies per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prescreen_rg.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    keys = ("model", "template", "system", "few_shot", "prompts", "samples", "max_new_tokens")
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds")}
    result["machine"] = machine_description("cpu")
    result.update({key: getattr(args, key) for key in keys}, tasks={})
    for task in args.tasks.split(","):
        start = time.perf_counter()
        result["tasks"][task] = screen(model, tokenizer, task, args)
        result["tasks"][task]["seconds"] = round(time.perf_counter() - start, 1)
        print(
            task,
            {k: round(v, 3) for k, v in result["tasks"][task].items() if isinstance(v, float)},
            flush=True,
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")  # after each task
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
