"""The training worker: one Ray actor per bundle holding an FSDP2 (DTensor) shard of the policy model (one
fp32 worker alone holds the plain model: see needs_fsdp), optionally tensor-parallel. It computes
logprobs, reference logprobs, micro-batched train steps whose summed loss is the global-batch loss,
native checkpoints, HF export and full weights for refit."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from posttrain.distributed.batched_data_dict import (
    BatchedDataDict,
    dynamic_microbatch_indices,
    pack_sequences,
)
from posttrain.distributed.shared_weights import SharedWeights, SharedWeightsWriter
from posttrain.distributed.worker_group import assigned_device, init_torch_distributed
from posttrain.models import lora
from posttrain.models.build import load_tokenizer
from posttrain.models.policy.config import PolicyConfig, optimizer_kwargs
from posttrain.models.policy.shared_prefix import shared_prefix_logprobs
from posttrain.models.policy.token_logprobs import compute_token_logprobs, first_trained_position
from posttrain.models.vlm import (
    is_vision_language_dir,
    is_vision_language_model,
    load_processor,
    vision_forward_inputs,
    vision_tower_anchor,
)
from posttrain.utils.metrics import metric_reductions, reduce_metrics, reduction_of
from posttrain.utils.timer import Timer

LossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]


# ----------------------------------------------------------------------------------------------------
# Pure helpers: logprobs, micro-batch plans, packed rows. No process group needed.
# ----------------------------------------------------------------------------------------------------


def length_mask(input_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """1 where position < length: [B] lengths -> [B, seq_len] long mask."""
    positions = torch.arange(seq_len, device=input_lengths.device)  # [T]
    return (positions.unsqueeze(0) < input_lengths.unsqueeze(1)).long()  # [B, T]


@dataclass
class PackedRow:
    """Several sequences concatenated in one row, kept apart by a block-diagonal causal mask."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L], restarting at 0 for each sequence
    attention_mask: torch.Tensor  # [1, 1, L, L] bool, True = may attend
    lengths: list[int]


def build_packed_row(input_ids: torch.Tensor, lengths: list[int]) -> PackedRow:
    """Concatenate the first lengths[i] tokens of each row of input_ids [n, T] into one packed row."""
    pieces = [input_ids[i, :length] for i, length in enumerate(lengths)]
    row_ids = torch.cat(pieces).unsqueeze(0)  # [1, L]
    position_ids = torch.cat([torch.arange(length) for length in lengths]).unsqueeze(0).to(input_ids.device)
    segment_ids = torch.cat([torch.full((length,), i) for i, length in enumerate(lengths)]).to(
        input_ids.device
    )
    same_segment = segment_ids.unsqueeze(0) == segment_ids.unsqueeze(1)  # [L, L]
    causal = torch.ones_like(same_segment).tril()  # [L, L]
    attention_mask = (same_segment & causal).view(1, 1, *same_segment.shape)  # [1, 1, L, L]
    return PackedRow(row_ids, position_ids, attention_mask, list(lengths))


def unpack_row_logprobs(row_logprobs: torch.Tensor, lengths: list[int], seq_len: int) -> torch.Tensor:
    """Split packed-row logprobs [1, L] back into [n, seq_len], zero at each sequence start and padding."""
    unpacked = row_logprobs.new_zeros(len(lengths), seq_len)  # [n, T]
    offset = 0
    for i, length in enumerate(lengths):
        unpacked[i, 1:length] = row_logprobs[0, offset + 1 : offset + length]
        offset += length
    return unpacked


def select_rows(data: dict[str, Any], indices: list[int], seq_len: int | None = None) -> BatchedDataDict:
    """Rows `indices` of every value; tensors with a sequence dim (dim 1) equal to the batch's T cut to seq_len."""
    full_len = data["input_ids"].shape[1]
    index = torch.tensor(indices, dtype=torch.long)
    rows = BatchedDataDict()
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            value = value.index_select(0, index.to(value.device))
            if seq_len is not None and value.dim() >= 2 and value.shape[1] == full_len:
                value = value[:, :seq_len]
        else:
            value = [value[i] for i in indices]
        rows[key] = value
    return rows


