"""A number-guessing environment written with openenv-core's server API, served over HTTP/WebSocket.

    python examples/openenv/guess_server.py --port 8000

An episode's secret is its reset seed modulo 10. Each guess (the action's `message`) earns reward 1 and
ends the episode when right; a wrong one is answered `higher` or `lower`, and the third wrong one ends it.
"""

from __future__ import annotations

import argparse
import re

from openenv.core.env_server import Action, Environment, Observation, create_fastapi_app
from openenv.core.env_server.types import State

MAX_GUESSES = 3


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    hint: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.secret, self.guesses = 0, 0
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        self.secret, self.guesses = (seed or 0) % 10, 0
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(hint="guess a number from 0 to 9")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs) -> GuessObservation:
        self.guesses += 1
        self._state.step_count = self.guesses
        numbers = re.findall(r"\d+", action.message)
        guess = int(numbers[-1]) if numbers else -1
        if guess == self.secret:
            return GuessObservation(hint="right", reward=1.0, done=True)
        hint = "higher" if guess < self.secret else "lower"
        return GuessObservation(hint=hint, reward=0.0, done=self.guesses >= MAX_GUESSES)

    @property
    def state(self) -> State:
        return self._state


def create_app(max_sessions: int = 8):
    """The FastAPI app serving `GuessEnvironment`, at most `max_sessions` episodes at once."""
    return create_fastapi_app(
        GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=max_sessions
    )


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-sessions", type=int, default=8)
    args = parser.parse_args()
    uvicorn.run(create_app(args.max_sessions), host="127.0.0.1", port=args.port)
