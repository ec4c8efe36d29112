"""`posttrain serve-env` against hostile clients, on 127.0.0.1: requests without the token, with another
client's episodes, a foreign Host or a non-JSON content type are refused; a large body gets 413, too many
episodes 429 (until idle ones expire); a bad Content-Length and a silent connection do not park a worker;
malformed and deeply nested bodies get 400 and an environment that raises costs its sample, never a
dropped connection; 100 clients at once are all served by 2 workers."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from posttrain.environments.interface import EnvironmentReturn
from posttrain.environments.remote import CLIENT_HEADER, RemoteEnvironment
from posttrain.environments.server import EnvironmentServer, ServerLimits
from posttrain.environments.sliding_puzzle import SlidingPuzzleEnvironment

BOARD = [[0, 1], [3, 2]]
CLIENT = "client-aaaaaaaa"


def start(env=None, **kwargs) -> EnvironmentServer:
    server = EnvironmentServer(env or SlidingPuzzleEnvironment(max_moves=3), **kwargs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def server(request):
    server = start(**getattr(request, "param", {}))
    yield server
    server.shutdown()
    server.server_close()


def post(server, path: str, body, client: str = CLIENT, **headers) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    all_headers = {"Content-Type": "application/json", CLIENT_HEADER: client, **headers}
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=5)
    try:
        conn.request("POST", path, body=data, headers=all_headers)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def step_body(episode_id: str) -> dict:
    log = [{"role": "user", "content": "solve"}, {"role": "assistant", "content": "<action>left</action>"}]
    return {"episodes": [{"episode_id": episode_id, "message_log": log}]}


@pytest.mark.parametrize("server", [{"token": "s3cret-token"}], indirect=True)
def test_without_the_token_nothing_is_served_and_the_client_reads_it_from_its_variable(server, monkeypatch):
    status, body = post(server, "/reset", {"episodes": [{"metadata": {"board": BOARD}}]})
    assert status == 401 and "token" in body["error"] and len(server.episodes) == 0
    status, _ = post(server, "/reset", {"episodes": []}, Authorization="Bearer wrong")
    assert status == 401
    monkeypatch.setenv("ENV_TOKEN", "s3cret-token")
    env = RemoteEnvironment(server.url, token_env="ENV_TOKEN")
    result = env.step([step_body("")["episodes"][0]["message_log"]], [{"board": BOARD}])
    assert result.num_errors == 0 and len(server.episodes) == 1
    monkeypatch.delenv("ENV_TOKEN")
    with pytest.raises(ValueError, match="'ENV_TOKEN', which is not set"):
        RemoteEnvironment(server.url, token_env="ENV_TOKEN")


def test_binding_beyond_loopback_needs_a_token():
    with pytest.raises(ValueError, match=r"0\.0\.0\.0 \(beyond loopback\) needs a token"):
        EnvironmentServer(SlidingPuzzleEnvironment(), host="0.0.0.0")


def test_another_clients_episodes_can_be_neither_stepped_nor_closed(server):
    _, body = post(server, "/reset", {"episodes": [{"metadata": {"board": BOARD}}]})
    episode_id = body["episode_ids"][0]
    status, body = post(server, "/step", step_body(episode_id), client="intruder-bbbbbbbb")
    assert status == 200 and body["results"][0]["error"].startswith("unknown episode")
    post(server, "/close", {"episode_ids": [episode_id]}, client="intruder-bbbbbbbb")
    status, body = post(server, "/step", step_body(episode_id))
    assert body["results"][0]["error"] is None and body["results"][0]["observation"]["content"]


def test_a_foreign_host_or_a_form_content_type_is_refused(server):
    """What a web page in a local browser can send: a DNS-rebound Host, or a form/text body."""
    status, _ = post(server, "/reset", {"episodes": []}, Host="attacker.example:8765")
    assert status == 403
    status, _ = post(server, "/reset", {"episodes": []}, **{"Content-Type": "text/plain"})
    assert status == 415
    status, _ = post(server, "/reset", {"episodes": []}, client="")
    assert status == 400


LIMITS = ServerLimits(max_body_bytes=4000, max_episodes=5, episode_ttl_s=0.5, socket_timeout_s=0.5)


@pytest.mark.parametrize("server", [{"limits": LIMITS}], indirect=True)
def test_a_large_body_gets_413_and_too_many_episodes_429_until_idle_ones_expire(server):
    status, body = post(server, "/reset", {"episodes": [{"metadata": {"pad": "x" * 5000}}]})
    assert status == 413 and "exceeds 4000" in body["error"]
    three = {"episodes": [{"metadata": {"board": BOARD}}] * 3}
    assert post(server, "/reset", three)[0] == 200
    status, body = post(server, "/reset", three)
    assert status == 429 and "cap of 5" in body["error"] and len(server.episodes) == 3
    time.sleep(0.6)
    assert post(server, "/reset", three)[0] == 200 and len(server.episodes) == 3


@pytest.mark.parametrize("server", [{"limits": LIMITS}], indirect=True)
def test_a_negative_length_and_a_silent_connection_do_not_park_a_worker(server):
    status, body = post(server, "/reset", b"{}", **{"Content-Length": "-1"})
    assert status == 400 and "not a length" in body["error"]
    with socket.create_connection(server.server_address[:2], timeout=5) as silent:
        head = f"POST /reset HTTP/1.1\r\nHost: 127.0.0.1\r\n{CLIENT_HEADER}: {CLIENT}\r\n"
        silent.sendall(head.encode() + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        start = time.monotonic()
        assert silent.recv(100).startswith(b"HTTP/1.0 408")  # the server's socket timeout, 0.5 s
        assert time.monotonic() - start < 2.0


class RaisesOnSample(SlidingPuzzleEnvironment):
    def step(self, message_logs, metadata):
        if any("boom" in log[-1]["content"] for log in message_logs):
            raise IndexError("list index out of range")
        return super().step(message_logs, metadata)


def test_malformed_bodies_get_400_and_a_raising_environment_costs_its_sample(server):
    assert post(server, "/reset", {"episodes": [1]})[0] == 400
    assert post(server, "/reset", b"[" * 100_000 + b"]" * 100_000)[0] == 400
    assert post(server, "/step", {"episodes": [{"episode_id": 3}]})[0] == 400
    raising = start(RaisesOnSample(max_moves=3))
    try:
        env = RemoteEnvironment(raising.url)
        logs = [[{"role": "assistant", "content": text}] for text in ("boom", "<action>right</action>")]
        result = env.step(logs, [{"board": [[1, 2], [0, 3]]}] * 2)
    finally:
        raising.shutdown()
        raising.server_close()
    assert result.rewards.tolist() == [0.0, 1.0] and result.num_errors == 1


@pytest.mark.parametrize("server", [{"limits": ServerLimits(max_workers=2)}], indirect=True)
def test_a_hundred_clients_at_once_are_all_served_by_two_workers(server):
    def health(_) -> int:
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status
        finally:
            conn.close()

    with ThreadPoolExecutor(100) as pool:
        assert list(pool.map(health, range(100))) == [200] * 100


def test_the_served_answer_is_checked_on_the_server_too():
    """An environment that answers NaN: the server reports that episode as an error, the client counts it."""

    class NaNPuzzle(SlidingPuzzleEnvironment):
        def step(self, message_logs, metadata) -> EnvironmentReturn:
            answer = super().step(message_logs, metadata)
            answer.rewards[0] = float("nan")
            return answer

    served = start(NaNPuzzle(max_moves=3))
    try:
        log = [{"role": "assistant", "content": "<action>right</action>"}]
        result = RemoteEnvironment(served.url).step([log], [{"board": [[1, 2], [0, 3]]}])
    finally:
        served.shutdown()
        served.server_close()
    assert result.rewards.tolist() == [0.0] and result.num_errors == 1
