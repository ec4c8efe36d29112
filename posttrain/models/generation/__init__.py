"""Generation backends: the `GenerationInterface` contract, Hugging Face (`HFGeneration`) and vLLM
(`VllmGeneration`, which needs the `vllm` extra only when constructed), and their config."""

import importlib.util

from posttrain.models.generation.config import GenerationConfig
from posttrain.models.generation.hf import HFGeneration, HFGenerationWorker
from posttrain.models.generation.interface import GenerationInterface, RayGeneration
from posttrain.models.generation.vllm import VllmGeneration, VllmGenerationWorker


def resolve_backend(cfg: GenerationConfig, on_gpus: bool) -> str:
    """`cfg.backend`, with "auto" resolved: vLLM when it is importable and the workers have GPUs, else hf."""
    if cfg.backend != "auto":
        return cfg.backend
    return "vllm" if on_gpus and importlib.util.find_spec("vllm") is not None else "hf"


def make_generation(cluster, cfg: GenerationConfig, model_name: str, tokenizer_name: str | None = None
                    ) -> GenerationInterface:
    """The backend named by `cfg.backend` on `cluster` (None: a cluster of its own)."""
    import ray

    on_gpus = cluster.cfg.num_gpus_per_worker > 0 if cluster is not None else ray.cluster_resources().get("GPU", 0) > 0
    backends = {"hf": HFGeneration, "vllm": VllmGeneration}
    return backends[resolve_backend(cfg, on_gpus)](cluster, cfg, model_name, tokenizer_name)


__all__ = [
    "GenerationConfig",
    "GenerationInterface",
    "HFGeneration",
    "HFGenerationWorker",
    "RayGeneration",
    "VllmGeneration",
    "VllmGenerationWorker",
    "make_generation",
    "resolve_backend",
]
