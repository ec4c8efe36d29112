"""Multi-turn sliding-tile puzzle: the model moves the blank with `<action>up</action>` until solved.

Board cells hold 1..N*N-1 and 0 for the blank; solved means `1 2 3 / 4 5 6 / 7 8 0`. An action names
the direction the blank moves (up, down, left, right). A valid move returns the new board; an invalid
one returns an error observation; solving gives reward 1 and ends the episode; `max_moves` turns end it
with reward 0.
"""

from __future__ import annotations

import random
import re
from typing import Any

import torch

from posttrain.environments.interface import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    last_assistant_text,
)

ACTION_PATTERN = re.compile(r"<action>\s*(\w+)\s*</action>")
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
STOP_STRINGS = ["</action>"]

Board = list[list[int]]


def solved_board(size: int) -> Board:
    values = list(range(1, size * size)) + [0]
    return [values[r * size:(r + 1) * size] for r in range(size)]


def render_board(board: Board) -> str:
    return "\n".join(" ".join(str(v) if v else "_" for v in row) for row in board)


def apply_move(board: Board, direction: str) -> Board | None:
    """The board after moving the blank in `direction`, or None if the move leaves the board."""
    if direction not in MOVES:
        return None
    size = len(board)
    row, col = next((r, c) for r in range(size) for c in range(size) if board[r][c] == 0)
    d_row, d_col = MOVES[direction]
    new_row, new_col = row + d_row, col + d_col
    if not (0 <= new_row < size and 0 <= new_col < size):
        return None
    new_board = [list(r) for r in board]
    new_board[row][col], new_board[new_row][new_col] = new_board[new_row][new_col], 0
    return new_board


def scrambled_board(size: int, num_moves: int, seed: int) -> Board:
    """A solvable board: `num_moves` random valid moves away from solved (by construction)."""
    rng = random.Random(seed)
    board = solved_board(size)
    for _ in range(num_moves):
        board = next(b for d in rng.sample(list(MOVES), 4) if (b := apply_move(board, d)) is not None)
    return board


def puzzle_prompt(board: Board) -> str:
    return (
        "Slide the blank (_) to reach the solved board. Answer with one move per turn as "
        f"<action>up|down|left|right</action>.\n{render_board(board)}\n"
    )


class SlidingPuzzleEnvironment(EnvironmentInterface):
    """Per-sample metadata: `board` (current), `num_moves` (so far); `max_moves` bounds the episode."""

    def __init__(self, max_moves: int = 10):
        self.max_moves = max_moves

    def _step_one(self, message_log: list[Message], meta: dict[str, Any]) -> tuple[str, dict, float, bool, str | None]:
        match = ACTION_PATTERN.search(last_assistant_text(message_log))
        direction = match.group(1).lower() if match else None
        num_moves = meta.get("num_moves", 0) + 1
        new_board = apply_move(meta["board"], direction) if direction else None
        if new_board is None:
            text = f"Invalid move {direction!r}; use <action>up|down|left|right</action> within the board."
            new_meta = {**meta, "num_moves": num_moves}
        else:
            text = render_board(new_board) + "\n"
            new_meta = {**meta, "board": new_board, "num_moves": num_moves}
        solved = new_board is not None and new_board == solved_board(len(new_board))
        done = solved or num_moves >= self.max_moves
        return text, new_meta, float(solved), done, direction

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        results = [self._step_one(log, meta) for log, meta in zip(message_logs, metadata)]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": r[0]} for r in results],
            metadata=[r[1] for r in results],
            next_stop_strings=[None if r[3] else list(STOP_STRINGS) for r in results],
            rewards=torch.tensor([r[2] for r in results], dtype=torch.float32),
            terminateds=torch.tensor([r[3] for r in results], dtype=torch.bool),
            answers=[r[4] for r in results],
        )
