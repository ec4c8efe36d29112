"""Serve any posttrain environment over HTTP with the protocol of `environments/remote.py`: each episode's
metadata lives in the server between steps; a step of several episodes is one batched `env.step` call.
`posttrain serve-env --cls sliding_puzzle --port 8765` runs one; tests start it on 127.0.0.1."""

from __future__ import annotations

import argparse
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from posttrain.environments.interface import EnvironmentInterface


class EnvironmentServer(ThreadingHTTPServer):
    """An HTTP server around one environment instance; `episodes` maps episode ids to metadata."""

    daemon_threads = True

    def __init__(self, env: EnvironmentInterface, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__((host, port), EnvironmentHandler)
        self.env = env
        self.episodes: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()  # one env.step at a time: environments need not be thread-safe

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def reset(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = []
        with self.lock:
            for episode in body["episodes"]:
                ids.append(uuid.uuid4().hex)
                self.episodes[ids[-1]] = dict(episode.get("metadata") or {})
        return {"episode_ids": ids}

    def step(self, body: dict[str, Any]) -> dict[str, Any]:
        episodes = body["episodes"]
        with self.lock:
            known = [e for e in episodes if e["episode_id"] in self.episodes]
            answer = None
            if known:
                answer = self.env.step(
                    [e["message_log"] for e in known], [self.episodes[e["episode_id"]] for e in known]
                )
                for e, meta in zip(known, answer.metadata):
                    self.episodes[e["episode_id"]] = meta
        results, position = [], 0
        for e in episodes:
            if e["episode_id"] not in self.episodes or answer is None:
                results.append(unknown_episode(e["episode_id"]))
                continue
            results.append(
                {
                    "observation": answer.observations[position],
                    "next_stop_strings": answer.next_stop_strings[position],
                    "reward": float(answer.rewards[position]),
                    "terminated": bool(answer.terminateds[position]),
                    "answer": answer.answers[position],
                    "error": None,
                }
            )
            position += 1
        return {"results": results}

    def close_episodes(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            for episode_id in body["episode_ids"]:
                self.episodes.pop(episode_id, None)
        return {}


def unknown_episode(episode_id: str) -> dict[str, Any]:
    return {
        "observation": {"role": "environment", "content": ""},
        "next_stop_strings": None,
        "reward": 0.0,
        "terminated": True,
        "answer": None,
        "error": f"unknown episode {episode_id}",
    }


class EnvironmentHandler(BaseHTTPRequestHandler):
    """Routes /reset, /step, /close (POST, JSON) and /health (GET)."""

    server: EnvironmentServer

    def do_GET(self) -> None:
        self._reply(200, {"ok": True}) if self.path == "/health" else self._reply(404, {"error": self.path})

    def do_POST(self) -> None:
        routes = {
            "/reset": self.server.reset,
            "/step": self.server.step,
            "/close": self.server.close_episodes,
        }
        if self.path not in routes:
            self._reply(404, {"error": f"no route {self.path}"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            self._reply(200, routes[self.path](body))
        except (ValueError, KeyError, TypeError) as error:
            self._reply(400, {"error": f"{type(error).__name__}: {error}"})

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise
        return


def main(args: argparse.Namespace) -> int:
    from posttrain.environments.registry import resolve_environment_class

    kwargs = json.loads(args.kwargs) if args.kwargs else {}
    server = EnvironmentServer(resolve_environment_class(args.cls)(**kwargs), args.host, args.port)
    print(f"serving environment {args.cls} at {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
