"""Generation: its typed config (`config.py`), and the backends (`backends.py`: `RayGeneration` driving
Hugging Face or vLLM workers, `make_generation`), which load on first use so that importing the config
stays light (no Ray)."""

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


def __getattr__(name: str):
    if name in __all__:
        from posttrain.workers.generation import backends

        return getattr(backends, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
