"""DPO end to end on real Ray workers, from a small SFT'd model: the loss starts at ln 2 and falls, the
preference accuracy on held-out pairs rises well above chance, a resumed run equals an uninterrupted one,
and batch settings that would split a chosen/rejected pair are refused before any worker starts."""

import math
from pathlib import Path

import pytest
from run_logs import as_overrides, metrics_by_step

from posttrain.algorithms import dpo, pairs
from posttrain.config import ConfigError, load_typed_config

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "dpo_tiny.yaml")
NUM_STEPS = 40


def overrides(log_dir, model_dir, **extra):
    values = {
        "logger.log_dir": str(log_dir),
        "logger.tensorboard_enabled": "false",
        "policy.model_name": str(model_dir),
        "cluster.num_cpus_per_worker": 0.5,
        "data.num_train": 2048,
        "data.num_val": 256,
        "dpo.max_val_samples": 256,
        "dpo.max_num_steps": NUM_STEPS,
        "dpo.val_period": 20,
        "checkpointing.save_period": 20,
        "checkpointing.keep_top_k": "null",
        "dpo.export_final_model": "false",
    }
    return as_overrides(values, extra)


def run_dpo(log_dir, model_dir, **extra) -> dict[int, dict]:
    """Run (or resume) DPO in `log_dir`; every logged metric by step."""
    cfg = load_typed_config(dpo.DPOConfig, CONFIG, overrides(log_dir, model_dir, **extra))
    run = pairs.setup(cfg)
    try:
        pairs.train(run)
    finally:
        run.shutdown()
    return metrics_by_step(log_dir)


@pytest.fixture(scope="module")
def dpo_log_dir(arithmetic_sft_model, tmp_path_factory):
    """One uninterrupted 40-step DPO run from the SFT'd model (checkpoints at steps 20 and 40), shared by
    the tests below."""
    log_dir = tmp_path_factory.mktemp("dpo")
    run_dpo(log_dir, arithmetic_sft_model)
    return log_dir


@pytest.fixture(scope="module")
def dpo_steps(dpo_log_dir):
    return metrics_by_step(dpo_log_dir)


def test_loss_starts_at_ln2_falls_and_held_out_preference_accuracy_rises(dpo_steps):
    """Step 1: the policy is the reference, so both implicit rewards are 0 and the loss is
    -log sigmoid(0) = ln 2 = 0.6931; no pair has r_c > r_r yet (accuracy 0)."""
    first = dpo_steps[1]
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["train/preference_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["train/accuracy"] == 0.0
    assert first["train/rewards_chosen_mean"] == pytest.approx(0.0, abs=1e-6)
    assert first["train/rewards_rejected_mean"] == pytest.approx(0.0, abs=1e-6)
    last_losses = [dpo_steps[s]["train/loss"] for s in range(NUM_STEPS - 9, NUM_STEPS + 1)]
    final = dpo_steps[NUM_STEPS]
    print(
        f"DPO train loss {first['train/loss']:.4f} -> {sum(last_losses) / 10:.4f} (mean of the last 10 "
        "steps); "
        f"val loss {final['val/loss']:.4f}, val accuracy {dpo_steps[20]['val/accuracy']:.3f} (step 20) -> "
        f"{final['val/accuracy']:.3f}"
    )
    assert sum(last_losses) / 10 < math.log(2) - 0.05
    assert final["val/loss"] < math.log(2) - 0.05
    assert final["val/accuracy"] >= 0.65  # 256 held-out pairs: chance is 0.5 +- 0.03; measured 0.73-0.85
    assert final["val/rewards_chosen_mean"] > final["val/rewards_rejected_mean"]


def test_resume_from_a_checkpoint_equals_uninterrupted(
    dpo_log_dir, dpo_steps, arithmetic_sft_model, tmp_path
):
    """Steps 21-22 of a run resumed from the shared run's step-20 checkpoint (model, optimizer, scheduler,
    data position; the reference stays the starting model) equal the uninterrupted run's."""
    checkpoint = dpo_log_dir / "checkpoints" / "step_20"
    resumed = run_dpo(
        tmp_path,
        arithmetic_sft_model,
        **{"checkpointing.resume_from": checkpoint, "dpo.max_num_steps": 22, "dpo.val_period": 100},
    )
    assert min(step for step, metrics in resumed.items() if "train/loss" in metrics) == 21
    for step in (21, 22):
        for key in (
            "train/loss",
            "train/accuracy",
            "train/rewards_chosen_mean",
            "train/rewards_rejected_mean",
        ):
            assert resumed[step][key] == pytest.approx(dpo_steps[step][key], abs=1e-6)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("policy.train_micro_batch_size=3", "policy.train_micro_batch_size"),
        ("policy.dynamic_batching.enabled=true", "policy.dynamic_batching.enabled"),
        ("policy.sequence_packing.enabled=true", "policy.sequence_packing.enabled"),
        ("policy.model_kind=reward_model", "policy.model_kind"),
    ],
)
def test_settings_that_would_split_pairs_are_a_config_error_naming_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError) as error:
        load_typed_config(dpo.DPOConfig, CONFIG, overrides(tmp_path, tmp_path, **dict([override.split("=")])))
    assert error.value.key == key


