"""The contract every generation backend fulfils (batch keys, `GenerationInterface`), and `RayGeneration`:
the data-parallel driver over Ray actors that the Hugging Face and vLLM backends share."""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

# Input keys of `generate`:
#   input_ids      [B, T]  prompt token ids, right-padded
#   input_lengths  [B]     prompt lengths
#   stop_strings   list[list[str] | None] of length B (optional), per-sample stop strings
#   pixel_values, image_grid_thw  lists of length B (optional): each prompt's image patches [P_i, D] and
#                  grids [N_i, 3] for a vision-language model (posttrain.data.vision)
# Output keys:
#   output_ids                [B, T_out]  prompt + generation, right-padded with the pad id
#   logprobs                  [B, T_out]  log p(token t | tokens < t) under logits / temperature at the
#                                         generated positions, 0 on prompt and padding positions
#   generation_lengths        [B]         generated tokens (a stop token is counted and kept)
#   unpadded_sequence_lengths [B]         input_lengths + generation_lengths
#   truncated                 [B] bool    hit max_new_tokens without a stop token or stop string
GENERATION_INPUT_KEYS = ("input_ids", "input_lengths")
GENERATION_OUTPUT_KEYS = (
    "output_ids",
    "logprobs",
    "generation_lengths",
    "unpadded_sequence_lengths",
    "truncated",
)


