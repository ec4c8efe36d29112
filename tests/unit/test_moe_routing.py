"""Mixture-of-experts pieces without Ray: tiny MoE models built from a config, router losses against
hand-derived values, router replay in a real forward, expert-load metrics, and router replay on a dense
model as a config error."""

import math
from pathlib import Path

import pytest
import torch

from posttrain.algorithms import grpo
from posttrain.config import ConfigError, load_typed_config
from posttrain.models.build import ModelFromConfig, build_model_dir, load_model
from posttrain.models.moe import (
    RouterTap,
    expert_counts,
    expert_load_metrics,
    load_balancing_loss,
    moe_routers,
    router_z_loss,
)
from posttrain.workers.policy.config import PolicyConfig
from posttrain.workers.policy.dtensor import DTensorPolicyWorker

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY_MOE = {"hidden_size": 32, "num_layers": 2, "num_attention_heads": 2, "num_experts": 4}


def test_load_balancing_loss_equals_the_hand_derived_switch_value():
    """One layer, E = 2, k = 1, two tokens. Logits [0, 0] -> p = [1/2, 1/2]; [ln 3, 0] -> p = [3/4, 1/4];
    both tokens go to expert 0: f = [2/2, 0/2] = [1, 0], P = [(1/2 + 3/4)/2, (1/2 + 1/4)/2] =
    [5/8, 3/8]; loss = E * sum f * P = 2 * 5/8 = 1.25. A third token masked out changes nothing."""
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [9.0, -9.0]])  # [N, E]
    indices = torch.tensor([[0], [0], [1]])[:, None, :]  # [N, L=1, k=1]
    mask = torch.tensor([1.0, 1.0, 0.0])
    assert load_balancing_loss([logits], indices, mask).item() == pytest.approx(1.25, abs=1e-6)
    # Perfectly balanced (each expert chosen once, uniform probabilities): the value is k = 1.
    balanced = load_balancing_loss([torch.zeros(2, 2)], torch.tensor([[[0]], [[1]]]), torch.ones(2))
    assert balanced.item() == pytest.approx(1.0)


def test_load_balancing_loss_matches_transformers_on_real_router_logits(tmp_path):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    build_model_dir(ModelFromConfig(architecture="qwen3_moe", **TINY_MOE), tmp_path)
    model = load_model(tmp_path)
    input_ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    with RouterTap(model) as tap:
        hf = model(input_ids=input_ids, output_router_logits=True).router_logits
    ours = load_balancing_loss(tap.layer_logits(), tap.layer_indices(), torch.ones(18))
    assert ours.item() == pytest.approx(load_balancing_loss_func(hf, 4, 2).item(), rel=1e-6)


def test_router_z_loss_is_the_mean_squared_logsumexp():
    """Logits [0, 0] -> lse = ln 2; [ln 3, 0] -> lse = ln 4 = 2 ln 2; mean of squares = 5/2 (ln 2)^2."""
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = 2.5 * math.log(2.0) ** 2
    assert router_z_loss([logits], torch.ones(2)).item() == pytest.approx(expected, rel=1e-6)


def test_expert_load_counts_each_chosen_expert_of_each_unmasked_token():
    indices = torch.tensor([[[0, 1]], [[0, 2]], [[3, 2]]])  # [N=3, L=1, k=2]
    counts = expert_counts(indices, torch.tensor([1.0, 1.0, 0.0]), 4)
    assert counts.tolist() == [[2.0, 1.0, 1.0, 0.0]]
    metrics = expert_load_metrics(counts)
    assert metrics == {
        "moe_tokens_per_expert_min": 0.0,
        "moe_tokens_per_expert_max": 2.0,
        "moe_expert_share_min": 0.0,
        "moe_expert_share_max": 0.5,
    }


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_create_model_builds_a_seeded_moe_with_the_configured_experts(tmp_path, architecture):
    cfg = ModelFromConfig(architecture=architecture, num_experts_per_token=3, **TINY_MOE)
    build_model_dir(cfg, tmp_path / "a")
    build_model_dir(cfg, tmp_path / "b")
    model, again = load_model(tmp_path / "a"), load_model(tmp_path / "b")
    routers = moe_routers(model)
    assert [(r.num_experts, r.top_k) for r in routers] == [(4, 3), (4, 3)]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    has_shared = any("shared_expert" in name for name, _ in model.named_parameters())
    assert has_shared == (architecture == "qwen2_moe")


