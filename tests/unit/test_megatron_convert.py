"""HF Llama/Qwen2 <-> Megatron GPTModel weight mapping (pure tensor code, no Megatron needed): the q/k/v
interleaving by hand, and HF -> per-TP-rank Megatron shards -> HF is the identity."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from posttrain.workers.policy import megatron_convert as mc


def test_qkv_rows_interleave_per_kv_group_by_hand():
    """4 query heads, 2 kv heads, head_dim 1: group g holds its 2 query heads, then k_g, then v_g:
    [q0, q1, k0, v0, q2, q3, k1, v1]; split_qkv undoes it."""
    layout = mc.GPTLayout(
        num_layers=1,
        hidden_size=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=1,
        ffn_hidden_size=4,
        vocab_size=8,
        padded_vocab_size=8,
        tied_embeddings=False,
        qkv_bias=True,
    )
    q, k, v = torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])
    qkv = mc.interleave_qkv(q, k, v, layout)
    assert qkv.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [t.tolist() for t in mc.split_qkv(qkv, layout)] == [q.tolist(), k.tolist(), v.tolist()]


def megatron_names(num_layers: int, qkv_bias: bool) -> list[str]:
    layer = [
        "input_layernorm.weight",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight",
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
    ]
    layer += ["self_attention.linear_qkv.bias"] if qkv_bias else []
    names = [f"decoder.layers.{i}.{part}" for i in range(num_layers) for part in layer]
    return [
        "embedding.word_embeddings.weight",
        *names,
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    ]


@pytest.mark.parametrize("config_class, tied", [(Qwen2Config, False), (LlamaConfig, True)])
def test_hf_to_tp_shards_and_back_is_the_identity(config_class, tied):
    """Vocabulary 101 is padded to 102 for TP 2 (a zero row), GQA 4/2 heads, Qwen2's q/k/v biases."""
    torch.manual_seed(0)
    config = config_class(
        vocab_size=101,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=24,
        tie_word_embeddings=tied,
    )
    hf_weights = AutoModelForCausalLM.from_config(config).state_dict()
    layout = mc.gpt_layout(config, tp_size=2)
    assert (layout.padded_vocab_size, layout.qkv_bias) == (102, config_class is Qwen2Config)
    names = megatron_names(2, layout.qkv_bias)
    shards = [mc.hf_to_megatron(hf_weights, names, 0, layout, rank, 2) for rank in range(2)]
    assert shards[0]["embedding.word_embeddings.weight"].shape == (51, 16)
    assert shards[1]["decoder.layers.0.mlp.linear_fc1.weight"].shape == (24, 16)  # its 12 gate + 12 up rows
    torch.testing.assert_close(
        shards[1]["decoder.layers.0.mlp.linear_fc1.weight"][:12],
        hf_weights["model.layers.0.mlp.gate_proj.weight"][12:],
        atol=0,
        rtol=0,
    )
    full = {name: mc.merge_tp_shards(name, [shard[name] for shard in shards], layout) for name in names}
    back = mc.megatron_to_hf(full, 0, layout)
    assert set(back) == set(hf_weights)
    for name, tensor in hf_weights.items():
        torch.testing.assert_close(back[name], tensor, atol=0, rtol=0, msg=name)


def test_unmapped_models_are_refused_by_name():
    with pytest.raises(ValueError, match="must divide num_attention_heads=4 and num_key_value_heads=2"):
        mc.gpt_layout(LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=16), tp_size=4)
    with pytest.raises(ValueError, match="RoPE scaling 'linear'"):
        mc.rope_theta(LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}))