def test_dpo_with_lora_learns_the_preference_against_the_base_model_as_reference(
    arithmetic_sft_model, tmp_path
):
    """20 DPO steps training only rank-8 adapters (lr 2e-3; the reference is the same model with the
    adapter disabled): step 1 is exactly ln 2 (B = 0, so policy = reference), and the held-out preference
    accuracy and reward margin rise (measured: val loss 0.561, accuracy 0.738, margin +0.50)."""
    steps = run_dpo(
        tmp_path,
        arithmetic_sft_model,
        **{
            "policy.lora.enabled": "true",
            "policy.optimizer.kwargs.lr": 2e-3,
            "dpo.max_num_steps": 20,
            "dpo.val_period": 20,
            "checkpointing.enabled": "false",
        },
    )
    assert steps[1]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    final = steps[20]
    assert final["val/loss"] < math.log(2) - 0.05
    assert final["val/accuracy"] >= 0.62  # 256 held-out pairs: chance is 0.5 +- 0.03
    assert final["val/rewards_chosen_mean"] - final["val/rewards_rejected_mean"] > 0.2


@pytest.mark.parametrize("variant, beta", [("ipo", 0.5), ("simpo", 2.0)], ids=["ipo", "simpo"])
def test_ipo_and_simpo_learn_the_held_out_preference(
    arithmetic_sft_model, dpo_steps, tmp_path, variant, beta
):
    """The same 40 steps as DPO with IPO's and SimPO's losses (configs/ipo_tiny.yaml, simpo_tiny.yaml):
    the held-out preference accuracy (the implicit reward of the correct sum above the wrong one) ends well
    above chance, and the chosen reward above the rejected one. SimPO keeps no reference."""
    steps = run_dpo(
        tmp_path,
        arithmetic_sft_model,
        **{"loss.preference_loss": variant, "loss.reference_policy_kl_penalty": beta},
    )
    first, final = steps[1], steps[NUM_STEPS]
    print(variant, {k: round(v, 3) for k, v in final.items() if k.startswith("val/")})
    if variant == "ipo":  # h = 0 at the start: the loss is the squared target margin (1 / (2 beta))^2 = 1
        assert first["train/loss"] == pytest.approx(1.0, abs=1e-5)
    if variant == "simpo":  # no reference forward
        assert "timing/reference_logprobs" not in first and "timing/reference_logprobs" in dpo_steps[1]
    assert final["val/accuracy"] >= 0.65  # 256 held-out pairs: chance is 0.5 +- 0.03
    assert final["val/rewards_chosen_mean"] > final["val/rewards_rejected_mean"]
