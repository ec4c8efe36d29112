"""A built-in visual task generated with PIL from a seed: "How many red squares are in the picture?" over a
32x32 image with 1-4 red squares and 0-2 blue ones (distractors), none overlapping; the answer is the digit."""

from __future__ import annotations

import random

IMAGE_SIZE, SQUARE_SIZE = 32, 6
MAX_RED, MAX_BLUE = 4, 2
RED, BLUE, BACKGROUND = (220, 30, 30), (30, 60, 220), (245, 245, 245)
QUESTION = "How many red squares? Answer with one digit."


def _free_spot(rng: random.Random, taken: list[tuple[int, int]]) -> tuple[int, int]:
    """A top-left corner whose square keeps one pixel clear of every square already drawn."""
    while True:
        x, y = rng.randrange(0, IMAGE_SIZE - SQUARE_SIZE + 1), rng.randrange(0, IMAGE_SIZE - SQUARE_SIZE + 1)
        if all(abs(x - a) > SQUARE_SIZE or abs(y - b) > SQUARE_SIZE for a, b in taken):
            return x, y


def red_squares_image(num_red: int, num_blue: int, rng: random.Random):
    """An RGB PIL image with `num_red` red and `num_blue` blue squares at random non-overlapping places."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw, taken = ImageDraw.Draw(image), []
    for color in [RED] * num_red + [BLUE] * num_blue:
        x, y = _free_spot(rng, taken)
        taken.append((x, y))
        draw.rectangle([x, y, x + SQUARE_SIZE - 1, y + SQUARE_SIZE - 1], fill=color)
    return image


def red_squares_row(seed: int) -> dict:
    """One row of the task, fully determined by `seed`: prompt, image, response/answer, task name."""
    rng = random.Random(seed)
    num_red, num_blue = rng.randint(1, MAX_RED), rng.randint(0, MAX_BLUE)
    answer = str(num_red)
    return {"prompt": QUESTION, "images": [red_squares_image(num_red, num_blue, rng)], "response": answer,
            "answer": answer, "task_name": "red_squares"}


def red_squares_rows(num_train: int, num_val: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Training rows from one seed stream and validation rows from another (images differ)."""
    train = [red_squares_row(seed * 1_000_003 + i) for i in range(num_train)]
    val = [red_squares_row(seed * 1_000_003 + 500_000 + i) for i in range(num_val)]
    return train, val
