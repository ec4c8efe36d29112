"""Pre-screen of the built-in `constrained_lists` task on a model, before any RL: is there signal to learn?

From the model as it is (Hugging Face `generate`, fp32 on the CPU), `--prompts` training prompts and as many
held-out ones, each answered greedily once and sampled `--samples` times (temperature 1, no top-k/top-p
cut, the GRPO recipe's sampling): the sampled pass@1 (all four constraints met), the share of groups
whose partial rewards (the share of constraints met) differ (the groups GRPO learns from), the greedy
strict grade and the on-topic share (items in the topic's word list, which the reward never reads).
A task is worth RL when the sampled pass@1 is between 5% and 50% or most groups have a spread.

  .venv/bin/python benchmarks/prescreen_lists.py --model models/smollm2-135m-instruct \
      --out benchmarks/reference/prescreen_lists_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.data.constraint_lists import constrained_list_rows  # noqa: E402
from posttrain.environments.constraint_lists import (  # noqa: E402
    all_constraints_met,
    constraint_share,
    on_topic_share,
)


def generate(
    model,
    tokenizer,
    prompts: list[str],
    greedy: bool,
    num: int,
    max_new_tokens: int,
    system=None,
    few_shot=(),
):
    """`num` replies to each prompt (contiguous), decoded without special tokens; `system`: a system
    message before each prompt, then the `few_shot` messages (`data.few_shot`)."""
    head = ([{"role": "system", "content": system}] if system else []) + list(few_shot)
    texts = [
        tokenizer.apply_chat_template(
            [*head, {"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=not greedy,
            temperature=1.0 if not greedy else None,
            top_k=0 if not greedy else None,
            top_p=1.0 if not greedy else None,
            num_return_sequences=num,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def screen(model, tokenizer, rows: list[dict], samples: int, max_new_tokens: int) -> dict:
    prompts = [r["prompt"] for r in rows]
    greedy = generate(model, tokenizer, prompts, True, 1, max_new_tokens)
    sampled = generate(model, tokenizer, prompts, False, samples, max_new_tokens)

    def grade(row: dict, reply: str) -> dict:
        sample = {"prompt": row["prompt"], "response": reply}
        columns = {k: row[k] for k in ("n", "case", "separator", "rule", "rule_value")}
        return {
            "reward": constraint_share(reply, **columns),
            "strict": all_constraints_met(sample),
            "on_topic": on_topic_share(sample),
        }

    greedy_grades = [grade(r, reply) for r, reply in zip(rows, greedy)]
    sampled_grades = [grade(rows[i // samples], reply) for i, reply in enumerate(sampled)]
    groups = [sampled_grades[i : i + samples] for i in range(0, len(sampled_grades), samples)]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {
        "sampled_pass@1": mean([g["strict"] for g in sampled_grades]),
        "sampled_reward_mean": mean([g["reward"] for g in sampled_grades]),
        "groups_with_reward_spread": mean([float(len({g["reward"] for g in group}) > 1) for group in groups]),
        "greedy_strict": mean([g["strict"] for g in greedy_grades]),
        "greedy_reward_mean": mean([g["reward"] for g in greedy_grades]),
        "greedy_on_topic_share": mean([g["on_topic"] for g in greedy_grades]),
        "greedy_replies": [
            {"prompt": r["prompt"], "reply": reply, **g}
            for r, reply, g in list(zip(rows, greedy, greedy_grades))[:6]
        ],
        "sampled_replies": [
            {"prompt": rows[i // samples]["prompt"], "reply": sampled[i], **sampled_grades[i]}
            for i in range(0, min(len(sampled), 6 * samples), samples)
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--prompts", type=int, default=64, help="training prompts, and as many held-out")
    parser.add_argument("--samples", type=int, default=4, help="sampled replies per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the recipe's reply budget")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "reference" / "prescreen_lists_smollm2_cpu.json")
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    train, val = constrained_list_rows(args.prompts, args.prompts, seed=0)  # the recipe's data.seed
    start = time.perf_counter()
    result = {
        "model": args.model,
        "prompts_per_split": args.prompts,
        "samples_per_prompt": args.samples,
        "train": screen(model, tokenizer, train, args.samples, args.max_new_tokens),
        "held_out": screen(model, tokenizer, val, args.samples, args.max_new_tokens),
    }
    result["seconds"] = round(time.perf_counter() - start, 1)
    for split in ("train", "held_out"):
        print(split, {k: round(v, 3) for k, v in result[split].items() if isinstance(v, float)})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
