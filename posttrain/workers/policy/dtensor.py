"""The DTensor/FSDP2 policy worker (`policy.backend: dtensor`): one Ray actor per bundle holding an FSDP2
shard of the policy model (one fp32 worker alone holds the plain model: see needs_fsdp), optionally
tensor-parallel and context-parallel (context_parallel.py). On the shared base (`base.PolicyWorker`) it
builds the model, optimizer and schedulers, runs forwards (plain, packed, shared-prefix, context-parallel,
vision-language) and optimizer steps, writes native checkpoints and HF exports, gathers full weights for
refit, and moves its state off the accelerator."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from posttrain.models import lora
from posttrain.models.moe import is_moe_model
from posttrain.models.vlm import is_vision_language_model, vision_forward_inputs, vision_tower_anchor
from posttrain.utils import native_checkpoint
from posttrain.utils.metrics import metric_reductions, reduce_metrics
from posttrain.workers.policy.base import LossFn, PolicyWorker, load_hf_model
from posttrain.workers.policy.config import PolicyConfig
from posttrain.workers.policy.context_parallel import (
    context_parallel_logprobs,
    use_context_parallel_attention,
)
from posttrain.workers.policy.expert_parallel import apply_expert_parallel, reduce_expert_gradients
from posttrain.workers.policy.microbatches import (
    ForwardCost,
    MicroBatch,
    PackedRow,
    length_mask,
    row_lengths,
    unpack_row_logprobs,
)
from posttrain.workers.policy.moe_step import add_router_losses, router_replay_enabled, router_tap
from posttrain.workers.policy.optim import build_optimizer, build_scheduler, clip_gradients
from posttrain.workers.policy.shared_prefix import attention_cost_ratio, shared_prefix_logprobs
from posttrain.workers.policy.step_metrics import StepMetrics
from posttrain.workers.policy.token_logprobs import (
    compute_token_logprobs,
    first_trained_position,
    next_token_logprobs_at,
    topk_next_token_logprobs,
)
from posttrain.workers.policy.tree_attention import use_layout_attention
from posttrain.workers.refit import cast_floating


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
        parallelize_module(
            layer, tp_mesh, lora.tensor_parallel_plan(layer, plan)
        )  # peft-wrapped: base + adapter


def needs_fsdp(world_size: int, cfg: PolicyConfig, device: torch.device) -> bool:
    """FSDP2 unless one worker trains in fp32 without CPU offload: a 1-rank FSDP shards nothing, yet copies
    every parameter in (forward and again for backward) and every gradient out (~7% of SmolLM2's training)."""
    return world_size > 1 or cfg.precision != "float32" or (cfg.cpu_offload and device.type == "cuda")


def shard_model(
    model: torch.nn.Module,
    dp_mesh: DeviceMesh,
    cfg: PolicyConfig,
    device: torch.device,
    ignored_params: set[torch.nn.Parameter] | None = None,
) -> None:
    """fully_shard every decoder layer and the root, except `ignored_params` (expert-parallel experts);
    gradients are SUMMED over ranks (no averaging)."""
    mp_policy = MixedPrecisionPolicy()
    if cfg.precision == "bfloat16":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy() if cfg.cpu_offload and device.type == "cuda" else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(
            layer,
            mesh=dp_mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored_params=ignored_params,
        )
    fully_shard(
        model, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload_policy, ignored_params=ignored_params
    )
    # The loss of each micro-batch is already normalised by GLOBAL counts, so the global gradient is the
    # sum over ranks: turn FSDP's default averaging off (and use plain SUM, which gloo supports).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


class DTensorPolicyWorker(PolicyWorker):
    """One rank of the policy: an FSDP2-sharded (optionally TP) model, its optimizer and scheduler."""

    def _init_parallel(self) -> None:
        """A (dp, cp, tp) device mesh; tensor parallelism splits over tp, context parallelism over cp
        (context_parallel.py), and FSDP2 shards over dp x cp: both hold different tokens of the batch, so
        their gradients are summed together. With expert parallelism also an (edp, ep) mesh of the same
        ranks, experts split over ep (expert_parallel.py)."""
        tp, cp = self.cfg.tensor_parallel_size, self.cfg.context_parallel_size
        ep = self.cfg.expert_parallel_size
        self.mesh = init_device_mesh(
            self.device.type, (self.world_size // (tp * cp), cp, tp), mesh_dim_names=("dp", "cp", "tp")
        )
        self.dp_group = self.mesh["dp"].get_group()
        self.dp_size = self.mesh["dp"].size()
        self.cp_group = self.mesh["cp"].get_group() if cp > 1 else None
        self.shard_mesh = self.mesh["dp", "cp"]._flatten("dp_cp") if cp > 1 else self.mesh["dp"]
        self.ep_mesh = None
        if ep > 1:
            self.ep_mesh = init_device_mesh(
                self.device.type, (self.world_size // ep, ep), mesh_dim_names=("edp", "ep")
            )

    def _build_model_and_optimizer(self) -> None:
        self.model = self._build_model()
        self.optimizer = build_optimizer(self.model, self.cfg)
        self.scheduler = build_scheduler(self.optimizer, self.cfg)

    def _build_model(self) -> torch.nn.Module:
        model = load_hf_model(self.cfg)
        if getattr(model.config, "vision_config", None) is not None and (
            self.cfg.tensor_parallel_size > 1
            or self.cfg.context_parallel_size > 1
            or self.cfg.sequence_packing.enabled
        ):
            raise ValueError(
                "policy: a vision-language model runs without tensor_parallel_size > 1, "
                "context_parallel_size > 1 and sequence_packing (its M-RoPE positions and vision tower "
                "are not split)"
            )
        if self.cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.router_replay = router_replay_enabled(model, self.cfg.moe, self.cfg.model_name)
        text_lm = self.cfg.model_kind == "causal_lm" and not is_vision_language_model(model)
        if self.cfg.context_parallel_size > 1:
            use_context_parallel_attention(model)  # sequences split over cp ranks (context_parallel.py)
        elif self.shares_prefixes(model) and text_lm:
            use_layout_attention(model)  # shared prompts attend only where tokens see (tree_attention.py)
        if self.cfg.lora.enabled:  # freezes the base; the optimizer then holds the adapter's state only
            model = lora.wrap_with_lora(model, self.cfg.lora, self.cfg.model_kind, self.cfg.model_name)
        if self.cfg.tensor_parallel_size > 1:
            model.to(self.device)
            apply_tensor_parallel(model, self.mesh["tp"])
        expert_params = apply_expert_parallel(model, self.ep_mesh) if self.ep_mesh is not None else None
        if needs_fsdp(self.world_size, self.cfg, self.device):
            shard_model(model, self.shard_mesh, self.cfg, self.device, expert_params)
        if not (self.cfg.cpu_offload and self.device.type == "cuda"):
            model.to(self.device)
        return model

    def _forward(self, microbatch: MicroBatch, logprobs_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logprobs [b, T_mb] for a causal LM, scores [b] for a reward model, values [b, T_mb] for a value
        model (fp32). With `logprobs_at` ([b, T_mb, k] token ids, a distillation loss's candidates): the
        logprobs and, after them, the logprobs of those ids at each position, [b, T_mb, 1 + k]."""
        data = microbatch.data
        input_ids = data["input_ids"].to(self.device)  # [b, T_mb]
        if logprobs_at is not None:
            return self._forward_with_candidates(data, input_ids, logprobs_at.to(self.device))
        if self.cp_group is not None:
            return self._forward_context_parallel(microbatch, input_ids)
        if microbatch.packed is not None:
            return self._forward_packed(microbatch.packed, input_ids.shape[1])
        attention_mask = length_mask(row_lengths(data).to(self.device), input_ids.shape[1])  # [b, T_mb]
        if self.cfg.model_kind == "reward_model":
            # HF pools the last non-pad token: make every position past the length a pad token.
            pad_id = self.model.config.pad_token_id
            input_ids = torch.where(attention_mask.bool(), input_ids, torch.full_like(input_ids, pad_id))
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits  # [b, 1]
            return logits.float().squeeze(-1)  # [b]
        if self.cfg.model_kind == "value_model":
            # The head at position t - 1 has seen tokens < t: shift right so values line up with logprobs.
            outputs = self.model(input_ids=input_ids, attention_mask=attention_mask).logits  # [b, T_mb, 1]
            values = torch.nn.functional.pad(outputs.float().squeeze(-1)[:, :-1], (1, 0))  # [b, T_mb]
            return values * attention_mask
        text_only = not is_vision_language_model(self.model)  # equal VLM prompts may show different images
        if self.shares_prefixes(self.model) and text_only and "token_mask" in data:  # prompts computed once
            rows = (data["input_ids"], row_lengths(data).tolist(), data["token_mask"])
            logprobs = shared_prefix_logprobs(self.model, *rows, self.cfg.logprob_temperature, self.device)
            if logprobs is not None:
                return logprobs * attention_mask
        vision = vision_forward_inputs(self.model, data, input_ids, attention_mask)  # {} for text only
        logits, num_kept = self._causal_logits(data, input_ids, vision)  # [b, K, V]
        logprobs = compute_token_logprobs(logits, input_ids[:, -num_kept:], self.cfg.logprob_temperature)
        logprobs = torch.nn.functional.pad(logprobs, (input_ids.shape[1] - num_kept, 0))  # [b, T_mb]
        return logprobs * attention_mask + vision_tower_anchor(self.model)

    def _forward_context_parallel(self, microbatch: MicroBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """Logprobs [b, T_mb] of whole rows (packed or not), each cp rank computing its own chunks; 0 before
        the first trained token, as in _forward (no loss reads them)."""
        data, packed, temperature = microbatch.data, microbatch.packed, self.cfg.logprob_temperature
        positions = torch.arange(input_ids.shape[1], device=self.device)  # [T_mb]
        read = length_mask(row_lengths(data).to(self.device), input_ids.shape[1]) * (
            positions >= first_trained_position(data.get("token_mask"))
        )  # [b, T_mb]
        if packed is None:
            logprobs = context_parallel_logprobs(
                self.model, input_ids, positions.expand_as(input_ids), self.cp_group, temperature
            )  # [b, T_mb]
            return logprobs * read
        ids, positions = packed.input_ids.to(self.device), packed.position_ids.to(self.device)
        row_logprobs = context_parallel_logprobs(
            self.model, ids, positions, self.cp_group, temperature, packed.lengths
        )
        return unpack_row_logprobs(row_logprobs, packed.lengths, input_ids.shape[1]) * read  # [n, T_mb]

    def _causal_logits(
        self, data: dict[str, Any], input_ids: torch.Tensor, vision: dict | None = None
    ) -> tuple[torch.Tensor, int]:
        """Logits [b, K, V] of the last K positions, from the one before the first trained token, and K (a
        GRPO prompt's logits are never read, and at a real vocabulary they are most of the memory and a good
        share of the time). `vision`: a vision-language model's image inputs."""
        if self.cp_group is not None:
            raise ValueError(
                "policy.context_parallel_size > 1: top-k logprobs and distillation losses need every "
                "position's logits on one rank; set it to 1 for them"
            )
        attention_mask = length_mask(row_lengths(data).to(self.device), input_ids.shape[1])  # [b, T_mb]
        num_kept = input_ids.shape[1] - first_trained_position(data.get("token_mask")) + 1  # K
        logits = self.model(
            input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=num_kept, **(vision or {})
        ).logits
        return logits, num_kept

    def _forward_with_candidates(
        self, data: dict[str, Any], input_ids: torch.Tensor, candidate_ids: torch.Tensor
    ) -> torch.Tensor:
        """[b, T_mb, 1 + k]: each token's logprob, then the logprobs of its k candidate ids."""
        logits, num_kept = self._causal_logits(data, input_ids)  # [b, K, V]
        temperature = self.cfg.logprob_temperature
        token = compute_token_logprobs(logits, input_ids[:, -num_kept:], temperature)  # [b, K]
        candidates = next_token_logprobs_at(logits, candidate_ids[:, -num_kept:], temperature)  # [b, K, k]
        both = torch.cat([token.unsqueeze(-1), candidates], dim=-1)  # [b, K, 1 + k]
        mask = length_mask(row_lengths(data).to(self.device), input_ids.shape[1]).unsqueeze(-1)
        return torch.nn.functional.pad(both, (0, 0, input_ids.shape[1] - num_kept, 0)) * mask

    @torch.no_grad()
    def topk_logprobs(self, data: dict[str, Any], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely next tokens at every position and their logprobs, [B, T, k] fp32 and [B, T, k]
        long, aligned with logprobs (position t: token t given < t); 0 before the first trained token."""
        self.model.eval()
        batch_size, seq_len = data["input_ids"].shape
        values = torch.zeros(batch_size, seq_len, k)
        ids = torch.zeros(batch_size, seq_len, k, dtype=torch.long)
        for microbatch in self.leased(
            self.make_microbatches(data, self.cfg.logprob_batch_size, *self.forward_plan())
        ):
            input_ids = microbatch.data["input_ids"].to(self.device)  # [b, T_mb]
            logits, num_kept = self._causal_logits(microbatch.data, input_ids)  # every rank runs each
            top_values, top_ids = topk_next_token_logprobs(logits, k, self.cfg.logprob_temperature)
            if microbatch.is_padding:
                continue
            end = input_ids.shape[1]
            values[microbatch.indices, end - num_kept : end] = top_values.cpu()
            ids[microbatch.indices, end - num_kept : end] = top_ids.cpu()
        return values, ids

    def forward_plan(self, rows_independent: bool = True) -> tuple[ForwardCost, bool]:
        """This worker's forward cost model (prompts count as shared where `_forward` shares them), and
        whether micro-batches may take rows longest first (`policy.length_bucketing`, for work whose rows
        are independent)."""
        share = (
            self.shares_prefixes(self.model)
            and self.cp_group is None
            and self.cfg.model_kind == "causal_lm"
            and not is_vision_language_model(self.model)
        )
        cost = ForwardCost(attention_cost_ratio(self.model.config), share)
        return cost, self.cfg.length_bucketing and rows_independent

    def shares_prefixes(self, model: torch.nn.Module) -> bool:
        """`policy.prefix_sharing`, except for an MoE model: its routers (replay, losses, expert load) see
        plain or packed rows only."""
        return self.cfg.prefix_sharing and not is_moe_model(model)

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

    def _forward_all(self, data: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
        """Fill `out` ([B, T] logprobs or [B] scores) micro-batch by micro-batch, in the original row
        order."""
        self.model.eval()
        for microbatch in self.leased(
            self.make_microbatches(data, self.cfg.logprob_batch_size, *self.forward_plan())
        ):
            with router_tap(self.model, microbatch, self.router_replay, keep_logits=False):
                outputs = self._forward(microbatch).cpu()  # [b, T_mb] or [b]
            if not microbatch.is_padding:
                self._store(out, microbatch, outputs)
        return out

    def _optimizer_step(self) -> tuple[float, float]:
        """Clip (if configured), step optimizer and scheduler; returns (grad norm before clipping, lr
        used)."""
        if self.ep_mesh is not None:
            reduce_expert_gradients(self.model, self.ep_mesh["edp"].get_group())
        grad_norm = clip_gradients(list(self.model.parameters()), self.cfg.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.versions.bump()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, float(lr)

    def _run_global_batch(
        self, batch: dict[str, Any], loss_fn: LossFn, eval_mode: bool, micro_batch_size: int
    ) -> StepMetrics:
        valid_seqs, valid_toks = self._global_counts(batch)
        step, parts = StepMetrics(), []
        plan = self.forward_plan(loss_fn.rows_independent)
        for microbatch in self.leased(self.make_microbatches(batch, micro_batch_size, *plan)):
            step.num_computed_tokens += microbatch.computed_tokens
            step.num_real_tokens += microbatch.real_tokens
            tap = router_tap(self.model, microbatch, self.router_replay, keep_logits=True)
            with torch.set_grad_enabled(not eval_mode), tap as routers:
                candidates_key = loss_fn.candidate_ids_key  # a distillation loss's
                candidates = microbatch.data[candidates_key] if candidates_key else None
                outputs = self._forward(microbatch, candidates)  # [b, T_mb] logprobs or [b] scores
                loss, metrics = loss_fn(outputs, microbatch.data.to(self.device), valid_seqs, valid_toks)
                loss, counts = add_router_losses(routers, microbatch, self.cfg.moe, valid_toks, loss, metrics)
                if not eval_mode:  # inside the tap: recomputed activations replay the same experts
                    (loss * (0.0 if microbatch.is_padding else 1.0)).backward()
            if microbatch.is_padding:
                continue
            step.add_expert_counts(counts)
            step.loss += float(loss.detach())
            step.num_microbatches += 1
            parts.append({k: float(v) for k, v in metrics.items()})
        step.loss_metrics = reduce_metrics(parts, metric_reductions(loss_fn))
        if not eval_mode:
            step.grad_norm, step.lr = self._optimizer_step()
        return step

    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> None:
        """Sharded model + optimizer (when `save_optimizer`) + scheduler state (DCP) under `path`, and this
        rank's RNG states (collective)."""
        optimizer = self.optimizer if save_optimizer else None
        lora_enabled = self.cfg.lora.enabled
        native_checkpoint.save_checkpoint(
            self.model, optimizer, self.scheduler, path, tokenizer=self.tokenizer, trainable_only=lora_enabled
        )
        if self.cfg.lora.enabled:  # adapter + optimizer only; the config names the base model
            native_checkpoint.on_rank0(
                lambda: lora.save_adapter_config(self.model, path), f"LoRA config in {path}"
            )
        native_checkpoint.save_rng_state(path, self.rank)

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer and scheduler state saved by save_checkpoint (collective)."""
        native_checkpoint.load_checkpoint(
            self.model, self.optimizer, self.scheduler, path, trainable_only=self.cfg.lora.enabled
        )
        native_checkpoint.load_rng_state_if_saved(path, self.rank)
        self.versions.bump()

    def export_hf(self, out_dir: str) -> None:
        """A Hugging Face directory (safetensors, config, tokenizer) with the current weights (collective)."""
        if self.cfg.lora.enabled:  # merged weights, and the PEFT adapter in out_dir/adapter
            lora.export_merged_hf(self.model, self.tokenizer, out_dir, self.model.config)
            return
        native_checkpoint.export_hf(self.model, self.tokenizer, out_dir, self.model.config)

    def _gather_weights(self, dtype: str | None) -> dict[str, torch.Tensor] | lora.AdapterWeights:
        """Full (gathered) CPU weights on rank 0, cast to `dtype`; with LoRA the adapter only (the generation
        workers keep the base resident)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.cfg.lora.enabled:
            kind = self.cfg.model_kind
            return lora.gather_adapter_weights(self.model, self.cfg.lora, kind, self.rank, dtype)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full_weights = get_model_state_dict(self.model, options=options)  # collective
        return cast_floating(full_weights, dtype) if self.rank == 0 else {}

    def _full_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter in HF names (tied weights once), complete on rank 0, {} elsewhere (collective);
        with one rank they are the parameters themselves, not copies."""
        weights = {}
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) and p.device_mesh.size() > 1 else p  # collective
            weights[name] = (full.to_local() if isinstance(full, DTensor) else full).detach()
        return weights if self.rank == 0 else {}

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
