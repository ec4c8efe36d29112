"""`posttrain serve-env`: any posttrain environment over HTTP with the protocol of `remote`; each episode's
metadata lives in the server between steps (`EpisodeStore`), and a step of several episodes is
one batched `env.step` call (`reward_check.step_isolated`). Its limits: a token (`Authorization: Bearer`,
required beyond loopback, generated when none is given), `ServerLimits`, a bounded pool of worker
threads, only `Content-Type: application/json` POSTs, and on loopback only loopback `Host` names (so a web
page in a local browser cannot drive it); an environment that raises anyway is an HTTP 500."""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import logging
import os
import secrets
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from posttrain.environments.interface import EnvironmentInterface
from posttrain.environments.registry import resolve_environment_class
from posttrain.environments.remote import CLIENT_HEADER
from posttrain.environments.reward_check import FAILED_KEY, step_isolated

log = logging.getLogger(__name__)

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


class BadRequest(ValueError):
    """A request the server refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Episode:
    owner: str
    metadata: dict[str, Any]
    last_used: float


class EpisodeStore:
    """Episode metadata by id, each visible to its owner only, at most `max_episodes` at once, forgotten
    after `ttl_s` seconds idle. Not thread-safe: the server calls it under its lock."""

    def __init__(self, max_episodes: int, ttl_s: float) -> None:
        self.max_episodes, self.ttl_s = max_episodes, ttl_s
        self._episodes: dict[str, _Episode] = {}

    def __len__(self) -> int:
        return len(self._episodes)

    def add(self, owner: str, metadata: list[dict[str, Any]]) -> list[str]:
        """New episode ids for `metadata`, owned by `owner`; BadRequest (429) when they would exceed the cap
        (after forgetting expired episodes)."""
        self.expire()
        if len(self._episodes) + len(metadata) > self.max_episodes:
            raise BadRequest(
                f"{len(self._episodes)} episodes are held; {len(metadata)} more would exceed the cap of "
                f"{self.max_episodes} (close finished episodes; idle ones expire after {self.ttl_s} s)",
                429,
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
    """`body` if it has the shape `path` needs (the protocol of `remote`); BadRequest naming the field
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
        if path == "/step" and not isinstance(episode.get("episode_id"), str):
            raise BadRequest(f"/step: episodes[{position}].episode_id must be a string")
        messages = episode.get("message_log") if path == "/step" else []
        if not (isinstance(messages, list) and all(_is_message(m) for m in messages)):
            raise BadRequest(
                f"/step: episodes[{position}].message_log must be a list of {{role, content}} strings"
            )
    return body


def _is_message(message: Any) -> bool:
    return isinstance(message, dict) and all(isinstance(message.get(k), str) for k in ("role", "content"))


@dataclass
class ServerLimits:
    """What one client may cost the server."""

    max_body_bytes: int = 8 * 2**20  # a larger request body is refused with 413
    max_episodes: int = 10_000  # episodes held at once; a reset beyond it is refused with 429
    episode_ttl_s: float = 3600.0  # an episode idle this long is forgotten
    socket_timeout_s: float = 30.0  # a connection silent this long is closed
    max_workers: int = 16  # requests handled at once; more wait in the listen backlog
    backlog: int = 128  # the listen backlog


