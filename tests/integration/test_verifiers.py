"""verifiers environments (`env.<task>.verifiers`), with the real verifiers 0.4.0 package: each episode is
the environment's own rollout (its `null` chat harness program, run by uv in a local subprocess, through
its interception server) against the endpoint over a generation worker. The reward posttrain records is the
environment's own score of the reply the model gave, the training tokens are the tokens the worker sampled,
an environment that raises costs only its episode, and GRPO trains on such episodes from a config.

The harness program's packages come through uv (from the package index, on the first run)."""

import json
import math
import os
import sys
from pathlib import Path

import pytest
from agents_for_tests import agent_batch
from test_grpo import run_grpo

from posttrain.config import ConfigError
from posttrain.environments.agent import AgentTask
from posttrain.environments.registry import EnvironmentConfig
from posttrain.environments.verifiers import env_config, task_of, write_tasks
from posttrain.experience.agent_rollouts import run_agent_rollout
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.hf_worker import HFGenerationWorker

vf_env = pytest.importorskip("verifiers_env_for_tests")  # verifiers needs Python 3.11+

ENV_FILE = "tests/integration/verifiers_env_for_tests.py"
HARNESS = {"agent": {"harness": {"id": "null"}}}  # the tool-less chat loop


class RecordingWorker:
    """A generation worker that keeps what each generate call sampled: prompt ids -> sampled ids."""

    def __init__(self, worker):
        self.worker, self.cfg, self.sampled = worker, worker.cfg, {}

    def generate(self, data, greedy=False, seed=None):
        out = self.worker.generate(data, greedy=greedy, seed=seed)
        for row, length in enumerate(data["input_lengths"].tolist()):
            end = length + int(out["generation_lengths"][row])
            prompt = tuple(data["input_ids"][row, :length].tolist())
            self.sampled[prompt] = out["output_ids"][row, length:end].tolist()
        return out


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    spec = ModelFromConfig(
        architecture="qwen2", hidden_size=64, num_layers=2, num_attention_heads=4, tokenizer="byte", seed=3
    )
    model_dir = build_model_dir(spec, tmp_path_factory.mktemp("verifiers_model"))
    return RecordingWorker(HFGenerationWorker(GenerationConfig(max_new_tokens=6, top_k=None), str(model_dir)))


@pytest.fixture(autouse=True)
def uv_on_path(monkeypatch):
    """The harness program runs through uv; the test environment installs it beside its Python."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def rollout(worker, answers: list[str], num_generations: int = 1):
    batch = agent_batch(answers, num_generations)
    cfg = EnvironmentConfig(verifiers=ENV_FILE, kwargs=HARNESS, agent_timeout_s=120.0)
    cfg.validate()
    task = AgentTask.load("t", cfg)
    return run_agent_rollout(worker, batch, worker.worker.tokenizer, {"t": task}, max_seq_len=512, seed=7)


def test_rewards_are_the_environments_scores_of_the_sampled_replies(worker):
    """Per episode: the trajectory is the prompt the worker generated from and the ids it sampled; the
    reward is what the environment's `@vf.reward` returned, for the reply those ids decode to."""
    vf_env.SCORED.clear()
    worker.sampled.clear()
    answers = ["1", "2", "3"]
    rollouts, metrics = rollout(worker, answers)
    assert not rollouts["failed"].any() and metrics["env/failed_episodes"] == 0.0
    tokenizer = worker.worker.tokenizer
    for i, (log, reward) in enumerate(zip(rollouts["message_log"], rollouts["total_reward"].tolist())):
        assert [m["role"] for m in log] == ["user", "assistant"]
        prompt, reply_ids = log[0]["token_ids"].tolist(), log[1]["token_ids"].tolist()
        assert worker.sampled[tuple(prompt)] == reply_ids
        reply = tokenizer.decode(reply_ids, skip_special_tokens=True).strip()
        scored = vf_env.SCORED[(f"{i}+1=", reply)]  # the reward read this reply
        assert scored == vf_env.score(reply, answers[i])
        assert reward == pytest.approx(scored, rel=1e-6)  # the rollouts hold rewards as float32
    assert metrics["mean_turns"] == 1.0


