"""reasoning-gym (the real package) as data and reward: `data.dataset: reasoning_gym:<task>` with
`data.options`, validation questions never asked in training, and the task's own scorer as the reward."""

import json

import pytest

from posttrain.config import ConfigError, validate_config
from posttrain.data import DataConfig, load_datasets
from posttrain.environments.registry import resolve_environment_class
from posttrain.models.tokenizer import build_char_tokenizer

# Two terms of one digit: 10 x 10 x 2 questions, few enough that seeds after the training ones repeat them.
EASY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def data_config(**overrides) -> DataConfig:
    settings = {"dataset": "reasoning_gym:chain_sum", "format": "rl", "options": EASY, "seed": 1}
    return validate_config(DataConfig, {**settings, **overrides})


def test_training_and_validation_never_share_a_question():
    """150 training questions from a space of 200: reasoning-gym's next 30 seeds repeat some of them; none is
    kept, and validation still has its 30."""
    from reasoning_gym import create_dataset

    train, val, stats = load_datasets(data_config(num_train=150, num_val=30), build_char_tokenizer())
    asked = {record["extra_env_info"]["reasoning_gym_entry"] for record in train}
    questions = {json.loads(entry)["question"] for entry in asked}
    val_questions = [json.loads(r["extra_env_info"]["reasoning_gym_entry"])["question"] for r in val]
    assert stats["num_train"] == 150 and len(val) == 30
    assert not questions & set(val_questions)
    next_seeds = create_dataset("chain_sum", size=30, seed=1 + 150, **EASY)
    assert questions & {entry["question"] for entry in next_seeds}  # what the filter removed
    entry = json.loads(val[0]["extra_env_info"]["reasoning_gym_entry"])
    assert val[0]["extra_env_info"]["ground_truth"] == entry["answer"]
    assert entry["metadata"]["num_terms"] == 2  # data.options reached create_dataset


def test_the_tasks_scorer_is_the_reward_and_partial_credit_is_less_than_one():
    """chain_sum `4 - 1 =` (answer 3): "3" and "<answer>3</answer>" score 1, "4" scores 0, and a reply that
    restates the sum ("4 - 1 = 3") gets the scorer's partial credit, 1/9; with full_marks_only it gets 0."""
    train, _, _ = load_datasets(data_config(num_train=3, num_val=1), build_char_tokenizer())
    metadata = train[0]["extra_env_info"]
    entry = json.loads(metadata["reasoning_gym_entry"])
    expression, answer = entry["metadata"]["expression"], entry["answer"]
    env = resolve_environment_class("reasoning_gym")()
    replies = [
        answer,
        f"Let me see. <answer>{answer}</answer>",
        str(int(answer) + 1),
        f"{expression} = {answer}",
    ]
    logs = [
        [{"role": "user", "content": entry["question"]}, {"role": "assistant", "content": r}] for r in replies
    ]
    rewards = env.step(logs, [metadata] * 4).rewards.tolist()
    assert rewards[:3] == [1.0, 1.0, 0.0]
    assert rewards[3] == pytest.approx(len(answer) / len(f"{expression} = {answer}"))  # 1 / 9
    strict = resolve_environment_class("reasoning_gym")(full_marks_only=True)
    assert strict.step(logs, [metadata] * 4).rewards.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_an_unknown_task_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"dataset: reasoning-gym has no task 'chain_summ'"):
        data_config(dataset="reasoning_gym:chain_summ")