def test_replayed_experts_are_the_ones_the_experts_compute_with_router_weights_that_get_gradients(
    tmp_path,
):
    """Replaying the router's own choice changes nothing; replaying another choice makes the experts
    compute with it, the weights being the router's renormalised softmax at those experts."""
    build_model_dir(ModelFromConfig(architecture="qwen3_moe", **TINY_MOE), tmp_path)
    model = load_model(tmp_path)
    input_ids = torch.randint(3, 60, (2, 5), generator=torch.Generator().manual_seed(1))
    with RouterTap(model) as own:
        plain = model(input_ids=input_ids).logits
    chosen = own.layer_indices()  # [10, L, 2]
    with RouterTap(model, replay=chosen):
        assert torch.equal(model(input_ids=input_ids).logits, plain)
    other = (chosen + 1) % 4
    other[0] = -1  # not recorded: the router's own choice
    used = []
    hooks = [r.register_forward_hook(lambda m, i, o: used.append(o)) for r in moe_routers(model)]
    experts = [layer.mlp.experts for layer in model.model.layers]
    seen = []  # (top_k_index, top_k_weights) the experts received
    pre = [e.register_forward_pre_hook(lambda m, args: seen.append(args[1:])) for e in experts]
    with RouterTap(model, replay=other):
        logits = model(input_ids=input_ids).logits
    for handle in hooks + pre:
        handle.remove()
    assert not torch.equal(logits, plain)
    for layer in range(2):
        expected = torch.where(other[:, layer] < 0, chosen[:, layer], other[:, layer])
        indices, weights = seen[layer]
        assert torch.equal(indices, expected)
        probs = torch.softmax(used[layer][0].float(), -1).gather(-1, expected)  # from the router's logits
        torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True))
    logits.sum().backward()
    assert all(float(r.weight.grad.abs().sum()) > 0 for r in moe_routers(model))


def test_router_replay_on_a_dense_model_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"policy\.moe\.router_replay"):
        load_typed_config(
            grpo.GRPOConfig,
            str(CONFIGS / "grpo_tiny.yaml"),
            [
                "policy.model_name=null",
                "policy.model.from_config={architecture: qwen2}",
                "policy.moe.router_replay=true",
            ],
        )
    with pytest.raises(ConfigError, match=r"policy\.moe\.router_replay.*generation\.backend=hf"):
        load_typed_config(
            grpo.GRPOConfig,
            str(CONFIGS / "grpo_moe_tiny.yaml"),
            ["generation.backend=vllm"],  # vLLM records no experts
        )
    dense = build_model_dir(ModelFromConfig(hidden_size=32, num_layers=1, num_attention_heads=2), tmp_path)
    cfg = PolicyConfig(model_name=str(dense))
    cfg.moe.router_replay = True
    with pytest.raises(ValueError, match=r"policy\.moe\.router_replay=true but .* is a dense model"):
        DTensorPolicyWorker(cfg)


def test_recorded_experts_travel_from_generation_shards_to_the_train_batch_at_their_tokens():
    """Two generation shards of different widths merge with -1 padding; an assistant message's experts
    land at its tokens' positions of the flat train row, everything else -1."""
    from posttrain.distributed import BatchedDataDict

    def shard(width, value):
        return {
            "output_ids": torch.zeros(1, width, dtype=torch.long),
            "logprobs": torch.zeros(1, width),
            "generation_lengths": torch.ones(1, dtype=torch.long),
            "unpadded_sequence_lengths": torch.full((1,), width),
            "truncated": torch.zeros(1, dtype=torch.bool),
            "routed_experts": torch.full((1, width, 2, 1), value, dtype=torch.int16),
        }

    merged = BatchedDataDict.from_batches([shard(3, 5), shard(2, 7)], {"output_ids": 0, "routed_experts": -1})
    assert merged["routed_experts"][:, :, 0, 0].tolist() == [[5, 5, 5], [7, 7, -1]]

    experts = torch.tensor([[[1], [2]], [[3], [0]]], dtype=torch.int16)  # two tokens, L = 2, k = 1
    logs = [
        [
            {"role": "user", "token_ids": torch.tensor([9, 9, 9])},
            {"role": "assistant", "token_ids": torch.tensor([4, 4]), "routed_experts": experts},
        ],
        [{"role": "user", "token_ids": torch.tensor([9])}],
    ]
    routed = grpo.flat_routed_experts(logs, num_cols=6)  # [B, T, L, k]
    assert routed.shape == (2, 6, 2, 1)
    assert routed[0, 3:5].tolist() == experts.tolist()
    assert (routed[0, :3] == -1).all() and (routed[0, 5:] == -1).all() and (routed[1] == -1).all()
    assert grpo.flat_routed_experts([logs[1]], num_cols=2) is None  # a dense generator recorded nothing
