"""The driver-side `Policy`: a handle over a Ray worker group of `DTensorPolicyWorker`s (one per bundle), or
of `MegatronPolicyWorker`s with `policy.backend: megatron`.

It shards batches across data-parallel ranks, calls the workers and puts their results back together."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import ray

from posttrain.config import ConfigError
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.named_sharding import NamedSharding
from posttrain.distributed.virtual_cluster import RayVirtualCluster
from posttrain.distributed.worker_group import RayWorkerGroup, WorkerDiedError
from posttrain.utils.metrics import reduce_timing
from posttrain.workers.policy.base import LossFn
from posttrain.workers.policy.config import PolicyConfig, check_parallel_sizes, model_parallel_size
from posttrain.workers.policy.dtensor import DTensorPolicyWorker


class NonFiniteLossError(RuntimeError):
    """A training step's loss came back NaN or infinite (policy.stop_on_nonfinite_loss)."""


def check_finite_losses(losses: list[float]) -> None:
    """NonFiniteLossError naming the first global batch whose loss is NaN or infinite."""
    for index, loss in enumerate(losses):
        if not math.isfinite(loss):
            raise NonFiniteLossError(
                f"training loss is {loss} (global batch {index + 1} of {len(losses)} in this step): the "
                "weights are no longer usable, so the run stops without writing a checkpoint of this step "
                "(resume from the last one, e.g. with a lower learning rate; "
                "policy.stop_on_nonfinite_loss=false keeps training)"
            )


def worker_class_and_sharding(cfg: PolicyConfig, world_size: int, dp_size: int) -> tuple[type, NamedSharding]:
    """The worker class of `policy.backend` and its rank layout: (dp, cp, tp) with tp fastest for dtensor;
    (pp, dp, tp) for megatron (Megatron's default order tp-cp-ep-dp-pp, tp fastest)."""
    ranks = np.arange(world_size)
    if cfg.backend == "megatron":
        from posttrain.workers.policy.megatron import MegatronPolicyWorker

        if cfg.lora.enabled:
            from posttrain.workers.policy.megatron_lora import (
                MegatronLoraPolicyWorker as MegatronPolicyWorker,
            )
        shape = (cfg.megatron.pipeline_model_parallel_size, dp_size, cfg.megatron.tensor_model_parallel_size)
        return MegatronPolicyWorker, NamedSharding(ranks.reshape(shape), ["pp", "dp", "tp"])
    shape = (dp_size, cfg.context_parallel_size, cfg.tensor_parallel_size)
    return DTensorPolicyWorker, NamedSharding(ranks.reshape(shape), ["dp", "cp", "tp"])


def check_expert_split(cfg: PolicyConfig) -> None:
    """ConfigError naming policy.expert_parallel_size, before any worker starts, when the model (its
    config.json, local or on the hub) has no experts or their number is not a multiple of it: the one check
    of the expert split, for both backends."""
    ep = cfg.expert_parallel_size
    if ep == 1:
        return
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(cfg.model_name)
    num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if not num_experts:
        raise ConfigError(
            "policy.expert_parallel_size",
            f"{ep}: {cfg.model_name} is a dense model (no MoE experts to split); set it to 1",
        )
    if num_experts % ep:
        raise ConfigError(
            "policy.expert_parallel_size", f"{ep} must divide the model's num_experts={num_experts}"
        )


