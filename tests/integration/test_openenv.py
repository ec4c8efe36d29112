"""An OpenEnv environment server as a task's environment (`env.<task>.openenv: <url>`), against a real
server written with openenv-core's server API (examples/openenv/guess_server.py), started on loopback:
reset with the row's seed, one step per reply, the step's reward and `done`, the observation as the next
message, several episodes at once, a server that is gone, and a short GRPO run with the shipped config's
environment section."""

import importlib.util
import json
import math
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
import yaml
from test_grpo import run_grpo

from posttrain.algorithms.grpo_config import GRPOConfig
from posttrain.config import load_typed_config
from posttrain.environments import EnvironmentConfig, resolve_environment
from posttrain.environments.openenv import SESSION_KEY
from posttrain.environments.reward_check import step_isolated

REPO = Path(__file__).resolve().parents[2]


def load_example():
    spec = importlib.util.spec_from_file_location("guess_server", REPO / "examples/openenv/guess_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server_url():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(
        load_example().create_app(max_sessions=16), host="127.0.0.1", port=port, log_level="error"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the OpenEnv server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def environment(url, **kwargs):
    cls, resolved = resolve_environment(EnvironmentConfig(openenv=url, kwargs=kwargs))
    return cls(**resolved)


def chat(*replies):
    log = [{"role": "user", "content": "Guess my number from 0 to 9."}]
    for reply in replies:
        log += [{"role": "assistant", "content": reply}, {"role": "environment", "content": ""}]
    return log[:-1]


def test_a_config_names_the_server_and_its_kwargs(tmp_path):
    path = tmp_path / "grpo_openenv.yaml"
    path.write_text(
        "env:\n  guess:\n    openenv: http://127.0.0.1:8000\n"
        "    kwargs: {observation_key: hint, reset_columns: [seed], max_sessions: 4}\n"
    )
    cfg = load_typed_config(GRPOConfig, path)
    cls, kwargs = resolve_environment(cfg.env["guess"])
    assert cls.__name__ == "OpenEnvEnvironment" and kwargs["url"] == "http://127.0.0.1:8000"
    assert cls.required_columns(kwargs) == {"seed"}


def test_episodes_reset_with_the_row_seed_and_score_each_step(server_url):
    env = environment(server_url, observation_key="hint", reset_columns=["seed"], max_sessions=2)
    metadata = [{"idx": 0, "seed": 7}, {"idx": 1, "seed": 13}, {"idx": 2, "seed": 5}]
    # secrets 7, 3, 5: the first guess is right, the second and third wrong (too high, too low)
    first = step_isolated(env, [chat("7"), chat("I say 8"), chat("2")], metadata, "test")
    assert first.rewards.tolist() == [1.0, 0.0, 0.0] and first.terminateds.tolist() == [True, False, False]
    assert [o["content"] for o in first.observations] == ["", "lower", "higher"]
    assert first.num_errors == 0 and SESSION_KEY in first.metadata[1]
    # the two open episodes go on in their own sessions: the secret stays, the guess count grows
    second = step_isolated(env, [chat("8", "3"), chat("2", "4")], first.metadata[1:], "test")
    assert second.rewards.tolist() == [1.0, 0.0] and second.terminateds.tolist() == [True, False]
    third = step_isolated(env, [chat("2", "4", "6")], second.metadata[1:], "test")
    assert third.rewards.tolist() == [0.0] and third.terminateds.tolist() == [True]  # the third wrong guess
    assert env.sessions == {}


def test_a_new_batch_closes_episodes_cut_off_by_the_turn_limit(server_url):
    env = environment(server_url, reset_columns=["seed"])
    first = step_isolated(env, [chat("1")], [{"idx": 0, "seed": 4}], "test")
    assert first.terminateds.tolist() == [False] and len(env.sessions) == 1
    assert first.observations[0]["content"] == '{"hint": "higher"}'  # no observation_key: the whole of it
    again = step_isolated(env, [chat("4")], [{"idx": 0, "seed": 4}], "test")
    assert again.rewards.tolist() == [1.0] and env.sessions == {}


def test_a_server_that_is_gone_scores_zero_and_counts_errors():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = environment(f"http://127.0.0.1:{port}", reset_columns=["seed"], timeout_seconds=5)
    result = step_isolated(
        env, [chat("1"), chat("2")], [{"idx": 0, "seed": 1}, {"idx": 1, "seed": 2}], "test"
    )
    assert result.rewards.tolist() == [0.0, 0.0] and result.num_errors == 2
    assert result.terminateds.tolist() == [True, True]


@pytest.mark.slow
def test_grpo_plays_the_shipped_guessing_game(ray_session, server_url, tmp_path):
    """configs/grpo_openenv_guess.yaml's environment and data on the tiny model: 16 three-turn episodes a
    step, every one in its own session on the server."""
    guess = yaml.safe_load((REPO / "configs/grpo_openenv_guess.yaml").read_text())["env"]["guess"]
    guess = {**guess, "openenv": server_url, "kwargs": {**guess["kwargs"], "max_sessions": 16}}
    metrics = run_grpo(
        tmp_path / "run",
        **{
            "data.dataset": str(REPO / "examples/openenv/guess.jsonl"),
            "env": json.dumps({"_override_": True, "guess": guess}),
            "grpo.max_rollout_turns": 3,
            "grpo.max_seq_len": 160,
            "data.max_length": 128,
            "grpo.max_num_steps": 2,
            "grpo.val_period": 0,
            "grpo.validation.grader": "null",
            "checkpointing.enabled": "false",
        },
    )
    for step in (1, 2):
        assert metrics[step]["train/rollout/env_errors"] == 0.0
        # the untrained model rarely guesses right: most episodes use all three guesses
        assert 2.0 <= metrics[step]["train/rollout/mean_turns"] <= 3.0
        assert 0.0 <= metrics[step]["train/reward_mean"] <= 1.0 and math.isfinite(metrics[step]["train/loss"])
