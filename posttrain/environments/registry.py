"""Environment classes by name, a public `register_environment`, and Ray actor pools that run them.

In YAML, `env.<task_name>.cls` is a registered name (`math`, `exact_match`, `sliding_puzzle`, `code`,
`reward_model`), or a user's class as `path/to/file.py:ClassName` or `package.module:ClassName`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.environments.code_sandbox import CodeToolEnvironment
from posttrain.environments.exact_match import ExactMatchEnvironment
from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn
from posttrain.environments.math_env import MathEnvironment
from posttrain.environments.sliding_puzzle import SlidingPuzzleEnvironment

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, type[EnvironmentInterface] | str] = {
    "math": MathEnvironment,
    "exact_match": ExactMatchEnvironment,
    "sliding_puzzle": SlidingPuzzleEnvironment,
    "code": CodeToolEnvironment,
    "reward_model": "posttrain.environments.reward_model:RewardModelEnvironment",
}


@dataclass
class EnvironmentConfig:
    """One task's environment."""

    cls: str = field(default="exact_match", metadata={"help": "registered name, or file.py:Class / module:Class"})
    kwargs: dict[str, Any] = field(default_factory=dict, metadata={"help": "keyword arguments of the class"})
    num_workers: int = field(default=1, metadata={"help": "Ray actors sharing this environment's samples"})
    num_cpus: float = field(default=0.1, metadata={"help": "logical CPUs reserved per environment actor"})


def register_environment(name: str, cls: type[EnvironmentInterface]) -> None:
    """Make `cls` available as `env.<task>.cls: <name>` in configs."""
    if not (isinstance(cls, type) and issubclass(cls, EnvironmentInterface)):
        raise TypeError(f"register_environment({name!r}): {cls!r} is not an EnvironmentInterface subclass")
    _REGISTRY[name] = cls


def _import_attribute(spec: str) -> Any:
    location, _, attribute = spec.rpartition(":")
    if location.endswith(".py"):
        path = Path(location).resolve()
        if not path.exists():
            raise FileNotFoundError(f"environment file {path} (from {spec!r}) does not exist")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(location)
    if not hasattr(module, attribute):
        raise AttributeError(f"environment {spec!r}: {location} has no attribute {attribute!r}")
    return getattr(module, attribute)


def resolve_environment_class(spec: str) -> type[EnvironmentInterface]:
    """The class for a registered name or an import spec; errors list the registered names."""
    target = _REGISTRY.get(spec, spec)
    if isinstance(target, type):
        return target
    if ":" not in target:
        raise KeyError(f"unknown environment {spec!r}; registered: {sorted(_REGISTRY)} (or use file.py:Class)")
    cls = _import_attribute(target)
    if not (isinstance(cls, type) and issubclass(cls, EnvironmentInterface)):
        raise TypeError(f"environment {spec!r} is not an EnvironmentInterface subclass")
    return cls


class _EnvironmentActor:
    """Hosts one environment instance inside a Ray actor."""

    def __init__(self, spec: str, kwargs: dict[str, Any]):
        self.environment = resolve_environment_class(spec)(**kwargs)

    def ready(self) -> bool:
        return True

    def step(self, message_logs, metadata) -> EnvironmentReturn:
        return self.environment.step(message_logs, metadata)

    def global_post_process_and_metrics(self, batch):
        return self.environment.global_post_process_and_metrics(batch)


class EnvironmentPool:
    """`num_workers` Ray actors of one environment; `step` splits the samples across them in order.
    An actor that dies mid-step (its process killed) scores its samples 0, counts them as errors and is
    replaced by a new actor; `num_restarts` counts the replacements."""

    def __init__(self, task_name: str, cfg: EnvironmentConfig):
        import ray

        resolve_environment_class(cfg.cls)  # fail on the driver, before any actor starts
        self.task_name, self.cfg, self.num_restarts = task_name, cfg, 0
        self._actor_cls = ray.remote(num_cpus=cfg.num_cpus)(_EnvironmentActor)
        self.actors = [self._start_actor(i) for i in range(cfg.num_workers)]
        try:  # a constructor that raises (e.g. no sandbox for `code`) stops the run here, not later
            ray.get([actor.ready.remote() for actor in self.actors])
        except ray.exceptions.RayActorError as error:
            self.shutdown()
            raise RuntimeError(f"env.{task_name}: environment {cfg.cls!r} failed to start: {error}") from error

    def _start_actor(self, index: int):
        name = f"env-{self.task_name}-{index}-{self.num_restarts}-{id(self):x}"
        return self._actor_cls.options(name=name).remote(self.cfg.cls, self.cfg.kwargs)

    def _restart(self, index: int) -> None:
        import ray

        ray.kill(self.actors[index])
        self.num_restarts += 1
        self.actors[index] = self._start_actor(index)

    def step(self, message_logs, metadata) -> EnvironmentReturn:
        """Score one turn; a chunk whose environment raised scores 0, terminates, and is counted."""
        import ray

        chunk = -(-len(message_logs) // len(self.actors)) if message_logs else 1
        chunks = [(message_logs[i:i + chunk], metadata[i:i + chunk]) for i in range(0, len(message_logs), chunk)]
        refs = [actor.step.remote(logs, meta) for actor, (logs, meta) in zip(self.actors, chunks)]
        parts = []
        for index, (ref, (logs, meta)) in enumerate(zip(refs, chunks)):
            try:
                parts.append(ray.get(ref))
            except ray.exceptions.RayTaskError as error:
                logger.warning("environment %r raised on %d samples: %s", self.task_name, len(logs), error)
                parts.append(failed_return(meta))
            except ray.exceptions.RayActorError as error:  # the actor's process died (ActorDiedError, ...)
                logger.warning("environment %r actor %d died on %d samples; restarting it: %s",
                               self.task_name, index, len(logs), error)
                parts.append(failed_return(meta))
                self._restart(index)
        return merge_returns(parts)

    def global_post_process_and_metrics(self, batch):
        import ray

        return ray.get(self.actors[0].global_post_process_and_metrics.remote(batch))

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)


def failed_return(metadata: list[dict[str, Any]]) -> EnvironmentReturn:
    """The answer for samples whose environment raised: reward 0, terminated, each counted as an error."""
    batch_size = len(metadata)
    return EnvironmentReturn(
        observations=[{"role": "environment", "content": ""} for _ in range(batch_size)],
        metadata=metadata,
        next_stop_strings=[None] * batch_size,
        rewards=torch.zeros(batch_size),
        terminateds=torch.ones(batch_size, dtype=torch.bool),
        answers=[None] * batch_size,
        num_errors=batch_size,
    )


def merge_returns(parts: list[EnvironmentReturn]) -> EnvironmentReturn:
    """Concatenate per-actor returns in order."""
    return EnvironmentReturn(
        observations=[o for p in parts for o in p.observations],
        metadata=[m for p in parts for m in p.metadata],
        next_stop_strings=[s for p in parts for s in p.next_stop_strings],
        rewards=torch.cat([p.rewards for p in parts]) if parts else torch.zeros(0),
        terminateds=torch.cat([p.terminateds for p in parts]) if parts else torch.zeros(0, dtype=torch.bool),
        answers=[a for p in parts for a in p.answers],
        num_errors=sum(p.num_errors for p in parts),
    )


def create_environments(env_cfgs: dict[str, EnvironmentConfig]) -> dict[str, EnvironmentPool]:
    """One pool per task name."""
    return {task: EnvironmentPool(task, cfg) for task, cfg in env_cfgs.items()}
