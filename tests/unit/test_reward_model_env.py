"""RewardModelEnvironment: rewards are the reward model's scores of the chat-rendered conversations."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from posttrain.environments.registry import resolve_environment_class
from posttrain.environments.reward_model import RewardModelEnvironment, strip_end_markers
from posttrain.models.build import ModelFromConfig, build_model_dir, load_tokenizer


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    """A tiny seeded 1-label sequence classifier with the character tokenizer."""
    model_dir = tmp_path_factory.mktemp("rm")
    build_model_dir(
        ModelFromConfig(hidden_size=32, num_layers=1, num_attention_heads=2, intermediate_size=64), model_dir
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    model.save_pretrained(model_dir)
    return model_dir


def conversation(prompt: str, response: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def direct_score(model_dir: Path, text: str) -> float:
    """The classifier's logit at the last token of `text`, computed without the environment."""
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1).eval()
    input_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        return float(model(input_ids=input_ids).logits[0, 0])


def test_rewards_equal_the_models_scores_of_the_rendered_conversations(reward_model_dir):
    env = RewardModelEnvironment(str(reward_model_dir))
    logs = [conversation("07+85=", "092"), conversation("10+10=", "021")]
    result = env.step(logs, [{}, {}])
    expected = [
        direct_score(reward_model_dir, "<|user|>07+85=<|assistant|>092<eos>"),
        direct_score(reward_model_dir, "<|user|>10+10=<|assistant|>021<eos>"),
    ]
    assert result.rewards.tolist() == pytest.approx(expected, abs=1e-5)
    assert result.rewards[0] != result.rewards[1]


def test_every_sample_terminates_after_one_turn(reward_model_dir):
    env = RewardModelEnvironment(str(reward_model_dir))
    result = env.step([conversation("1+1=", "02")] * 3, [{"a": 1}] * 3)
    assert result.terminateds.tolist() == [True, True, True]
    assert result.metadata == [{"a": 1}] * 3
    assert result.num_errors == 0


def test_a_generated_end_marker_is_not_doubled_by_the_chat_template(reward_model_dir):
    env = RewardModelEnvironment(str(reward_model_dir))
    with_marker, without_marker = env.score(
        [conversation("07+85=", "092<eos>"), conversation("07+85=", "092")]
    )
    assert float(with_marker) == float(without_marker)


def test_scores_do_not_depend_on_batch_size_or_padding(reward_model_dir):
    logs = [conversation("7+8=", "15"), conversation("123+456=", "0579"), conversation("1=", "1")]
    one_by_one = RewardModelEnvironment(str(reward_model_dir), batch_size=1).score(logs)
    together = RewardModelEnvironment(str(reward_model_dir), batch_size=3).score(logs)
    assert together.tolist() == pytest.approx(one_by_one.tolist(), abs=1e-5)


def test_strip_end_markers_removes_only_trailing_markers():
    assert strip_end_markers("a<eos>b<eos><eos>", ("<eos>",)) == "a<eos>b"
    assert strip_end_markers("x</s>", ("<eos>", "</s>")) == "x"


def test_registered_name_resolves_to_the_class():
    assert resolve_environment_class("reward_model") is RewardModelEnvironment
