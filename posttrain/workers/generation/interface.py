"""The contract of generation (batch keys) and `RayGeneration`, the data-parallel driver over Ray actors that
the Hugging Face and vLLM backends share, which replaces a generation worker lost mid-generate and
generates the lost shard again."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray

from posttrain.distributed import (
    BatchedDataDict,
    ClusterConfig,
    ClusterResourceError,
    RayVirtualCluster,
    RayWorkerGroup,
    WorkerDiedError,
)
from posttrain.distributed.worker_group import wait_until_marked_dead
from posttrain.models.build import load_tokenizer
from posttrain.models.moe import NOT_RECORDED

logger = logging.getLogger(__name__)

# Input keys of `generate`:
#   input_ids      [B, T]  prompt token ids, right-padded
#   input_lengths  [B]     prompt lengths
#   stop_strings   list[list[str] | None] of length B (optional), per-sample stop strings
#   pixel_values, image_grid_thw  lists of length B (optional): each prompt's image patches [P_i, D] and
#                  grids [N_i, 3] for a vision-language model (posttrain.data.vision)
#   max_new_tokens [B]     (optional, hf backend) this call's budget of new tokens, at most the config's;
#                          all equal (partial rollouts generate in chunks: experience/partial_rollouts.py)
# Output keys:
#   output_ids                [B, T_out]  prompt + generation, right-padded with the pad id
#   logprobs                  [B, T_out]  log p(token t | tokens < t) under logits / temperature at the
#                                         generated positions, 0 on prompt and padding positions
#   generation_lengths        [B]         generated tokens (a stop token is counted and kept)
#   unpadded_sequence_lengths [B]         input_lengths + generation_lengths
#   truncated                 [B] bool    hit max_new_tokens without a stop token or stop string
INPUTS = ("input_ids", "input_lengths", "stop_strings", "pixel_values", "image_grid_thw", "max_new_tokens")
ROUTED_EXPERTS_KEY = "routed_experts"  # MoE models (HF backend): [B, T, L, k] experts per generated token


def sample_seed(seed: int, sample_index: int) -> int:
    """A 63-bit seed for one sample, mixed from the call's seed and the sample's index in the batch."""
    state = np.random.SeedSequence([seed, sample_index]).generate_state(1, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))


def split_contiguous(num_samples: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, end) of num_shards contiguous shards whose sizes differ by at most one."""
    base, extra = divmod(num_samples, num_shards)  # the first `extra` shards take one more
    starts = [shard * base + min(shard, extra) for shard in range(num_shards + 1)]
    return list(zip(starts, starts[1:]))


def lost_ranks(dead_workers: Sequence[str], names: Sequence[str]) -> list[int]:
    """The ranks of the workers named in `dead_workers` (a WorkerDiedError's), in rank order."""
    dead = set(dead_workers)
    return [rank for rank, name in enumerate(names) if name in dead]


