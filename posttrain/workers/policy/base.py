"""What every policy worker (one Ray actor per rank) does the same way, whatever holds the model: joining
the process group, micro-batching, logprobs and scores in the original row order, the reference-weight
swap, train steps normalised by global counts and their reduction over data-parallel ranks, and
shared-memory refit. The DTensor/FSDP2 worker (`dtensor.py`) and the Megatron Core worker (`megatron.py`)
are its siblings: each builds its model and optimizer, runs forwards and optimizer steps, and saves,
exports and gathers weights its own way."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.core_lease import LeasedThreads
from posttrain.distributed.shared_weights import SharedWeights, SharedWeightsWriter
from posttrain.distributed.worker_group import assigned_device, init_torch_distributed
from posttrain.models import lora
from posttrain.models.build import causal_lm_class, load_tokenizer
from posttrain.models.vlm import is_vision_language_dir, load_processor
from posttrain.utils.metrics import metric_reductions
from posttrain.utils.timer import Timer
from posttrain.workers.policy.config import PolicyConfig
from posttrain.workers.policy.microbatches import (
    ForwardCost,
    MicroBatch,
    length_mask,
    pad_microbatches,
    plan_microbatches,
    row_lengths,
    select_rows,
)
from posttrain.workers.policy.step_metrics import StepMetrics, reduce_steps
from posttrain.workers.refit import WeightVersions


class LossFn(Protocol):
    """A loss as the worker calls and asks it (the contract and the `Loss` base: algorithms/loss.py)."""

    rows_independent: bool
    metric_reductions: Mapping[str, str]
    candidate_ids_key: str | None

    def __call__(
        self, outputs: torch.Tensor, data: Any, global_valid_seqs: Any, global_valid_toks: Any
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def ensure_process_group() -> None:
    """Join the process group from RANK/WORLD_SIZE/MASTER_* env vars, or form a 1-rank group when absent."""
    if dist.is_initialized():
        return
    backend = "nccl" if assigned_device().type == "cuda" else "gloo"
    if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
        init_torch_distributed(backend)
    else:  # a file store: a TCP store would listen on every interface
        path = os.path.join(tempfile.mkdtemp(prefix="posttrain-pg-"), "store")
        dist.init_process_group(backend=backend, init_method=f"file://{path}", rank=0, world_size=1)


def load_hf_model(cfg: PolicyConfig) -> torch.nn.Module:
    """The configured model in fp32 on CPU with SDPA attention: a causal LM, a 1-label sequence classifier
    (reward model) or a 1-label token classifier without dropout (value model: the policy's architecture
    with a linear value head on every position)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification

    kwargs: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if cfg.model_kind == "causal_lm":
        return causal_lm_class(cfg.model_name).from_pretrained(cfg.model_name, **kwargs)
    if cfg.model_kind == "value_model":
        config = AutoConfig.from_pretrained(cfg.model_name, num_labels=1)
        config.classifier_dropout = 0.0  # a value head regresses: dropout would only add noise
        starts_a_head = not any("TokenClassification" in name for name in config.architectures or [])
        model = AutoModelForTokenClassification.from_pretrained(cfg.model_name, config=config, **kwargs)
        if starts_a_head:  # a new head predicts 0: the first advantages are the rewards, not noise
            torch.nn.init.zeros_(model.score.weight)
            if model.score.bias is not None:
                torch.nn.init.zeros_(model.score.bias)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(cfg.model_name, num_labels=1, **kwargs)
    model.config.architectures = [type(model).__name__]  # exports and checkpoints rebuild this class
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