def is_loopback(host: str) -> bool:
    """The address (or name) `host` is on the loopback interface."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class JsonServer(HTTPServer):
    """A JSON-over-HTTP server with serve-env's limits: a token required beyond loopback, a bounded pool of
    worker threads handling the connections (`ServerLimits`); the handler class does the routing."""

    def __init__(
        self, handler: type, host: str, port: int, token: str | None, limits: ServerLimits | None, name: str
    ) -> None:
        if not is_loopback(host) and not token:
            raise ValueError(f"serving on {host} (beyond loopback) needs a token")
        self.limits = limits or ServerLimits()
        self.request_queue_size = self.limits.backlog
        super().__init__((host, port), handler)
        self.token, self.loopback_only, self.name = token, is_loopback(host), name
        self.workers = ThreadPoolExecutor(self.limits.max_workers, thread_name_prefix=name)
        self.slots = threading.BoundedSemaphore(self.limits.max_workers)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"

    def process_request(self, request: Any, client_address: Any) -> None:
        """Hand the connection to a worker; with every worker busy, wait (new connections queue in the
        kernel's listen backlog meanwhile)."""
        self.slots.acquire()
        self.workers.submit(self._handle, request, client_address)

    def _handle(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed (a client that hung up, a timeout): one log line, no traceback."""
        log.info("%s: connection from %s failed: %r", self.name, client_address, sys.exc_info()[1])

    def server_close(self) -> None:
        super().server_close()
        self.workers.shutdown(wait=False, cancel_futures=True)


class EnvironmentServer(JsonServer):
    """An HTTP server around one environment instance (see the module docstring)."""

    def __init__(
        self,
        env: EnvironmentInterface,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        super().__init__(EnvironmentHandler, host, port, token, limits, "serve-env")
        self.env = env
        self.episodes = EpisodeStore(self.limits.max_episodes, self.limits.episode_ttl_s)
        self.lock = threading.Lock()  # one env.step at a time: environments need not be thread-safe
        self.source = f"environment {type(env).__name__} (served)"

    def reset(self, body: dict[str, Any], client: str) -> dict[str, Any]:
        """Start one episode per entry; BadRequest (429) when they would not fit."""
        metadata = [dict(episode.get("metadata") or {}) for episode in body["episodes"]]
        with self.lock:
            return {"episode_ids": self.episodes.add(client, metadata)}

    def step(self, body: dict[str, Any], client: str) -> dict[str, Any]:
        """One batched env.step over this client's known episodes; the check that an episode is known, the
        step and the update of its state happen under one lock, so a concurrent /close cannot interleave."""
        episodes = body["episodes"]
        with self.lock:
            known = [e for e in episodes if self.episodes.get(client, e["episode_id"]) is not None]
            answer = None
            if known:
                metadata = [self.episodes.get(client, e["episode_id"]) for e in known]
                answer = step_isolated(self.env, [e["message_log"] for e in known], metadata, self.source)
                for e, meta in zip(known, answer.metadata):
                    self.episodes.update(client, e["episode_id"], meta)
        positions = {id(e): position for position, e in enumerate(known)}
        return {"results": [result_of(e, answer, positions.get(id(e))) for e in episodes]}

    def close_episodes(self, body: dict[str, Any], client: str) -> dict[str, Any]:
        with self.lock:
            for episode_id in body["episode_ids"]:
                self.episodes.remove(client, episode_id)
        return {}


def result_of(episode: dict[str, Any], answer: Any, position: int | None) -> dict[str, Any]:
    """The protocol's result for one episode of a step (`position` in the batched answer, None: unknown
    to this client); a sample whose scoring failed is an error result."""
    if position is None or answer.extra.get(FAILED_KEY, {position: False})[position]:
        reason = "unknown episode" if position is None else "scoring failed on the server"
        return {
            "observation": {"role": "environment", "content": ""},
            "next_stop_strings": None,
            "reward": 0.0,
            "terminated": True,
            "answer": None,
            "error": f"{reason}: {episode['episode_id']}",
        }
    return {
        "observation": answer.observations[position],
        "next_stop_strings": answer.next_stop_strings[position],
        "reward": float(answer.rewards[position]),
        "terminated": bool(answer.terminateds[position]),
        "answer": answer.answers[position],
        "error": None,
    }


class EnvironmentHandler(BaseHTTPRequestHandler):
    """Routes /reset, /step, /close (POST, JSON) and /health (GET), after the checks of the module
    docstring; every refusal is a JSON `{"error": ...}` with its status."""

    server: EnvironmentServer
    protocol_version = "HTTP/1.0"
    needs_client_id = True  # each client names itself (its episodes are its own)

    def setup(self) -> None:
        self.timeout = self.server.limits.socket_timeout_s
        super().setup()

    def do_GET(self) -> None:
        self._reply(200, {"ok": True}) if self.path == "/health" else self._reply(404, {"error": self.path})

    def do_POST(self) -> None:
        routes = {
            "/reset": self.server.reset,
            "/step": self.server.step,
            "/close": self.server.close_episodes,
        }
        refusal = self._refusal() or (None if self.path in routes else (404, f"no route {self.path}"))
        if refusal is not None:
            self._reply(refusal[0], {"error": refusal[1]})
            return
        try:
            body = check_request(self.path, self._read_json())
            self._reply(200, routes[self.path](body, self.headers[CLIENT_HEADER]))
        except BadRequest as error:
            self._reply(error.status, {"error": str(error)})
        except Exception as error:  # the environment raised: say so rather than drop the connection
            log.warning("serve-env: %s raised %r", self.path, error)
            self._reply(500, {"error": f"the environment raised {type(error).__name__}: {error}"[:500]})

    def _refusal(self) -> tuple[int, str] | None:
        """(status, reason) when the request's headers are refused: host, token, content type, client."""
        host = (self.headers.get("Host") or "").rpartition(":")[0] or self.headers.get("Host") or ""
        if self.server.loopback_only and host.strip("[]") not in LOOPBACK_NAMES:
            return 403, f"Host {self.headers.get('Host')!r} is not a loopback name"
        if self.server.token is not None:
            given = self.headers.get("Authorization") or ""
            if not hmac.compare_digest(given.encode(), f"Bearer {self.server.token}".encode()):
                return 401, "missing or wrong token (Authorization: Bearer <token>)"
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if content_type != "application/json":
            return 415, f"Content-Type must be application/json, got {content_type or 'none'!r}"
        client = self.headers.get(CLIENT_HEADER) or ""
        if self.needs_client_id and not 8 <= len(client) <= 128:
            return 400, f"{CLIENT_HEADER} must be a client id of 8 to 128 characters"
        return None

    def _read_json(self) -> Any:
        """The request body decoded as JSON, its declared length checked against the cap first."""
        data = self._read_body()
        try:
            return json.loads(data)
        except RecursionError:
            raise BadRequest("the body's JSON is nested too deeply") from None
        except ValueError as error:
            raise BadRequest(f"the body is not JSON: {error}") from None

    def _read_body(self) -> bytes:
        """The request body's bytes, its declared length checked against the cap first."""
        length = self.headers.get("Content-Length")
        if length is None:
            raise BadRequest("a Content-Length is required", 411)
        if not length.isdigit():
            raise BadRequest(f"Content-Length {length!r} is not a length")
        if int(length) > self.server.limits.max_body_bytes:
            self.close_connection = True
            raise BadRequest(f"body of {length} bytes exceeds {self.server.limits.max_body_bytes}", 413)
        try:
            data = self.rfile.read(int(length))
        except TimeoutError:
            self.close_connection = True
            raise BadRequest(f"the body did not arrive within {self.timeout} s", 408) from None
        return data

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise
        return


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `posttrain serve-env` options."""
    parser.add_argument("--cls", required=True, help="registered environment name, or file.py:Class")
    parser.add_argument("--kwargs", default=None, help="keyword arguments as JSON, e.g. '{\"max_moves\": 5}'")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8765, help="port (0: any free one)")
    token_help = "environment variable that holds the token (beyond loopback: generated when unset)"
    parser.add_argument("--token-env", default="POSTTRAIN_ENV_TOKEN", help=token_help)
    add_limit_arguments(parser)


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The `ServerLimits` options of a served endpoint."""
    defaults = ServerLimits()
    for name, help_text in (
        ("max_body_bytes", "largest request body"),
        ("max_episodes", "episodes held at once"),
        ("episode_ttl_s", "seconds after which an idle episode is forgotten"),
        ("socket_timeout_s", "seconds a connection may stay silent"),
        ("max_workers", "requests handled at once"),
    ):
        default = getattr(defaults, name)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"{help_text} ({default})",
        )


