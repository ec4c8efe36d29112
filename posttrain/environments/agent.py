"""Agents that bring their own loop (`env.<task>.agent: file.py:fn`, or a program: `agent_command`): the
task's configuration on the driver (`AgentTask`) and the registered name `agent` (`AgentEnvironment`),
which never steps: an agent task's episodes run through `experience/agent_rollouts.py`."""

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
            return cls(task, command_agent([str(arg) for arg in cfg.agent_command]), cfg.agent_timeout_s)
        fn = import_attribute(cfg.agent, kind="agent")
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"env.{task}.agent: {cfg.agent} must be an async function (client, row) -> float")
        return cls(task, fn, cfg.agent_timeout_s)

    def shutdown(self) -> None:
        """Nothing runs between rollouts."""


def command_agent(argv: list[str]) -> Callable[..., Any]:
    """An agent function that runs the program `argv` for one episode: the row as JSON on its stdin, the
    episode's endpoint as OPENAI_BASE_URL and OPENAI_API_KEY in its environment; its reward is the last line
    it prints. A non-zero exit or a last line that is not a number raises (the episode fails, with the end
    of the program's stderr); a cancelled episode (its timeout) kills the program."""

    async def run_command(client: Any, row: dict[str, Any]) -> float:
        endpoint = {"OPENAI_BASE_URL": str(client.base_url).rstrip("/"), "OPENAI_API_KEY": client.api_key}
        pipe = asyncio.subprocess.PIPE
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=pipe, stdout=pipe, stderr=pipe, env={**os.environ, **endpoint}
        )
        try:
            stdout, stderr = await process.communicate(json.dumps(row, default=str).encode())
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        lines = stdout.decode(errors="replace").strip().splitlines()
        tail = stderr.decode(errors="replace")[-2000:]
        if process.returncode != 0:
            raise RuntimeError(f"{argv} exited with {process.returncode}; its stderr ends:\n{tail}")
        try:
            return float(lines[-1])
        except (IndexError, ValueError):
            last = lines[-1] if lines else ""
            raise ValueError(f"{argv} printed {last!r} last, not a reward; stderr ends:\n{tail}") from None

    return run_command


class AgentEnvironment(EnvironmentInterface):
    """The registered name of agent tasks; their rollouts do not call `step`."""

    def step(self, message_logs: list, metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        raise RuntimeError("an agent task rolls out through its agent (experience/agent_rollouts.py)")
