"""Generation backends: `RayGeneration` driving Hugging Face (`HFGeneration`) or vLLM (`VllmGeneration`,
which needs the `vllm` extra only when constructed) workers, and their config. Only the config is imported
eagerly, so that importing it stays light (no Ray); the rest loads on first use."""

from posttrain.workers.generation.config import GenerationConfig

__all__ = [
    "GenerationConfig",
    "HFGeneration",
    "HFGenerationWorker",
    "RayGeneration",
    "VllmGeneration",
    "VllmGenerationWorker",
    "make_generation",
]

_LAZY = {
    "HFGeneration": "backends",
    "VllmGeneration": "backends",
    "make_generation": "backends",
    "RayGeneration": "interface",
    "HFGenerationWorker": "hf_worker",
    "VllmGenerationWorker": "vllm_worker",
}


def __getattr__(name: str):
    """The backends and workers load on first use (they import Ray and transformers' models)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