class Policy:
    """The trainable model over `cluster`: one worker per bundle, laid out by worker_class_and_sharding."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        cfg: PolicyConfig,
        init_reference_model: bool = False,
        name_prefix: str = "policy",
        bundle_share: float = 0.5,
        host: RayWorkerGroup | None = None,
    ) -> None:
        """`bundle_share`: the share of each bundle's CPUs and GPUs a worker reserves (half, so that a
        colocated generation group fits beside it; a quarter for a policy and a critic). `host`: host_for."""
        self.cfg = cfg
        if cfg.model_name is None:
            raise ValueError("policy.model_name is not set: give a Hugging Face model directory or hub name")
        check_parallel_sizes(cfg, cluster.world_size, "the cluster's bundles")
        check_expert_split(cfg)
        self.dp_size = cluster.world_size // model_parallel_size(cfg)
        worker_cls, self.sharding = worker_class_and_sharding(cfg, cluster.world_size, self.dp_size)
        self.worker_group = RayWorkerGroup(
            cluster,
            worker_cls,
            init_kwargs={"cfg": cfg, "init_reference_model": init_reference_model},
            sharding=self.sharding,
            name_prefix=name_prefix,
            num_cpus_per_worker=cluster.num_cpus_per_worker * bundle_share,
            num_gpus_per_worker=cluster.cfg.num_gpus_per_worker * bundle_share,
            host=host,
        )

    def host_for(self, cfg: PolicyConfig) -> RayWorkerGroup | None:
        """Where another model of `cfg` on this cluster lives (RayWorkerGroup's `host`): on CPUs, when both
        are DTensor models, in this policy's worker processes (no start-up of its own); else None."""
        cpu = self.worker_group.cluster.cfg.num_gpus_per_worker == 0
        return self.worker_group if cpu and self.cfg.backend == cfg.backend == "dtensor" else None

    def _run_dp(self, method: str, shards: list[BatchedDataDict], **kwargs: Any) -> list[Any]:
        """Call `method` with one shard per dp rank (replicated over tp and pp); one result per dp rank."""
        model_parallel_axes = [axis for axis in self.sharding.names if axis != "dp"]
        return self.worker_group.run_sharded(
            method,
            shards,
            in_sharded_axes=["dp"],
            replicate_on_axes=model_parallel_axes,
            output_is_replicated=model_parallel_axes,
            **kwargs,
        )

    def _gather_rows(self, method: str, data: BatchedDataDict, **kwargs: Any) -> BatchedDataDict:
        """Split rows evenly over dp ranks (padding with copies of the last row), run, re-join in order."""
        num_rows = data.size
        num_padding = -num_rows % self.dp_size
        if num_padding:
            padding_rows = data.select_indices([num_rows - 1] * num_padding)
            data = BatchedDataDict.from_batches([data, padding_rows])
        shards = data.shard_by_batch_size(self.dp_size)
        results = self._run_dp(method, shards, **kwargs)
        return BatchedDataDict.from_batches(results).slice(0, num_rows)

    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """{"logprobs": [B, T]} fp32; position t = log p(token t | tokens < t), position 0 and padding 0."""
        return self._gather_rows("get_logprobs", data)

    def get_topk_logprobs(self, data: BatchedDataDict, k: int) -> BatchedDataDict:
        """{"topk_logprobs": [B, T, k] fp32, "topk_ids": [B, T, k]}: the k most likely next tokens at each
        position, aligned with logprobs (a distillation teacher's targets)."""
        return self._gather_rows("get_topk_logprobs", data, k=k)

    def get_scores(self, data: BatchedDataDict) -> BatchedDataDict:
        """{"scores": [B]} fp32 from a reward model (policy.model_kind = "reward_model")."""
        return self._gather_rows("get_scores", data)

    def get_values(self, data: BatchedDataDict) -> BatchedDataDict:
        """{"values": [B, T]} fp32 from a value model (policy.model_kind = "value_model"); position t is the
        value of the state before token t, aligned with logprobs."""
        return self._gather_rows("get_values", data)

    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """{"reference_policy_logprobs": [B, T]} from the frozen initial weights."""
        return self._gather_rows("get_reference_policy_logprobs", data)

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFn,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        eval_mode: bool = False,
    ) -> dict[str, list[float]]:
        """One optimizer step per global batch of `global_batch_size` rows (default
        `policy.train_global_batch_size`), in micro-batches of `micro_batch_size` rows (default
        `policy.train_micro_batch_size`); forward only when `eval_mode` (see evaluate).

        Returns one entry per global batch, reduced over ranks: `loss` (the global-batch loss), `grad_norm`
        (before clipping), `lr` (used by the step), `num_microbatches`, and the loss function's metrics summed
        over micro-batches and ranks."""
        global_batch_size = global_batch_size or self.cfg.train_global_batch_size
        shards = data.shard_by_batch_size(self.dp_size, batch_size=global_batch_size)
        results = self._run_dp(
            "train",
            shards,
            loss_fn=loss_fn,
            eval_mode=eval_mode,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
        )
        if not eval_mode and self.cfg.stop_on_nonfinite_loss:
            check_finite_losses(results[0]["loss"])
        return results[0]  # every rank returns the same, already reduced over dp

    def evaluate(
        self, data: BatchedDataDict, loss_fn: LossFn, **batch_sizes: int | None
    ) -> dict[str, list[float]]:
        """`loss_fn` and its metrics per global batch, forward only (`batch_sizes`: train's
        global_batch_size and micro_batch_size): the weights do not change (no `grad_norm`, no `lr`)."""
        return self.train(data, loss_fn, eval_mode=True, **batch_sizes)

    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> None:
        """Sharded model + optimizer (unless not `save_optimizer`) + scheduler state under `path` (DCP),
        and every rank's RNG states (`rng/rank_N.safetensors`)."""
        self.worker_group.run_all("save_checkpoint", path=str(path), save_optimizer=save_optimizer)

    def load_checkpoint(self, path: str) -> None:
        """Restore the state written by save_checkpoint (any number of workers), RNG states included."""
        self.worker_group.run_all("load_checkpoint", path=str(path))

    def export_hf(self, out_dir: str) -> None:
        """Write a Hugging Face directory (safetensors, config, tokenizer) with the current weights."""
        self.worker_group.run_all("export_hf", out_dir=str(out_dir))

    def get_weights(self, only_changed: bool = True, dtype: str | None = None) -> ray.ObjectRef:
        """The workers' get_weights, left in the object store: an ObjectRef of rank 0's dict name -> full CPU
        tensor (with LoRA: `AdapterWeights`, the adapter tensors only): {} when `only_changed` and no
        optimizer step or checkpoint load happened since the last call; floating tensors cast to `dtype`."""
        refs = self.worker_group.run_all_async("get_weights", only_changed=only_changed, dtype=dtype)
        return refs[0]

    def share_weights(self, dtype: str | None = None, on_device: bool = False) -> Any:
        """Rank 0's handle of its full weights in shared memory (`SharedWeights`; `on_device`: in its GPU's
        memory), refreshed when an optimizer step or checkpoint load changed them: generation workers on its
        machine map it once."""
        return self.worker_group.run_all("share_weights", dtype=dtype, on_device=on_device)[0]

    def last_weights_bytes(self) -> int:
        """Bytes of the tensors the last get_weights or share_weights sent (the adapter only with LoRA; 0 when
        unchanged)."""
        return int(self.worker_group.run_on([0], "last_weights_bytes")[0])

    def offload(self) -> None:
        """Move weights and optimizer state off the accelerator (for colocated generation)."""
        self.worker_group.run_all("offload")

    def onload(self) -> None:
        """Bring weights and optimizer state back before training."""
        self.worker_group.run_all("onload")

    def get_timing_metrics(self) -> dict[str, float]:
        """Seconds per worker stage (train, eval, logprobs) since the last call, the max over ranks
        (the slowest rank sets the pace); the workers' timers restart."""
        return reduce_timing(self.worker_group.run_all("get_timing_metrics"))

    def memory_footprint(self) -> list[dict[str, int]]:
        """Per rank: bytes of its parameter shards (param_bytes, trainable_param_bytes), of its optimizer
        state (optimizer_state_bytes) and its accelerator's total memory (device_total_bytes, 0 on CPU)."""
        return self.worker_group.run_all("memory_footprint")

    def describe(self) -> list[dict[str, Any]]:
        """Per rank: device, process-group backend (gloo/nccl), world size and CPU threads."""
        return self.worker_group.run_all("describe")

    def shutdown(self) -> None:
        """Leave the process groups and kill the workers (those left, after a worker died)."""
        try:
            self.worker_group.run_all("shutdown")
        except WorkerDiedError:
            pass  # the group is lost anyway: its peers cannot leave a process group cleanly
        finally:
            self.worker_group.shutdown()
