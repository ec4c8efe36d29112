"""GRPO with tool episodes on real Ray workers and the tiny model, synchronous and asynchronous: episodes
of one to three turns (call, tool result, ..., answer) train, tool calls are counted, and the asynchronous
buffer takes whole episodes."""

import json

import pytest
from test_grpo import run_grpo

from posttrain.environments.tool_env import ToolEnvironment

pytestmark = pytest.mark.slow

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


class OddRepliesCall(ToolEnvironment):
    """The tools environment, reading a reply of an odd number of characters as a calculator call (a
    random tiny model writes no calls of its own), so episodes end after one to three turns."""

    def _step_one(self, log, meta):
        if len(log[-1]["content"]) % 2 and meta.get("num_tool_turns", 0) < 2:
            log = log[:-1] + [{**log[-1], "content": CALL}]
        return super()._step_one(log, meta)


def tool_run(tmp_path, **extra):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"prompt": f"{a}*7?", "answer": str(a * 7)}) + "\n" for a in range(40))
    )
    settings = {
        "data.dataset": str(rows),
        "data.task_name": "arithmetic",
        "data.num_val": 4,
        "data.max_length": 64,
        "env.arithmetic.cls": "test_grpo_tools:OddRepliesCall",
        "+env.arithmetic.kwargs": "{tools: [calculator], system_prompt: T, max_tool_turns: 3}",
        "grpo.max_rollout_turns": 4,
        "grpo.max_seq_len": 96,
        "grpo.val_period": 0,
        "checkpointing.enabled": "false",
    }
    return run_grpo(tmp_path / "run", **{**settings, **extra})


def check_tool_episodes(metrics, steps):
    for step in steps:
        assert 1.0 < metrics[step]["train/rollout/mean_turns"] <= 3.0
        assert metrics[step]["train/rollout/env/tool_calls"] > 0
        assert metrics[step]["train/rollout/env/tool_errors"] == 0.0
        assert metrics[step]["train/loss"] == metrics[step]["train/loss"]  # finite


def test_grpo_trains_on_tool_episodes(ray_session, tmp_path):
    metrics = tool_run(tmp_path, **{"grpo.max_num_steps": 2})
    check_tool_episodes(metrics, (1, 2))


def test_async_grpo_takes_whole_tool_episodes_of_different_lengths(ray_session, tmp_path):
    metrics = tool_run(
        tmp_path,
        **{
            "grpo.max_num_steps": 3,
            "grpo.async_grpo.enabled": "true",
            "generation.colocated": "false",
            "grpo.async_grpo.max_trajectory_age_steps": 1,
        },
    )
    check_tool_episodes(metrics, (1, 2, 3))
    for step in (1, 2, 3):
        assert metrics[step]["train/async/trained_trajectories_total"] == 16.0 * step
        assert metrics[step]["train/async/trajectory_age_max"] == min(1, step - 1)
