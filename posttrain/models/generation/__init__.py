"""Generation backends: the `GenerationInterface` contract, Hugging Face (`HFGeneration`) and vLLM
(`VllmGeneration`, which needs the `vllm` extra only when constructed), and their config."""

from posttrain.models.generation.config import GenerationConfig
from posttrain.models.generation.hf import HFGeneration, HFGenerationWorker
from posttrain.models.generation.interface import GenerationInterface, RayGeneration
from posttrain.models.generation.vllm import VllmGeneration, VllmGenerationWorker


def make_generation(cluster, cfg: GenerationConfig, model_name: str, tokenizer_name: str | None = None
                    ) -> GenerationInterface:
    """The backend named by `cfg.backend` ("hf" or "vllm") on `cluster` (None: a cluster of its own)."""
    backends = {"hf": HFGeneration, "vllm": VllmGeneration}
    return backends[cfg.backend](cluster, cfg, model_name, tokenizer_name)


__all__ = [
    "GenerationConfig",
    "GenerationInterface",
    "HFGeneration",
    "HFGenerationWorker",
    "RayGeneration",
    "VllmGeneration",
    "VllmGenerationWorker",
    "make_generation",
]
