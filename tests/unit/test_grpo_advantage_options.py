"""GRPO's advantage options as the loop computes them (per-token advantages on the trained tokens), and
their config checks: the tiny configs load, errors name the key."""

import math
from pathlib import Path

import pytest
import torch

from posttrain.algorithms.advantages import ESTIMATORS
from posttrain.algorithms.grpo import GRPOConfig, estimator_inputs
from posttrain.config import ConfigError, load_typed_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0])  # two groups of two
TOKEN_MASK = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 0], [0, 1, 0]]).float()  # sample 0: 2 tokens


def advantages_of(config: str, *overrides: str) -> torch.Tensor:
    groups_of_two = [
        "grpo.num_generations_per_prompt=2",
        "policy.train_global_batch_size=64",
        "policy.train_micro_batch_size=64",
    ]
    cfg = load_typed_config(GRPOConfig, str(CONFIGS / config), [*groups_of_two, *overrides])
    return ESTIMATORS[cfg.grpo.advantage_estimator].fn(REWARDS, TOKEN_MASK, estimator_inputs(cfg))


def test_grpo_divides_by_each_groups_std():
    """Group [1,0]: mean .5, sample std .707107 -> +-.707107 on every trained token; group [1,1]: 0."""
    root = math.sqrt(0.5)
    expected = torch.tensor([[0, root, root], [0, -root, 0], [0, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(advantages_of("grpo_tiny.yaml"), expected, atol=1e-5, rtol=0)


def test_dr_grpo_config_gives_reward_minus_group_mean():
    """Group [1,0] -> +-.5, group [1,1] -> 0, broadcast onto the trained tokens; the loss normaliser is 8."""
    expected = torch.tensor([[0, 0.5, 0.5], [0, -0.5, 0], [0, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(advantages_of("grpo_dr_tiny.yaml"), expected)
    cfg = load_typed_config(GRPOConfig, str(CONFIGS / "grpo_dr_tiny.yaml"))
    assert cfg.loss.constant_length_normalizer == 8


def test_reinforce_pp_baseline_config_whitens_over_the_batch_tokens():
    """Group-centred [.5,-.5,0,0] on 5 tokens (sample 0 has 2): values .5, .5, -.5, 0, 0, mean .1,
    population variance (2 * .16 + .36 + 2 * .01) / 5 = .14, std .374166: (.5 - .1) / .374166 =
    1.069045, (-.5 - .1) / .374166 = -1.603567, (0 - .1) / .374166 = -0.267261."""
    expected = torch.tensor(
        [[0, 1.069045, 1.069045], [0, -1.603567, 0], [0, -0.267261, 0], [0, -0.267261, 0]]
    )
    torch.testing.assert_close(advantages_of("reinforce_pp_tiny.yaml"), expected, atol=1e-5, rtol=0)


def test_plain_reinforce_pp_uses_the_batch_mean_as_baseline():
    """Rewards 1, 0, 1, 1 on 5 tokens: values 1, 1, 0, 1, 1, mean .8, population std .4: (1 - .8) / .4 =
    .5 and (0 - .8) / .4 = -2."""
    expected = torch.tensor([[0, 0.5, 0.5], [0, -2.0, 0], [0, 0.5, 0], [0, 0.5, 0]])
    advantages = advantages_of("grpo_tiny.yaml", "grpo.advantage_estimator=reinforce_pp")
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)


def test_dr_grpo_without_a_constant_normaliser_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as error:
        load_typed_config(GRPOConfig, str(CONFIGS / "grpo_tiny.yaml"), ["grpo.advantage_estimator=dr_grpo"])
    assert error.value.key == "loss.constant_length_normalizer" and "max_new_tokens (8)" in str(error.value)


def test_leave_one_out_with_another_estimator_is_refused_naming_the_key():
    overrides = ["grpo.advantage_estimator=reinforce_pp", "grpo.use_leave_one_out_baseline=true"]
    with pytest.raises(ConfigError) as error:
        load_typed_config(GRPOConfig, str(CONFIGS / "grpo_tiny.yaml"), overrides)
    assert error.value.key == "grpo.use_leave_one_out_baseline"


def test_an_unknown_estimator_is_refused_naming_the_key_and_listing_the_table():
    for name, suggestion in (("ppo2", None), ("dr_grp", "dr_grpo")):
        with pytest.raises(ConfigError) as error:
            load_typed_config(
                GRPOConfig, str(CONFIGS / "grpo_tiny.yaml"), [f"grpo.advantage_estimator={name}"]
            )
        assert error.value.key == "grpo.advantage_estimator" and error.value.suggestion == suggestion
        assert all(known in error.value.message for known in ESTIMATORS), error.value.message


def test_ppo_config_gets_a_value_model_critic_by_default():
    """The critic section's model is a value_model even where the file does not say so."""
    cfg = load_typed_config(GRPOConfig, str(CONFIGS / "grpo_tiny.yaml"), ["grpo.advantage_estimator=gae"])
    assert cfg.critic.model.model_kind == "value_model" and cfg.critic.model.model_name is None
    ppo = load_typed_config(GRPOConfig, str(CONFIGS / "ppo_tiny.yaml"))
    assert (ppo.critic.gamma, ppo.critic.lam, ppo.critic.loss.value_clip) == (1.0, 0.95, 0.2)


def test_ppo_config_errors_name_the_critic_key():
    base = ["grpo.advantage_estimator=gae"]
    for override, key in (
        ("critic.model.model_kind=causal_lm", "critic.model.model_kind"),
        ("critic.lam=1.5", "critic.lam"),
        ("critic.loss.value_clip=0", "critic.loss.value_clip"),
        ("critic.model.train_global_batch_size=48", "critic.model.train_global_batch_size"),
    ):
        with pytest.raises(ConfigError) as error:
            load_typed_config(GRPOConfig, str(CONFIGS / "grpo_tiny.yaml"), [*base, override])
        assert error.value.key == key, override


def test_posttrain_ppo_refuses_a_config_without_the_critic(capsys):
    from posttrain.cli import main

    hub_model = (
        "policy.model_name=HuggingFaceTB/SmolLM2-135M-Instruct"  # not looked up: the check comes first
    )
    assert main(["ppo", "--config", str(CONFIGS / "grpo_tiny.yaml"), hub_model]) == 2
    assert "grpo.advantage_estimator" in capsys.readouterr().err


def test_distillation_needs_a_teacher_and_the_tiny_config_names_one():
    with pytest.raises(ConfigError) as error:
        load_typed_config(
            GRPOConfig, str(CONFIGS / "grpo_tiny.yaml"), ["grpo.advantage_estimator=on_policy_distillation"]
        )
    assert error.value.key == "teacher.model.model_name"
    cfg = load_typed_config(GRPOConfig, str(CONFIGS / "distill_tiny.yaml"))
    assert cfg.teacher.model.model_name == "results/sft_tiny/hf_model" and cfg.teacher.reward_weight == 0.0
    for overrides, key in [
        (["teacher.top_k=20", "teacher.reward_weight=0.5"], "teacher.reward_weight"),
        (["teacher.top_k=20", "teacher.model.backend=megatron"], "teacher.top_k"),
    ]:
        with pytest.raises(ConfigError) as error:
            load_typed_config(GRPOConfig, str(CONFIGS / "distill_tiny.yaml"), overrides)
        assert error.value.key == key, overrides


def test_a_teacher_with_another_tokenizer_is_refused_naming_the_key(tmp_path):
    from posttrain.algorithms.teacher import TeacherConfig, check_same_tokenizer
    from posttrain.models.build import ModelFromConfig, build_model_dir
    from posttrain.models.tokenizer import build_char_tokenizer
    from posttrain.workers.policy import PolicyConfig

    tiny = {"hidden_size": 16, "num_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    for name in ("byte", "char"):
        build_model_dir(ModelFromConfig(**tiny, tokenizer=name), tmp_path / name)
    byte_teacher = TeacherConfig(model=PolicyConfig(model_name=str(tmp_path / "byte")))
    with pytest.raises(ConfigError) as error:
        check_same_tokenizer(build_char_tokenizer(), byte_teacher.model)
    assert error.value.key == "teacher.model.model_name" and "vocabulary" in str(error.value)
    char_teacher = TeacherConfig(model=PolicyConfig(model_name=str(tmp_path / "char")))
    assert check_same_tokenizer(build_char_tokenizer(), char_teacher.model) is None
    missing = TeacherConfig(model=PolicyConfig(model_name=str(tmp_path / "none" / "hf_model")))
    with pytest.raises(ConfigError) as error:
        check_same_tokenizer(build_char_tokenizer(), missing.model)
    assert error.value.key == "teacher.model.model_name" and "does not exist" in str(error.value)


def test_posttrain_distill_refuses_a_config_without_the_teacher(capsys):
    from posttrain.cli import main

    hub_model = (
        "policy.model_name=HuggingFaceTB/SmolLM2-135M-Instruct"  # not looked up: the check comes first
    )
    assert main(["distill", "--config", str(CONFIGS / "grpo_tiny.yaml"), hub_model]) == 2
    assert "on_policy_distillation" in capsys.readouterr().err


def test_rejection_sampling_trains_sfts_loss_on_the_accepted_replies_alone():
    """Rewards [1, 0, 1, 1] with the bound 1: samples 0, 2, 3 are kept (advantage 1 on their tokens; 2 and
    3 would be a group where GRPO learns nothing). Sample 1 is masked out, so SFT's loss is the mean over
    the 4 kept tokens: -(-1 - 2 - 3 - 4) / 4 = 2.5 (sample 1's -10 does not count)."""
    from types import SimpleNamespace

    from posttrain.algorithms.grpo import add_advantages
    from posttrain.algorithms.loss import NLLLoss
    from posttrain.utils.timer import Timer

    cfg = load_typed_config(
        GRPOConfig,
        str(CONFIGS / "grpo_tiny.yaml"),
        ["grpo.advantage_estimator=rejection_sampling", "grpo.num_generations_per_prompt=8"],
    )
    expected = torch.tensor([[0, 1, 1], [0, 0, 0], [0, 1, 0], [0, 1, 0]]).float()
    torch.testing.assert_close(
        ESTIMATORS["rejection_sampling"].fn(REWARDS, TOKEN_MASK, estimator_inputs(cfg)), expected
    )
    train_data = {
        "token_mask": TOKEN_MASK,
        "sample_mask": torch.ones(4),
        "generation_logprobs": torch.zeros(4, 3),
    }
    run = SimpleNamespace(cfg=cfg, critic=None, teacher=None)
    metrics = add_advantages(run, train_data, REWARDS, TOKEN_MASK, Timer())
    assert metrics == {"rejection_sampling/accepted_share": 0.75}
    assert train_data["sample_mask"].tolist() == [1.0, 0.0, 1.0, 1.0]
    logprobs = torch.tensor([[0, -1, -2], [0, -10, 0], [0, -3, 0], [0, -4, 0]]).float()
    kept_tokens = (TOKEN_MASK * train_data["sample_mask"].unsqueeze(1)).sum()
    loss, _ = NLLLoss()(logprobs, train_data, 3, kept_tokens)
    assert float(loss) == 2.5 and float(kept_tokens) == 4.0


def test_the_loss_trains_on_sampled_replies_not_on_a_prompts_few_shot_answer():
    """[user 3 tokens, few-shot assistant 2, user 2, sampled reply 2]: only the reply's 2 tokens are trained,
    and its sampling logprobs sit at its positions."""
    from posttrain.algorithms.grpo import build_train_data
    from posttrain.distributed.batched_data_dict import BatchedDataDict

    def message(role, ids, logprobs=None):
        return {"role": role, "content": "", "token_ids": torch.tensor(ids)} | (
            {"generation_logprobs": torch.tensor(logprobs)} if logprobs else {}
        )

    log = [message("user", [5, 6, 7]), message("assistant", [8, 9]), message("user", [10, 11])]
    log.append(message("assistant", [12, 2], [-0.5, -0.25]))
    data = build_train_data(BatchedDataDict(message_log=[log]), pad_token_id=0, overlong_filtering=False)
    assert data["token_mask"][0].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert data["generation_logprobs"][0].tolist() == [0, 0, 0, 0, 0, 0, 0, -0.5, -0.25]