def server_token(host: str, token_env: str) -> str | None:
    """The token from `token_env`; beyond loopback without one, a new token, printed once."""
    token = os.environ.get(token_env) or None
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(32)
        print(f"serve-env: generated token (give it to clients through their token_env): {token}", flush=True)
    return token


def main(args: argparse.Namespace) -> int:
    kwargs = json.loads(args.kwargs) if args.kwargs else {}
    limits = ServerLimits(
        args.max_body_bytes, args.max_episodes, args.episode_ttl_s, args.socket_timeout_s, args.max_workers
    )
    if not is_loopback(args.host):
        print(
            f"serve-env: WARNING: listening on {args.host}, beyond loopback: any host that can reach this "
            "port can try to use the environment; a token is required on every request. Prefer 127.0.0.1 "
            "with an SSH tunnel, or a private network.",
            file=sys.stderr,
            flush=True,
        )
    token = server_token(args.host, args.token_env)
    server = EnvironmentServer(
        resolve_environment_class(args.cls)(**kwargs), args.host, args.port, token, limits
    )
    print(f"serving environment {args.cls} at {server.url} (Ctrl-C stops)", flush=True)
    return serve_until_interrupted(server)


def serve_until_interrupted(server: JsonServer) -> int:
    """Serve until Ctrl-C, then close the socket; the command's exit status."""
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
