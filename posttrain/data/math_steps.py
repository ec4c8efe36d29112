"""The built-in `math_steps` task: `a * b + c` asked for step-by-step working that ends in `\\boxed{}`.

`What is 47 * 13 + 512? Work it out step by step, one step per line, then give the final answer as
\\boxed{N}.` -> `1123`, with a and c drawn from [12, 99] and [100, 999], b from [3, 19]. The `response`
(what SFT trains on) is a worked solution in one of three styles, drawn per question, so that solutions
are uneven in length (31 to 141 tokens, 79 on average, in SmolLM2's tokenizer):
- terse: the product and the sum, one line each (`47 * 13 = 611`, `611 + 512 = 1123`, `\\boxed{1123}`);
- split: the product split over the tens and ones of the two-digit factor (`b` when it has two digits,
  else `a`), then the sum;
- long: each partial product on its own line, then the sum split at c's hundreds.
The terse style asks for a two-digit product in one go, which a small model gets wrong more often than
the split ones: reinforcement learning on this task can raise accuracy by choosing the longer styles.
Rewards (`task_name` `math`) grade only the final answer."""

from __future__ import annotations

import random

QUESTION = (
    "What is {a} * {b} + {c}? Work it out step by step, one step per line, then give the final answer as "
    "\\boxed{{N}}."
)


def question_text(a: int, b: int, c: int) -> str:
    """The prompt of one question (the long-reply GRPO benchmark asks the same)."""
    return QUESTION.format(a=a, b=b, c=c)


def split_product(a: int, b: int) -> tuple[int, int, int, int]:
    """(tens part, ones part, factor kept, tens part x kept) of the factor split for a product: b's tens and
    ones when b has two digits, else a's."""
    split, kept = (b, a) if b >= 10 else (a, b)
    return split - split % 10, split % 10, kept, (split - split % 10) * kept


def worked_solution(a: int, b: int, c: int, style: int) -> str:
    """The worked solution of `a * b + c` in style 0 (terse), 1 (split) or 2 (long)."""
    product, result = a * b, a * b + c
    tens, ones, kept, tens_product = split_product(a, b)
    if style == 0:
        return f"{a} * {b} = {product}\n{product} + {c} = {result}\n\\boxed{{{result}}}"
    if style == 1:
        return (
            f"Step 1: {a} * {b} = {tens} * {kept} + {ones} * {kept} = {tens_product} + {ones * kept} = "
            f"{product}\nStep 2: {product} + {c} = {result}\nThe final answer is \\boxed{{{result}}}."
        )
    hundreds = c - c % 100
    return (
        f"First, the product {a} * {b}.\n"
        f"{tens} * {kept} = {tens_product}\n"
        f"{ones} * {kept} = {ones * kept}\n"
        f"{tens_product} + {ones * kept} = {product}\n"
        f"So {a} * {b} = {product}.\n"
        f"Next, add {c}.\n"
        f"{product} + {hundreds} = {product + hundreds}\n"
        f"{product + hundreds} + {c % 100} = {result}\n"
        f"So {a} * {b} + {c} = {result}.\n"
        f"The final answer is \\boxed{{{result}}}."
    )


def math_steps_rows(num_train: int, num_val: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train rows, validation rows): disjoint questions, validation drawn first, each with its worked
    solution (`response`, style drawn per question) and its answer."""
    rng, seen = random.Random(seed), set()

    def draw(count: int) -> list[dict]:
        rows = []
        while len(rows) < count:
            a, b, c = rng.randint(12, 99), rng.randint(3, 19), rng.randint(100, 999)
            style = rng.randrange(3)
            if (a, b, c) in seen:
                continue
            seen.add((a, b, c))
            prompt, response = question_text(a, b, c), worked_solution(a, b, c, style)
            rows.append(
                {"prompt": prompt, "response": response, "answer": str(a * b + c), "task_name": "math"}
            )
        return rows

    val = draw(num_val)
    return draw(num_train), val
