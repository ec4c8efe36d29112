"""Built-in tasks generated from a seed (no download), with disjoint training and validation rows."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from posttrain.data.constraint_lists import constrained_list_rows
from posttrain.data.math_steps import math_steps_rows
from posttrain.data.sliding_puzzle import puzzle_prompt, scrambled_board, solved_board
from posttrain.data.visual_tasks import red_squares_rows

BUILTIN_TASKS = (
    "arithmetic",
    "arithmetic_preference",
    "sliding_puzzle",
    "math_words",
    "math_steps",
    "multiplication",
    "red_squares",
    "constrained_lists",
)


def addition_pairs(num_digits: int, num_train: int, num_val: int, seed: int) -> tuple[list, list]:
    """Disjoint (a, b) operand pairs: validation drawn first, training never repeats a validation pair."""
    limit = 10**num_digits
    if num_train + num_val > limit * limit:
        raise ValueError(
            f"{num_train}+{num_val} pairs requested but only {limit * limit} exist with {num_digits} digits"
        )
    rng = random.Random(seed)
    draw = lambda: (rng.randrange(limit), rng.randrange(limit))  # noqa: E731
    val = set(_draw_distinct(num_val, set(), draw))
    if num_train > limit * limit // 2:  # dense: enumerate what is left and shuffle
        pool = [(a, b) for a in range(limit) for b in range(limit) if (a, b) not in val]
        rng.shuffle(pool)
        train = pool[:num_train]
    else:
        train = _draw_distinct(num_train, set(val), draw)
    return train, sorted(val, key=lambda p: rng.random())


def _draw_distinct(count: int, seen: set, draw: Callable[[], Any]) -> list:
    """`count` values of `draw()` that are not in `seen` (each is added to it), in the order drawn."""
    drawn = []
    while len(drawn) < count:
        value = draw()
        if value not in seen:
            seen.add(value)
            drawn.append(value)
    return drawn


def arithmetic_row(a: int, b: int, num_digits: int) -> dict:
    """Fixed-width, zero-padded addition: `07+85=` -> `092` (all prompts share one length)."""
    answer = f"{a + b:0{num_digits + 1}d}"
    return {
        "prompt": f"{a:0{num_digits}d}+{b:0{num_digits}d}=",
        "response": answer,
        "answer": answer,
        "task_name": "arithmetic",
    }


def wrong_answer(a: int, b: int, num_digits: int, rng: random.Random) -> str:
    """A plausible wrong sum: off by 1..9 (or 10), same width, never negative."""
    offset = rng.choice(
        [d for d in range(-9, 11) if d and a + b + d >= 0 and a + b + d < 10 ** (num_digits + 1)]
    )
    return f"{a + b + offset:0{num_digits + 1}d}"


def word_problems(num_digits: int, num_train: int, num_val: int, seed: int) -> tuple[list, list]:
    """Disjoint (a, op, b) questions with `num_digits`-digit operands (no leading zeros); subtraction never
    goes below zero. Validation is drawn first; training never repeats a validation question."""
    low, high = 10 ** (num_digits - 1) if num_digits > 1 else 0, 10**num_digits - 1
    span = high - low + 1
    available = span * span + span * (span + 1) // 2
    if num_train + num_val > available:
        raise ValueError(
            f"{num_train}+{num_val} questions requested but only {available} exist with {num_digits} digits"
        )
    rng, seen = random.Random(seed), set()

    def question() -> tuple[int, str, int]:
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice("+-")
        return (max(a, b), op, min(a, b)) if op == "-" else (a, op, b)

    val = _draw_distinct(num_val, seen, question)
    return _draw_distinct(num_train, seen, question), val


def word_problem_row(a: int, op: str, b: int) -> dict:
    """A question for a chat model: `What is 51 minus 29? Reply with the number only.` -> `22`."""
    answer = str(a + b if op == "+" else a - b)
    question = f"What is {a} {'plus' if op == '+' else 'minus'} {b}? Reply with the number only."
    return {"prompt": question, "response": answer, "answer": answer, "task_name": "math"}


def multiplication_rows(num_digits: int, num_train: int, num_val: int, seed: int) -> tuple[list, list]:
    """Disjoint products of two `num_digits`-digit numbers asked in words (`What is 347 times 912? Reply
    with the number only.` -> `316464`), validation drawn first; task `math`."""
    low, high = 10 ** (num_digits - 1), 10**num_digits - 1
    if num_train + num_val > (high - low + 1) ** 2:
        raise ValueError(f"{num_train}+{num_val} products requested; {num_digits}-digit operands have fewer")
    rng, seen = random.Random(seed), set()
    draw = lambda: (rng.randint(low, high), rng.randint(low, high))  # noqa: E731
    val, train = _draw_distinct(num_val, seen, draw), _draw_distinct(num_train, seen, draw)
    rows = lambda pairs: [  # noqa: E731
        {
            "prompt": f"What is {a} times {b}? Reply with the number only.",
            "response": str(a * b),
            "answer": str(a * b),
            "task_name": "math",
        }
        for a, b in pairs
    ]
    return rows(train), rows(val)


def builtin_rows(
    name: str,
    num_train: int | None,
    num_val: int | None,
    seed: int,
    num_digits: int = 2,
    puzzle_size: int = 2,
    scramble_moves: int = 2,
) -> tuple[list[dict], list[dict]]:
    """(train rows, validation rows) of a built-in task."""
    if name not in BUILTIN_TASKS:
        raise KeyError(f"unknown built-in task {name!r}; built-in tasks: {BUILTIN_TASKS}")
    num_train = 4096 if num_train is None else num_train
    num_val = 256 if num_val is None else num_val
    if name == "sliding_puzzle":
        make = lambda i: puzzle_row(puzzle_size, scramble_moves, seed * 1_000_003 + i)  # noqa: E731
        return [make(i) for i in range(num_train)], [make(-1 - i) for i in range(num_val)]
    if name == "red_squares":  # images: needs a vision-language model
        return red_squares_rows(num_train, num_val, seed)
    if name == "multiplication":
        return multiplication_rows(num_digits, num_train, num_val, seed)
    if name == "constrained_lists":  # no answers: rewarded by a verifier of the columns
        return constrained_list_rows(num_train, num_val, seed)
    if name == "math_steps":
        return math_steps_rows(num_train, num_val, seed)
    if name == "math_words":
        train, val = word_problems(num_digits, num_train, num_val, seed)
        return [word_problem_row(*q) for q in train], [word_problem_row(*q) for q in val]
    train, val = addition_pairs(num_digits, num_train, num_val, seed)
    rng = random.Random(seed + 1)  # arithmetic_preference's wrong answers

    def row(a: int, b: int) -> dict:
        plain = arithmetic_row(a, b, num_digits)
        if name == "arithmetic":
            return plain
        return {
            "prompt": plain["prompt"],
            "chosen": plain["answer"],
            "rejected": wrong_answer(a, b, num_digits, rng),
        }

    return [row(a, b) for a, b in train], [row(a, b) for a, b in val]


def puzzle_row(size: int, scramble_moves: int, seed: int) -> dict:
    """A scrambled (never already solved) board; the first attempt that is not solved wins."""
    attempt = 0
    while (board := scrambled_board(size, scramble_moves, seed * 31 + attempt)) == solved_board(size):
        attempt += 1
    return {
        "prompt": puzzle_prompt(board),
        "answer": None,
        "task_name": "sliding_puzzle",
        "metadata": {"board": board},
    }
