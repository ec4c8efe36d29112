"""`RemoteEnvironment` plays an environment served over HTTP (`server`, or any server of this protocol).

JSON over HTTP POST, batched, one episode per sample; the server keeps each episode's state. Every request
carries `X-Posttrain-Client: <id>` (episodes belong to the client id that started them) and, when the
server has a token, `Authorization: Bearer <token>`.
- `POST /reset` `{"episodes": [{"metadata": {...}}]}` -> `{"episode_ids": [...]}`: start episodes from
  the rows' metadata.
- `POST /step` `{"episodes": [{"episode_id", "message_log": [{"role", "content"}, ...]}]}` -> `{"results":
  [{"observation": {"role", "content"}, "next_stop_strings": [...] | null, "reward": float, "terminated":
  bool, "answer": str | null, "error": str | null}]}`: score the last assistant message of each episode.
- `POST /close` `{"episode_ids": [...]}` -> `{}`: forget episodes (the client closes each that ends).
- `GET /health` -> `{"ok": true}`.

Calls have the limits of `http_call`; only a connection that could not be opened is retried, as the
server may have acted on a request once sent. A failed call ends each of its episodes with reward 0, and
each result is checked on its own (`parse_result`): a malformed one costs that episode alone."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from posttrain.environments.http_call import HTTPCallError, JSONClient
from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn, Message, Turn
from posttrain.environments.reward_check import check_reward, failed_return, parse_flag, sample_name

log = logging.getLogger(__name__)

EPISODE_KEY = "remote_episode_id"
CLIENT_KEY = "remote_client_id"
CLIENT_HEADER = "X-Posttrain-Client"


class RemoteEnvironment(EnvironmentInterface):
    """An environment served over HTTP at `url` (see the module docstring for the protocol). The token,
    if the server wants one, is read from the environment variable named by `token_env`."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        token_env: str | None = None,
        max_response_bytes: int = 16 * 2**20,
        min_reward: float = -1e6,
        max_reward: float = 1e6,
    ) -> None:
        if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ValueError(f"remote environment: url must start with http:// or https://, got {url!r}")
        if not timeout_s > 0 or max_response_bytes < 1 or not max_reward >= min_reward:
            raise ValueError(
                "remote environment: timeout_s and max_response_bytes must be > 0 and max_reward >= "
                f"min_reward (got {timeout_s}, {max_response_bytes}, [{min_reward}, {max_reward}])"
            )
        self.url, self.reward_range = url.rstrip("/"), (min_reward, max_reward)
        token = None if token_env is None else os.environ.get(token_env)
        if token_env is not None and not token:
            raise ValueError(f"remote environment: token_env names {token_env!r}, which is not set")
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = JSONClient(timeout_s, max_response_bytes, retries, backoff_s, headers=auth)
        self.client_id = uuid.uuid4().hex
        self.source = f"remote environment {self.url}"

    def _post(self, path: str, body: dict[str, Any], client_id: str) -> dict[str, Any]:
        """The JSON object the server answers; HTTPCallError for anything else."""
        return self.http.call(f"{self.url}{path}", body, {CLIENT_HEADER: client_id})

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        try:
            episode_ids = self._episode_ids(metadata)
        except HTTPCallError as error:
            log.warning("%s: reset failed; %d episode(s) score 0: %s", self.source, len(metadata), error)
            return failed_return(metadata, f"environment service error: {error}")
        new_metadata = [
            {**meta, EPISODE_KEY: episode_id, CLIENT_KEY: meta.get(CLIENT_KEY, self.client_id)}
            for meta, episode_id in zip(metadata, episode_ids)
        ]
        by_index: dict[int, Turn] = {}
        for client_id, indices in _by_client(new_metadata).items():
            by_index.update(zip(indices, self._step_group(message_logs, new_metadata, indices, client_id)))
        turns = [by_index[i] for i in range(len(metadata))]
        self._close([t.metadata for t in turns if t.terminated and t.error is None])
        return EnvironmentReturn.from_turns(turns)

    def _step_group(
        self, logs: list[list[Message]], metadata: list[dict[str, Any]], indices: list[int], client: str
    ) -> list[Turn]:
        """The checked turn of each episode in `indices` (all started by `client`), one POST /step."""
        episodes = [
            {
                "episode_id": metadata[i][EPISODE_KEY],
                "message_log": [{"role": m["role"], "content": m["content"]} for m in logs[i]],
            }
            for i in indices
        ]
        try:
            results = self._post("/step", {"episodes": episodes}, client).get("results")
            if not isinstance(results, list) or len(results) != len(episodes):
                count = len(results) if isinstance(results, list) else type(results).__name__
                raise HTTPCallError(f"{self.url}/step: {count} results for {len(episodes)} episodes")
        except HTTPCallError as error:
            log.warning("%s failed; %d episode(s) score 0: %s", self.source, len(indices), error)
            return [failed_turn(f"environment service error: {error}", metadata[i]) for i in indices]
        return [self._check_result(result, metadata[i], i) for i, result in zip(indices, results)]

    def _check_result(self, result: Any, meta: dict[str, Any], position: int) -> Turn:
        """One episode's result, every field checked; a wrong one fails this episode alone (logged)."""
        try:
            return parse_result(result, meta, self.source, sample_name(meta, position), self.reward_range)
        except ValueError as error:
            log.warning("%s; the episode scores 0", error)
            return failed_turn(f"environment service error: {error}", meta)

    def _episode_ids(self, metadata: list[dict[str, Any]]) -> list[str]:
        """Each sample's episode id, starting (reset) the episodes that have none yet."""
        new = [i for i, meta in enumerate(metadata) if EPISODE_KEY not in meta]
        ids = [meta.get(EPISODE_KEY) for meta in metadata]
        if new:
            reply = self._post(
                "/reset", {"episodes": [{"metadata": metadata[i]} for i in new]}, self.client_id
            )
            new_ids = reply.get("episode_ids")
            if not (isinstance(new_ids, list) and len(new_ids) == len(new)):
                raise HTTPCallError(f"{self.url}/reset: not {len(new)} episode ids: {new_ids!r:.200}")
            if not all(isinstance(episode_id, str) for episode_id in new_ids):
                raise HTTPCallError(f"{self.url}/reset: episode ids must be strings")
            for i, episode_id in zip(new, new_ids):
                ids[i] = episode_id
        return ids

    def _close(self, ended: list[dict[str, Any]]) -> None:
        """Forget the ended episodes (their metadata) on the server, one POST per client id; a failure is
        only logged."""
        for client_id, indices in _by_client(ended).items():
            try:
                self._post("/close", {"episode_ids": [ended[i][EPISODE_KEY] for i in indices]}, client_id)
            except HTTPCallError as error:  # the episodes are over either way
                log.info("%s: close failed: %s", self.source, error)


