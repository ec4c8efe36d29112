"""Environment classes by name (`env.<task>.cls`: a registered name, `path/to/file.py:Class` or
`module:Class`) and the checks that every task has its environment. The driver resolves a task's class and
reward function and hands them to the actors (`pool`) by value, so what a script registers reaches them."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Any

from posttrain.config import ConfigError
from posttrain.data.config import DataConfig
from posttrain.data.sources import DataError
from posttrain.data.tool_calls import ToolPrompt
from posttrain.environments.interface import EnvironmentInterface
from posttrain.environments.reward_function import RewardFunctionEnvironment, resolve_reward
from posttrain.environments.single_turn import ExactMatchEnvironment, MathEnvironment
from posttrain.environments.sliding_puzzle import SlidingPuzzleEnvironment
from posttrain.utils.imports import import_attribute, pickle_by_value

_REGISTRY: dict[str, type[EnvironmentInterface] | str] = {
    "math": MathEnvironment,
    "exact_match": ExactMatchEnvironment,
    "sliding_puzzle": SlidingPuzzleEnvironment,
    "code": "posttrain.environments.tool_env:CodeToolEnvironment",
    "reward_model": "posttrain.environments.reward_model:RewardModelEnvironment",
    "remote": "posttrain.environments.remote:RemoteEnvironment",
    "judge": "posttrain.environments.judge:JudgeEnvironment",
    "tools": "posttrain.environments.tool_env:ToolEnvironment",
    "reward_function": RewardFunctionEnvironment,
    "reasoning_gym": "posttrain.environments.reasoning_gym:ReasoningGymEnvironment",
    "agent": "posttrain.environments.agent:AgentEnvironment",
    "openenv": "posttrain.environments.openenv:OpenEnvEnvironment",
}


@dataclass
class EnvironmentConfig:
    """One task's environment."""

    cls: str = "exact_match"
    """registered name, or file.py:Class / module:Class (reward_function with reward)"""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """keyword arguments of the class"""
    num_workers: int = 1
    """Ray actors sharing this environment's samples; 0 runs it in the driver (a cheap scorer needs no
    process, but then a crash or a hang of the environment is the run's)"""
    num_cpus: float = 0.1
    """logical CPUs reserved per environment actor"""
    reward: str | None = None
    """a reward function fn(reply, **columns) -> float as file.py:fn, module:fn or a register_reward name
    (replaces cls)"""
    reward_batched: bool = False
    """call reward once per batch: fn(replies, **columns) -> list"""
    agent: str | None = None
    """an agent that brings its own loop, file.py:fn or module:fn: `async def fn(client, row) -> float`, with
    an openai.AsyncOpenAI client on the policy scoped to the episode (replaces cls; see docs/serve.md)"""
    agent_command: list[str] | None = None
    """an agent in any language, as a command: run once per episode with OPENAI_BASE_URL (the episode's
    endpoint) and OPENAI_API_KEY in its environment and the row as JSON on stdin; its last line of output is
    the reward (replaces cls)"""
    verifiers: str | None = None
    """a verifiers 0.4.0 environment, its taskset id or path/to/taskset.py: each episode is its own rollout
    and scoring against the policy (replaces cls; kwargs: the verifiers env config; see
    docs/bring-your-environment.md)"""
    agent_timeout_s: float = 120.0
    """seconds an agent's episode may take; a slower one fails (left out of the loss, counted)"""
    openenv: str | None = None
    """URL of an OpenEnv environment server, one episode per sample (replaces cls; kwargs: action_key,
    observation_key, reset_columns, max_sessions)"""

    def validate(self) -> None:
        if self.num_workers < 0:
            raise ConfigError("num_workers", f"must be >= 0 (0: in the driver), got {self.num_workers}")
        if self.openenv is not None and (self.reward or self.is_agent or self.cls != "exact_match"):
            raise ConfigError(
                "openenv", "an OpenEnv server is its own environment: remove reward, agent, cls"
            )
        if self.reward is not None and self.cls not in ("exact_match", "reward_function"):
            raise ConfigError(
                "reward",
                f"reward and cls={self.cls!r} are both set: a reward function is its own environment; "
                "remove one of them",
            )
        if self.reward is None and self.cls == "reward_function":
            raise ConfigError("reward", "cls reward_function needs reward: path/to/rewards.py:fn")
        if self.reward_batched and self.reward is None:
            raise ConfigError("reward_batched", "is an option of reward: set reward too")
        if self.agent is not None and self.agent_command is not None:
            raise ConfigError("agent_command", "an agent is a function (agent) or a command: set one of them")
        if self.agent_command == []:
            raise ConfigError("agent_command", "is empty: give the command and its arguments as a list")
        if self.verifiers is not None and (self.agent is not None or self.agent_command is not None):
            raise ConfigError(
                "verifiers", "a verifiers environment is its own agent: remove agent_command, agent"
            )
        if self.is_agent and (self.reward is not None or self.cls != "exact_match"):
            raise ConfigError("agent", "an agent computes its own reward: remove reward and cls")

    @property
    def is_agent(self) -> bool:
        """An agent runs this task's episodes (`agent`, `agent_command` or a `verifiers` environment)."""
        return self.agent is not None or self.agent_command is not None or self.verifiers is not None

    @property
    def environment(self) -> str:
        """The environment's registered name or import spec (or `reward_function`, `agent`, `openenv`)."""
        if self.is_agent:
            return "agent"
        if self.openenv is not None:
            return "openenv"
        return "reward_function" if self.reward is not None else self.cls


