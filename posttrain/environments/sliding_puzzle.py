"""Multi-turn sliding-tile puzzle (board rules in `posttrain.data.sliding_puzzle`): the model moves the
blank with `<action>up</action>`; a valid move returns the new board, an invalid one an error observation;
solving gives reward 1 and ends the episode; `max_moves` turns end it with reward 0."""

from __future__ import annotations

import re
from typing import Any

from posttrain.data.sliding_puzzle import apply_move, render_board, solved_board
from posttrain.environments.interface import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    Turn,
    last_assistant_text,
)

ACTION_PATTERN = re.compile(r"<action>\s*(\w+)\s*</action>")
STOP_STRINGS = ["</action>"]


class SlidingPuzzleEnvironment(EnvironmentInterface):
    """Per-sample metadata: `board` (current), `num_moves` (so far); `max_moves` bounds the episode."""

    def __init__(self, max_moves: int = 10):
        self.max_moves = max_moves

    def _step_one(self, message_log: list[Message], meta: dict[str, Any]) -> Turn:
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
        stops = None if done else list(STOP_STRINGS)
        return Turn({"role": "environment", "content": text}, new_meta, float(solved), done, direction, stops)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        turns = [self._step_one(log, meta) for log, meta in zip(message_logs, metadata)]
        return EnvironmentReturn.from_turns(turns)
