"""Tool-use demonstrations for the SFT warm-up of the calculator recipe (docs/tools.md): one conversation
per training question of a GRPO tools config, with the system prompt that config's `tools` environment
renders, a calculator call, the tool's result and the answer, written as `messages` rows.

    .venv/bin/python benchmarks/tool_demos.py configs/grpo_tools_smollm2.yaml results/tool_demos.jsonl 400
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from posttrain.algorithms.grpo import GRPOConfig
from posttrain.config import load_typed_config
from posttrain.data.tasks import builtin_rows
from posttrain.data.tool_calls import add_tool_prompt
from posttrain.environments import tool_prompts
from posttrain.environments.tools import calculator
from posttrain.models.tokenizer import build_char_tokenizer


def demonstration(row: dict, system: list[dict]) -> dict:
    words = row["prompt"].split()  # What is A times B? Reply with the number only.
    expression = f"{words[2]} * {words[4].rstrip('?')}"
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    result = calculator(expression)
    return {
        "messages": system
        + [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result},
        ]
    }


def main(config: str, out: str, num_rows: int) -> None:
    cfg = load_typed_config(GRPOConfig, config, [])
    (task,) = [t for t, env in cfg.env.items() if env.cls == "tools"]
    # The tools go into the system message for a template without tools= support (SmolLM2's); the
    # character tokenizer's template has none either, so it gives the same messages.
    system, _ = add_tool_prompt([], tool_prompts(cfg.env)[task], build_char_tokenizer())
    train, _ = builtin_rows(
        cfg.data.dataset, cfg.data.num_train, cfg.data.num_val, cfg.data.seed, cfg.data.num_digits
    )
    rows = [demonstration(row, system) for row in train[:num_rows]]  # never a validation question
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} demonstrations -> {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
