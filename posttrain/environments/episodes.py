"""The episodes `posttrain serve-env` holds and the shape of the requests it accepts: each episode belongs
to the client id that started it, at most `max_episodes` are held at once, and one left idle for `ttl_s`
seconds is forgotten. Not thread-safe: the server calls it under its lock."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any


class BadRequest(ValueError):
    """A request the server refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class StoreFull(RuntimeError):
    """A reset would hold more episodes than the server's cap."""


@dataclass
class _Episode:
    owner: str
    metadata: dict[str, Any]
    last_used: float


class EpisodeStore:
    """Episode metadata by id, each visible to its owner only."""

    def __init__(self, max_episodes: int, ttl_s: float) -> None:
        self.max_episodes, self.ttl_s = max_episodes, ttl_s
        self._episodes: dict[str, _Episode] = {}

    def __len__(self) -> int:
        return len(self._episodes)

    def add(self, owner: str, metadata: list[dict[str, Any]]) -> list[str]:
        """New episode ids for `metadata`, owned by `owner`; StoreFull when they would exceed the cap
        (after forgetting expired episodes)."""
        self.expire()
        if len(self._episodes) + len(metadata) > self.max_episodes:
            raise StoreFull(
                f"{len(self._episodes)} episodes are held; {len(metadata)} more would exceed the cap of "
                f"{self.max_episodes} (close finished episodes; idle ones expire after {self.ttl_s} s)"
            )
        now, ids = time.monotonic(), []
        for meta in metadata:
            ids.append(uuid.uuid4().hex)
            self._episodes[ids[-1]] = _Episode(owner, meta, now)
        return ids

    def get(self, owner: str, episode_id: str) -> dict[str, Any] | None:
        """The episode's metadata if `owner` owns a live one by that id, else None."""
        episode = self._episodes.get(episode_id)
        if episode is None or episode.owner != owner:
            return None
        if time.monotonic() - episode.last_used > self.ttl_s:
            del self._episodes[episode_id]
            return None
        return episode.metadata

    def update(self, owner: str, episode_id: str, metadata: dict[str, Any]) -> None:
        """Store the episode's new metadata and mark it used."""
        episode = self._episodes.get(episode_id)
        if episode is not None and episode.owner == owner:
            episode.metadata, episode.last_used = metadata, time.monotonic()

    def remove(self, owner: str, episode_id: str) -> None:
        """Forget the episode if `owner` owns it (another client's id is ignored)."""
        episode = self._episodes.get(episode_id)
        if episode is not None and episode.owner == owner:
            del self._episodes[episode_id]

    def expire(self) -> None:
        """Forget every episode idle longer than the TTL."""
        cutoff = time.monotonic() - self.ttl_s
        for episode_id in [i for i, e in self._episodes.items() if e.last_used < cutoff]:
            del self._episodes[episode_id]


def check_request(path: str, body: Any) -> dict[str, Any]:
    """`body` if it has the shape `path` needs (see `environments/remote.py`); BadRequest naming the field
    otherwise."""
    if not isinstance(body, dict):
        raise BadRequest(f"{path}: the body must be a JSON object")
    if path == "/close":
        ids = body.get("episode_ids")
        if not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            raise BadRequest("/close: episode_ids must be a list of strings")
        return body
    episodes = body.get("episodes")
    if not isinstance(episodes, list):
        raise BadRequest(f"{path}: episodes must be a list")
    for position, episode in enumerate(episodes):
        if not isinstance(episode, dict):
            raise BadRequest(f"{path}: episodes[{position}] must be an object")
        if path == "/reset" and not isinstance(episode.get("metadata") or {}, dict):
            raise BadRequest(f"/reset: episodes[{position}].metadata must be an object")
        if path == "/step":
            _check_step_episode(episode, position)
    return body


def _check_step_episode(episode: dict[str, Any], position: int) -> None:
    if not isinstance(episode.get("episode_id"), str):
        raise BadRequest(f"/step: episodes[{position}].episode_id must be a string")
    messages = episode.get("message_log")

    def is_message(m: Any) -> bool:
        return isinstance(m, dict) and all(isinstance(m.get(key), str) for key in ("role", "content"))

    if not (isinstance(messages, list) and all(is_message(m) for m in messages)):
        raise BadRequest(
            f"/step: episodes[{position}].message_log must be a list of {{role, content}} strings"
        )