def register_environment(name: str, cls: type[EnvironmentInterface]) -> None:
    """Make `cls` available as `env.<task>.cls: <name>` in configs; the class itself travels to the
    environment actors, so it needs no import path there."""
    if not (isinstance(cls, type) and issubclass(cls, EnvironmentInterface)):
        raise TypeError(f"register_environment({name!r}): {cls!r} is not an EnvironmentInterface subclass")
    _REGISTRY[name] = cls
    pickle_by_value(cls)


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


def resolve_environment(cfg: EnvironmentConfig) -> tuple[type[EnvironmentInterface], dict[str, Any]]:
    """The class and keyword arguments of one task's environment, resolved on the driver: a reward
    function is looked up here and passed as an object, so actors need no registry of their own."""
    cls = resolve_environment_class(cfg.environment)
    if cfg.openenv is not None:
        return cls, {"url": cfg.openenv, **cfg.kwargs}
    if cfg.reward is None:
        return cls, dict(cfg.kwargs)
    return cls, {"reward": resolve_reward(cfg.reward), "batched": cfg.reward_batched, **cfg.kwargs}


def tool_prompts(env_cfgs: dict[str, EnvironmentConfig]) -> dict[str, ToolPrompt]:
    """The tools each task's environment declares in its prompts (tasks without tools are left out); a
    bad tool configuration is an error naming `env.<task>.kwargs`."""
    prompts = {}
    for task, cfg in env_cfgs.items():
        try:
            prompt = resolve_environment_class(cfg.environment).tool_prompt(cfg.kwargs)
        except Exception as error:
            raise ValueError(f"env.{task}.kwargs: {error}") from error
        if prompt is not None:
            prompts[task] = prompt
    return prompts


def default_task_name(data_cfg: DataConfig, env_cfgs: dict[str, EnvironmentConfig]) -> None:
    """Rows without a task column go to `data.task_name`; unset, it becomes the one task of `env` (so the
    defaults agree). Run when a config is built (`__post_init__`), before its checks."""
    if data_cfg.task_name is None and len(env_cfgs) == 1:
        data_cfg.task_name = next(iter(env_cfgs))


def match_task_to_environments(data_cfg: DataConfig, env_cfgs: dict[str, EnvironmentConfig]) -> None:
    """A `data.task_name` without an environment is a config error naming both keys."""
    if data_cfg.task_name is not None and data_cfg.task_name not in env_cfgs:
        task = data_cfg.task_name
        raise ConfigError(
            "data.task_name",
            f"{task!r} has no environment: env configures {sorted(env_cfgs)}; set data.task_name to one of "
            f"them, or add env.{task} (e.g. env.{task}.reward=path/to/rewards.py:fn)",
        )


def check_record_tasks(
    records: list[dict], env_cfgs: dict[str, EnvironmentConfig], data_cfg: DataConfig
) -> None:
    """Every record's task must have an environment, and every column its environment requires
    (`required_columns`: the answer, for those that grade against it); the error names the data, the row
    and the keys to change."""
    tasks = {record["task_name"] for record in records}
    if None in tasks:
        raise ConfigError(
            "data.task_name",
            f"rows of {data_cfg.dataset} have no {data_cfg.task_key!r} column and env configures several "
            f"tasks {sorted(env_cfgs)}: set data.task_name to the one these rows belong to",
        )
    missing = sorted(tasks - set(env_cfgs))
    if missing:
        raise ConfigError(
            "env",
            f"rows of {data_cfg.dataset} name task(s) {missing} (column {data_cfg.task_key!r}) but env "
            f"configures {sorted(env_cfgs)}: add " + ", ".join(f"env.{task}" for task in missing),
        )
    for task in sorted(tasks):
        cls, kwargs = resolve_environment(env_cfgs[task])
        required = sorted(cls.required_columns(kwargs))
        for record in (r for r in records if r["task_name"] == task and required):
            missing = [key for key in required if record["extra_env_info"].get(key) is None]
            if missing:
                where = record.get("where", f"{data_cfg.dataset} row {record.get('idx')}")
                column = repr(missing[0])
                if missing[0] == "ground_truth":
                    column = f"{data_cfg.answer_key!r} (data.answer_key)"
                raise DataError(
                    f"{where}: no {column}, which env.{task} "
                    f"({env_cfgs[task].environment}) needs: give every row of task {task!r} one, or use a "
                    "reward that does not read it"
                )


def environment_file_problems(env_cfgs: dict[str, EnvironmentConfig]) -> list[ConfigError]:
    """One error per task whose reward function or environment class cannot be loaded (a missing file, a
    missing attribute, an unknown name), naming `env.<task>.reward` or `env.<task>.cls`, or whose agent
    command is not found."""
    problems = []
    for task, cfg in env_cfgs.items():
        if cfg.agent_command and shutil.which(cfg.agent_command[0]) is None:
            problems.append(ConfigError(f"env.{task}.agent_command", f"{cfg.agent_command[0]} is not found"))
        key = f"env.{task}.reward" if cfg.reward is not None else f"env.{task}.cls"
        try:
            resolve_environment(cfg)
        except (ImportError, OSError, AttributeError, KeyError, TypeError, SyntaxError) as error:
            problems.append(ConfigError(key, error.args[0] if isinstance(error, KeyError) else str(error)))
    return problems
