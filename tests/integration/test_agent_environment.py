"""Agents that bring their own loop (`env.<task>.agent`): episodes written with the real `openai` client run
against the endpoint over a generation worker, their training tokens are the tokens it sampled (with a
byte-level tokenizer, whose re-tokenization of the text would change them), a failing agent costs only its
episode, and GRPO trains on agent episodes end to end."""

import asyncio
import math
import random

import pytest
import torch
from agents_for_tests import SEEN, agent_batch
from test_grpo import run_grpo

from posttrain.environments.agent import AgentTask
from posttrain.experience.agent_rollouts import run_agent_rollout
from posttrain.experience.rollouts import flat_token_ids
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.hf_worker import HFGenerationWorker

AGENTS = "tests/integration/agents_for_tests.py"


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    spec = ModelFromConfig(
        architecture="qwen2", hidden_size=64, num_layers=2, num_attention_heads=4, tokenizer="byte", seed=3
    )
    model_dir = build_model_dir(spec, tmp_path_factory.mktemp("agent_model"))
    return HFGenerationWorker(GenerationConfig(max_new_tokens=6, top_k=None), str(model_dir))


def rollout(worker, agent, answers: list[str], timeout_s: float = 30.0, num_generations: int = 1):
    batch = agent_batch(answers, num_generations)
    task = AgentTask("t", agent, timeout_s)
    return run_agent_rollout(worker, batch, worker.tokenizer, {"t": task}, max_seq_len=512, seed=7)


def test_training_tokens_are_the_sampled_tokens_across_turns(worker):
    """Two calls per episode: each assistant turn of the trajectory holds exactly the ids the endpoint
    returned, the second call's prompt is the first call's prompt and reply plus the new user turn's tokens,
    and re-tokenizing the replies' text would have changed some of them."""
    from agents_for_tests import two_turns

    SEEN.clear()
    rollouts, metrics = rollout(worker, two_turns, ["2", "3", "4", "5"])
    retokenized_differs = 0
    for i, log in enumerate(rollouts["message_log"]):
        calls = SEEN[f"{i}+1="]
        replies = [m for m in log if m["role"] == "assistant"]
        assert [r["token_ids"].tolist() for r in replies] == [c["token_ids"] for c in calls]
        assert all(len(r["generation_logprobs"]) == len(r["token_ids"]) for r in replies)
        second_prompt = calls[1]["prompt_token_ids"]
        assert flat_token_ids(log)[: len(second_prompt)].tolist() == second_prompt
        assert second_prompt[: len(calls[0]["prompt_token_ids"])] == calls[0]["prompt_token_ids"]
        for call in calls:
            again = worker.tokenizer(call["text"], add_special_tokens=False)["input_ids"]
            retokenized_differs += again != call["token_ids"][: len(again)] or len(again) != len(
                call["token_ids"]
            )
    assert retokenized_differs > 0
    assert rollouts["num_turns"].tolist() == [2, 2, 2, 2] and not rollouts["failed"].any()
    assert metrics["env/failed_episodes"] == 0.0 and metrics["env/agent_resequenced"] == 0.0


def test_a_raising_hanging_or_nan_agent_costs_only_its_episode(worker, caplog):
    """Rows by kind, in groups of two of the same record: a failed episode is flagged (left out of the loss)
    and takes its group peer's reward; an edit of an earlier turn ends the sequence and is counted."""
    from agents_for_tests import misbehaving

    kinds = ["ok", "raise", "hang", "nan", "edit"]
    with caplog.at_level("WARNING"):
        rollouts, metrics = rollout(worker, misbehaving, kinds, timeout_s=2.0, num_generations=2)
    failed = rollouts["failed"].tolist()
    assert failed == [False, False, True, True, True, True, True, True, False, False]
    assert metrics["env/failed_episodes"] == 6.0 and metrics["env/agent_resequenced"] == 2.0
    rewards = rollouts["total_reward"].tolist()
    assert all(not math.isnan(r) for r in rewards) and rewards[2:8] == [0.0] * 6  # no peer succeeded
    assert "the agent's tool crashed" in caplog.text
    edit_log = rollouts["message_log"][8]
    assert sum(m["role"] == "assistant" for m in edit_log) == 1  # the edited call is not merged in


