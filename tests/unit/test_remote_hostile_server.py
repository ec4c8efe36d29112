"""The remote-environment client against hostile servers the tests start on 127.0.0.1: rewards that are
NaN, infinite, strings or absurd, flags that are strings, results of the wrong type, a server that drips
its answer one byte at a time, one that answers 5 MB, and one that drops the connection after reading the
request. Each costs its own episodes only, within the call's deadline, and nothing is retried once sent."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from posttrain.environments.remote import RemoteEnvironment


class Hostile(ThreadingHTTPServer):
    """/reset hands out ids e0, e1, ...; /step answers `step_text` (raw JSON text) or runs `behaviour`."""

    daemon_threads = True

    def __init__(self, step_text: str = "", behaviour: str = "json") -> None:
        self.step_text, self.behaviour, self.step_calls = step_text, behaviour, 0
        super().__init__(("127.0.0.1", 0), HostileHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def handle_error(self, request, client_address) -> None:  # the client hanging up is expected here
        pass


class HostileHandler(BaseHTTPRequestHandler):
    server: Hostile

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/reset":
            return self.send(json.dumps({"episode_ids": [f"e{i}" for i in range(len(body["episodes"]))]}))
        if self.path == "/close":
            return self.send("{}")
        self.server.step_calls += 1
        if self.server.behaviour == "drop":  # read the request, then hang up without a word
            self.close_connection = True
            return
        if self.server.behaviour == "drip":  # one byte every 0.2 s, for at most 4 s
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(20):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.2)
            return
        if self.server.behaviour == "huge":
            return self.send('{"results": "' + "x" * (5 * 2**20) + '"}')
        self.send(self.server.step_text)

    def send(self, text: str) -> None:
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def result(reward: str, terminated: str = "true") -> str:
    observation = '{"role": "environment", "content": ""}'
    return (
        f'{{"observation": {observation}, "next_stop_strings": null, "reward": {reward}, '
        f'"terminated": {terminated}, "answer": null, "error": null}}'
    )


def play(url: str, count: int, **kwargs):
    env = RemoteEnvironment(url, **kwargs)
    logs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]] * count
    return env.step(logs, [{"idx": i} for i in range(count)])


def test_nan_inf_string_and_absurd_rewards_and_string_flags_cost_their_own_episode():
    """Rewards NaN, Infinity, "nan", 1e308 and a terminated of "false", beside two good results (1.0 and
    0.5, not terminated): rewards [0, 0, 0, 0, 0, 1, 0.5], 5 errors."""
    bad = [result("NaN"), result("Infinity"), result('"nan"'), result("1e308"), result("1.0", '"false"')]
    good = [result("1.0"), result("0.5", "false")]
    server = Hostile('{"results": [' + ", ".join(bad + good) + "]}")
    try:
        returned = play(server.url, 7)
    finally:
        server.stop()
    assert returned.rewards.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5]
    assert returned.terminateds.tolist() == [True] * 6 + [False]
    assert returned.num_errors == 5
    assert "sample idx=2" in returned.observations[2]["content"]
    assert "terminated must be true or false" in returned.observations[4]["content"]


def test_results_of_the_wrong_type_cost_their_own_episode():
    text = '{"results": [1, "x", {"observation": 5, "reward": 1.0, "terminated": true}, ' + result("1") + "]}"
    server = Hostile(text)
    try:
        returned = play(server.url, 4)
    finally:
        server.stop()
    assert returned.rewards.tolist() == [0.0, 0.0, 0.0, 1.0] and returned.num_errors == 3


@pytest.mark.parametrize("behaviour", ["drip", "huge"])
def test_a_dripping_or_flooding_server_fails_the_call_within_its_deadline(behaviour):
    """A server sending one byte every 0.2 s (4 s in all) held a call with a 1 s read timeout for the whole
    answer; a 5 MB answer was read whole. Now both fail within the 1 s deadline (plus slack), the 5 MB one
    at the 1 MB cap, and each episode scores 0."""
    server = Hostile(behaviour=behaviour)
    try:
        start = time.monotonic()
        returned = play(server.url, 2, timeout_s=1.0, max_response_bytes=2**20)
        elapsed = time.monotonic() - start
    finally:
        server.stop()
    assert elapsed < 2.0
    assert returned.rewards.tolist() == [0.0, 0.0] and returned.num_errors == 2
    reason = "before the deadline" if behaviour == "drip" else "over the cap"
    assert reason in returned.observations[0]["content"]


def test_a_dropped_connection_is_not_retried_once_the_request_was_sent():
    """The server read the step and hung up: with retries=2 the step reached it 3 times; now once."""
    server = Hostile(behaviour="drop")
    try:
        returned = play(server.url, 1, retries=2, backoff_s=0.01, timeout_s=2.0)
    finally:
        server.stop()
    assert server.step_calls == 1
    assert returned.rewards.tolist() == [0.0] and returned.num_errors == 1
    assert "after the request was sent" in returned.observations[0]["content"]
