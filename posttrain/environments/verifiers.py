"""verifiers environments (`env.<task>.verifiers: <taskset id>` or `path/to/taskset.py`, verifiers 0.4.0's
`verifiers.v1`) as agent tasks: each episode is the environment's own rollout (its harness program, its
interception server, its task's `@reward`s) against the episode's endpoint (`environments/agent.py`), so
the trajectory is the endpoint's sampled tokens and a failed episode is counted and left out of the loss.

A data row is a task's wire data, as verifiers' own env server receives it: the row's columns that are
fields of the taskset's `TaskData` type (the prompt; the answer column reaches the `answer` field) are
validated into it and wrapped in its `Task`. The reward is the one trace's reward: the sum of the task's
weighted rewards. `env.<task>.kwargs` is the verifiers env config (`agent.harness`, `agent.runtime`, ...)
over the taskset (`env_config` says what it defaults to here)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOCAL_RUNTIME = {"type": "subprocess"}


def taskset_id(source: str) -> str:
    """The taskset id `source` names: an installed taskset's id as it is, a `.py` file's module name (the
    file imported under it, so that verifiers' loader finds it)."""
    if not source.endswith(".py"):
        return source
    path = Path(source).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no verifiers taskset file {source} (looked at {path})")
    if path.stem not in sys.modules:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    return path.stem


def env_config(source: str, overrides: dict[str, Any]) -> Any:
    """The verifiers env config of `source` with `overrides`. Unless they say otherwise, the agent runs in a
    local subprocess (verifiers' default, a Prime sandbox, needs a Prime account and a tunnel), and with the
    tool-less `null` harness where verifiers would pick `bash`, whose shell would then be this host's."""
    import verifiers.v1 as vf

    taskset = taskset_id(source)
    defaults: dict[str, Any] = {"runtime": LOCAL_RUNTIME}
    if vf.default_harness_id(taskset) == "bash":  # the taskset bundles no harness of its own
        defaults["harness"] = {"id": "null"}
    agent = {**defaults, **overrides.get("agent", {})}
    return vf.resolve_env_config({**overrides, "taskset": {"id": taskset}, "agent": agent})


def task_of(row: dict[str, Any], task_type: type, config: Any) -> Any:
    """The taskset's task for a data row: its `TaskData` from the row's columns that are its fields."""
    data_type = task_type.data_type()
    columns = {"answer": row.get("ground_truth"), **row}
    fields = {k: v for k, v in columns.items() if k in data_type.model_fields and v is not None}
    return task_type(data_type.model_validate(fields), config.taskset.task)


def check_tunnel_login(config: Any) -> None:
    """A remote runtime reaches the model through a Prime tunnel, which needs a Prime login; verifiers
    exits the process without one, mid-episode, so it is checked here, before training."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.runtimes import runtime_is_local
    from verifiers.v1.utils.prime import ensure_prime_auth

    if all(runtime_is_local(agent.runtime) for agent in agent_config_fields(config).values()):
        return
    try:
        ensure_prime_auth()
    except SystemExit as stop:
        raise RuntimeError(f"verifiers: a remote agent runtime needs a Prime tunnel: {stop}") from None


def write_tasks(source: str, path: str) -> int:
    """Write the tasks of the taskset `source` (its `load()`) to the JSONL file `path` as data rows, each a
    task's wire data; returns how many. A task whose prompt is not text (Messages) is a ValueError."""
    import verifiers.v1 as vf

    taskset = vf.load_environment(env_config(source, {})).taskset
    if not taskset.bounded:
        raise ValueError(f"the taskset of {source} is infinite: bound it in its config to write its tasks")
    rows = []
    for task in taskset:
        if not isinstance(task.data.prompt, str):
            raise ValueError(f"task {task.data.idx}: its prompt is Messages; posttrain's rows take text")
        rows.append(task.data.model_dump_json(exclude_defaults=True) + "\n")
    Path(path).write_text("".join(rows))
    return len(rows)


def episode_reward(episode: Any) -> float:
    """The reward of a finished single-agent episode; a RuntimeError with verifiers' record of its errors
    when it failed."""
    if not episode.ok:
        errors = [*episode.errors, *(e for trace in episode.traces for e in trace.errors)]
        details = "\n".join(f"{e.type}: {e.message}\n{e.traceback or ''}".strip() for e in errors)
        raise RuntimeError(f"the verifiers episode failed:\n{details or 'no error recorded'}")
    if len(episode.traces) != 1:
        raise RuntimeError(f"a multi-agent episode ({len(episode.traces)} traces): not supported")
    return float(episode.traces[0].reward)


def verifiers_agent(source: str, overrides: dict[str, Any], timeout_s: float) -> Callable[..., Any]:
    """The agent function (client, row) -> reward that plays one episode of the verifiers environment
    `source`; the environment is loaded here once, so a bad taskset or config fails before training. An
    episode starts a harness process: at most twice the machine's CPU count of episodes run at once (the
    others wait their turn), and `timeout_s` counts from an episode's start."""
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise ImportError(
            f"verifiers: needs the verifiers package: pip install 'posttrain[envs]' ({error})"
        ) from None

    config = env_config(source, overrides)
    task_type = type(vf.load_environment(config).taskset).task_type()
    check_tunnel_login(config)
    limit: list[Any] = [None, None]  # the event loop of this batch of episodes and its semaphore

    async def play(client: Any, row: dict[str, Any]) -> float:
        if limit[0] is not asyncio.get_running_loop():
            limit[:] = [asyncio.get_running_loop(), asyncio.Semaphore(2 * (os.cpu_count() or 1))]
        env = vf.load_environment(config)  # its serving resources are per episode: episodes run concurrently
        endpoint = vf.EvalClientConfig(base_url=str(client.base_url), api_key_var="POSTTRAIN_EPISODE_KEY")
        task = task_of(row, task_type, config)
        async with limit[1]:
            try:
                async with asyncio.timeout(timeout_s), env.serving():
                    episode = await env.run_episode(task, vf.ModelContext("policy", endpoint))
            except TimeoutError:
                raise RuntimeError(f"the verifiers episode took longer than {timeout_s:g} s") from None
        return episode_reward(episode)

    return play
