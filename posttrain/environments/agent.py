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
    timeout_s: float | None  # None: `fn` keeps its own time (a command's starts with its process)

    @classmethod
    def load(cls, task: str, cfg: Any) -> AgentTask:
        if cfg.agent_command is not None:
            return cls(task, command_agent(list(cfg.agent_command), cfg.agent_timeout_s), None)
        fn = import_attribute(cfg.agent, kind="agent")
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"env.{task}.agent: {cfg.agent} must be an async function (client, row) -> float")
        return cls(task, fn, cfg.agent_timeout_s)

    def shutdown(self) -> None:
        """Nothing runs between rollouts."""


def command_agent(argv: list[str], timeout_s: float) -> Callable[..., Any]:
    """The agent function of a command: each episode runs `argv` with OPENAI_BASE_URL (the episode's
    endpoint) and OPENAI_API_KEY set, writes the row as JSON to its stdin and reads the reward from the last
    line it prints. At most twice the machine's CPU count of processes run at once (the others wait their
    turn; `timeout_s` counts from a process's start, and a process past it is killed). A non-zero exit, a
    timeout or a last line that is not a number raises: the episode fails, with the end of its stderr."""
    limit: list[Any] = [None, None]  # the event loop of this batch of episodes and its semaphore

    async def run(client: Any, row: dict[str, Any]) -> float:
        if limit[0] is not asyncio.get_running_loop():
            limit[:] = [asyncio.get_running_loop(), asyncio.Semaphore(2 * (os.cpu_count() or 1))]
        env = {**os.environ, "OPENAI_BASE_URL": str(client.base_url), "OPENAI_API_KEY": client.api_key}
        pipe = asyncio.subprocess.PIPE
        async with limit[1]:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=pipe, stdout=pipe, stderr=pipe, env=env
            )
            try:
                row_json = json.dumps(row, default=str).encode()
                out, err = await asyncio.wait_for(process.communicate(row_json), timeout_s)
            except asyncio.TimeoutError:
                raise RuntimeError(f"{argv[0]} took longer than {timeout_s:g} s") from None
            finally:
                if process.returncode is None:  # timed out, or the rollout is stopping
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
