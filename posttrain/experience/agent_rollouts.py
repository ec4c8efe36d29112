"""Rollouts of agents that bring their own loop (`env.<task>.agent`, `environments/agent.py`): each episode's
agent gets an `openai.AsyncOpenAI` client on an OpenAI-compatible endpoint over the generation workers
(`workers/generation/openai_server.py`), scoped to the episode, and the data row (`prompt` and its columns);
it returns the reward. The calls it made are the trajectory, in the endpoint's own token ids (`Episode`),
so the training tokens are the sampled ones, never a re-tokenization of text. The episodes of a batch run
concurrently and their requests are batched into the generation workers; sampling follows the run's
generation settings (a request's temperature and top_p are ignored; its max_tokens lowers the budget).

An agent that raises, times out, returns a non-finite reward or makes no call fails its episode: counted
(`env/failed_episodes`, the first traceback logged), `failed` in the rollouts (the loss leaves it out) and
never scored 0: it takes the mean reward of its group's other episodes, so the group's baseline stays."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import traceback
from typing import Any

import torch

from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.environments.agent import AgentTask
from posttrain.experience.rollouts import flat_token_ids, rollout_metrics, run_multi_turn_rollout

log = logging.getLogger(__name__)


def agent_row(message_log: list[dict], metadata: dict[str, Any]) -> dict[str, Any]:
    """What the agent gets: the prompt (the record's last user message) and the row's columns."""
    prompt = next((m["content"] for m in reversed(message_log) if m["role"] == "user"), "")
    return {"prompt": prompt, **metadata}


async def _run_episodes(agents: list[Any], rows: list[dict], base_urls: list[str], batcher: Any) -> list[Any]:
    """Every agent's reward (or the exception it raised), concurrently; their clients share one connection
    pool, which loads no TLS certificates (the endpoint is plain HTTP on loopback; loading them costs ~40 ms
    a rollout). The batcher learns of each episode's end, so the requests of the others need not wait."""
    import httpx
    import openai

    async def one(agent: Any, row: dict, base_url: str, http: httpx.AsyncClient) -> Any:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="episode", max_retries=0, http_client=http)
        try:
            return await asyncio.wait_for(agent.fn(client, row), agent.timeout_s)
        finally:
            batcher.episode_done()

    unlimited = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=unlimited, timeout=None, verify=False) as http:
        episodes = (one(*args, http) for args in zip(agents, rows, base_urls))
        return await asyncio.gather(*episodes, return_exceptions=True)


def failure(result: Any, num_calls: int, timeout_s: float | None) -> str | None:
    """Why an episode failed (None: it did not)."""
    if isinstance(result, asyncio.TimeoutError):
        return f"the agent took longer than {timeout_s:g} s"
    if isinstance(result, BaseException):
        return "".join(traceback.format_exception(result)).strip()
    if not isinstance(result, (int, float)) or isinstance(result, bool) or not math.isfinite(result):
        return f"the agent returned {result!r}, not a finite number"
    if num_calls == 0:
        return "the agent made no call to the endpoint"
    return None


def run_rollout(
    generation: Any,
    batch: BatchedDataDict,
    tokenizer: Any,
    task_to_env: dict[str, Any],
    max_seq_len: int,
    max_rollout_turns: int,
    greedy: bool = False,
    seed: int | None = None,
    timer: Any = None,
) -> tuple[BatchedDataDict, dict[str, float]]:
    """`run_multi_turn_rollout`, or for a batch of agent tasks `run_agent_rollout` (agents sample with the
    run's settings: `greedy` does not apply to them)."""
    agents = {task: env for task, env in task_to_env.items() if isinstance(env, AgentTask)}
    if not agents:
        return run_multi_turn_rollout(
            generation, batch, tokenizer, task_to_env, max_seq_len, max_rollout_turns, greedy, seed, timer
        )
    if any(task not in agents for task in batch["task_name"]):
        raise ValueError(f"a batch mixes agent tasks {sorted(agents)} with environment tasks: not supported")
    return run_agent_rollout(generation, batch, tokenizer, agents, max_seq_len, seed)