class RayGeneration:
    """Data-parallel generation over one Ray actor per bundle of `cluster`: the policy's when colocated
    (`cfg.num_workers` unused), or with None a cluster of `cfg.num_workers` bundles of its own. Subclasses
    name the worker class, which takes `(cfg, model_name, tokenizer_name)` and has generate(data, greedy,
    seed, sample_offset), update_weights(weights), prepare_for_generation() and finish_generation().
    With `host` (the policy's worker group), the workers live in the host's actors instead of their own.

    On a cluster of its own, with `replaces_lost_workers`, a worker that dies during `generate` (its process
    or its node) is replaced up to `max_worker_restarts` times: the new actor starts in the lost one's bundle,
    loads the weights the others hold (`set_weights_source`) and generates the lost shard again as the lost
    worker would have (samples are seeded by (seed, global sample index)). Colocated workers live in the
    policy's bundles: their loss stays the whole run's (`algorithms/recovery.py`)."""

    worker_cls: type = object
    backend_name: str = "generation"
    replaces_lost_workers: bool = False  # the backend's shards are reproducible on a new worker

    def __init__(
        self,
        cluster: Any,
        cfg: Any,
        model_name: str,
        tokenizer_name: str | None = None,
        max_worker_restarts: int = 0,
        host: RayWorkerGroup | None = None,
    ) -> None:
        self.cfg = cfg
        self.owned_cluster = cluster is None
        if cluster is None:  # num_workers bundles of its own, apart from the policy (a GPU each if any)
            num_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
            own = ClusterConfig(
                workers_per_node=cfg.num_workers,
                num_cpus_per_worker=cfg.num_cpus_per_worker,
                num_gpus_per_worker=num_gpus,
            )
            cluster = RayVirtualCluster(own, key="generation.num_workers x num_cpus_per_worker")
        self.cluster = cluster  # colocated: one worker per bundle of the policy's cluster
        pad_id = int(load_tokenizer(tokenizer_name or model_name).pad_token_id)
        # The shards' outputs are right-padded to the longest: the pad id, logprob 0, experts not recorded.
        self.output_pad_values = {"output_ids": pad_id, ROUTED_EXPERTS_KEY: NOT_RECORDED}
        self.num_calls = 0
        replaces = self.owned_cluster and self.replaces_lost_workers
        self.max_worker_restarts = max_worker_restarts if replaces else 0
        self.num_worker_restarts = 0  # losses survived by replacing workers
        self.weights_source: Callable[[], Any] | None = None
        self.refitted = False  # the workers hold weights other than the model directory's
        # Colocated: None lets the group take half of each policy bundle; separate: the whole bundle.
        self.worker_group = RayWorkerGroup(
            self.cluster,
            self.worker_cls,
            name_prefix=f"{self.backend_name}_generation",
            init_kwargs={
                "cfg": cfg,
                "model_name": str(model_name),
                "tokenizer_name": None if tokenizer_name is None else str(tokenizer_name),
            },
            num_cpus_per_worker=self.cluster.num_cpus_per_worker if self.owned_cluster else None,
            num_gpus_per_worker=self.cluster.cfg.num_gpus_per_worker if self.owned_cluster else None,
            host=host,
        )

    def generate(self, data: Any, greedy: bool = False, seed: int | None = None) -> Any:
        """Continue each prompt of `data` (a BatchedDataDict with the input keys above) in contiguous shards
        decoded in parallel (a lost worker's again on its replacement: see the class); returns the output
        keys in the input's order. `seed` (None: the config's seed plus the call count) seeds sampling."""
        seed = self.cfg.seed + self.num_calls if seed is None else seed
        self.num_calls += 1
        num_samples = int(data["input_ids"].shape[0])
        if num_samples == 0:
            raise ValueError("generate: the batch has no samples (input_ids has 0 rows)")
        shards = split_contiguous(num_samples, len(self.worker_group.workers))

        def decode(rank: int) -> Any:
            start, end = shards[rank]
            shard = {key: data[key][start:end] for key in INPUTS if data.get(key) is not None}
            return self.worker_group.call(
                rank, "generate", shard, greedy=greedy, seed=seed, sample_offset=start
            )

        ranks = [rank for rank, (start, end) in enumerate(shards) if end > start]
        refs = {rank: decode(rank) for rank in ranks}
        while True:
            try:
                outputs = self.worker_group.get([refs[rank] for rank in ranks])
                return BatchedDataDict.from_batches(outputs, self.output_pad_values)
            except WorkerDiedError as error:
                redo = [rank for rank in self.replace_lost_workers(error) if rank in refs]
                where = ", ".join(f"[{shards[rank][0]}, {shards[rank][1]}) on rank {rank}" for rank in redo)
                where = where or "none (the lost workers had no samples)"
                print(f"generation: generating samples again: {where}", flush=True)
                refs.update({rank: decode(rank) for rank in redo})

    def replace_lost_workers(self, error: WorkerDiedError) -> list[int]:
        """Start a new actor, with the weights the others hold, for each worker `error` names; returns their
        ranks. Raises `error` itself when it names none, this handle replaces no workers, its restarts are
        spent, the weights cannot be had again (refitted, no weights source) or a replacement fails."""
        ranks = lost_ranks(error.dead_workers, self.worker_group.names)
        restarts_left = self.num_worker_restarts < self.max_worker_restarts
        weights_known = self.weights_source is not None or not self.refitted
        if not ranks or not restarts_left or not weights_known:
            raise error
        self.num_worker_restarts += 1
        lost = ", ".join(
            f"{self.worker_group.names[rank]} (rank {rank}, node {self.worker_group.info[rank]['node_ip']})"
            for rank in ranks
        )
        nodes = f"; lost node(s): {', '.join(error.lost_nodes)}" if error.lost_nodes else ""
        message = (
            f"generation: lost worker(s) {lost}{nodes}; replacing them and generating their samples again "
            f"(generation restart {self.num_worker_restarts} of {self.max_worker_restarts})"
        )
        logger.warning(message)
        print(message, flush=True)
        if error.lost_nodes:  # Ray moves the lost node's bundles once it counts the node dead
            wait_until_marked_dead(set(error.lost_nodes))
        try:
            self.worker_group.replace_workers(ranks, self.cluster.cfg.resource_timeout_s)
            if self.weights_source is not None:  # else: the model directory's weights, as the others
                self.update_weights(self.weights_source(), ranks)
        except (ClusterResourceError, ray.exceptions.RayError, WorkerDiedError) as failure:
            logger.warning("generation: the replacement failed (%s); giving up on the lost workers", failure)
            raise error  # noqa: B904 - the loss, as without a replacement (the failure is its context)
        return ranks

    def set_weights_source(self, source: Callable[[], Any]) -> None:
        """`source()` returns all the weights the workers hold at that moment (as `update_weights` takes
        them), for a worker that replaces a lost one."""
        self.weights_source = source

    def update_weights(self, weights: Any, ranks: Sequence[int] | None = None) -> float:
        """Send new weights (dict name -> tensor, possibly only the changed ones, or a Ray ObjectRef of one)
        once, through the object store, to every worker (or those of `ranks`); return wall seconds."""
        start = time.perf_counter()
        weights_ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)
        ranks = range(len(self.worker_group.workers)) if ranks is None else ranks
        self.worker_group.run_on(ranks, "update_weights", weights=weights_ref)
        self.refitted = True
        return time.perf_counter() - start

    def prepare_for_generation(self) -> None:
        self.worker_group.run_all("prepare_for_generation")

    def finish_generation(self) -> None:
        self.worker_group.run_all("finish_generation")

    def shutdown(self) -> None:
        """Stop the workers, and the cluster if this handle started it."""
        self.worker_group.shutdown()
        if self.owned_cluster:
            self.cluster.shutdown()