def test_an_environment_that_raises_costs_only_its_episode(worker, caplog):
    """Groups of two: the scorer raises on the middle record's tasks; those two episodes fail (flagged, left
    out of the loss, counted, the error logged), the others keep their own rewards."""
    vf_env.SCORED.clear()
    with caplog.at_level("WARNING"):
        rollouts, metrics = rollout(worker, ["1", "raise", "3"], num_generations=2)
    assert rollouts["failed"].tolist() == [False, False, True, True, False, False]
    assert metrics["env/failed_episodes"] == 2.0
    assert "the scorer crashed on this task" in caplog.text
    rewards = rollouts["total_reward"].tolist()
    assert rewards[2:4] == [0.0, 0.0]  # no peer of the failed group succeeded
    for i in (4, 5):
        reply_ids = rollouts["message_log"][i][1]["token_ids"]
        reply = worker.worker.tokenizer.decode(reply_ids, skip_special_tokens=True).strip()
        assert rewards[i] == pytest.approx(vf_env.SCORED[("2+1=", reply)], rel=1e-6)


def test_a_verifiers_environment_is_its_own_scorer():
    with pytest.raises(ConfigError, match="computes its own reward: remove reward"):
        EnvironmentConfig(verifiers=ENV_FILE, reward="rewards.py:fn").validate()
    with pytest.raises(ConfigError, match="verifiers environment is its own agent"):
        EnvironmentConfig(verifiers=ENV_FILE, agent_command=["python", "agent.py"]).validate()
    with pytest.raises(FileNotFoundError, match="no verifiers taskset file"):
        AgentTask.load("t", EnvironmentConfig(verifiers="missing_env.py"))
    task = AgentTask.load("t", EnvironmentConfig(verifiers=ENV_FILE, agent_timeout_s=30.0))
    assert task.timeout_s is None  # an episode keeps its own time, from its start


def test_the_agent_runs_locally_and_without_a_shell_unless_the_config_says_otherwise():
    default = env_config(ENV_FILE, {}).agent
    assert (default.runtime.type, default.harness.id) == ("subprocess", "null")
    chosen = env_config(ENV_FILE, {"agent": {"harness": {"id": "bash"}, "runtime": {"type": "docker"}}}).agent
    assert (chosen.runtime.type, chosen.harness.id) == ("docker", "bash")


def test_a_remote_runtime_without_a_prime_login_stops_before_training(monkeypatch, tmp_path):
    """verifiers would exit the process mid-episode; the adapter refuses at load."""
    monkeypatch.delenv("PRIME_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no Prime CLI config either
    remote = {"agent": {"harness": {"id": "null"}, "runtime": {"type": "prime"}}}
    with pytest.raises(RuntimeError, match="needs a Prime tunnel: not authenticated with prime"):
        AgentTask.load("t", EnvironmentConfig(verifiers=ENV_FILE, kwargs=remote))


def test_a_tasksets_tasks_become_data_rows_that_rebuild_them(tmp_path):
    """write_tasks: one row per task of the taskset's load(), its wire data; a row read back through
    posttrain's data columns (the answer as ground_truth) is the same task."""
    rows_file = tmp_path / "tasks.jsonl"
    assert write_tasks(ENV_FILE, str(rows_file)) == 4
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert [(r["prompt"], r["answer"], r["idx"]) for r in rows] == [
        (f"{i}+1=", str(i + 1), i) for i in range(4)
    ]
    config = env_config(ENV_FILE, {})
    task = task_of({"prompt": "2+1=", "ground_truth": "3", "idx": 2}, vf_env.SumTask, config)
    assert task.data == vf_env.SumData(**rows[2])


@pytest.mark.slow
def test_grpo_trains_on_a_verifiers_environment(ray_session, tmp_path):
    metrics = run_grpo(
        tmp_path / "run",
        **{
            "grpo.max_num_steps": 2,
            "grpo.val_period": 0,
            "grpo.max_seq_len": 96,
            # 4 episodes a step (each starts verifiers' harness as a process of its own)
            "grpo.num_prompts_per_step": 2,
            "grpo.num_generations_per_prompt": 2,
            "policy.train_global_batch_size": 4,
            "env.arithmetic": f"{{_override_: true, verifiers: '{ENV_FILE}', kwargs: {{agent: {{harness: "
            "{id: 'null'}}}}",
            "checkpointing.enabled": "false",
        },
    )
    for step in (1, 2):
        assert metrics[step]["train/rollout/mean_turns"] == 1.0
        assert metrics[step]["train/rollout/env/failed_episodes"] == 0.0
        assert math.isfinite(metrics[step]["train/loss"])