def run_agent_rollout(
    generation: Any,
    batch: BatchedDataDict,
    tokenizer: Any,
    agents: dict[str, Any],
    max_seq_len: int,
    seed: int | None = None,
) -> tuple[BatchedDataDict, dict[str, float]]:
    """Run each sample's agent (`agents`: task name -> `AgentTask`); the rollouts of
    `run_multi_turn_rollout` plus `failed [B]`, and its metrics plus `env/failed_episodes`,
    `env/agent_resequenced` (calls that did not continue their episode's sequence) and `env/agent_batches`."""
    from posttrain.environments.server import ServerLimits
    from posttrain.workers.generation.openai_server import Batcher, CompletionServer, Episode

    size = len(batch["message_log"])
    max_tokens = int(getattr(generation.cfg, "max_new_tokens", 256))
    batcher = Batcher(generation, tokenizer.pad_token_id, 0.05, fixed_sampling=True, base_seed=seed or 0)
    batcher.live = size  # a batch goes once every running episode waits on it
    limits = ServerLimits(max_workers=size + 4)  # each episode's request waits in a thread of its own
    server = CompletionServer(batcher, tokenizer, "policy", max_tokens=max_tokens, limits=limits)
    server.episodes = {str(i): Episode(i) for i in range(size)}
    # its shutdown waits for the serving loop's next poll: 10 ms, not the default 0.5 s, ends each rollout
    threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
    try:
        task_agents = [agents[task] for task in batch["task_name"]]
        rows = [agent_row(m, e) for m, e in zip(batch["message_log"], batch["extra_env_info"])]
        urls = [f"{server.url}/e/{i}/v1" for i in range(size)]
        results = asyncio.run(_run_episodes(task_agents, rows, urls, batcher))
    finally:
        server.shutdown()
        server.server_close()
    episodes = [server.episodes[str(i)] for i in range(size)]
    num_turns = torch.tensor([sum("generation_logprobs" in m for m in e.log) for e in episodes])  # sampled
    reasons = [failure(r, int(n), a.timeout_s) for r, n, a in zip(results, num_turns, task_agents)]
    failed = torch.tensor([reason is not None for reason in reasons])
    if failed.any():
        first, count = int(failed.nonzero()[0]), int(failed.sum())
        log.warning("%d/%d agent episodes failed; first (sample %d): %s", count, size, first, reasons[first])
    rewards = torch.tensor([0.0 if reason else float(r) for r, reason in zip(results, reasons)])
    rewards = group_mean_for_failed(rewards, failed, batch.get("idx") or list(range(size)))
    message_logs, truncated = [], torch.zeros(size, dtype=torch.bool)
    for i, episode in enumerate(episodes):
        message_logs.append(episode.log if episode.log else list(batch["message_log"][i]))
        truncated[i] = len(flat_token_ids(message_logs[i])) > max_seq_len
    done = torch.ones(size, dtype=torch.bool)
    metrics = rollout_metrics(message_logs, rewards, truncated, num_turns, done, int(failed.sum()))
    metrics["env/failed_episodes"] = float(failed.sum())
    metrics["env/agent_resequenced"] = float(sum(e.resequenced for e in episodes))
    metrics["env/agent_batches"] = float(batcher.num_batches)  # generate calls: one per turn when all wait
    rollouts = BatchedDataDict(
        message_log=message_logs,
        extra_env_info=list(batch["extra_env_info"]),
        task_name=list(batch["task_name"]),
        idx=list(batch.get("idx") or [None] * size),
        total_reward=rewards,
        truncated=truncated,
        num_turns=num_turns,
        answer=[e.sent[-1]["content"] if e.sent else None for e in episodes],
        failed=failed,
    )
    return rollouts, metrics


def group_mean_for_failed(rewards: torch.Tensor, failed: torch.Tensor, group_ids: list[Any]) -> torch.Tensor:
    """Each failed episode's reward: the mean of its group's (same record) episodes that did not fail (0 when
    none did), so that it moves neither the group's baseline nor, left out of the loss, anything else."""
    rewards = rewards.clone()
    for i in torch.nonzero(failed).flatten().tolist():
        peers = [j for j, g in enumerate(group_ids) if g == group_ids[i] and not failed[j]]
        rewards[i] = float(rewards[peers].mean()) if peers else 0.0
    return rewards
