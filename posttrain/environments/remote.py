"""Environments behind a server: `RemoteEnvironment` plays any posttrain environment that runs as an HTTP
service (`environments/server.py`, or your own implementation of the protocol), so that the environment
can live on another machine, in another language or in its own container.

The protocol: JSON over HTTP POST, batched, one episode per sample; the server keeps each episode's
state.

- `POST /reset` `{"episodes": [{"metadata": {...}}]}` -> `{"episode_ids": ["e1", ...]}`: start episodes
  from the task's metadata (the dataset row's `extra_env_info`).
- `POST /step` `{"episodes": [{"episode_id": "e1", "message_log": [{"role", "content"}, ...]}]}` ->
  `{"results": [{"observation": {"role", "content"}, "next_stop_strings": [...] | null, "reward": 0.0,
  "terminated": false, "answer": "..." | null, "error": null | "..."}]}`: score the last assistant message
  of each episode.
- `POST /close` `{"episode_ids": [...]}` -> `{}`: forget episodes (the client closes every episode that
  terminates).
- `GET /health` -> `{"ok": true}`.

Failure accounting, per call: a connection refused is retried (`retries` times, `backoff_s` apart);
a timeout (`timeout_s`) is not, since the server may have acted on the request. When a call still fails,
or the server answers with an error, each of its episodes ends with reward 0 and an error observation,
is counted in `num_errors`, and the run goes on.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import requests
import torch

from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn, Message

log = logging.getLogger(__name__)

EPISODE_KEY = "remote_episode_id"


class EnvironmentServiceError(RuntimeError):
    """The environment service could not be reached or answered with an error."""


class RemoteEnvironment(EnvironmentInterface):
    """An environment served over HTTP at `url` (see the module docstring for the protocol)."""

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.5) -> None:
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.session = requests.Session()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        for attempt in range(self.retries + 1):
            try:
                reply = self.session.post(f"{self.url}{path}", json=body, timeout=self.timeout_s)
                break
            except requests.ConnectionError as error:
                if attempt == self.retries:
                    raise EnvironmentServiceError(f"{self.url}{path}: {error}") from error
                time.sleep(self.backoff_s)
            except requests.Timeout as error:
                raise EnvironmentServiceError(
                    f"{self.url}{path}: no answer within {self.timeout_s} s"
                ) from error
        if reply.status_code != 200:
            raise EnvironmentServiceError(f"{self.url}{path}: HTTP {reply.status_code}: {reply.text[:200]}")
        try:
            return reply.json()
        except ValueError as error:
            raise EnvironmentServiceError(f"{self.url}{path}: not JSON: {reply.text[:200]!r}") from error

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        try:
            episode_ids = self._episode_ids(metadata)
            episodes = [
                {
                    "episode_id": episode_id,
                    "message_log": [{"role": m["role"], "content": m["content"]} for m in log_],
                }
                for episode_id, log_ in zip(episode_ids, message_logs)
            ]
            results = self._post("/step", {"episodes": episodes})["results"]
            if len(results) != len(episodes):
                raise EnvironmentServiceError(
                    f"{self.url}/step: {len(results)} results for {len(episodes)} episodes"
                )
        except (EnvironmentServiceError, KeyError, TypeError) as error:
            log.warning(
                "environment service %s failed; %d episode(s) end with reward 0: %s",
                self.url,
                len(metadata),
                error,
            )
            return failed_episodes(metadata, str(error))
        new_metadata = [{**meta, EPISODE_KEY: episode_id} for meta, episode_id in zip(metadata, episode_ids)]
        ended = [
            episode_id for episode_id, r in zip(episode_ids, results) if r["terminated"] or r.get("error")
        ]
        if ended:
            self._close(ended)
        return EnvironmentReturn(
            observations=[r["observation"] for r in results],
            metadata=new_metadata,
            next_stop_strings=[r.get("next_stop_strings") for r in results],
            rewards=torch.tensor([0.0 if r.get("error") else float(r["reward"]) for r in results]),
            terminateds=torch.tensor([bool(r["terminated"] or r.get("error")) for r in results]),
            answers=[r.get("answer") for r in results],
            num_errors=sum(1 for r in results if r.get("error")),
        )

    def _episode_ids(self, metadata: list[dict[str, Any]]) -> list[str]:
        """Each sample's episode id, starting (reset) the episodes that have none yet."""
        new = [i for i, meta in enumerate(metadata) if EPISODE_KEY not in meta]
        ids = [meta.get(EPISODE_KEY) for meta in metadata]
        if new:
            reply = self._post("/reset", {"episodes": [{"metadata": metadata[i]} for i in new]})
            for i, episode_id in zip(new, reply["episode_ids"]):
                ids[i] = episode_id
        return ids

    def _close(self, episode_ids: list[str]) -> None:
        try:
            self._post("/close", {"episode_ids": episode_ids})
        except EnvironmentServiceError as error:  # the episodes are over either way
            log.info("environment service %s: close failed: %s", self.url, error)


def failed_episodes(metadata: list[dict[str, Any]], reason: str) -> EnvironmentReturn:
    """Every episode of a failed call: reward 0, ended, an error observation, counted as an error."""
    count = len(metadata)
    return EnvironmentReturn(
        observations=[{"role": "environment", "content": f"environment service error: {reason}"}] * count,
        metadata=[dict(meta) for meta in metadata],
        next_stop_strings=[None] * count,
        rewards=torch.zeros(count),
        terminateds=torch.ones(count, dtype=torch.bool),
        answers=[None] * count,
        num_errors=count,
    )