class PolicyWorker:
    """One rank of the policy. A backend sets `dp_group` and `dp_size` in `_init_parallel`, `model`,
    `optimizer` and `scheduler` in `_build_model_and_optimizer`, and implements `_forward_all`,
    `_run_global_batch`, `_full_weights`, `_gather_weights`, checkpoints, export, offload and onload."""

    reuse_process = True  # leaves only its process group behind (RayWorkerGroup keeps the process)

    def __init__(self, cfg: PolicyConfig, init_reference_model: bool = False) -> None:
        self.cfg = cfg
        self.timer = Timer()  # this rank's stage times, collected by get_timing_metrics
        self.owns_process_group = not dist.is_initialized()  # not when hosted in another worker's process
        ensure_process_group()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = assigned_device()
        self._init_parallel()
        torch.manual_seed(cfg.seed)
        self._build_model_and_optimizer()
        self.tokenizer = self._load_tokenizer()
        self.reference_weights: dict[str, torch.Tensor] | None = None
        self.versions = WeightVersions()  # optimizer steps and loads so far, and what refit last carried
        self.sent_bytes = 0  # what the last get_weights / share_weights sent or wrote (rank 0)
        self.shared_weights: SharedWeightsWriter | None = None  # rank 0's shared-memory refit file
        self.shared_on_device: bool | None = None  # where the last share_weights put it (all ranks)
        self.leased_threads: LeasedThreads | None = None  # threads borrowed from an idle generator
        if init_reference_model:
            self.init_reference_model()

    def _init_parallel(self) -> None:
        raise NotImplementedError

    def _build_model_and_optimizer(self) -> None:
        raise NotImplementedError

    def _backend(self) -> contextlib.AbstractContextManager:
        """Entered around every public call that runs the model (the Megatron worker's CPU shim)."""
        return contextlib.nullcontext()

    def _forward_all(self, data: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _run_global_batch(
        self, batch: dict[str, Any], loss_fn: LossFn, eval_mode: bool, micro_batch_size: int
    ) -> StepMetrics:
        raise NotImplementedError

    def _full_weights(self) -> dict[str, torch.Tensor]:
        """Every weight in HF names, complete on rank 0, {} elsewhere (collective; shared-memory refit)."""
        raise NotImplementedError

    def _gather_weights(self, dtype: str | None) -> dict[str, torch.Tensor] | lora.AdapterWeights:
        """What get_weights sends: full CPU weights (with LoRA: the adapter) on rank 0, {} elsewhere."""
        raise NotImplementedError

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose state memory_footprint counts."""
        return [self.optimizer]

    def _adapters_disabled(self) -> contextlib.AbstractContextManager:
        """The base model's forward with LoRA: the reference policy."""
        return lora.adapter_disabled(self.model)

    def _load_tokenizer(self) -> Any:
        """The tokenizer saved with checkpoints and exports (a vision-language model's: with its image
        processor)."""
        if is_vision_language_dir(self.cfg.model_name):
            return load_processor(self.cfg.tokenizer_name or self.cfg.model_name)
        return load_tokenizer(self.cfg.tokenizer_name or self.cfg.model_name)

    def _all_reduce_dp(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """All-reduce ("sum", "min", "max") over the data-parallel ranks (on the worker's device: NCCL needs
        CUDA tensors); CPU out."""
        reduced = tensor.to(self.device)
        dist.all_reduce(reduced, op=REDUCE_OPS[op], group=self.dp_group)
        return reduced.cpu()

    def _global_counts(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid sequences, valid tokens) of the global batch: this rank's sums all-reduced over dp."""
        batch_size, seq_len = batch["input_ids"].shape
        sample_mask = batch.get("sample_mask", torch.ones(batch_size)).float()  # [B]
        token_mask = batch.get("token_mask")
        if token_mask is None:
            token_mask = length_mask(row_lengths(batch), seq_len)
        counts = torch.stack([sample_mask.sum(), (token_mask.float() * sample_mask.unsqueeze(1)).sum()])
        counts = self._all_reduce_dp(counts, "sum")
        return counts[0].to(self.device), counts[1].to(self.device)

    def make_microbatches(
        self, data: dict[str, Any], batch_size: int, cost: ForwardCost | None = None, reorder: bool = False
    ) -> list[MicroBatch]:
        """This rank's micro-batches of `data` (see microbatches.plan_microbatches; `cost`: the forward's
        cost model; `reorder`: rows may be bucketed by length), padded with repeats to the largest count of
        any dp rank."""
        microbatches = plan_microbatches(data, batch_size, self.cfg, cost, reorder)
        count = self._all_reduce_dp(torch.tensor([len(microbatches)]), "max")
        return pad_microbatches(microbatches, int(count.item()), self.rank)

    def leased(self, microbatches: list[MicroBatch]) -> Iterator[MicroBatch]:
        """`microbatches` one by one, setting this rank's threads from the core lease before each (see
        distributed/core_lease.py; unchanged without a lease). The time spent on micro-batches run with
        borrowed threads is timed as `borrowed_threads`."""
        lease = self.leased_threads
        for microbatch in microbatches:
            if lease is None or lease.adjust() == lease.own:
                yield microbatch
                continue
            self.timer.start("borrowed_threads")
            try:
                yield microbatch
            finally:
                self.timer.stop("borrowed_threads")

    def set_core_lease(self, lease: Any, side: str, lent: int) -> None:
        """Borrow `lent` threads while `side` holds `lease` (a core_lease.CoreLease actor)."""
        self.leased_threads = LeasedThreads(lease, side, lent)

    def _forward_rows(self, data: dict[str, Any], name: str, model_kind: str, shape: Any) -> BatchedDataDict:
        """{name: `_forward_all` of `data` into zeros of `shape`}, in the original row order; ValueError
        naming `get_<name>` when policy.model_kind is not `model_kind`."""
        if self.cfg.model_kind != model_kind:
            raise ValueError(f"get_{name}: policy.model_kind is {self.cfg.model_kind!r}, not {model_kind!r}")
        with self._backend(), self.timer.time(name):
            return BatchedDataDict({name: self._forward_all(data, torch.zeros(shape))})

    @torch.no_grad()
    def get_logprobs(self, data: dict[str, Any]) -> BatchedDataDict:
        """{"logprobs": [B, T]} in fp32: position t = log p(token t | < t), position 0 and padding 0."""
        return self._forward_rows(data, "logprobs", "causal_lm", data["input_ids"].shape)

    @torch.no_grad()
    def get_scores(self, data: dict[str, Any]) -> BatchedDataDict:
        """{"scores": [B]} in fp32 from a reward model (the score at each sequence's last token)."""
        return self._forward_rows(data, "scores", "reward_model", data["input_ids"].shape[:1])

    @torch.no_grad()
    def get_values(self, data: dict[str, Any]) -> BatchedDataDict:
        """{"values": [B, T]} in fp32 from a value model: position t = V(tokens < t), the value of the state
        in which token t is chosen (aligned with logprobs); position 0 and padding 0."""
        return self._forward_rows(data, "values", "value_model", data["input_ids"].shape)

    def topk_logprobs(self, data: dict[str, Any], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(
            f"top-k logprobs (a distillation teacher's) run on the dtensor backend, not {self.cfg.backend!r}"
        )

    def get_topk_logprobs(self, data: dict[str, Any], k: int) -> BatchedDataDict:
        """{"topk_logprobs": [B, T, k] fp32, "topk_ids": [B, T, k]}: the k most likely next tokens at each
        position (position t: token t given < t, aligned with logprobs) and their logprobs."""
        if self.cfg.model_kind != "causal_lm":
            raise ValueError(
                f"get_topk_logprobs: policy.model_kind is {self.cfg.model_kind!r}, not 'causal_lm'"
            )
        with self._backend(), self.timer.time("topk_logprobs"):
            values, ids = self.topk_logprobs(data, k)
        return BatchedDataDict({"topk_logprobs": values, "topk_ids": ids})

    @staticmethod
    def _store(out: torch.Tensor, microbatch: MicroBatch, outputs: torch.Tensor) -> None:
        """Write a micro-batch's outputs ([b, T_mb] or [b]) into its rows of `out` ([B, T] or [B])."""
        if outputs.dim() == 2:
            out[microbatch.indices, : outputs.shape[1]] = outputs
        else:
            out[microbatch.indices] = outputs

    def _local_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, this rank's shard) of every parameter, for the reference swap. FSDP2 leaves the root
        module's parameters unsharded after a forward without backward, so it reshards first."""
        if hasattr(self.model, "reshard"):
            self.model.reshard()
        for name, p in self.model.named_parameters():
            yield name, p.to_local() if isinstance(p, DTensor) else p

    def _local_weights(self) -> dict[str, torch.Tensor]:
        """This rank's shards of every parameter, copied to CPU."""
        return {name: local.detach().to("cpu", copy=True) for name, local in self._local_params()}

    @torch.no_grad()
    def _load_local_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for name, local in self._local_params():
            local.copy_(weights[name].to(local.device))

    def init_reference_model(self) -> None:
        """Keep a frozen CPU copy of the current (initial) weights for reference logprobs; with LoRA the
        reference is the base model with the adapter disabled, so nothing is copied."""
        self.reference_weights = {} if self.cfg.lora.enabled else self._local_weights()

    def get_reference_policy_logprobs(self, data: dict[str, Any]) -> BatchedDataDict:
        """{"reference_policy_logprobs": [B, T]} from the frozen initial weights (swapped in, then back)."""
        if self.reference_weights is None:
            raise RuntimeError(
                f"rank {self.rank}: no reference model; create the Policy with init_reference_model=True"
            )
        if self.cfg.lora.enabled:
            with self._adapters_disabled():
                return BatchedDataDict({"reference_policy_logprobs": self.get_logprobs(data)["logprobs"]})
        current_weights = self._local_weights()
        self._load_local_weights(self.reference_weights)
        try:
            logprobs = self.get_logprobs(data)["logprobs"]
        finally:
            self._load_local_weights(current_weights)
        return BatchedDataDict({"reference_policy_logprobs": logprobs})

    def train(
        self,
        data: dict[str, Any],
        loss_fn: LossFn,
        eval_mode: bool = False,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
    ) -> dict[str, Any]:
        """One optimizer step per global batch (this rank holds global_batch_size / dp rows of each);
        forward only when `eval_mode`.

        Returns per-step lists, already reduced over dp ranks (step_metrics.reduce_steps): loss (global-batch
        loss), grad_norm, lr, num_microbatches (summed), and the loss function's metrics."""
        global_batch_size = global_batch_size or self.cfg.train_global_batch_size
        micro_batch_size = micro_batch_size or self.cfg.train_micro_batch_size
        local_batch_size = global_batch_size // self.dp_size  # the driver's shard_by_batch_size checked
        num_rows = data["input_ids"].shape[0]
        self.model.train(not eval_mode)
        with self._backend(), self.timer.time("eval" if eval_mode else "train"):
            steps = [
                self._run_global_batch(
                    select_rows(data, list(range(start, start + local_batch_size))),
                    loss_fn,
                    eval_mode,
                    micro_batch_size,
                )
                for start in range(0, num_rows, local_batch_size)
            ]
            return reduce_steps(steps, eval_mode, metric_reductions(loss_fn), self._all_reduce_dp)

    def get_weights(
        self, only_changed: bool = True, dtype: str | None = None
    ) -> dict[str, torch.Tensor] | lora.AdapterWeights:
        """Full CPU weights in HF names on rank 0 (with LoRA: the adapter only, as AdapterWeights), {}
        elsewhere; with `only_changed`, {} when no optimizer step or checkpoint load changed them since the
        last call (see refit.WeightVersions). `dtype` ("bfloat16", "float32") casts floating tensors for the
        receiver, halving what travels to a bf16 generation model (collective)."""
        self.sent_bytes = 0
        if not self.versions.take_send(only_changed):  # the same on every rank
            return {}
        with self._backend():
            weights = self._gather_weights(dtype)
        self.sent_bytes = lora.payload_num_bytes(weights)
        return weights

    @torch.no_grad()
    def share_weights(self, dtype: str | None = None, on_device: bool = False) -> SharedWeights | None:
        """Full weights written into a flat buffer that generation workers on this machine map once (see
        distributed/shared_weights.py): a shared-memory file, or with `on_device` this rank's GPU memory
        shared through CUDA IPC; rank 0 returns its handle, other ranks None (collective). Nothing is copied
        when no optimizer step or checkpoint load changed the weights since the last call."""
        import ray

        self.sent_bytes = 0
        moved = self.shared_on_device not in (None, on_device)  # the refit left the device: a new buffer
        self.shared_on_device = on_device
        if self.versions.take_share() or moved:
            with self._backend():
                weights = self._full_weights()
            if self.rank == 0:
                if self.shared_weights is None or moved:
                    if self.shared_weights is not None:
                        self.shared_weights.close()
                    target = getattr(torch, dtype) if dtype is not None else None
                    layout = {name: (tuple(t.shape), target or t.dtype) for name, t in weights.items()}
                    device = self.device if on_device else torch.device("cpu")
                    node_id = ray.get_runtime_context().get_node_id()
                    self.shared_weights = SharedWeightsWriter(layout, node_id, device)
                self.shared_weights.write(weights)
                self.sent_bytes = sum(view.nbytes for view in self.shared_weights.views.values())
        return self.shared_weights.handle if self.rank == 0 else None

    def last_weights_bytes(self) -> int:
        """Bytes of the tensors the last get_weights or share_weights sent (0 when nothing changed; rank
        0)."""
        return self.sent_bytes

    def get_timing_metrics(self) -> dict[str, float]:
        """Seconds this rank spent per stage (train, eval, logprobs) since the last call, then reset."""
        timing = self.timer.get_timing_metrics(reduction="sum")
        self.timer.reset()
        return timing

    def memory_footprint(self) -> dict[str, int]:
        """Bytes of this rank's parameter shards (all, and those that train), of its optimizer state, and
        the accelerator's total memory (0 on CPU)."""

        def local_bytes(tensor: torch.Tensor) -> int:
            return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).nbytes

        params = list(self.model.parameters())
        optimizer_bytes = sum(
            local_bytes(value)
            for optimizer in self._torch_optimizers()
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
        total = (
            torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else 0
        )
        return {
            "param_bytes": int(sum(local_bytes(p) for p in params)),
            "trainable_param_bytes": int(sum(local_bytes(p) for p in params if p.requires_grad)),
            "optimizer_state_bytes": int(optimizer_bytes),
            "device_total_bytes": int(total),
        }

    def describe(self) -> dict[str, Any]:
        """Where this rank runs: device, process-group backend, world size, CPU threads, and the
        accelerator memory its tensors hold (0 on CPU)."""
        on_gpu = self.device.type == "cuda"
        return {
            "device": str(self.device),
            "backend": str(dist.get_backend()),
            "world_size": self.world_size,
            "num_threads": torch.get_num_threads(),
            "memory_allocated": torch.cuda.memory_allocated(self.device) if on_gpu else 0,
        }

    def shutdown(self) -> bool:
        """Leave the process group (if this worker joined it); the actor can then be killed."""
        if self.shared_weights is not None:
            self.shared_weights.close()
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        return True
