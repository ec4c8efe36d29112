"""The Hugging Face generation backend's driver-side handle: data-parallel generation over
`generation.num_workers` `HFGenerationWorker` actors."""

from __future__ import annotations

from posttrain.workers.generation.hf_worker import HFGenerationWorker
from posttrain.workers.generation.interface import RayGeneration


class HFGeneration(RayGeneration):
    """Driver-side handle: data-parallel Hugging Face generation over `cfg.num_workers` Ray actors."""

    worker_cls = HFGenerationWorker
    backend_name = "hf"
    replaces_lost_workers = True
