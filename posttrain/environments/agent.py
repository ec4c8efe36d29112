"""Agents that bring their own loop (`env.<task>.agent: file.py:fn`, or `env.<task>.agent_command: [...]`
for an agent in any language): the task's configuration on the driver (`AgentTask`) and the registered
name `agent` (`AgentEnvironment`), which never steps: an agent task's episodes run through
`experience/agent_rollouts.py`."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn
from posttrain.utils.imports import import_attribute


@dataclass
class AgentTask:
    """A task whose episodes an agent runs: `fn(client, row)` (async) returns the reward."""

    task: str
    fn: Callable[..., Any]
    timeout_s: float

    @classmethod
    def load(cls, task: str, cfg: Any) -> AgentTask:
        if cfg.agent_command is not None:
            return cls(task, command_agent(list(cfg.agent_command)), cfg.agent_timeout_s)
        fn = import_attribute(cfg.agent, kind="agent")
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"env.{task}.agent: {cfg.agent} must be an async function (client, row) -> float")
        return cls(task, fn, cfg.agent_timeout_s)

    def shutdown(self) -> None:
        """Nothing runs between rollouts."""


def command_agent(argv: list[str]) -> Callable[..., Any]:
    """The agent function of a command: each episode runs `argv` with OPENAI_BASE_URL (the episode's
    endpoint) and OPENAI_API_KEY set, writes the row as JSON to its stdin and reads the reward from the last
    line it prints. A non-zero exit or a last line that is not a number raises (the episode fails, with the
    end of its stderr); a timed-out episode's process is killed."""

    async def run(client: Any, row: dict[str, Any]) -> float:
        env = {**os.environ, "OPENAI_BASE_URL": str(client.base_url), "OPENAI_API_KEY": client.api_key}
        pipe = asyncio.subprocess.PIPE
        process = await asyncio.create_subprocess_exec(*argv, stdin=pipe, stdout=pipe, stderr=pipe, env=env)
        try:
            out, err = await process.communicate(json.dumps(row, default=str).encode())
        finally:
            if process.returncode is None:  # cancelled: the episode timed out
                process.kill()
                await process.wait()
        if process.returncode != 0:
            tail = err.decode(errors="replace")[-2000:]
            raise RuntimeError(f"{argv[0]} exited with status {process.returncode}: {tail}")
        last = (out.decode(errors="replace").strip().splitlines() or [""])[-1]
        try:
            return float(last)
        except ValueError:
            raise RuntimeError(f"{argv[0]} printed {last!r} as its last line, not a reward") from None

    return run


class AgentEnvironment(EnvironmentInterface):
    """The registered name of agent tasks; their rollouts do not call `step`."""

    def step(self, message_logs: list, metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        raise RuntimeError("an agent task rolls out through its agent (experience/agent_rollouts.py)")
