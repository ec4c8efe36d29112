"""Hugging Face Llama / Qwen2 / Qwen3-MoE / Mixtral <-> Megatron Core `GPTModel` (local layer spec): the
model's config, and the weight mapping in both directions, sharded over tensor-parallel ranks, pipeline stages
and (experts of MoE layers, see megatron_moe_convert) expert-parallel ranks.

Megatron layout of one layer (TP shards along the first dim unless noted):
  linear_qkv   [groups x (q heads of the group, k, v) x head_dim, H]  (q/k/v interleaved per kv group)
  linear_proj  [H, heads x head_dim]                                   (TP shards along dim 1)
  linear_fc1   [gate; up] of this rank's slice of the FFN                (SwiGLU)
  linear_fc2   [H, FFN]                                                  (TP shards along dim 1)
  q_layernorm, k_layernorm [head_dim]  (Qwen3-MoE's q_norm / k_norm; replicated)
The vocabulary is padded to a multiple of the TP size (rows of zeros); logits past it are cut off. A reward
model (a HF `*ForSequenceClassification`) has `ScoreHead` ([1, H], replicated over TP) as its output layer."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.workers.policy.megatron_moe_convert import (
    MoeLayout,
    allow_missing_transformer_engine,
    expert_from_hf,
    experts_to_hf,
    is_expert_name,
    moe_config_fields,
    moe_layout,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3_moe", "mixtral")


@dataclass
class GPTLayout:
    """The facts of a HF config that the mapping needs."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    reward_model: bool = False  # output layer = the [1, H] score head, not the vocabulary projection
    qk_norm: bool = False  # RMSNorm of each query and key head (Qwen3)
    moe: MoeLayout | None = None  # the MoE layers' facts (None: a dense model)


def rope_theta(hf_config: Any) -> float:
    """RoPE base of a transformers config (v4 `rope_theta`, v5 `rope_parameters`); only plain RoPE."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(
            f"policy.backend=megatron: RoPE scaling {rope_type!r} is not mapped (only plain RoPE)"
        )
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def gpt_layout(hf_config: Any, tp_size: int) -> GPTLayout:
    """Layout of a HF Llama/Qwen2/Qwen3-MoE/Mixtral config at `tp_size`; ValueError for what the mapping
    does not cover."""
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"policy.backend=megatron maps {SUPPORTED_MODEL_TYPES} models; this one is {model_type!r}"
        )
    if getattr(hf_config, "mlp_bias", False) or (
        model_type != "qwen2" and getattr(hf_config, "attention_bias", False)
    ):
        raise ValueError(
            f"policy.backend=megatron: {model_type} models with attention_bias/mlp_bias are not mapped"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"policy.backend=megatron: hidden_act {hf_config.hidden_act!r} is not mapped (silu)")
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    if num_heads % tp_size or num_kv_heads % tp_size:
        raise ValueError(
            f"policy.megatron.tensor_model_parallel_size={tp_size} must divide "
            f"num_attention_heads={num_heads} and num_key_value_heads={num_kv_heads}"
        )
    moe = moe_layout(hf_config)
    if moe is not None and tp_size > 1:
        raise ValueError(
            f"policy.megatron.tensor_model_parallel_size={tp_size} with a mixture-of-experts model: "
            "policy.backend=megatron runs MoE models at tensor_model_parallel_size=1"
        )
    if hf_config.intermediate_size % tp_size:
        raise ValueError(
            f"policy.megatron.tensor_model_parallel_size={tp_size} must divide intermediate_size="
            f"{hf_config.intermediate_size}"
        )
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    vocab_size = hf_config.vocab_size
    architecture = (getattr(hf_config, "architectures", None) or [""])[0]
    return GPTLayout(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=vocab_size,
        padded_vocab_size=-(-vocab_size // tp_size) * tp_size,
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        reward_model=architecture.endswith("ForSequenceClassification"),
        qk_norm=model_type == "qwen3_moe",
        moe=moe,
    )


LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
HF_LAYER_PARTS = {
    "input_layernorm.weight": ["input_layernorm.weight"],
    "self_attention.linear_qkv.weight": [f"self_attn.{p}_proj.weight" for p in "qkv"],
    "self_attention.linear_qkv.bias": [f"self_attn.{p}_proj.bias" for p in "qkv"],
    "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
    "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
    "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
    "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
    "mlp.router.weight": ["mlp.gate.weight"],
    "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
}
TP_DIM = {  # the dim a Megatron tensor is split along over TP ranks; the others (norms, router): replicated
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
}


def tp_dim(name: str, layout: GPTLayout) -> int | None:
    """The dim along which the Megatron parameter `name` is sharded over TP ranks (None: replicated)."""
    if (name == "output_layer.weight" and layout.reward_model) or is_expert_name(name):
        return None  # experts are whole on every rank: MoE models run at TP 1
    match = LAYER_NAME.match(name)
    return TP_DIM.get(match.group(2) if match else name)


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: GPTLayout) -> torch.Tensor:
    """HF q [nq*d, ...], k/v [nkv*d, ...] -> Megatron's per-group [q of the group, k, v] rows."""
    heads_per_group = layout.num_heads // layout.num_kv_heads
    d = layout.head_dim
    q = q.reshape(layout.num_kv_heads, heads_per_group * d, *q.shape[1:])
    k = k.reshape(layout.num_kv_heads, d, *k.shape[1:])
    v = v.reshape(layout.num_kv_heads, d, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def split_qkv(qkv: torch.Tensor, layout: GPTLayout) -> list[torch.Tensor]:
    """Inverse of interleave_qkv: [q, k, v] in HF layout."""
    heads_per_group = layout.num_heads // layout.num_kv_heads
    d = layout.head_dim
    grouped = qkv.reshape(layout.num_kv_heads, (heads_per_group + 2) * d, *qkv.shape[1:])
    q, k, v = grouped.split([heads_per_group * d, d, d], dim=1)
    return [t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v)]


