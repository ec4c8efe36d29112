"""An OpenEnv environment server as the environment (`env.<task>.openenv: http://host:port`), reached with
openenv-core's own client (a WebSocket session per episode on the server's `/ws`).

Each sample is one episode: its first reply opens a session and resets it (with the row's `reset_columns`
as reset arguments, e.g. `seed`), then every reply is one step, sent as the action `{action_key: reply}`.
The step's reward is the turn's reward and its `done` ends the episode; an episode not done goes on with
the observation (its `observation_key` field, or the whole observation as JSON) as the next message, while
`grpo.max_rollout_turns` allows. At most `max_sessions` episodes start at once (an OpenEnv server serves one
session unless started with more); an episode that goes on past its first turn keeps its session open, so
multi-turn episodes need a server serving as many sessions as a batch has samples. A step that fails
(server gone, action refused) scores 0, ends the episode and counts as an environment error."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

from posttrain.environments.answers import strip_end_markers
from posttrain.environments.interface import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    Turn,
    last_assistant_text,
)

logger = logging.getLogger(__name__)
SESSION_KEY = "openenv_session"


class OpenEnvEnvironment(EnvironmentInterface):
    """Episodes on an OpenEnv server at `url` (see the module docstring)."""

    def __init__(
        self,
        url: str,
        action_key: str = "message",
        observation_key: str | None = None,
        reset_columns: tuple[str, ...] | list[str] = (),
        max_sessions: int = 1,
        timeout_seconds: float = 60.0,
    ) -> None:
        self.url, self.action_key, self.observation_key = url, action_key, observation_key
        self.reset_columns, self.max_sessions = tuple(reset_columns), max_sessions
        self.timeout_seconds = timeout_seconds
        self.loop = asyncio.new_event_loop()  # clients stay bound to one loop across turns
        self.sessions: dict[str, Any] = {}

    @classmethod
    def required_columns(cls, kwargs: dict[str, Any]) -> set[str]:
        return set(kwargs.get("reset_columns", ()))

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        replies = [strip_end_markers(last_assistant_text(log)) for log in message_logs]
        return EnvironmentReturn.from_turns(self.loop.run_until_complete(self._turns(replies, metadata)))

    async def _turns(self, replies: list[str], metadata: list[dict[str, Any]]) -> list[Turn]:
        if not any(meta.get(SESSION_KEY) in self.sessions for meta in metadata):
            await self._close_all()  # a new batch: what is left open belongs to episodes cut off by turns
        limit = asyncio.Semaphore(self.max_sessions)
        return list(await asyncio.gather(*(self._turn(r, m, limit) for r, m in zip(replies, metadata))))

    async def _turn(self, reply: str, meta: dict[str, Any], limit: asyncio.Semaphore) -> Turn:
        session = meta.get(SESSION_KEY)
        try:
            if session in self.sessions:
                result = await self._step(session, reply)
            else:
                async with limit:  # a new episode: opened, reset and stepped while holding a place
                    session = uuid.uuid4().hex
                    self.sessions[session] = await self._open(meta)
                    result = await self._step(session, reply)
        except Exception as error:  # the server's failure scores 0 and ends the episode
            logger.warning("OpenEnv server %s failed on sample %s: %r", self.url, meta.get("idx"), error)
            await self._close(session)
            return Turn(_message(""), meta, terminated=True, answer=reply, error=repr(error))
        reward = float(result.reward or 0.0)
        if result.done:
            await self._close(session)
            return Turn(_message(""), meta, reward=reward, terminated=True, answer=reply)
        text = self._text(result.observation)
        return Turn(_message(text), {**meta, SESSION_KEY: session}, reward, answer=reply)

    async def _step(self, session: str, reply: str) -> Any:
        return await asyncio.wait_for(
            self.sessions[session].step({self.action_key: reply}), self.timeout_seconds
        )

    async def _open(self, meta: dict[str, Any]) -> Any:
        from openenv.core.generic_client import GenericEnvClient

        client = GenericEnvClient(base_url=self.url, message_timeout_s=self.timeout_seconds)
        await client.connect()
        await client.reset(**{column: meta[column] for column in self.reset_columns})
        return client

    def _text(self, observation: dict[str, Any]) -> str:
        if self.observation_key is None:
            return json.dumps(observation)
        return str(observation.get(self.observation_key, ""))

    async def _close(self, session: str | None) -> None:
        client = self.sessions.pop(session, None)
        if client is not None:
            await client.close()

    async def _close_all(self) -> None:
        for client in self.sessions.values():
            await client.close()
        self.sessions.clear()


def _message(text: str) -> Message:
    return {"role": "environment", "content": text}
