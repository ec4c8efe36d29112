"""An environment behind a server, against real HTTP servers the tests start on 127.0.0.1: the sliding
puzzle served over HTTP plays exactly as in process; a server that hangs, one that dies mid-episode and
one that forgot its episodes each end the affected episodes with reward 0, counted as errors, and the
caller goes on."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from posttrain.environments.remote import EPISODE_KEY, RemoteEnvironment
from posttrain.environments.server import EnvironmentServer
from posttrain.environments.sliding_puzzle import SlidingPuzzleEnvironment

BOARDS = [[[1, 2], [0, 3]], [[0, 1], [3, 2]]]  # solved by "right"; needs more moves
MOVES = ["<action>right</action>", "<action>left</action>", "<action>down</action>"]


def serve(server):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server


@pytest.fixture
def puzzle_server():
    server = serve(EnvironmentServer(SlidingPuzzleEnvironment(max_moves=3)))
    yield server
    server.shutdown()
    server.server_close()


def conversation(move: str) -> list[dict]:
    return [{"role": "user", "content": "solve"}, {"role": "assistant", "content": move}]


def play(env, turns: int):
    metadata = [{"board": board} for board in BOARDS]
    returns = []
    for turn in range(turns):
        result = env.step([conversation(MOVES[turn])] * 2, metadata)
        metadata = result.metadata
        returns.append(result)
    return returns


def test_the_served_puzzle_plays_exactly_as_in_process(puzzle_server):
    local = play(SlidingPuzzleEnvironment(max_moves=3), 1)[0]
    remote = play(RemoteEnvironment(puzzle_server.url), 1)[0]
    assert remote.observations == local.observations
    assert remote.next_stop_strings == local.next_stop_strings and remote.answers == local.answers
    assert torch.equal(remote.rewards, local.rewards) and torch.equal(remote.terminateds, local.terminateds)
    assert remote.rewards.tolist() == [1.0, 0.0] and remote.num_errors == 0
    assert all(EPISODE_KEY in meta for meta in remote.metadata)
    assert len(puzzle_server.episodes) == 1  # the solved episode was closed; the other one lives on


def test_a_multi_turn_episode_keeps_its_state_on_the_server(puzzle_server):
    """The server holds the board between turns: three remote turns on board 2 (right, left, down) answer
    what three local turns do, and the episode is closed when it ends."""
    env = RemoteEnvironment(puzzle_server.url)
    metadata = [{"board": BOARDS[1]}]
    local_meta = [{"board": BOARDS[1]}]
    local = SlidingPuzzleEnvironment(max_moves=3)
    for move in MOVES:
        remote_result = env.step([conversation(move)], metadata)
        local_result = local.step([conversation(move)], local_meta)
        metadata, local_meta = remote_result.metadata, local_result.metadata
        assert remote_result.observations == local_result.observations
    assert remote_result.terminateds.tolist() == [True] and len(puzzle_server.episodes) == 0


class HangingHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        time.sleep(3.0)

    def log_message(self, *args):
        return


def test_a_hanging_server_costs_its_episodes_after_the_timeout_and_the_caller_goes_on():
    server = serve(ThreadingHTTPServer(("127.0.0.1", 0), HangingHandler))
    host, port = server.server_address[:2]
    env = RemoteEnvironment(f"http://{host}:{port}", timeout_s=0.5, retries=3)
    start = time.monotonic()
    result = env.step([conversation(MOVES[0])] * 2, [{"board": board} for board in BOARDS])
    elapsed = time.monotonic() - start
    server.shutdown()
    server.server_close()
    assert elapsed < 1.5  # a timeout is not retried: the server may have acted on the request
    assert result.rewards.tolist() == [0.0, 0.0] and result.terminateds.tolist() == [True, True]
    assert (
        result.num_errors == 2
        and "no complete answer before the deadline" in result.observations[0]["content"]
    )


def test_a_server_that_dies_mid_episode_ends_the_episode_with_zero_and_counts_it(puzzle_server):
    env = RemoteEnvironment(puzzle_server.url, retries=2, backoff_s=0.05)
    metadata = [{"board": BOARDS[1]}]
    first = env.step([conversation(MOVES[1])], metadata)
    assert first.num_errors == 0 and not first.terminateds.item()
    puzzle_server.shutdown()
    puzzle_server.server_close()
    second = env.step([conversation(MOVES[2])], first.metadata)
    assert second.rewards.tolist() == [0.0] and second.terminateds.tolist() == [True]
    assert second.num_errors == 1 and "environment service error" in second.observations[0]["content"]


def test_a_server_that_forgot_the_episode_scores_it_zero(puzzle_server):
    env = RemoteEnvironment(puzzle_server.url)
    result = env.step([conversation(MOVES[0])], [{"board": BOARDS[1], EPISODE_KEY: "no-such-episode"}])
    assert (
        result.rewards.tolist() == [0.0] and result.terminateds.tolist() == [True] and result.num_errors == 1
    )
