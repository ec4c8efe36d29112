"""Model and tokenizer loading for every backend, and tiny seeded models built from an architecture config.

`build_model_dir` is the documented way to create an offline Hugging Face model directory to start from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from posttrain.config import ConfigError, validate_config
from posttrain.models.tokenizer import TOKENIZERS
from posttrain.models.tokenizer import load_tokenizer as load_tokenizer  # re-exported for its callers
from posttrain.models.vlm import build_vlm_dir, is_vision_language_dir, write_seeded_model

ARCHITECTURES: dict[str, type[PretrainedConfig]] = {
    "qwen2": Qwen2Config,
    "llama": LlamaConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "mixtral": MixtralConfig,
    "qwen2_moe": Qwen2MoeConfig,
}
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe")  # every decoder layer a mixture of experts
VISION_ARCHITECTURES = ("qwen2_vl",)  # built by posttrain.models.vlm (a tiny vision tower + this text model)


@dataclass
class ModelFromConfig:
    """A decoder-only model with seeded random weights and a built-in tokenizer (character or byte-level)."""

    architecture: str = "qwen2"
    """Model family: 'qwen2', 'llama', 'qwen2_vl' (a vision-language Qwen2-VL), or a mixture of experts:
    'qwen3_moe', 'mixtral', 'qwen2_moe' (with a shared expert)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_attention_heads: int = 4
    """Number of query heads per layer."""
    num_key_value_heads: int | None = None
    """Key/value heads (grouped-query attention); None = num_attention_heads."""
    intermediate_size: int = 512
    """Hidden width of the MLP."""
    max_position_embeddings: int = 512
    """Longest sequence the model supports."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the output projection."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities while training (0: none)."""
    num_experts: int = 8
    """Routed experts per MoE layer (MoE families)."""
    num_experts_per_token: int = 2
    """Experts each token is routed to (top-k; MoE families)."""
    expert_intermediate_size: int = 128
    """Hidden width of one expert's MLP (MoE families)."""
    shared_expert_intermediate_size: int = 256
    """Hidden width of the shared expert every token goes through (qwen2_moe only)."""
    seed: int = 0
    """Seed of the random initial weights."""
    tokenizer: Literal["char", "byte"] = "char"
    """Built-in tokenizer: 'char' (one token per character, ~105) or 'byte' (byte-level BPE, 300)."""

    def validate(self) -> None:
        if self.tokenizer not in TOKENIZERS:
            raise ConfigError("tokenizer", f"{self.tokenizer!r} is not one of {sorted(TOKENIZERS)}")
        if self.architecture not in ARCHITECTURES and self.architecture not in VISION_ARCHITECTURES:
            raise ConfigError(
                "architecture",
                f"{self.architecture!r} is not one of {sorted(ARCHITECTURES) + list(VISION_ARCHITECTURES)}",
            )
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "hidden_size",
                f"{self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}",
            )
        if not 1 <= self.num_experts_per_token <= self.num_experts:
            raise ConfigError(
                "num_experts_per_token",
                f"{self.num_experts_per_token} must be between 1 and num_experts={self.num_experts}",
            )
        num_kv_heads = self.num_key_value_heads or self.num_attention_heads
        if self.num_attention_heads % num_kv_heads:
            raise ConfigError(
                "num_attention_heads",
                f"{self.num_attention_heads} is not divisible by num_key_value_heads={num_kv_heads}",
            )


def make_hf_config(cfg: ModelFromConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The transformers config of `cfg`, with vocabulary size and special ids taken from `tokenizer`."""
    config_class = ARCHITECTURES[cfg.architecture]
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_dropout=cfg.attention_dropout,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return config_class(**(fields | moe_config_fields(cfg)))


def moe_config_fields(cfg: ModelFromConfig) -> dict[str, Any]:
    """The mixture-of-experts fields of the transformers config of `cfg` ({} for a dense family). Every
    layer is sparse; top-k weights are renormalised to sum to 1 (Mixtral always does); no router jitter."""
    if cfg.architecture == "mixtral":
        return {
            "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_token,
            "intermediate_size": cfg.expert_intermediate_size,
        }
    if cfg.architecture not in ("qwen3_moe", "qwen2_moe"):
        return {}
    fields = {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_token,
        "moe_intermediate_size": cfg.expert_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }
    if cfg.architecture == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return fields


def build_model_dir(cfg: ModelFromConfig, out_dir: str | Path) -> Path:
    """Write a Hugging Face directory (safetensors weights, config, tokenizer) of a seeded random model.

    The same `cfg` (seed included) always gives identical weights. Returns the directory."""
    if cfg.architecture in VISION_ARCHITECTURES:
        return build_vlm_dir(cfg, out_dir)
    tokenizer = TOKENIZERS[cfg.tokenizer]()
    hf_config = make_hf_config(cfg, tokenizer)
    build = lambda: AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)  # noqa: E731
    return write_seeded_model(build, cfg.seed, tokenizer, tokenizer, out_dir)


def load_model(path_or_name: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A causal LM (or an image-text-to-text model, for a vision-language directory) from a local Hugging Face
    directory or a hub name, in `dtype`."""
    return causal_lm_class(path_or_name).from_pretrained(str(path_or_name), dtype=dtype)


def causal_lm_class(path_or_name: str | Path) -> Any:
    """AutoModelForImageTextToText for a local vision-language directory, else AutoModelForCausalLM."""
    if is_vision_language_dir(path_or_name):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def main(args: Any) -> int:
    """`posttrain create-model OUT_DIR [key=value ...]`: a from-config model + tokenizer directory."""
    overrides = dict(item.split("=", 1) for item in args.overrides)
    values = {key: yaml.safe_load(value) for key, value in overrides.items()}
    cfg = validate_config(ModelFromConfig, values, {key: "command line" for key in overrides})
    out_dir = build_model_dir(cfg, args.out_dir)
    num_params = sum(p.numel() for p in load_model(out_dir).parameters())
    print(f"created {cfg.architecture} model ({num_params / 1e6:.2f}M parameters) in {out_dir}")
    return 0
