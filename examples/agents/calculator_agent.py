"""A two-turn agent in plain `openai`-client code: it offers the model a calculator through a tool-call-like
reply (`CALC: 51 - 29`), runs the expression, feeds the result back and asks for the final answer; the
reward is 1 when the final reply's last number is the row's answer (the agent's own arithmetic, which the
model cannot change). A reply without a CALC line is asked for the number straight away.

posttrain trains it with `env.<task>.agent: examples/agents/calculator_agent.py:solve`
(configs/grpo_agent_smollm2.yaml). To try it by hand against a served model:

    .venv/bin/posttrain serve --model models/smollm2-135m-instruct --port 8000 &
    .venv/bin/python examples/agents/calculator_agent.py --base-url http://127.0.0.1:8000/v1
"""

import argparse
import ast
import asyncio
import operator
import re

SYSTEM = "You have a calculator. To use it, reply with one line: CALC: <expression>."
# One worked exchange before the question: a 135M model imitates it far more often than it follows the
# system prompt alone.
EXAMPLE = [
    {"role": "user", "content": "What is 12 plus 34?"},
    {"role": "assistant", "content": "CALC: 12 + 34"},
    {"role": "user", "content": "The calculator says: 46. Reply with the number only."},
    {"role": "assistant", "content": "46"},
]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
CALL = re.compile(r"CALC:\s*([-+*() 0-9]+)")


def calculate(expression: str) -> str:
    """The value of `+ - *` over integers, or an error message the model reads."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"cannot calculate {expression.strip()!r}")

    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (ValueError, SyntaxError) as error:
        return f"error: {error}"


def last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+", text or "")
    return numbers[-1] if numbers else None


async def solve(client, row) -> float:
    """One episode: the question, maybe one calculator call, the final answer; 1.0 when it is right."""
    question = row["prompt"].replace(" Reply with the number only.", "")  # the calculator may be used
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": question}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
    text = first.choices[0].message.content or ""
    call = CALL.search(text)
    follow_up = "Reply with the number only."
    if call:
        follow_up = f"The calculator says: {calculate(call.group(1))}. {follow_up}"
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]
    final = await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
    return float(last_number(final.choices[0].message.content) == str(row["ground_truth"]))


if __name__ == "__main__":
    import openai

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--question", default="What is 51 minus 29? Reply with the number only.")
    parser.add_argument("--answer", default="22")
    args = parser.parse_args()
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="none")
    row = {"prompt": args.question, "ground_truth": args.answer}
    print("reward:", asyncio.run(solve(client, row)))
