"""Reward-model training end to end on real Ray workers, from a small SFT'd model with a fresh scalar head:
held-out accuracy rises well above chance, the exported model scores GRPO rollouts as the `reward_model`
environment (RLHF with a learned reward), and impossible settings are refused naming the key."""

import json
import math
from pathlib import Path

import pytest
import torch
from run_logs import as_overrides, metrics_by_step
from transformers import AutoModelForSequenceClassification

from posttrain.algorithms import grpo, pairs, rm
from posttrain.config import ConfigError, load_typed_config
from posttrain.models.build import load_tokenizer

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "rm_tiny.yaml")
NUM_STEPS = 120


def overrides(log_dir, model_dir, **extra):
    values = {
        "logger.log_dir": str(log_dir),
        "logger.tensorboard_enabled": "false",
        "policy.model_name": str(model_dir),
        "cluster.num_cpus_per_worker": 0.5,
        "data.num_train": 6400,
        "data.num_val": 256,
        "rm.max_val_samples": 256,
        "rm.max_num_steps": NUM_STEPS,
        "rm.val_period": 60,
        "checkpointing.enabled": "false",
        "policy.train_global_batch_size": 512,
        "policy.train_micro_batch_size": 512,
    }
    return as_overrides(values, extra)


@pytest.fixture(scope="module")
def rm_log_dir(arithmetic_sft_model, tmp_path_factory):
    """One 120-step reward-model run from the SFT'd model, 256 pairs a step (with fewer, whether this tiny
    model leaves its initial plateau within the run depends on the data order); its final model is
    exported to hf_model/."""
    log_dir = tmp_path_factory.mktemp("rm")
    run = pairs.setup(load_typed_config(rm.RMConfig, CONFIG, overrides(log_dir, arithmetic_sft_model)))
    try:
        pairs.train(run)
    finally:
        run.shutdown()
    return log_dir


def test_held_out_accuracy_rises_well_above_chance(rm_log_dir):
    steps = metrics_by_step(rm_log_dir)
    first, final = steps[1], steps[NUM_STEPS]
    print(
        f"RM train loss {first['train/loss']:.4f} -> {final['train/loss']:.4f}; val loss "
        f"{steps[60]['val/loss']:.4f} "
        f"-> {final['val/loss']:.4f}, val accuracy {steps[60]['val/accuracy']:.3f} -> "
        f"{final['val/accuracy']:.3f}"
    )
    assert abs(first["train/loss"] - math.log(2)) < 0.05  # a fresh head scores every response about the same
    assert final["val/loss"] < math.log(2) - 0.05
    assert final["val/accuracy"] >= 0.65  # 256 held-out pairs: chance is 0.5 +- 0.03; measured 0.74-0.92
    assert final["val/rewards_chosen_mean"] > final["val/rewards_rejected_mean"]
    assert (rm_log_dir / "hf_model" / "config.json").exists()


def direct_scores(model_dir: Path, message_logs: list[list[dict]]) -> list[float]:
    """The exported classifier's score of each conversation, computed here with plain transformers: the
    chat template of the conversation (the generated end marker dropped; the template adds its own)."""
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    scores = []
    for log in message_logs:
        messages = [{**m, "content": m["content"].removesuffix("<eos>")} for m in log]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        input_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            scores.append(float(model(input_ids=input_ids).logits[0, 0]))
    return scores


def test_grpo_with_the_reward_model_environment_is_rewarded_with_its_scores(
    rm_log_dir, arithmetic_sft_model, tmp_path
):
    """RLHF: a GRPO step of the SFT'd policy with the trained reward model as the environment; the rewards
    of the validation samples are the reward model's scores of those conversations."""
    reward_model_dir = rm_log_dir / "hf_model"
    values = {
        "logger.log_dir": str(tmp_path),
        "logger.tensorboard_enabled": "false",
        "policy.model_name": str(arithmetic_sft_model),
        "env.arithmetic.cls": "reward_model",
        "+env.arithmetic.kwargs.model_dir": str(reward_model_dir),
        "grpo.max_num_steps": 1,
        "grpo.num_prompts_per_step": 4,
        "grpo.num_generations_per_prompt": 4,
        "grpo.val_period": 1,
        "grpo.val_at_start": "false",
        "grpo.max_val_samples": 8,
        "policy.train_global_batch_size": 16,
        "policy.train_micro_batch_size": 16,
        "generation.max_new_tokens": 6,
        "data.num_train": 64,
        "data.num_val": 8,
        "cluster.num_cpus_per_worker": 0.5,
        "checkpointing.enabled": "false",
    }
    grpo_config = str(REPO / "configs" / "grpo_tiny.yaml")
    cfg = load_typed_config(grpo.GRPOConfig, grpo_config, as_overrides(values))
    run = grpo.setup(cfg)
    try:
        grpo.grpo_train(run)
    finally:
        run.shutdown()
    steps = metrics_by_step(tmp_path)
    samples = [
        json.loads(line) for line in (tmp_path / "val_samples" / "step_1.jsonl").read_text().splitlines()
    ]
    logged = [s["reward"] for s in samples]
    assert len(logged) == 8
    assert logged == pytest.approx(
        direct_scores(reward_model_dir, [s["message_log"] for s in samples]), abs=1e-4
    )
    assert len(set(logged)) > 1  # real scores, not a constant
    assert steps[1]["val/accuracy"] == pytest.approx(sum(logged) / len(logged), abs=1e-5)  # the mean reward
    assert math.isfinite(steps[1]["train/reward_mean"]) and steps[1]["train/advantage_abs_mean"] > 0.0


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"policy.model_kind": "causal_lm"}, "policy.model_kind"),
        ({"policy.train_micro_batch_size": 5}, "policy.train_micro_batch_size"),
        (
            {"policy.train_global_batch_size": 6, "cluster.workers_per_node": 2},
            "policy.train_global_batch_size",
        ),
        ({"policy.dynamic_batching.enabled": "true"}, "policy.dynamic_batching.enabled"),
    ],
)
def test_settings_that_cannot_train_a_reward_model_are_a_config_error_naming_the_key(tmp_path, extra, key):
    with pytest.raises(ConfigError) as error:
        load_typed_config(rm.RMConfig, CONFIG, overrides(tmp_path, tmp_path, **extra))
    assert error.value.key == key
