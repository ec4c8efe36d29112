"""LoRA helpers without Ray: the merge that vLLM refits use (by hand and against peft's own), the refit
payload's byte count, and the config errors of `policy.lora`."""

from __future__ import annotations

import pytest
import torch

from posttrain.config import ConfigError, validate_config
from posttrain.models.build import ModelFromConfig, build_model_dir, load_model
from posttrain.models.lora import (
    AdapterWeights,
    LoraConfig,
    adapter_weights,
    apply_adapter,
    merge_adapter,
    payload_num_bytes,
    wrap_with_lora,
)
from posttrain.workers.policy.config import PolicyConfig


def test_merge_adds_scaled_b_times_a_to_the_base_weight():
    """W = 0 (2 x 2), A = [[1, 2]] (r = 1), B = [[1], [0]], alpha = 2: W' = (2 / 1) * B @ A = [[2, 4], [0,
    0]].
    Weights the adapter does not touch are not returned."""
    cfg = LoraConfig(enabled=True, rank=1, alpha=2.0)
    adapter = AdapterWeights(
        cfg,
        "causal_lm",
        {
            "base_model.model.layer.proj.lora_A.weight": torch.tensor([[1.0, 2.0]]),
            "base_model.model.layer.proj.lora_B.weight": torch.tensor([[1.0], [0.0]]),
        },
    )
    base = {"layer.proj.weight": torch.zeros(2, 2), "layer.other.weight": torch.ones(2, 2)}
    merged = merge_adapter(base, adapter)
    assert merged.keys() == {"layer.proj.weight"}
    assert merged["layer.proj.weight"].tolist() == [[2.0, 4.0], [0.0, 0.0]]
    assert base["layer.proj.weight"].tolist() == [[0.0, 0.0], [0.0, 0.0]]  # the base is left as it was
    assert payload_num_bytes(adapter) == (2 + 2) * 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = ModelFromConfig(
        architecture="llama", hidden_size=32, num_layers=2, num_attention_heads=2, intermediate_size=64
    )
    return build_model_dir(cfg, tmp_path_factory.mktemp("lora_unit"))


def trained_peft_model(model_dir, cfg: LoraConfig) -> torch.nn.Module:
    """A peft model whose adapters are random (as after training: B no longer 0)."""
    model = wrap_with_lora(load_model(model_dir), cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def test_merge_equals_peft_merge_and_apply_adapter_equals_the_trained_model(model_dir):
    cfg = LoraConfig(enabled=True, rank=4, alpha=8.0)
    model = trained_peft_model(model_dir, cfg)
    trainable = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    adapter = adapter_weights(model, trainable, cfg, "causal_lm")
    input_ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        expected_logits = model(input_ids=input_ids).logits
        applied = apply_adapter(load_model(model_dir), adapter)  # what an HF generation worker does
        torch.testing.assert_close(applied(input_ids=input_ids).logits, expected_logits, atol=1e-6, rtol=0)
    base = load_model(model_dir).state_dict()
    merged = merge_adapter(base, adapter)  # what a vLLM generation worker does
    assert len(merged) == 2 * 7  # every targeted projection of both layers
    peft_merged = model.merge_and_unload().state_dict()
    for name, weight in merged.items():
        torch.testing.assert_close(weight, peft_merged[name], atol=1e-6, rtol=0, msg=name)


def test_target_modules_that_match_nothing_name_the_key(model_dir):
    with pytest.raises(ConfigError, match=r"policy\.lora\.target_modules.*q_proj"):
        wrap_with_lora(load_model(model_dir), LoraConfig(enabled=True, target_modules=["query"]))


def test_lora_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"lora\.rank: must be >= 1"):
        validate_config(PolicyConfig, {"model_name": "m", "lora": {"enabled": True, "rank": 0}})
    validate_config(PolicyConfig, {"model_name": "m", "tensor_parallel_size": 2, "lora": {"enabled": True}})
    with pytest.raises(
        ConfigError, match=r"policy\.lora\.modules_to_save=\['o_proj'\] with policy\.tensor_parallel_size=2"
    ):
        validate_config(
            PolicyConfig,
            {
                "model_name": "m",
                "tensor_parallel_size": 2,
                "lora": {"enabled": True, "modules_to_save": ["o_proj", "score"]},
            },
        )


def test_vllm_lora_rank_must_be_a_vllm_bucket_at_least_the_adapter_rank():
    from posttrain.algorithms.grpo import GRPOConfig

    with pytest.raises(ConfigError, match=r"vllm_lora_max_rank: vLLM accepts one of"):
        validate_config(GRPOConfig, {"generation": {"vllm_lora_max_rank": 3}})
    with pytest.raises(
        ConfigError, match=r"generation\.vllm_lora_max_rank: 8 is below policy\.lora\.rank=16"
    ):
        validate_config(
            GRPOConfig,
            {
                "generation": {"vllm_lora_max_rank": 8},
                "policy": {"model_name": "m", "lora": {"enabled": True, "rank": 16}},
            },
        )