def _by_client(metadata: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Sample indices grouped by the client id that started their episodes."""
    groups: dict[str, list[int]] = {}
    for index, meta in enumerate(metadata):
        groups.setdefault(meta[CLIENT_KEY], []).append(index)
    return groups


def parse_result(
    result: Any, meta: dict[str, Any], source: str, sample: str, reward_range: tuple[float, float]
) -> Turn:
    """One `/step` result with every field checked; a server-reported error is a turn with `error`;
    anything malformed is a ValueError naming source, sample and field."""
    if not isinstance(result, dict):
        raise ValueError(f"{source}, {sample}: a result must be a JSON object, got {type(result).__name__}")
    error = result.get("error")
    if error is not None:
        return failed_turn(f"environment service error: {str(error)[:500]}", meta)
    observation = result.get("observation")
    observation = observation if isinstance(observation, dict) else {}
    role, content = observation.get("role"), observation.get("content")
    if not (isinstance(role, str) and isinstance(content, str)):
        raise ValueError(f"{source}, {sample}: observation must be {{role: str, content: str}}")
    stops = result.get("next_stop_strings")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise ValueError(f"{source}, {sample}: next_stop_strings must be a list of strings or null")
    answer = result.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise ValueError(f"{source}, {sample}: answer must be a string or null")
    reward = check_reward(result.get("reward"), source, sample, reward_range)
    terminated = parse_flag(result.get("terminated"), "terminated", source, sample)
    return Turn({"role": role, "content": content}, meta, reward, terminated, answer, stops)


def failed_turn(reason: str, meta: dict[str, Any]) -> Turn:
    """An episode that ends with reward 0 and an error observation, counted as an error."""
    return Turn({"role": "environment", "content": reason}, meta, terminated=True, error=reason)