class ToolCallingGeneration:
    """The worker's tokenizer and config, and a reply that is always one Hermes tool call: the model under
    training would have to learn it first; the endpoint's handling of it is what is tested."""

    def __init__(self, worker):
        self.cfg, self.tokenizer = worker.cfg, worker.tokenizer
        call = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
        self.reply = self.tokenizer(call, add_special_tokens=False)["input_ids"]

    def generate(self, data, greedy=False, seed=0):
        rows, width = data["input_ids"].shape
        output_ids = torch.cat([data["input_ids"], torch.tensor([self.reply] * rows)], dim=1)
        lengths = torch.full((rows,), len(self.reply))  # the prompts are one width: one call per batch here
        logprobs = torch.zeros(output_ids.shape)
        return {
            "output_ids": output_ids,
            "logprobs": logprobs,
            "generation_lengths": lengths,
            "truncated": lengths < 0,
        }


def test_the_same_seed_samples_the_same_episodes_whatever_order_their_requests_arrive_in(worker):
    """A turn's batch is decoded in episode order, not in order of arrival: two rollouts of 16 two-turn
    episodes with the same seed, whose first requests arrive in a random order, sample the same tokens."""
    from agents_for_tests import two_turns

    async def jittered(client, row):
        await asyncio.sleep(random.random() / 50)
        return await two_turns(client, row)

    runs = [rollout(worker, jittered, [str(i) for i in range(16)])[0] for _ in range(2)]
    first, second = ([flat_token_ids(log).tolist() for log in run["message_log"]] for run in runs)
    assert first == second and len({tuple(ids) for ids in first}) > 1


def test_a_tool_call_sent_back_as_returned_continues_the_episode(worker):
    """The reply's tool call comes back parsed (`tool_calls`, the markup out of `content`); an agent that
    sends that message back with the tool's result continues its trajectory: two assistant turns, the tool
    result between them, nothing resequenced."""
    from agents_for_tests import one_tool_call

    rollouts, metrics = rollout(ToolCallingGeneration(worker), one_tool_call, ["7"])
    assert not rollouts["failed"].any() and metrics["env/agent_resequenced"] == 0.0
    assert [m["role"] for m in rollouts["message_log"][0]][1:] == ["assistant", "tool", "assistant"]


def test_a_hundred_concurrent_episodes_complete_in_one_batch(worker):
    """Every episode's request waits in a server thread of its own, and the batch goes once all wait (with
    the server's default 16 threads, 16 at a time: 7 batches)."""
    from agents_for_tests import misbehaving

    rollouts, metrics = rollout(worker, misbehaving, ["ok"] * 100)
    assert not rollouts["failed"].any() and metrics["mean_turns"] == 1.0
    assert metrics["env/agent_batches"] <= 2.0


def test_an_agent_command_runs_each_episode_and_its_failures_cost_only_theirs(worker, caplog):
    """`agent_command`: a Python script using the openai client from its environment; its reward (the share
    of digits in the reply it got) equals the same function of the trajectory's tokens, decoded. A non-zero
    exit, a last line that is not a number and a command past its timeout (killed) fail their episodes, with
    the stderr's end or the reason logged."""
    import sys

    from posttrain.environments.agent import command_agent

    agent = command_agent([sys.executable, "tests/integration/command_agent.py"], timeout_s=120.0)
    with caplog.at_level("WARNING"):
        rollouts, metrics = rollout(worker, agent, ["ok", "ok", "exit", "garbage"], timeout_s=None)
    assert rollouts["failed"].tolist() == [False, False, True, True]
    assert metrics["env/failed_episodes"] == 2.0 and "the agent's sandbox is gone" in caplog.text
    for i in (0, 1):
        reply = [m for m in rollouts["message_log"][i] if m["role"] == "assistant"]
        text = worker.tokenizer.decode(reply[0]["token_ids"], skip_special_tokens=True)
        assert len(reply) == 1 and 1 <= len(reply[0]["token_ids"]) <= 5
        digits = sum(c.isdigit() for c in text) / max(1, len(text))
        assert rollouts["total_reward"][i].item() == pytest.approx(digits)
    sleeper = command_agent([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=2.0)
    with caplog.at_level("WARNING"):
        rollouts, _ = rollout(worker, sleeper, ["x"], timeout_s=None)
    assert rollouts["failed"].tolist() == [True] and "took longer than 2 s" in caplog.text


@pytest.mark.slow
def test_grpo_trains_an_openai_client_agent(ray_session, tmp_path):
    metrics = run_grpo(
        tmp_path / "run",
        **{
            "grpo.max_num_steps": 2,
            "grpo.val_period": 0,
            "grpo.max_seq_len": 96,
            "env.arithmetic": f"{{_override_: true, agent: '{AGENTS}:two_turns'}}",
            "checkpointing.enabled": "false",
        },
    )
    for step in (1, 2):
        assert metrics[step]["train/rollout/mean_turns"] == 2.0
        assert metrics[step]["train/rollout/env/failed_episodes"] == 0.0
        assert math.isfinite(metrics[step]["train/loss"])