def pad_vocab(weight: torch.Tensor, layout: GPTLayout) -> torch.Tensor:
    return torch.nn.functional.pad(weight, (0, 0, 0, layout.padded_vocab_size - weight.shape[0]))


def hf_to_megatron(
    hf_weights: dict[str, torch.Tensor],
    megatron_names: list[str],
    layer_offset: int,
    layout: GPTLayout,
    tp_rank: int,
    tp_size: int,
    expert_offset: int = 0,
) -> dict[str, torch.Tensor]:
    """This rank's tensors for each Megatron parameter name of its stage (local layer i = global layer
    layer_offset + i; local expert j = HF expert expert_offset + j), from full HF weights (`model.*`,
    `lm_head.weight`)."""
    local: dict[str, torch.Tensor] = {}
    for name in megatron_names:
        if is_expert_name(name):
            local[name] = expert_from_hf(hf_weights, name, layer_offset, expert_offset)
            continue
        full = full_megatron_tensor(hf_weights, name, layer_offset, layout)
        dim = tp_dim(name, layout)
        if name.endswith("mlp.linear_fc1.weight"):  # each rank holds [its gate slice; its up slice]
            gate, up = full.chunk(2, dim=0)
            local[name] = torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
        elif dim is None:
            local[name] = full
        else:
            local[name] = full.chunk(tp_size, dim=dim)[tp_rank]
    return local


def full_megatron_tensor(
    hf_weights: dict[str, torch.Tensor], name: str, layer_offset: int, layout: GPTLayout
) -> torch.Tensor:
    """The unsharded Megatron tensor `name` built from HF weights."""
    if name == "embedding.word_embeddings.weight":
        return pad_vocab(hf_weights["model.embed_tokens.weight"], layout)
    if name == "output_layer.weight" and layout.reward_model:
        return hf_weights["score.weight"]
    if name == "output_layer.weight":
        key = "model.embed_tokens.weight" if layout.tied_embeddings else "lm_head.weight"
        return pad_vocab(hf_weights[key], layout)
    if name == "decoder.final_layernorm.weight":
        return hf_weights["model.norm.weight"]
    match = LAYER_NAME.match(name)
    if match is None:
        raise KeyError(f"no Hugging Face weight maps to the Megatron parameter {name}")
    prefix = f"model.layers.{layer_offset + int(match.group(1))}."
    parts = [hf_weights[prefix + part] for part in HF_LAYER_PARTS[match.group(2)]]
    if "linear_qkv" in name:
        return interleave_qkv(*parts, layout)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def merge_tp_shards(name: str, shards: list[torch.Tensor], layout: GPTLayout) -> torch.Tensor:
    """The unsharded Megatron tensor `name` from its TP shards (in TP rank order)."""
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    dim = tp_dim(name, layout)
    return shards[0] if dim is None else torch.cat(shards, dim=dim)