class GenerationInterface(abc.ABC):
    """A generation backend: sample continuations of prompts and take new weights from the policy."""

    @abc.abstractmethod
    def generate(self, data: Any, greedy: bool = False, seed: int | None = None) -> Any:
        """Continue each prompt of `data` (a BatchedDataDict with the input keys above).

        Returns a BatchedDataDict with the output keys above, in the order of the input.
        `seed` makes sampling reproducible; None draws a fresh seed per call (from the config's).
        """

    @abc.abstractmethod
    def prepare_for_generation(self) -> None:
        """Bring the weights / caches onto the accelerator before a round of generation."""

    @abc.abstractmethod
    def finish_generation(self) -> None:
        """Free accelerator memory after a round of generation (for colocated training)."""

    @abc.abstractmethod
    def update_weights(self, weights: Any) -> float:
        """Load new weights (dict name -> tensor, possibly only the changed ones, or a Ray ObjectRef of one).

        Returns the seconds the refit took.
        """

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release what this backend created."""


def sample_seed(seed: int, sample_index: int) -> int:
    """A 63-bit seed for one sample, mixed from the call's seed and the sample's index in the batch."""
    state = np.random.SeedSequence([seed, sample_index]).generate_state(1, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))


def split_contiguous(num_samples: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, end) of num_shards contiguous shards whose sizes differ by at most one."""
    base, extra = divmod(num_samples, num_shards)
    bounds, start = [], 0
    for shard in range(num_shards):
        end = start + base + (1 if shard < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def slice_batch(data: Mapping[str, Any], start: int, end: int) -> dict[str, Any]:
    """Rows [start, end) of the keys a worker reads (prompt ids, lengths, per-sample stop strings, images)."""
    optional = ("stop_strings", "pixel_values", "image_grid_thw")
    keys = [key for key in GENERATION_INPUT_KEYS + optional if data.get(key) is not None]
    return {key: data[key][start:end] for key in keys}


def concat_padded(outputs: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Concatenate worker outputs in order, right-padding the [B, T] keys to the longest T."""
    num_cols = max(o["output_ids"].shape[1] for o in outputs)
    pad_values = {"output_ids": pad_id, "logprobs": 0.0}
    merged = {}
    for key in GENERATION_OUTPUT_KEYS:
        parts = [o[key] for o in outputs]
        if key in pad_values:
            parts = [
                torch.nn.functional.pad(p, (0, num_cols - p.shape[1]), value=pad_values[key]) for p in parts
            ]
        merged[key] = torch.cat(parts, dim=0)
    return merged


class RayGeneration(GenerationInterface):
    """Data-parallel generation over one Ray actor per bundle; subclasses name the worker class.

    `cluster` is the policy's RayVirtualCluster when colocated (one worker per bundle, sharing them, so
    `cfg.num_workers` is not used), or None to start a cluster of `cfg.num_workers` bundles of its own. A
    worker class takes
    `(cfg, model_name, tokenizer_name)` and has generate(data, greedy, seed, sample_offset),
    update_weights(weights), prepare_for_generation() and finish_generation().
    """

    worker_cls: type = object
    backend_name: str = "generation"

    def __init__(self, cluster: Any, cfg: Any, model_name: str, tokenizer_name: str | None = None) -> None:
        from posttrain.distributed import RayWorkerGroup
        from posttrain.models.build import load_tokenizer

        self.cfg = cfg
        self.owned_cluster = cluster is None
        # Colocated: one worker per bundle of the policy's cluster; separate: num_workers bundles of its own.
        self.cluster = make_generation_cluster(cfg) if cluster is None else cluster
        self.pad_id = int(load_tokenizer(tokenizer_name or model_name).pad_token_id)
        self.num_calls = 0
        # Colocated: None lets the group take half of each policy bundle; separate: the whole bundle.
        whole_bundle = self.owned_cluster
        self.worker_group = RayWorkerGroup(
            self.cluster,
            self.worker_cls,
            name_prefix=f"{self.backend_name}_generation",
            init_kwargs={
                "cfg": cfg,
                "model_name": str(model_name),
                "tokenizer_name": None if tokenizer_name is None else str(tokenizer_name),
            },
            num_cpus_per_worker=self.cluster.num_cpus_per_worker if whole_bundle else None,
            num_gpus_per_worker=self.cluster.cfg.num_gpus_per_worker if whole_bundle else None,
        )

    def generate(self, data: Any, greedy: bool = False, seed: int | None = None) -> Any:
        """Split the batch into contiguous shards, decode them in parallel, gather them in order."""
        from posttrain.distributed import BatchedDataDict

        if seed is None:
            seed = self.cfg.seed + self.num_calls
        self.num_calls += 1
        num_samples = int(data["input_ids"].shape[0])
        if num_samples == 0:
            raise ValueError("generate: the batch has no samples (input_ids has 0 rows)")
        workers = self.worker_group.workers
        refs = [
            workers[rank].generate.remote(
                slice_batch(data, start, end), greedy=greedy, seed=seed, sample_offset=start
            )
            for rank, (start, end) in enumerate(split_contiguous(num_samples, len(workers)))
            if end > start
        ]
        return BatchedDataDict(concat_padded(self.worker_group.get(refs), self.pad_id))

    def update_weights(self, weights: Any) -> float:
        """Send new weights (once, through the object store) to every worker; return wall seconds."""
        import ray

        start = time.perf_counter()
        weights_ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)
        self.worker_group.get(self.worker_group.run_all_async("update_weights", weights=weights_ref))
        return time.perf_counter() - start

    def prepare_for_generation(self) -> None:
        self.worker_group.run_all("prepare_for_generation")

    def finish_generation(self) -> None:
        self.worker_group.run_all("finish_generation")

    def shutdown(self) -> None:
        self.worker_group.shutdown()
        self.shutdown_cluster()

    def shutdown_cluster(self) -> None:
        """Remove the cluster only if this handle started it."""
        if self.owned_cluster:
            self.cluster.shutdown()


def make_generation_cluster(cfg: Any) -> Any:
    """A cluster of `num_workers` bundles for generation placed apart from the policy (a GPU each if any)."""
    import ray

    from posttrain.distributed import ClusterConfig, RayVirtualCluster

    num_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    return RayVirtualCluster(
        ClusterConfig(
            workers_per_node=cfg.num_workers,
            num_cpus_per_worker=cfg.num_cpus_per_worker,
            num_gpus_per_worker=num_gpus,
        ),
        key="generation.num_workers x num_cpus_per_worker",
    )
