"""`posttrain eval` configuration errors, checkpoint detection and scoring helpers (no Ray)."""

from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, load_typed_config, validate_config
from posttrain.evals.run import (
    EvalConfig,
    EvalModelConfig,
    EvalSettings,
    check_model_source,
    compute_score,
    find_policy_checkpoint,
    merge_results,
)
from posttrain.evals.validate import ValidationResult

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "eval_tiny.yaml"
MODEL = {"model_name": "some/model"}


def eval_config(**settings) -> EvalConfig:
    return validate_config(EvalConfig, {"eval": settings, "model": MODEL})


def test_k_below_one_is_rejected_naming_eval_k_value():
    with pytest.raises(ConfigError) as error:
        eval_config(k_value=0)
    assert error.value.key == "eval.k_value"


def test_fewer_samples_than_k_is_rejected_naming_num_tests_per_prompt():
    with pytest.raises(ConfigError) as error:
        eval_config(k_value=4, num_tests_per_prompt=2, greedy=False)
    assert error.value.key == "eval.num_tests_per_prompt"
    assert "k_value=4" in str(error.value)


def test_several_samples_with_greedy_decoding_is_rejected():
    with pytest.raises(ConfigError) as error:
        eval_config(k_value=1, num_tests_per_prompt=4, greedy=True)
    assert error.value.key == "eval.greedy"
    assert "identical" in str(error.value)


def test_sampling_several_per_prompt_is_accepted():
    cfg = eval_config(metric="cons@k", k_value=2, num_tests_per_prompt=4, greedy=False)
    assert (cfg.eval.metric, cfg.eval.k_value, cfg.eval.num_tests_per_prompt) == ("cons@k", 2, 4)


def test_unknown_metric_is_rejected():
    with pytest.raises(ConfigError) as error:
        eval_config(metric="maj@k")
    assert error.value.key == "eval.metric"


@pytest.mark.parametrize("model", [{}, {"model_name": "m", "from_config": {"hidden_size": 32}}])
def test_model_needs_exactly_one_of_name_and_from_config(model):
    with pytest.raises(ConfigError) as error:
        validate_config(EvalConfig, {"model": model})
    assert error.value.key == "model.model_name"


def test_example_config_loads_and_command_line_errors_name_their_source():
    cfg = load_typed_config(EvalConfig, CONFIG)
    assert cfg.model.from_config is not None
    assert "arithmetic" in cfg.env
    with pytest.raises(ConfigError) as error:
        load_typed_config(EvalConfig, CONFIG, ["eval.k_value=0"])
    assert error.value.key == "eval.k_value"
    assert error.value.source == "command line"


def test_checkpoint_is_found_in_a_step_dir_or_a_policy_dir_but_not_in_a_hf_dir(tmp_path):
    policy_dir = tmp_path / "checkpoints" / "step_3" / "policy"
    (policy_dir / "model").mkdir(parents=True)
    (policy_dir / "model" / ".metadata").write_bytes(b"")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert find_policy_checkpoint(tmp_path / "checkpoints" / "step_3") == policy_dir
    assert find_policy_checkpoint(policy_dir) == policy_dir
    assert find_policy_checkpoint(hf_dir) is None
    assert find_policy_checkpoint("Qwen/Qwen2.5-0.5B") is None
    check_model_source(EvalModelConfig(model_name=str(hf_dir)))  # accepted


def test_a_directory_without_model_or_checkpoint_is_rejected_before_running(tmp_path):
    with pytest.raises(ConfigError) as error:
        check_model_source(EvalModelConfig(model_name=str(tmp_path)))
    assert error.value.key == "model.model_name"
    assert str(tmp_path) in str(error.value)


def test_pass_at_k_score_of_one_prompt_with_two_of_three_correct():
    """n=3, c=2: pass@1 = 2/3; pass@2 = 1 - C(1,2)/C(3,2) = 1."""
    rewards = [1.0, 0.0, 1.0]
    pass1 = EvalSettings(metric="pass@k", k_value=1, num_tests_per_prompt=3, greedy=False)
    pass2 = EvalSettings(metric="pass@k", k_value=2, num_tests_per_prompt=3, greedy=False)
    assert compute_score(pass1, rewards, ["5", "7", "5"]) == pytest.approx(2 / 3)
    assert compute_score(pass2, rewards, ["5", "7", "5"]) == 1.0


def test_cons_at_k_majority_wins_and_empty_answers_do_not_vote():
    """Prompt 1: answers 5,7,7 (only 5 correct): the majority 7 is wrong -> 0.
    Prompt 2: answers '', ' ', 9 (9 correct): empty answers do not vote, so 9 wins -> 1. Mean 0.5."""
    settings = EvalSettings(metric="cons@k", k_value=3, num_tests_per_prompt=3, greedy=False)
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    answers = ["5", "7", "7", "", " ", "9"]
    assert compute_score(settings, rewards, answers) == 0.5


def test_merged_batches_weight_mean_length_by_samples():
    """Batch 1: 2 samples of mean length 2; batch 2: 1 sample of length 5 -> (2*2 + 5) / 3 = 3."""

    def part(rewards, mean_length, truncated):
        samples = [{"truncated": t} for t in truncated]
        metrics = {"mean_generated_length": mean_length, "num_samples": float(len(rewards))}
        return ValidationResult(metrics, samples, torch.tensor(rewards))

    merged = merge_results([part([1.0, 0.0], 2.0, [False, True]), part([1.0], 5.0, [False])])
    assert merged.metrics["mean_generated_length"] == 3.0
    assert merged.metrics["accuracy"] == pytest.approx(2 / 3)
    assert merged.metrics["truncation_rate"] == pytest.approx(1 / 3)
    assert merged.rewards.tolist() == [1.0, 0.0, 1.0]


def test_a_missing_local_model_path_is_rejected_but_a_hub_name_is_left_to_the_loader(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        check_model_source(EvalModelConfig(model_name=str(tmp_path / "missing")))
    check_model_source(EvalModelConfig(model_name="Qwen/Qwen2.5-0.5B"))


def test_an_evaluated_checkpoint_is_logged_at_its_step():
    """EvaluationRunner "logs evaluation outcomes to" UnifiedLogger: a run's `checkpoints/step_N` is
    logged at step N, beside that run's training curves; any other model at step 0."""
    from posttrain.evals.run import eval_step

    assert eval_step("results/grpo-1/checkpoints/step_40") == 40
    assert eval_step("results/grpo-1/checkpoints/step_40/") == 40
    assert eval_step("results/grpo-1/hf_model") == 0
    assert eval_step(None) == 0
