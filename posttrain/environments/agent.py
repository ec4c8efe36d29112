"""Agents that bring their own loop (`env.<task>.agent: file.py:fn`): the task's configuration on the driver
(`AgentTask`) and the registered name `agent` (`AgentEnvironment`), which never steps: an agent task's
episodes run through `experience/agent_rollouts.py`."""

from __future__ import annotations

import inspect
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
        fn = import_attribute(cfg.agent, kind="agent")
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"env.{task}.agent: {cfg.agent} must be an async function (client, row) -> float")
        return cls(task, fn, cfg.agent_timeout_s)

    def shutdown(self) -> None:
        """Nothing runs between rollouts."""


class AgentEnvironment(EnvironmentInterface):
    """The registered name of agent tasks; their rollouts do not call `step`."""

    def step(self, message_logs: list, metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        raise RuntimeError("an agent task rolls out through its agent (experience/agent_rollouts.py)")
