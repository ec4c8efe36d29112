"""Environment classes by name and a public `register_environment` (the Ray actors that run them are
in `posttrain.environments.pool`).

In YAML, `env.<task_name>.cls` is a registered name (`math`, `exact_match`, `sliding_puzzle`, `code`,
`reward_model`, `remote`, `judge`, `tools`), or a user's class as `path/to/file.py:ClassName` or
`package.module:ClassName`.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.data.tool_calls import ToolPrompt
from posttrain.environments.code_sandbox import CodeToolEnvironment
from posttrain.environments.exact_match import ExactMatchEnvironment
from posttrain.environments.interface import EnvironmentInterface
from posttrain.environments.math_env import MathEnvironment
from posttrain.environments.sliding_puzzle import SlidingPuzzleEnvironment

_REGISTRY: dict[str, type[EnvironmentInterface] | str] = {
    "math": MathEnvironment,
    "exact_match": ExactMatchEnvironment,
    "sliding_puzzle": SlidingPuzzleEnvironment,
    "code": CodeToolEnvironment,
    "reward_model": "posttrain.environments.reward_model:RewardModelEnvironment",
    "remote": "posttrain.environments.remote:RemoteEnvironment",
    "judge": "posttrain.environments.judge:JudgeEnvironment",
    "tools": "posttrain.environments.tool_env:ToolEnvironment",
}


@dataclass
class EnvironmentConfig:
    """One task's environment."""

    cls: str = field(
        default="exact_match", metadata={"help": "registered name, or file.py:Class / module:Class"}
    )
    kwargs: dict[str, Any] = field(default_factory=dict, metadata={"help": "keyword arguments of the class"})
    num_workers: int = field(default=1, metadata={"help": "Ray actors sharing this environment's samples"})
    num_cpus: float = field(default=0.1, metadata={"help": "logical CPUs reserved per environment actor"})


def register_environment(name: str, cls: type[EnvironmentInterface]) -> None:
    """Make `cls` available as `env.<task>.cls: <name>` in configs."""
    if not (isinstance(cls, type) and issubclass(cls, EnvironmentInterface)):
        raise TypeError(f"register_environment({name!r}): {cls!r} is not an EnvironmentInterface subclass")
    _REGISTRY[name] = cls


def import_attribute(spec: str, kind: str = "environment") -> Any:
    """The attribute named by `path/to/file.py:name` or `package.module:name` (`kind` names it in errors)."""
    location, _, attribute = spec.rpartition(":")
    if location.endswith(".py"):
        path = Path(location).resolve()
        if not path.exists():
            raise FileNotFoundError(f"{kind} file {path} (from {spec!r}) does not exist")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(location)
    if not hasattr(module, attribute):
        raise AttributeError(f"{kind} {spec!r}: {location} has no attribute {attribute!r}")
    return getattr(module, attribute)


def resolve_environment_class(spec: str) -> type[EnvironmentInterface]:
    """The class for a registered name or an import spec; errors list the registered names."""
    target = _REGISTRY.get(spec, spec)
    if isinstance(target, type):
        return target
    if ":" not in target:
        raise KeyError(
            f"unknown environment {spec!r}; registered: {sorted(_REGISTRY)} (or use file.py:Class)"
        )
    cls = import_attribute(target)
    if not (isinstance(cls, type) and issubclass(cls, EnvironmentInterface)):
        raise TypeError(f"environment {spec!r} is not an EnvironmentInterface subclass")
    return cls


def tool_prompts(env_cfgs: dict[str, EnvironmentConfig]) -> dict[str, ToolPrompt]:
    """The tools each task's environment declares in its prompts (tasks without tools are left out); a
    bad tool configuration is an error naming `env.<task>.kwargs`."""
    prompts = {}
    for task, cfg in env_cfgs.items():
        try:
            prompt = resolve_environment_class(cfg.cls).tool_prompt(cfg.kwargs)
        except Exception as error:
            raise ValueError(f"env.{task}.kwargs: {error}") from error
        if prompt is not None:
            prompts[task] = prompt
    return prompts
