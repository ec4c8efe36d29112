"""A built-in visual task generated with PIL from a seed: "How many red squares?" over a 16x16 picture, a 4x4
grid of 4-pixel cells of which 1-4 are red and 0-3 blue (distractors), the rest background; the answer is
the digit. Small on purpose: the tiny model's 4-pixel patches see one cell each, so SFT and GRPO both
train in minutes on a CPU."""

from __future__ import annotations

import random

GRID, CELL = 4, 4
IMAGE_SIZE = GRID * CELL
MAX_RED, MAX_BLUE = 4, 3
RED, BLUE, BACKGROUND = (220, 30, 30), (30, 60, 220), (245, 245, 245)
QUESTION = "How many red squares?"


def red_squares_image(num_red: int, num_blue: int, rng: random.Random):
    """An RGB PIL image with `num_red` red and `num_blue` blue cells at distinct random places of the grid."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    cells = rng.sample(range(GRID * GRID), num_red + num_blue)
    for cell, color in zip(cells, [RED] * num_red + [BLUE] * num_blue):
        x, y = (cell % GRID) * CELL, (cell // GRID) * CELL
        draw.rectangle([x, y, x + CELL - 1, y + CELL - 1], fill=color)
    return image


def red_squares_row(seed: int) -> dict:
    """One row of the task, fully determined by `seed`: prompt, image, response/answer, task name."""
    rng = random.Random(seed)
    num_red, num_blue = rng.randint(1, MAX_RED), rng.randint(0, MAX_BLUE)
    answer = str(num_red)
    return {
        "prompt": QUESTION,
        "images": [red_squares_image(num_red, num_blue, rng)],
        "response": answer,
        "answer": answer,
        "task_name": "red_squares",
    }


def red_squares_rows(num_train: int, num_val: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Training rows from one seed stream and validation rows from another (pictures may repeat: there are
    only so many grids, which is fine for a counting task)."""
    train = [red_squares_row(seed * 1_000_003 + i) for i in range(num_train)]
    val = [red_squares_row(seed * 1_000_003 + 500_000 + i) for i in range(num_val)]
    return train, val
