"""The sliding-tile puzzle's board rules, shared by the built-in task (boards and prompts) and the
environment that plays it. Board cells hold 1..N*N-1 and 0 for the blank; solved means
`1 2 3 / 4 5 6 / 7 8 0`. A move names the direction the blank moves (up, down, left, right)."""

from __future__ import annotations

import random

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}

Board = list[list[int]]


def solved_board(size: int) -> Board:
    values = list(range(1, size * size)) + [0]
    return [values[r * size : (r + 1) * size] for r in range(size)]


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
