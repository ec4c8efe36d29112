"""Mixture-of-experts layers of Hugging Face Qwen3-MoE and Mixtral <-> Megatron Core's `MoELayer` (top-k
router, `SequentialMLP` experts): the MoE fields of the Megatron config, and the per-expert weight mapping
that `megatron_convert` uses for the MoE part of a layer.

HF (transformers 5) layer:  mlp.gate.weight [E, H] (the router), mlp.experts.gate_up_proj [E, 2I, H]
                            ([gate; up] of each expert), mlp.experts.down_proj [E, H, I]
Megatron layer:             mlp.router.weight [E, H]; mlp.experts.local_experts.{j}.linear_fc1.weight
                            [2I, H] and .linear_fc2.weight [H, I] of the j-th of this expert-parallel
                            rank's E/ep experts, which is global expert ep_rank x E/ep + j.
Routing: softmax over all experts in fp32, the top k, renormalised to sum to 1 (HF `norm_topk_prob`,
always for Mixtral) = Megatron's top-k of the logits then softmax over those k (`moe_router_pre_softmax`
false); without renormalisation = softmax first, then top-k (`moe_router_pre_softmax` true)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
EXPERT_NAME = re.compile(
    r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$"
)
HF_EXPERTS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}  # Megatron linear -> HF fused tensor


@dataclass
class MoeLayout:
    """The mixture-of-experts facts of a HF config."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    norm_topk_prob: bool


def moe_layout(hf_config: Any) -> MoeLayout | None:
    """The MoE layout of a HF Qwen3-MoE or Mixtral config (every layer sparse); None for a dense model."""
    model_type = hf_config.model_type
    if model_type not in MOE_MODEL_TYPES:
        return None
    if model_type == "qwen3_moe" and (
        getattr(hf_config, "mlp_only_layers", None) or getattr(hf_config, "decoder_sparse_step", 1) != 1
    ):
        raise ValueError(
            "policy.backend=megatron maps Qwen3-MoE models whose every layer is sparse "
            "(mlp_only_layers=[] and decoder_sparse_step=1)"
        )
    num_experts = getattr(hf_config, "num_experts", None) or hf_config.num_local_experts
    return MoeLayout(
        num_experts=num_experts,
        top_k=hf_config.num_experts_per_tok,
        expert_ffn_hidden_size=(
            hf_config.moe_intermediate_size if model_type == "qwen3_moe" else hf_config.intermediate_size
        ),
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", True)),
    )


def check_moe_pipeline(moe: MoeLayout | None, pp: int) -> None:
    """ValueError naming the key when an MoE model is asked for pipeline stages (its router losses are read
    on one stage); `Policy` has checked the expert split (handle.check_expert_split)."""
    if moe is not None and pp > 1:
        raise ValueError(
            f"policy.megatron.pipeline_model_parallel_size={pp} with a mixture-of-experts model: "
            "policy.backend=megatron runs MoE models with data and expert parallelism only; set it to 1"
        )


def moe_config_fields(moe: MoeLayout | None) -> dict[str, Any]:
    """Megatron TransformerConfig fields of the model's MoE layers ({} for a dense model): routing as the HF
    router does it, per-expert MLPs (no grouped GEMM, which needs CUDA kernels), no token dropping."""
    if moe is None:
        return {}
    return {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.top_k,
        "moe_ffn_hidden_size": moe.expert_ffn_hidden_size,
        "moe_router_pre_softmax": not moe.norm_topk_prob,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": False,
    }


def moe_training_fields(
    moe: MoeLayout | None, num_layers: int, load_balancing_coef: float, z_loss_coef: float, dispatcher: str
) -> dict[str, Any]:
    """Megatron's router losses and token dispatcher for `policy.moe` ({} for a dense model). Megatron adds
    each layer's losses (load balancing: E x sum_e f_e P_e with f counting each token once, 1 when balanced;
    z-loss: mean logsumexp^2) and sums them over layers; posttrain's coefficients weight the mean over
    layers with the load-balancing loss as transformers scales it (k when balanced), hence the division by
    the layers and the factor k."""
    if moe is None:
        return {}
    return {
        "moe_aux_loss_coeff": load_balancing_coef * moe.top_k / num_layers,
        "moe_z_loss_coeff": z_loss_coef / num_layers if z_loss_coef > 0 else None,
        "moe_token_dispatcher_type": dispatcher,
    }


def is_expert_name(name: str) -> bool:
    return EXPERT_NAME.match(name) is not None


def with_global_expert(name: str, expert_offset: int) -> str:
    """A local expert parameter's name with its global expert index (other names unchanged)."""
    match = EXPERT_NAME.match(name)
    if match is None:
        return name
    layer, expert, linear = match.groups()
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{int(expert) + expert_offset}.{linear}.weight"


def expert_from_hf(hf_weights: dict[str, torch.Tensor], name: str, layer_offset: int, expert_offset: int):
    """The Megatron tensor of the expert parameter `name` (local index + expert_offset = HF expert index)."""
    layer, expert, linear = EXPERT_NAME.match(name).groups()
    key = f"model.layers.{layer_offset + int(layer)}.mlp.experts.{HF_EXPERTS[linear]}"
    return hf_weights[key][expert_offset + int(expert)]


def experts_to_hf(expert_weights: dict[str, torch.Tensor], layer_offset: int) -> dict[str, torch.Tensor]:
    """HF fused expert tensors [E, ...] of one stage from every expert's Megatron tensor (global names)."""
    by_key: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in expert_weights.items():
        layer, expert, linear = EXPERT_NAME.match(name).groups()
        key = f"model.layers.{layer_offset + int(layer)}.mlp.experts.{HF_EXPERTS[linear]}"
        by_key.setdefault(key, {})[int(expert)] = tensor
    return {key: torch.stack([experts[e] for e in sorted(experts)]) for key, experts in by_key.items()}


def allow_missing_transformer_engine() -> None:
    """megatron-core 0.16's router reads `moe_utils.te_general_gemm`, which it defines only when Transformer
    Engine is installed: define it as None (its own fallback: a torch matmul) when it is missing."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
