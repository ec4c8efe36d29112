"""Ray actor pools running environments, one per task; actors check rewards (`reward_check.step_isolated`)."""

from __future__ import annotations

import logging
from typing import Any

from posttrain.environments.interface import EnvironmentReturn
from posttrain.environments.registry import EnvironmentConfig, resolve_environment
from posttrain.environments.reward_check import failed_return, merge_returns, step_isolated

logger = logging.getLogger(__name__)


class _EnvironmentActor:
    """Hosts one environment instance inside a Ray actor; the class (and a reward function among the
    keyword arguments) arrive resolved from the driver."""

    def __init__(self, cls: type, kwargs: dict[str, Any], source: str = ""):
        self.environment = cls(**kwargs)
        self.source = source or f"environment {cls.__name__!r}"  # names the culprit of a bad reward

    def ready(self) -> bool:
        return True

    def step(self, message_logs, metadata) -> EnvironmentReturn:
        return step_isolated(self.environment, message_logs, metadata, self.source)


class EnvironmentPool:
    """`num_workers` Ray actors of one environment (with none, it runs in the driver); `step` splits the
    samples across them in order, and replaces a dead actor (`_collect`); `num_restarts` counts the
    replacements."""

    def __init__(self, task_name: str, cfg: EnvironmentConfig):
        import ray

        # resolved on the driver: fails before any actor starts, and what the driver registered travels
        self.environment_cls, self.kwargs = resolve_environment(cfg)
        self.task_name, self.cfg, self.num_restarts, self.ray = task_name, cfg, 0, ray
        self.source = f"environment {cfg.environment!r} of task {task_name!r}"
        local = cfg.num_workers == 0  # in the driver: no process to start, and no isolation from a crash
        self.local = _EnvironmentActor(self.environment_cls, self.kwargs, self.source) if local else None
        self._actor_cls = ray.remote(num_cpus=cfg.num_cpus)(_EnvironmentActor)
        self.actors = [self._start_actor(i) for i in range(cfg.num_workers)]
        try:  # a constructor that raises (e.g. no sandbox for `code`) stops the run here, not later
            ray.get([actor.ready.remote() for actor in self.actors])
        except ray.exceptions.RayActorError as error:
            self.shutdown()
            raise RuntimeError(
                f"env.{task_name}: environment {cfg.environment!r} failed to start: {error}"
            ) from error

    def _start_actor(self, index: int):
        name = f"env-{self.task_name}-{index}-{self.num_restarts}-{id(self):x}"
        return self._actor_cls.options(name=name).remote(self.environment_cls, self.kwargs, self.source)

    def _restart(self, index: int) -> None:
        self.ray.kill(self.actors[index])
        self.num_restarts += 1
        self.actors[index] = self._start_actor(index)

    def step(self, message_logs, metadata) -> EnvironmentReturn:
        """Score one turn; a chunk whose environment raised scores 0, terminates, and is counted."""
        if self.local is not None:
            return self.local.step(message_logs, metadata)
        chunk = -(-len(message_logs) // len(self.actors)) if message_logs else 1
        chunks = [
            (message_logs[i : i + chunk], metadata[i : i + chunk]) for i in range(0, len(message_logs), chunk)
        ]
        refs = [actor.step.remote(logs, meta) for actor, (logs, meta) in zip(self.actors, chunks)]
        parts = [
            self._collect(index, ref, logs, meta)
            for index, (ref, (logs, meta)) in enumerate(zip(refs, chunks))
        ]
        return merge_returns(parts)

    def _collect(self, index: int, ref: Any, logs: list, meta: list[dict[str, Any]]) -> EnvironmentReturn:
        """Actor `index`'s answer for its chunk: a raised error scores 0; a dead actor is replaced and the
        chunk is scored again on the new one, and scores 0 if that one dies too (replaced again)."""
        for attempt in (1, 2):
            try:
                return self.ray.get(ref)
            except self.ray.exceptions.RayTaskError as error:
                logger.warning("environment %r raised on %d samples: %s", self.task_name, len(logs), error)
                return failed_return(meta)
            except self.ray.exceptions.RayActorError as error:  # the process died (ActorDiedError, ...)
                then = "scoring them again on a new actor" if attempt == 1 else "scoring them 0"
                what = "environment %r actor %d died on %d samples; %s: %s"
                logger.warning(what, self.task_name, index, len(logs), then, error)
                self._restart(index)
                ref = self.actors[index].step.remote(logs, meta) if attempt == 1 else None
        return failed_return(meta)

    def shutdown(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)


def create_environments(env_cfgs: dict[str, EnvironmentConfig]) -> dict[str, Any]:
    """One pool per task name; an agent task (an agent, an agent command, a verifiers environment) gets its
    `AgentTask`, which runs in the driver."""
    from posttrain.environments.agent import AgentTask

    return {
        task: AgentTask.load(task, cfg) if cfg.is_agent else EnvironmentPool(task, cfg)
        for task, cfg in env_cfgs.items()
    }
