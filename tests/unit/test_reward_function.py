"""A plain reward function as an environment (reply without end markers, the row's columns as keyword
arguments, errors scored 0 and counted), the task/environment agreement of the defaults, `--check-config`
on missing files, and YAML mappings that merge into the defaults."""

from pathlib import Path

import pytest

from posttrain import cli
from posttrain.algorithms.grpo_config import GRPOConfig
from posttrain.algorithms.sft import SFTConfig
from posttrain.config import ConfigError, load_typed_config
from posttrain.environments import EnvironmentConfig, register_reward, resolve_environment

REPO = Path(__file__).resolve().parents[2]
REWARDS = REPO / "tests" / "integration" / "byo_rewards.py"


def reply(text):
    return [{"role": "user", "content": "39 + 49 ="}, {"role": "assistant", "content": text}]


def environment(**cfg):
    cls, kwargs = resolve_environment(EnvironmentConfig(**cfg))
    return cls(**kwargs)


def test_a_file_function_sees_the_reply_without_its_end_marker_and_the_ground_truth():
    env = environment(reward=f"{REWARDS}:contains_answer")
    result = env.step(
        [reply("39 + 49 = 88<|im_end|>"), reply("87<|im_end|>")],
        [{"ground_truth": "88", "source": "a"}, {"ground_truth": "88", "source": "b"}],
    )
    assert result.rewards.tolist() == [1.0, 0.0]
    assert result.answers == ["39 + 49 = 88", "87"] and result.num_errors == 0


def test_a_registered_function_with_columns_and_a_batched_function():
    def exact(reply, ground_truth, **columns):
        return (reply == ground_truth) + columns["bonus"]

    name = register_reward(exact)
    env = environment(reward=name)
    result = env.step([reply("88<eos>"), reply("8")], [{"ground_truth": "88", "bonus": 0.5}] * 2)
    assert result.rewards.tolist() == [1.5, 0.5]
    batched = environment(reward=f"{REWARDS}:batched_length", reward_batched=True)
    rewards = batched.step([reply("88"), reply("12345")], [{"ground_truth": "88"}] * 2).rewards
    assert rewards.tolist() == pytest.approx([0.2, 0.5])


def test_a_function_that_raises_returns_garbage_or_hangs_scores_zero_and_counts_an_error():
    def picky(reply):
        if reply == "boom":
            raise RuntimeError("bug in the user's reward")
        if reply == "nan":
            return float("nan")
        if reply == "text":
            return "1.0"
        if reply == "slow":
            while True:
                pass
        return 1.0

    env = environment(reward=register_reward(picky), kwargs={"timeout_seconds": 0.2})
    result = env.step([reply(t) for t in ("ok", "boom", "nan", "text", "slow")], [{}] * 5)
    assert result.rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0] and result.num_errors == 4


def test_rows_without_a_task_column_go_to_the_one_environment_by_default():
    cfg = load_typed_config(
        GRPOConfig, REPO / "configs" / "grpo_tiny.yaml", ["+env.qa.cls=math", "~env.arithmetic"]
    )
    assert cfg.data.task_name == "qa"
    with pytest.raises(ConfigError, match=r"data.task_name: 'math' has no environment.*env.math"):
        load_typed_config(GRPOConfig, REPO / "configs" / "grpo_tiny.yaml", ["data.task_name=math"])


def check_config(capsys, *overrides) -> list[str]:
    """The problem lines `posttrain grpo --check-config` prints (none: exit 0)."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(["grpo", "--config", str(REPO / "configs" / "grpo_tiny.yaml"), *overrides, "--check-config"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == (2 if lines else 0)
    return lines


def test_check_config_names_each_missing_file_on_one_line(capsys, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    lines = check_config(
        capsys,
        f"policy.model_name={tmp_path / 'no_model'}",
        "data.dataset=no_such_questions.jsonl",
        f"+env.arithmetic.reward={tmp_path / 'no_rewards.py'}:score",
        f"grpo.validation.grader={tmp_path / 'no_graders.py'}:grade",
    )
    assert len(lines) == 4
    for key, words in (
        ("policy.model_name", "no_model does not exist"),
        (
            "data.dataset",
            f"no_such_questions.jsonl does not exist (looked for {REPO}/no_such_questions.jsonl)",
        ),
        ("env.arithmetic.reward", "no_rewards.py"),
        ("grpo.validation.grader", "no_graders.py"),
    ):
        assert any(f": {key}: " in line and words in line for line in lines), (key, lines)
    assert (
        check_config(capsys, f"policy.model_name={model}", f"+env.arithmetic.reward={REWARDS}:digit_share")
        == []
    )


def test_a_yaml_optimizer_kwargs_keeps_the_other_defaults(tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text("policy:\n  optimizer:\n    kwargs: {lr: 1.0e-5}\n")
    kwargs = load_typed_config(SFTConfig, config).policy.optimizer.kwargs
    assert kwargs == {"lr": 1e-5, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}
    config.write_text("policy:\n  optimizer:\n    name: SGD\n    kwargs: {lr: 0.1}\n")
    assert load_typed_config(SFTConfig, config).policy.optimizer.kwargs == {"lr": 0.1}  # AdamW's keys dropped
    assert SFTConfig().policy.optimizer.kwargs["lr"] == 2e-5
