"""The vLLM generation backend's driver-side handle: data-parallel generation over `generation.num_workers`
`VllmGenerationWorker` actors; constructing it where vLLM is missing raises `VllmNotInstalledError`."""

from __future__ import annotations

from typing import Any

from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.interface import RayGeneration
from posttrain.workers.generation.vllm_worker import VllmGenerationWorker, require_vllm


class VllmGeneration(RayGeneration):
    """Driver-side handle: data-parallel vLLM generation over `cfg.num_workers` Ray actors."""

    worker_cls = VllmGenerationWorker
    backend_name = "vllm"

    def __init__(
        self,
        cluster: Any,
        cfg: GenerationConfig,
        model_name: str,
        tokenizer_name: str | None = None,
        max_worker_restarts: int = 0,
    ) -> None:
        require_vllm()
        super().__init__(cluster, cfg, model_name, tokenizer_name, max_worker_restarts)
