"""A user's own reward, data and steps on real Ray actors: a reward function from a file and one
registered in Python (defined where no actor could import it) score through the environment actors as
the function does, a GRPO run on a plain reward function learns, `posttrain eval` scores every row of a
file, and `sft.max_num_steps` runs that many steps on a dataset of fewer batches."""

import json
from pathlib import Path

import pytest
import torch
from run_logs import as_overrides, metrics_by_step
from tiny_model import tiny_from_config

from posttrain import cli
from posttrain.algorithms import grpo, sft
from posttrain.config import load_typed_config
from posttrain.environments import (
    EnvironmentConfig,
    EnvironmentInterface,
    EnvironmentPool,
    EnvironmentReturn,
    register_environment,
    register_reward,
)

pytestmark = pytest.mark.slow  # Ray actors and short runs: make test, not make test-fast

REPO = Path(__file__).resolve().parents[2]
REWARDS = Path(__file__).resolve().parent / "byo_rewards.py"
REPLIES = ["39 + 49 = 88<|im_end|>", "88", "It is 87.<eos>", "", "8 8"]
GROUND_TRUTHS = ["88", "88", "88", "88", "88"]


def logs_and_metadata():
    logs = [[{"role": "assistant", "content": text}] for text in REPLIES]
    return logs, [{"ground_truth": truth, "idx": i} for i, truth in enumerate(GROUND_TRUTHS)]


def test_rewards_through_the_actors_equal_the_functions_values(ray_session):
    """Two actors each: a function from a file, and a function and an environment class registered in
    Python from inside this test (not importable by any actor)."""

    def ends_with_answer(reply, ground_truth):
        return float(reply.endswith(ground_truth))

    class LengthEnvironment(EnvironmentInterface):
        def step(self, message_logs, metadata):
            n = len(message_logs)
            return EnvironmentReturn(
                [{"role": "environment", "content": ""}] * n,
                metadata,
                [None] * n,
                torch.tensor([float(len(log[-1]["content"])) for log in message_logs]),
                torch.ones(n, dtype=torch.bool),
                [None] * n,
            )

    register_environment("length_of_reply", LengthEnvironment)
    configs = {
        "file": EnvironmentConfig(reward=f"{REWARDS}:contains_answer", num_workers=2),
        "registered": EnvironmentConfig(reward=register_reward(ends_with_answer), num_workers=2),
        "class": EnvironmentConfig(cls="length_of_reply", num_workers=2),
    }
    stripped = ["39 + 49 = 88", "88", "It is 87.", "", "8 8"]
    expected = {
        "file": [float(truth in text) for text, truth in zip(stripped, GROUND_TRUTHS)],
        "registered": [float(text.endswith(truth)) for text, truth in zip(stripped, GROUND_TRUTHS)],
        "class": [float(len(text)) for text in REPLIES],
    }
    for name, cfg in configs.items():
        pool = EnvironmentPool(name, cfg)
        try:
            result = pool.step(*logs_and_metadata())
        finally:
            pool.shutdown()
        assert result.rewards.tolist() == expected[name] and result.num_errors == 0, name


def grpo_overrides(log_dir, **extra):
    values = {
        "logger.log_dir": str(log_dir),
        "logger.tensorboard_enabled": "false",
        "checkpointing.enabled": "false",
        "policy.model_name": "null",
        "policy.model.from_config": tiny_from_config(tie_word_embeddings=False, seed=3),
        "grpo.num_prompts_per_step": 8,
        "grpo.num_generations_per_prompt": 8,
        "grpo.val_period": 0,
        "grpo.val_at_start": "false",
        "policy.train_global_batch_size": 64,
        "policy.train_micro_batch_size": 64,
        "policy.logprob_batch_size": 64,
        "policy.optimizer.kwargs.lr": 0.01,
        "generation.max_new_tokens": 6,
        "+env.arithmetic.reward": f"{REWARDS}:digit_share",
        "data.num_train": 128,
        "data.num_val": 8,
        "cluster.num_cpus_per_worker": 0.5,
    }
    return as_overrides(values, extra)


def test_grpo_on_a_reward_function_in_a_user_file_learns(ray_session, tmp_path):
    """The reward is the share of digits in the reply, a plain function in a file: from a random tiny
    model, the mean reward of the last three of 12 steps exceeds that of the first three."""
    cfg = load_typed_config(
        grpo.GRPOConfig,
        REPO / "configs" / "grpo_tiny.yaml",
        grpo_overrides(tmp_path, **{"grpo.max_num_steps": 12}),
    )
    run = grpo.setup(cfg)
    try:
        grpo.grpo_train(run)
    finally:
        run.shutdown()
    steps = metrics_by_step(tmp_path)
    rewards = [steps[step]["train/rollout/mean_reward"] for step in range(1, 13)]
    print("mean reward per step:", [round(r, 3) for r in rewards])
    assert all(steps[step]["train/rollout/env_errors"] == 0 for step in range(1, 13))
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05


def test_eval_scores_every_row_of_a_file(ray_session, tmp_path):
    questions = tmp_path / "questions.jsonl"
    rows = [{"prompt": f"{a:02d}+{a + 1:02d}=", "answer": f"{2 * a + 1:03d}"} for a in range(20)]
    questions.write_text("".join(json.dumps(row) + "\n" for row in rows))
    save_path = tmp_path / "eval"
    code = cli.main(
        [
            "eval",
            "--config",
            str(REPO / "configs" / "eval_tiny.yaml"),
            f"eval.save_path={save_path}",
            f"data.dataset={questions}",
            "~data.num_val",
            "~data.num_train",
            "eval.num_tests_per_prompt=1",
            "eval.k_value=1",
        ]
    )
    assert code == 0
    summary = json.loads((save_path / "summary.json").read_text())
    assert summary["num_prompts"] == 20 and summary["records"] == "all"
    prompts = [json.loads(line)["prompt"] for line in (save_path / "samples.jsonl").read_text().splitlines()]
    assert len(set(prompts)) == 20


def test_max_num_steps_wins_over_epochs_on_a_dataset_of_fewer_batches(ray_session, tmp_path):
    """40 rows in batches of 16 are 2 batches per epoch; max_num_epochs 1 and max_num_steps 5 run 5 steps."""
    overrides = {
        "logger.log_dir": str(tmp_path),
        "logger.tensorboard_enabled": "false",
        "checkpointing.enabled": "false",
        "policy.model.from_config.hidden_size": 32,
        "policy.model.from_config.num_layers": 1,
        "policy.model.from_config.intermediate_size": 64,
        "policy.train_global_batch_size": 16,
        "policy.train_micro_batch_size": 16,
        "cluster.num_cpus_per_worker": 0.5,
        "data.num_train": 40,
        "data.num_val": 16,
        "sft.max_val_samples": 16,
        "sft.max_num_epochs": 1,
        "sft.max_num_steps": 5,
        "sft.val_period": 5,
        "sft.export_final_model": "false",
    }
    cfg = load_typed_config(
        sft.SFTConfig, REPO / "configs" / "sft_tiny.yaml", [f"{k}={v}" for k, v in overrides.items()]
    )
    run = sft.setup(cfg)
    try:
        sft.sft_train(run)
        assert run.step == 5 and run.train_loader.epoch == 2  # the third pass over the data
    finally:
        run.shutdown()
    assert sorted(step for step, m in metrics_by_step(tmp_path).items() if "train/loss" in m) == [
        1,
        2,
        3,
        4,
        5,
    ]