@dataclass
class MicroBatch:
    """One forward/backward unit: its rows of the data (what the loss function sees) and forward inputs."""

    data: BatchedDataDict
    indices: list[int]  # rows of the local batch, in the order of `data`
    packed: PackedRow | None = None
    is_padding: bool = False  # a repeated micro-batch that only keeps ranks in step (its loss is scaled by 0)


@dataclass
class StepMetrics:
    """What one global batch (one optimizer step) produced on this rank, before the cross-rank reduction."""

    loss: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0
    num_microbatches: int = 0
    loss_metrics: dict[str, float] = field(default_factory=dict)


def step_value(step: StepMetrics, name: str) -> float:
    """A named number of a step: its loss, its micro-batch count or one of the loss function's metrics."""
    if name == "loss":
        return step.loss
    if name == "num_microbatches":
        return float(step.num_microbatches)
    return step.loss_metrics[name]


# ----------------------------------------------------------------------------------------------------
# Process group, model, optimizer
# ----------------------------------------------------------------------------------------------------


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
    """The configured model in fp32 on CPU with SDPA attention (causal LM or a 1-label sequence classifier)."""
    from transformers import AutoModelForSequenceClassification

    from posttrain.models.build import causal_lm_class

    if cfg.model_name is None:
        raise ValueError("policy.model_name is not set: give a Hugging Face model directory or hub name")
    kwargs: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if cfg.model_kind == "causal_lm":
        return causal_lm_class(cfg.model_name).from_pretrained(cfg.model_name, **kwargs)
    model = AutoModelForSequenceClassification.from_pretrained(cfg.model_name, num_labels=1, **kwargs)
    model.config.architectures = [type(model).__name__]  # exports and checkpoints rebuild this class
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (the classes the model lists in `_no_split_modules`); a vision tower's
    blocks stay with the root module (see posttrain.models.vlm.vision_tower_anchor)."""
    block_names = {name for name in getattr(model, "_no_split_modules", None) or [] if "Vision" not in name}
    layers = [module for module in model.modules() if type(module).__name__ in block_names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__}: found no decoder layers to shard (_no_split_modules={block_names})"
        )
    return layers


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP of attention and MLP projections (Qwen2/Llama layout); embeddings stay replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    config = model.config
    tp = tp_mesh.size()
    if config.num_attention_heads % tp or config.num_key_value_heads % tp:
        raise ValueError(
            f"policy.tensor_parallel_size={tp} must divide num_attention_heads={config.num_attention_heads} "
            f"and num_key_value_heads={config.num_key_value_heads}"
        )
    for layer in decoder_layers(model):
        missing = [name for name in plan if layer.get_submodule(name) is None]
        if missing:
            raise ValueError(f"{type(layer).__name__}: no {missing} for tensor parallelism")
        parallelize_module(layer, tp_mesh, lora.tensor_parallel_plan(layer, plan))  # peft-wrapped: base + adapter


def needs_fsdp(world_size: int, cfg: PolicyConfig, device: torch.device) -> bool:
    """FSDP2 unless one worker trains in fp32 without CPU offload: a 1-rank FSDP shards nothing, yet copies
    every parameter in (forward and again for backward) and every gradient out (~7% of SmolLM2's training)."""
    return world_size > 1 or cfg.precision != "float32" or (cfg.cpu_offload and device.type == "cuda")


def shard_model(model: torch.nn.Module, dp_mesh: DeviceMesh, cfg: PolicyConfig, device: torch.device) -> None:
    """fully_shard every decoder layer and the root; gradients are SUMMED over ranks (no averaging)."""
    mp_policy = MixedPrecisionPolicy()
    if cfg.precision == "bfloat16":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy() if cfg.cpu_offload and device.type == "cuda" else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    # The loss of each micro-batch is already normalised by GLOBAL counts, so the global gradient is the
    # sum over ranks: turn FSDP's default averaging off (and use plain SUM, which gloo supports).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


@torch.no_grad()
def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Global L2 norm of all gradients (DTensor shards on any mesh included); scale them to max_norm if above."""
    grads = [p.grad for p in parameters if p.grad is not None]
    grads_by_mesh: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:  # with TP, norms/embeddings live on the dp mesh and projections on the (dp, tp) mesh
        grads_by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    squared_total = 0.0
    for mesh_grads in grads_by_mesh.values():
        norm = torch.nn.utils.get_total_norm(mesh_grads, norm_type=2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squared_total += float(norm) ** 2
    total_norm = math.sqrt(squared_total)
    if max_norm is not None:
        clip_coef = min(1.0, max_norm / (total_norm + 1e-6))
        if clip_coef < 1.0:
            torch._foreach_mul_(grads, clip_coef)
    return total_norm


FUSED_OPTIMIZERS = ("Adam", "AdamW")


def build_optimizer(model: torch.nn.Module, cfg: PolicyConfig) -> torch.optim.Optimizer:
    """Any torch.optim class by name, over the trainable parameters."""
    optimizer_cls = getattr(torch.optim, cfg.optimizer.name, None)
    if optimizer_cls is None:
        raise ValueError(f"policy.optimizer.name: torch.optim has no {cfg.optimizer.name!r}")
    kwargs = optimizer_kwargs(cfg.optimizer.kwargs)
    if cfg.optimizer.name in FUSED_OPTIMIZERS and not cfg.cpu_offload and not {"fused", "foreach"} & set(kwargs):
        kwargs["fused"] = True  # one vectorised kernel per step (on a CPU too): the same update, ~4x faster
    return optimizer_cls([p for p in model.parameters() if p.requires_grad], **kwargs)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: PolicyConfig
) -> torch.optim.lr_scheduler.LRScheduler:
    """The configured schedulers (constant LR when none; several become SequentialLR)."""
    schedulers = []
    for i, scheduler_cfg in enumerate(cfg.scheduler):
        scheduler_cls = getattr(torch.optim.lr_scheduler, scheduler_cfg.name, None)
        if scheduler_cls is None:
            raise ValueError(
                f"policy.scheduler[{i}].name: torch.optim.lr_scheduler has no {scheduler_cfg.name!r}"
            )
        schedulers.append(scheduler_cls(optimizer, **scheduler_cfg.kwargs))
    if not schedulers:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    if len(schedulers) == 1:
        return schedulers[0]
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer, schedulers, milestones=list(cfg.scheduler_milestones)
    )


# ----------------------------------------------------------------------------------------------------
# The worker
# ----------------------------------------------------------------------------------------------------


class DTensorPolicyWorker:
    """One rank of the policy: an FSDP2-sharded (optionally TP) model, its optimizer and scheduler."""

    shared_weights: SharedWeightsWriter | None = None  # rank 0's shared-memory refit file (share_weights)
    shared_weights_version: int | None = None  # the weights_version last written into it
    last_weights_bytes = 0  # what the last get_weights / share_weights sent or wrote (the refit_bytes metric)

    def __init__(self, cfg: PolicyConfig, init_reference_model: bool = False) -> None:
        self.cfg = cfg
        self.timer = Timer()  # this rank's stage times, collected by get_timing_metrics
        ensure_process_group()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = assigned_device()
        tp = cfg.tensor_parallel_size
        if self.world_size % tp:
            raise ValueError(
                f"policy.tensor_parallel_size={tp} does not divide the {self.world_size} workers"
            )
        self.mesh = init_device_mesh(
            self.device.type, (self.world_size // tp, tp), mesh_dim_names=("dp", "tp")
        )
        self.dp_group = self.mesh["dp"].get_group()
        self.dp_size = self.mesh["dp"].size()
        torch.manual_seed(cfg.seed)
        self.model = self._build_model()
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.tokenizer = self._load_tokenizer()
        self.reference_weights: dict[str, torch.Tensor] | None = None
        self.weights_version = 0  # optimizer steps and checkpoint loads so far (see get_weights)
        self.sent_weights_version: int | None = None
        if init_reference_model:
            self.init_reference_model()

    def _build_model(self) -> torch.nn.Module:
        model = load_hf_model(self.cfg)
        if getattr(model.config, "vision_config", None) is not None and (
                self.cfg.tensor_parallel_size > 1 or self.cfg.sequence_packing.enabled):
            raise ValueError("policy: a vision-language model runs without tensor_parallel_size > 1 and "
                             "sequence_packing (its M-RoPE positions and vision tower are not split)")
        if self.cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.cfg.lora.enabled:  # freezes the base; the optimizer then holds the adapter's state only
            model = lora.wrap_with_lora(model, self.cfg.lora, self.cfg.model_kind, self.cfg.model_name)
        if self.cfg.tensor_parallel_size > 1:
            model.to(self.device)
            apply_tensor_parallel(model, self.mesh["tp"])
        if needs_fsdp(self.world_size, self.cfg, self.device):
            shard_model(model, self.mesh["dp"], self.cfg, self.device)
        if not (self.cfg.cpu_offload and self.device.type == "cuda"):
            model.to(self.device)
        return model

    def _load_tokenizer(self) -> Any:
        """The tokenizer saved with checkpoints and exports (a vision-language model's: with its image processor)."""
        if is_vision_language_dir(self.cfg.model_name):
            return load_processor(self.cfg.tokenizer_name or self.cfg.model_name)
        return load_tokenizer(self.cfg.tokenizer_name or self.cfg.model_name)

    def _all_reduce_dp(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        """All-reduce over the data-parallel ranks (on the worker's device: NCCL needs CUDA tensors); CPU out."""
        reduced = tensor.to(self.device)
        dist.all_reduce(reduced, op=op, group=self.dp_group)
        return reduced.cpu()

    # -- micro-batches ---------------------------------------------------------------------------------

    def _lengths(self, data: dict[str, Any]) -> torch.Tensor:
        if "input_lengths" in data:
            return data["input_lengths"].long()
        return torch.full((data["input_ids"].shape[0],), data["input_ids"].shape[1], dtype=torch.long)

    def make_microbatches(self, data: dict[str, Any], batch_size: int) -> list[MicroBatch]:
        """Fixed-size, token-budget (dynamic batching) or packed micro-batches, each cut to its longest row."""
        lengths = self._lengths(data).tolist()
        if self.cfg.sequence_packing.enabled:
            if self.cfg.model_kind != "causal_lm":
                raise ValueError("policy.sequence_packing: only for model_kind='causal_lm'")
            groups = pack_sequences(lengths, self.cfg.sequence_packing.max_tokens_per_bin)
        elif self.cfg.dynamic_batching.enabled:
            budget = self.cfg.dynamic_batching
            groups = dynamic_microbatch_indices(
                lengths, budget.max_tokens_per_microbatch, budget.sequence_length_round
            )
        else:
            groups = [
                list(range(i, min(i + batch_size, len(lengths)))) for i in range(0, len(lengths), batch_size)
            ]
        microbatches = []
        for indices in groups:
            rows = select_rows(data, indices, seq_len=max(lengths[i] for i in indices))
            packed = None
            if self.cfg.sequence_packing.enabled:
                packed = build_packed_row(rows["input_ids"], [lengths[i] for i in indices])
            microbatches.append(MicroBatch(rows, indices, packed))
        return microbatches

    def _pad_to_common_count(self, microbatches: list[MicroBatch]) -> list[MicroBatch]:
        """Every dp rank must run the same number of forwards (FSDP all-gathers): repeat one as padding."""
        count = self._all_reduce_dp(torch.tensor([len(microbatches)]), dist.ReduceOp.MAX)
        if not microbatches and count.item() > 0:
            raise ValueError(
                f"rank {self.rank}: got no data while other ranks did; send at least one row per rank"
            )
        padding = [MicroBatch(microbatches[0].data, [], microbatches[0].packed, is_padding=True)] * (
            int(count.item()) - len(microbatches)
        )
        return microbatches + padding

    # -- forward ---------------------------------------------------------------------------------------

    def _forward(self, microbatch: MicroBatch) -> torch.Tensor:
        """Logprobs [b, T_mb] for a causal LM, scores [b] for a reward model (fp32)."""
        data = microbatch.data
        input_ids = data["input_ids"].to(self.device)  # [b, T_mb]
        if microbatch.packed is not None:
            return self._forward_packed(microbatch.packed, input_ids.shape[1])
        attention_mask = length_mask(self._lengths(data).to(self.device), input_ids.shape[1])  # [b, T_mb]
        if self.cfg.model_kind == "reward_model":
            # HF pools the last non-pad token: make every position past the length a pad token.
            pad_id = self.model.config.pad_token_id
            input_ids = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, pad_id))
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits  # [b, 1]
            return logits.float().squeeze(-1)  # [b]
        text_only = not is_vision_language_model(self.model)  # equal VLM prompts may show different images
        if self.cfg.prefix_sharing and text_only and "token_mask" in data:  # shared prompts computed once
            logprobs = shared_prefix_logprobs(self.model, data["input_ids"], self._lengths(data).tolist(),
                                              data["token_mask"], self.cfg.logprob_temperature, self.device)
            if logprobs is not None:
                return logprobs * attention_mask
        # Logits only from the position before the first trained token: a GRPO prompt's logits are never
        # read, and at a real vocabulary they are most of the memory and a good share of the time.
        num_kept = input_ids.shape[1] - first_trained_position(data.get("token_mask")) + 1  # K
        vision = vision_forward_inputs(self.model, data, input_ids, attention_mask)  # {} for a text-only model
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            logits_to_keep=num_kept, **vision).logits  # [b, K, V]
        logprobs = compute_token_logprobs(logits, input_ids[:, -num_kept:], self.cfg.logprob_temperature)  # [b, K]
        logprobs = torch.nn.functional.pad(logprobs, (input_ids.shape[1] - num_kept, 0))  # [b, T_mb]
        return logprobs * attention_mask + vision_tower_anchor(self.model)

    def _forward_packed(self, packed: PackedRow, seq_len: int) -> torch.Tensor:
        logits = self.model(
            input_ids=packed.input_ids.to(self.device),
            position_ids=packed.position_ids.to(self.device),
            attention_mask=packed.attention_mask.to(self.device),
        ).logits  # [1, L, V]
        row_logprobs = compute_token_logprobs(
            logits, packed.input_ids.to(self.device), self.cfg.logprob_temperature
        )
        return unpack_row_logprobs(row_logprobs, packed.lengths, seq_len)  # [n, T_mb]

    @torch.no_grad()
    def get_logprobs(self, data: dict[str, Any]) -> BatchedDataDict:
        """{"logprobs": [B, T]} in fp32: position t = log p(token t | < t), position 0 and padding 0."""
        if self.cfg.model_kind != "causal_lm":
            raise ValueError("get_logprobs: policy.model_kind is 'reward_model'; use get_scores")
        batch_size, seq_len = data["input_ids"].shape
        with self.timer.time("logprobs"):
            return BatchedDataDict({"logprobs": self._forward_all(data, torch.zeros(batch_size, seq_len))})

    @torch.no_grad()
    def get_scores(self, data: dict[str, Any]) -> BatchedDataDict:
        """{"scores": [B]} in fp32 from a reward model (the score at each sequence's last token)."""
        if self.cfg.model_kind != "reward_model":
            raise ValueError("get_scores: policy.model_kind is 'causal_lm'; use get_logprobs")
        return BatchedDataDict({"scores": self._forward_all(data, torch.zeros(data["input_ids"].shape[0]))})

    def _forward_all(self, data: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
        """Fill `out` ([B, T] logprobs or [B] scores) micro-batch by micro-batch, in the original row order."""
        self.model.eval()
        microbatches = self._pad_to_common_count(self.make_microbatches(data, self.cfg.logprob_batch_size))
        for microbatch in microbatches:
            outputs = self._forward(microbatch).cpu()  # [b, T_mb] or [b]
            if microbatch.is_padding:
                continue
            if outputs.dim() == 2:
                out[microbatch.indices, : outputs.shape[1]] = outputs
            else:
                out[microbatch.indices] = outputs
        return out

    # -- reference model -------------------------------------------------------------------------------

    def _local_weights(self) -> dict[str, torch.Tensor]:
        """This rank's shards of every parameter, copied to CPU."""
        return {
            name: (p.to_local() if isinstance(p, DTensor) else p).detach().to("cpu", copy=True)
            for name, p in self.model.named_parameters()
        }

    @torch.no_grad()
    def _load_local_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for name, p in self.model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
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
            with lora.adapter_disabled(self.model):
                return BatchedDataDict({"reference_policy_logprobs": self.get_logprobs(data)["logprobs"]})
        current_weights = self._local_weights()
        self._load_local_weights(self.reference_weights)
        try:
            logprobs = self.get_logprobs(data)["logprobs"]
        finally:
            self._load_local_weights(current_weights)
        return BatchedDataDict({"reference_policy_logprobs": logprobs})

    # -- training --------------------------------------------------------------------------------------

    def _global_counts(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid sequences, valid tokens) of the global batch: this rank's sums all-reduced over dp."""
        batch_size, seq_len = batch["input_ids"].shape
        sample_mask = batch.get("sample_mask", torch.ones(batch_size)).float()  # [B]
        token_mask = batch.get("token_mask")
        if token_mask is None:
            token_mask = length_mask(self._lengths(batch), seq_len)
        counts = torch.stack([sample_mask.sum(), (token_mask.float() * sample_mask.unsqueeze(1)).sum()])
        counts = self._all_reduce_dp(counts, dist.ReduceOp.SUM)
        return counts[0].to(self.device), counts[1].to(self.device)

    def _optimizer_step(self) -> tuple[float, float]:
        """Clip (if configured), step optimizer and scheduler; returns (grad norm before clipping, lr used)."""
        grad_norm = clip_gradients(list(self.model.parameters()), self.cfg.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.weights_version += 1
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, float(lr)

    def _run_global_batch(
        self, batch: dict[str, Any], loss_fn: LossFn, eval_mode: bool, micro_batch_size: int
    ) -> StepMetrics:
        valid_seqs, valid_toks = self._global_counts(batch)
        step, parts = StepMetrics(), []
        for microbatch in self._pad_to_common_count(self.make_microbatches(batch, micro_batch_size)):
            with torch.set_grad_enabled(not eval_mode):
                outputs = self._forward(microbatch)  # [b, T_mb] logprobs or [b] scores
                loss, metrics = loss_fn(outputs, microbatch.data.to(self.device), valid_seqs, valid_toks)
            if not eval_mode:
                (loss * (0.0 if microbatch.is_padding else 1.0)).backward()
            if microbatch.is_padding:
                continue
            step.loss += float(loss.detach())
            step.num_microbatches += 1
            parts.append({k: float(v) for k, v in metrics.items()})
        step.loss_metrics = reduce_metrics(parts, metric_reductions(loss_fn))
        if not eval_mode:
            step.grad_norm, step.lr = self._optimizer_step()
        return step

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

        Returns per-step lists, already reduced over dp ranks: loss (global-batch loss), grad_norm, lr,
        num_microbatches (summed), and the loss function's metrics (summed over micro-batches and ranks).
        """
        global_batch_size = global_batch_size or self.cfg.train_global_batch_size
        micro_batch_size = micro_batch_size or self.cfg.train_micro_batch_size
        if global_batch_size % self.dp_size:
            raise ValueError(
                f"train: global batch size {global_batch_size} is not divisible by {self.dp_size} data-parallel ranks"
            )
        local_batch_size = global_batch_size // self.dp_size
        num_rows = data["input_ids"].shape[0]
        if num_rows % local_batch_size:
            raise ValueError(
                f"train: rank {self.rank} got {num_rows} rows, not a multiple of global batch size / dp = "
                f"{local_batch_size}"
            )
        self.model.train(not eval_mode)
        with self.timer.time("eval" if eval_mode else "train"):
            steps = [
                self._run_global_batch(
                    select_rows(data, list(range(start, start + local_batch_size))), loss_fn, eval_mode,
                    micro_batch_size,
                )
                for start in range(0, num_rows, local_batch_size)
            ]
            return self._reduce_steps(steps, eval_mode, metric_reductions(loss_fn))

    def _reduce_steps(
        self, steps: list[StepMetrics], eval_mode: bool, reductions: dict[str, str]
    ) -> dict[str, Any]:
        """Reduce over dp ranks, each loss metric by its reduction (`reduction_of`: named by the loss
        function, else `*_min` / `*_max` by min / max, else sum; a mean is over all micro-batches of all
        ranks); losses and micro-batch counts summed; grad norm and lr are global already. Every rank has
        the same metric keys."""
        keys = sorted({key for step in steps for key in step.loss_metrics} - {"loss", "num_microbatches"})
        columns: dict[str, list[str]] = {"sum": ["loss", "num_microbatches"], "min": [], "max": [], "mean": []}
        for key in keys:
            columns[reduction_of(key, reductions)].append(key)
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        counts = torch.tensor([float(step.num_microbatches) for step in steps], dtype=torch.float64)  # [S]
        result: dict[str, Any] = {}
        for kind, names in columns.items():
            if not names:
                continue
            values = torch.tensor(
                [[step_value(step, name) for name in names] for step in steps], dtype=torch.float64
            )  # [num_steps, num_names]
            if kind == "mean":  # each rank's micro-batch mean weighted by its micro-batch count
                values = self._all_reduce_dp(values * counts[:, None], dist.ReduceOp.SUM)
                values = values / self._all_reduce_dp(counts.clone(), dist.ReduceOp.SUM)[:, None].clamp(min=1)
            else:
                values = self._all_reduce_dp(values, ops[kind])
            for column, name in enumerate(names):
                result.setdefault(name, values[:, column].tolist())
        if not eval_mode:
            result["grad_norm"] = [step.grad_norm for step in steps]
            result["lr"] = [step.lr for step in steps]
        return result

    # -- checkpoints, export, refit ----------------------------------------------------------------------

    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> None:
        """Sharded model + optimizer (when `save_optimizer`) + scheduler state (DCP) under `path`, and this
        rank's RNG states (collective)."""
        from posttrain.utils import native_checkpoint

        optimizer = self.optimizer if save_optimizer else None
        native_checkpoint.save_checkpoint(self.model, optimizer, self.scheduler, path, tokenizer=self.tokenizer,
                                          trainable_only=self.cfg.lora.enabled)
        if self.cfg.lora.enabled:  # adapter + optimizer only; the config names the base model
            native_checkpoint.on_rank0(lambda: lora.save_adapter_config(self.model, path), f"LoRA config in {path}")
        native_checkpoint.save_rng_state(path, self.rank)

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer and scheduler state saved by save_checkpoint (collective)."""
        from posttrain.utils import native_checkpoint

        native_checkpoint.load_checkpoint(self.model, self.optimizer, self.scheduler, path,
                                          trainable_only=self.cfg.lora.enabled)
        native_checkpoint.load_rng_state_if_saved(path, self.rank)
        self.weights_version += 1

    def export_hf(self, out_dir: str) -> None:
        """A Hugging Face directory (safetensors, config, tokenizer) with the current weights (collective)."""
        from posttrain.utils import native_checkpoint

        if self.cfg.lora.enabled:  # merged weights, and the PEFT adapter in out_dir/adapter
            lora.export_merged_hf(self.model, self.tokenizer, out_dir, self.model.config)
            return
        native_checkpoint.export_hf(self.model, self.tokenizer, out_dir, self.model.config)

    def get_weights(self, only_changed: bool = True, dtype: str | None = None
                    ) -> dict[str, torch.Tensor] | lora.AdapterWeights:
        """Full (gathered) CPU weights on rank 0 (with LoRA: the adapter only, as AdapterWeights), {}
        elsewhere; with `only_changed`, {} when no optimizer step or checkpoint load changed them since the
        last call (weights change only through those, so no copy is kept to compare with). `dtype` ("bfloat16", "float32") casts floating tensors for the
        receiver, halving what travels to a bf16 generation model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        unchanged = only_changed and self.sent_weights_version == self.weights_version  # same on every rank
        self.sent_weights_version = self.weights_version
        if unchanged:
            self.last_weights_bytes = 0
            return {}
        if self.cfg.lora.enabled:  # the adapter only: the generation workers keep the base resident
            adapter = lora.gather_adapter_weights(self.model, self.cfg.lora, self.cfg.model_kind, self.rank, dtype)
            self.last_weights_bytes = lora.payload_num_bytes(adapter) if self.rank == 0 else 0
            return adapter
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full_weights = get_model_state_dict(self.model, options=options)  # collective
        if self.rank != 0:
            return {}
        if dtype is not None:
            target = getattr(torch, dtype)
            full_weights = {name: t.to(target) if t.is_floating_point() else t for name, t in full_weights.items()}
        self.last_weights_bytes = lora.payload_num_bytes(full_weights)
        return full_weights

    def _full_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter in HF names (tied weights once), complete on rank 0, {} elsewhere (collective);
        with one rank they are the parameters themselves, not copies."""
        weights = {}
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) and p.device_mesh.size() > 1 else p  # collective
            weights[name] = (full.to_local() if isinstance(full, DTensor) else full).detach()
        return weights if self.rank == 0 else {}

    @torch.no_grad()
    def share_weights(self, dtype: str | None = None) -> SharedWeights | None:
        """Full weights written into a shared-memory file that generation workers on this machine map once
        (see distributed/shared_weights.py); rank 0 returns its handle, other ranks None (collective).
        Nothing is copied when no optimizer step or checkpoint load changed the weights since the last call."""
        import ray

        self.last_weights_bytes = 0
        if self.shared_weights_version != self.weights_version:
            weights = self._full_weights()
            if self.rank == 0:
                if self.shared_weights is None:
                    target = getattr(torch, dtype) if dtype is not None else None
                    layout = {name: (tuple(t.shape), target or t.dtype) for name, t in weights.items()}
                    self.shared_weights = SharedWeightsWriter(layout, ray.get_runtime_context().get_node_id())
                for name, tensor in weights.items():
                    self.shared_weights.views[name].copy_(tensor)
                self.last_weights_bytes = sum(view.nbytes for view in self.shared_weights.views.values())
            self.shared_weights_version = self.weights_version
        return self.shared_weights.handle if self.rank == 0 else None

    def get_last_weights_bytes(self) -> int:
        """Bytes of the tensors the last get_weights returned (0 when nothing changed; rank 0)."""
        return self.last_weights_bytes

    def _move_training_state(self, device: torch.device) -> None:
        self.model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)

    def offload(self) -> None:
        """Move weights and optimizer state to CPU to free accelerator memory (no-op on a CPU worker)."""
        if self.device.type != "cpu":
            self._move_training_state(torch.device("cpu"))
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Bring weights and optimizer state back to the worker's device."""
        if self.device.type != "cpu" and not self.cfg.cpu_offload:
            self._move_training_state(self.device)

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
        optimizer_bytes = sum(local_bytes(value) for state in self.optimizer.state.values()
                              for value in state.values() if isinstance(value, torch.Tensor))
        total = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else 0
        return {"param_bytes": int(sum(local_bytes(p) for p in params)),
                "trainable_param_bytes": int(sum(local_bytes(p) for p in params if p.requires_grad)),
                "optimizer_state_bytes": int(optimizer_bytes), "device_total_bytes": int(total)}

    def describe(self) -> dict[str, Any]:
        """Where this rank runs: device, process-group backend, world size, CPU threads, and the
        accelerator memory its tensors hold (0 on CPU)."""
        on_gpu = self.device.type == "cuda"
        return {"device": str(self.device), "backend": str(dist.get_backend()), "world_size": self.world_size,
                "num_threads": torch.get_num_threads(),
                "memory_allocated": torch.cuda.memory_allocated(self.device) if on_gpu else 0}

    def shutdown(self) -> bool:
        """Leave the process group; the actor can then be killed."""
        if self.shared_weights is not None:
            self.shared_weights.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        return True
