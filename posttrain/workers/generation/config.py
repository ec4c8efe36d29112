"""Typed configuration of the generation backends (one section: `generation`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from posttrain.config import ConfigError

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank values


@dataclass
class GenerationConfig:
    """How rollouts are sampled and where the generation workers run."""

    backend: Literal["auto", "hf", "vllm"] = "auto"
    """hf: transformers (CPU or GPU); vllm: vLLM (the `vllm` extra); auto: vllm when it is importable and
    the workers have GPUs, else hf."""
    max_new_tokens: int = 64
    """Most tokens generated per sample."""
    temperature: float = 1.0
    """Sampling temperature (> 0); logprobs use it too."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1.0 keeps all tokens."""
    top_k: int | None = None
    """Keep only the k most likely tokens; None keeps all (no hidden default)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end a sample (kept in the output); None: the tokenizer's EOS."""
    stop_strings: list[str] | None = None
    """Strings that end every sample (kept); added to per-sample stop_strings."""
    num_workers: int = 1
    """Data-parallel generation workers when not colocated (colocated: one per policy bundle)."""
    colocated: bool = True
    """Share the policy's bundles (True) or run on a cluster of its own (False)."""
    colocated_offload: bool | Literal["auto"] = "auto"
    """Colocated on GPUs: the policy's weights and optimizer state leave the GPU while generating (True),
    never (False), or only when policy and generation would not fit together (auto: 4 x the policy's
    parameter bytes + the generation weights over half of the GPU)."""
    num_cpus_per_worker: float = 0.5
    """Logical CPUs of each generation actor on its own cluster (colocated: half a bundle)."""
    precision: Literal["float32", "bfloat16"] = "float32"
    """dtype of the generation model's weights and compute."""
    packed_weights: bool = True
    """hf backend, fp32 on a CPU: every linear layer computes with a copy of its weight laid out once for
    oneDNN, repacked after each refit (decoding ~1.4x faster at SmolLM2's size, for a second copy of the
    weights in memory); False: torch's own linear."""
    decode_loop: Literal["auto", "static", "eager"] = "auto"
    """hf backend: static: a static KV cache and mask, sampling and stop flags on the device, the host
    reading them every decode_sync_every steps, each step a CUDA graph on a GPU (dense text models without
    stop strings); eager: the host in every step (any model); auto: static on a GPU where it applies, else
    eager."""
    decode_sync_every: int = 8
    """hf backend, static decode loop: steps between reads of the stop flags."""
    seed: int = 0
    """Base seed; a call without seed uses seed + call index."""
    vllm_gpu_memory_utilization: float = 0.5
    """vLLM only: share of GPU memory the engine may take (on CPU: of CPU memory)."""
    vllm_max_model_len: int | None = None
    """vLLM only: context length of the engine (None: the model's)."""
    vllm_refit: Literal["memory", "disk"] = "memory"
    """vLLM only (the engine runs in the actor's process): memory: a refit hands it the tensors (vLLM's
    reload_weights with a weights iterator); disk: a refit writes the model as safetensors for it to reload
    (for vLLM builds without an in-memory reload)."""
    vllm_lora_max_rank: int | None = None
    """vLLM only, with policy.lora: serve the adapter with vLLM's LoRA support (a refit loads the adapter
    only) for ranks up to this (8, 16, 32, ...); None: merge the adapter into the weights and reload them."""

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible setting of the `generation` section (the config load
        has checked the Literal fields' values already)."""
        minimums = {"max_new_tokens": 1, "decode_sync_every": 1, "num_workers": 1, "num_cpus_per_worker": 0}
        for key, least in minimums.items():
            if getattr(self, key) < least:
                raise ConfigError(key, f"must be >= {least}, got {getattr(self, key)}")
        if self.temperature <= 0:
            raise ConfigError("temperature", f"must be > 0 (greedy=True: argmax), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError("top_k", f"must be >= 1 or None (keep all tokens), got {self.top_k}")
        if self.vllm_lora_max_rank is not None and self.vllm_lora_max_rank not in VLLM_LORA_RANKS:
            raise ConfigError(
                "vllm_lora_max_rank", f"vLLM accepts one of {VLLM_LORA_RANKS}, got {self.vllm_lora_max_rank}"
            )
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError(
                "vllm_gpu_memory_utilization", f"must be in (0, 1], got {self.vllm_gpu_memory_utilization}"
            )
