"""A tiny mixture-of-experts model learns the tiny task with GRPO as the dense one does: SFT'd from
scratch (qwen3_moe, 4 experts, 2 per token) until its validation loss falls below 0.4 like the dense
fixture model, then the dense learning run's 40 steps x 128 samples with router replay on and the router
losses in the loss. Graded strictly (the reply's final number equals the sum) on 500 held-out prompts,
greedy: at least +0.05 over the start, the bar the dense estimators meet."""

from pathlib import Path

import pytest
from test_ppo import learning_run

from posttrain.algorithms import sft
from posttrain.config import load_typed_config

pytestmark = pytest.mark.slow  # a learning run: make test, not make test-fast

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MOE_MODEL = (
    "{architecture: qwen3_moe, hidden_size: 64, num_layers: 2, num_attention_heads: 4, num_experts: 4, "
    "num_experts_per_token: 2, expert_intermediate_size: 128, seed: 0}"
)


def sft_moe_model(log_dir: Path) -> Path:
    """The dense fixture's SFT recipe on the MoE model: until validation loss < 0.4 (at most 600 steps)."""
    overrides = [
        f"logger.log_dir={log_dir}",
        "logger.tensorboard_enabled=false",
        "checkpointing.enabled=false",
        f"policy.model.from_config={MOE_MODEL}",
        "policy.moe.load_balancing_coef=0.01",
        "policy.optimizer.kwargs.lr=3e-3",
        "sft.max_num_steps=600",
        "sft.max_val_samples=64",
        "sft.export_final_model=false",
        "cluster.num_cpus_per_worker=0.5",
    ]
    run = sft.setup(load_typed_config(sft.SFTConfig, str(CONFIGS / "sft_tiny.yaml"), overrides))
    try:
        val_loss = float("inf")
        while val_loss >= 0.4 and run.step < run.total_steps:
            val_loss = sft.sft_train(run, num_steps=25)["loss"]
        assert val_loss < 0.4, f"the MoE SFT start did not take off in {run.step} steps ({val_loss:.3f})"
        run.policy.export_hf(str(log_dir / "hf_model"))
    finally:
        run.shutdown()
    return log_dir / "hf_model"


def test_a_tiny_moe_raises_strict_held_out_accuracy_with_router_replay(ray_session, tmp_path):
    model = sft_moe_model(tmp_path / "sft")
    steps = learning_run(
        tmp_path / "grpo",
        model,
        "grpo",
        40,
        **{"policy.moe.router_replay": "true", "policy.moe.load_balancing_coef": 0.01},
    )
    start, end = steps[0]["val/strict_accuracy"], steps[40]["val/strict_accuracy"]
    print(f"MoE GRPO: strict accuracy {start:.3f} -> {end:.3f}")
    assert end >= start + 0.05
    assert all(steps[s]["train/moe_expert_share_min"] > 0 for s in (1, 40))  # no expert starves