def megatron_to_hf(
    full_weights: dict[str, torch.Tensor], layer_offset: int, layout: GPTLayout
) -> dict[str, torch.Tensor]:
    """HF tensors (`model.*`, `lm_head.weight`) of one stage's unsharded Megatron tensors (every expert of
    an MoE layer, under its global index)."""
    experts = {name: tensor for name, tensor in full_weights.items() if is_expert_name(name)}
    hf: dict[str, torch.Tensor] = experts_to_hf(experts, layer_offset)
    for name, tensor in full_weights.items():
        if name in experts:
            continue
        if name == "embedding.word_embeddings.weight":
            hf["model.embed_tokens.weight"] = tensor[: layout.vocab_size]
            if layout.tied_embeddings and not layout.reward_model:  # tied HF state dicts list both names
                hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
        elif name == "output_layer.weight" and layout.reward_model:
            hf["score.weight"] = tensor
        elif name == "output_layer.weight":
            hf["lm_head.weight"] = tensor[: layout.vocab_size]
        elif name == "decoder.final_layernorm.weight":
            hf["model.norm.weight"] = tensor
        else:
            match = LAYER_NAME.match(name)
            prefix = f"model.layers.{layer_offset + int(match.group(1))}."
            part_names = HF_LAYER_PARTS[match.group(2)]
            if "linear_qkv" in name:
                parts = split_qkv(tensor, layout)
            elif len(part_names) == 2:
                parts = list(tensor.chunk(2, dim=0))
            else:
                parts = [tensor]
            for part_name, part in zip(part_names, parts):
                hf[prefix + part_name] = part
    return hf


def transformer_config(
    hf_config: Any, parallel: dict[str, Any], bf16: bool, moe_training: dict[str, Any] | None = None
) -> Any:
    """Megatron's TransformerConfig of a HF config. `parallel`: tensor_model_parallel_size,
    pipeline_model_parallel_size, sequence_parallel (and expert_model_parallel_size); `moe_training`: an MoE
    model's router losses and token dispatcher (megatron_moe_convert.moe_training_fields). Fusions that need
    CUDA kernels are off."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = gpt_layout(hf_config, parallel["tensor_model_parallel_size"])
    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads,
        kv_channels=layout.head_dim,
        ffn_hidden_size=layout.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        qk_layernorm=layout.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=True,
        calculate_per_token_loss=True,  # losses arrive normalised by global counts: sum, never average
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        **(moe_config_fields(layout.moe) | (moe_training or {}) | parallel),
    )


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm taking Megatron's norm arguments, and usable with sequence parallelism (Megatron's own
    torch-norm wrapper refuses it; the fused ones need Apex or TransformerEngine): its weight is marked so
    that Megatron all-reduces its gradient over the TP ranks, each of which saw part of the sequence."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


class ScoreHead(torch.nn.Module):
    """A reward model's score projection [1, H] in GPTModel's output-layer slot, replicated over TP ranks
    (it sees the whole sequence: with sequence parallelism its input is gathered first)."""

    def __init__(self, config: Any, hidden_size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=config.params_dtype))
        self.sequence_parallel = config.sequence_parallel

    def forward(
        self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if self.sequence_parallel:
            # every rank computes the whole gradient of its input: split it back (no reduce-scatter sum)
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        return torch.nn.functional.linear(hidden_states, self.weight), None  # [s, b, 1]


def block_spec(config: Any) -> Any:
    """Megatron's local layer spec (MoE layers with per-expert MLPs when the config has experts) with
    SequenceParallelRMSNorm for every norm, for this stage's layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer_spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm, normalization="RMSNorm"
    )
    layer_spec.submodules.input_layernorm = SequenceParallelRMSNorm
    layer_spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    if config.qk_layernorm:
        layer_spec.submodules.self_attention.submodules.q_layernorm = SequenceParallelRMSNorm
        layer_spec.submodules.self_attention.submodules.k_layernorm = SequenceParallelRMSNorm
    layer_specs = [layer_spec] * get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=SequenceParallelRMSNorm)


def build_gpt_model(hf_config: Any, config: Any, pre_process: bool, post_process: bool) -> Any:
    """A GPTModel (local layer spec, RoPE) for this pipeline stage; logits gathered over TP ranks."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    layout = gpt_layout(hf_config, config.tensor_model_parallel_size)
    if layout.moe is not None:
        allow_missing_transformer_engine()
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config),
        vocab_size=layout.padded_vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=False,
        share_embeddings_and_output_weights=layout.tied_embeddings and not layout.reward_model,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )
    if layout.reward_model and post_process:
        model.output_layer = ScoreHead(config, layout.hidden_size)
    return model
