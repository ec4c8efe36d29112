"""The Megatron Core training worker (`policy.backend: megatron`): one Ray actor per rank of a tp x pp x dp
layout, holding its pipeline stage's tensor-parallel shard of a `GPTModel` converted from a Hugging Face
Llama/Qwen2/Qwen3-MoE/Mixtral model (an MoE model's experts split over `ep` of the dp ranks), Megatron's DDP
and optimizer (optionally distributed). On the shared base (`base.PolicyWorker`) it runs train steps with
Megatron's 1F1B schedule, logprobs, native checkpoints (`dist_checkpointing`, reshardable across tp/pp/dp),
HF export and full HF-named weights for refit; without a GPU, inside `megatron_cpu_shim.cpu_shim()`."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from posttrain.utils import native_checkpoint
from posttrain.utils.metrics import metric_reductions, reduce_metrics
from posttrain.workers.policy import megatron_convert, megatron_moe_convert, megatron_moe_step
from posttrain.workers.policy.base import LossFn, PolicyWorker, load_hf_model
from posttrain.workers.policy.config import PolicyConfig, optimizer_kwargs
from posttrain.workers.policy.microbatches import MicroBatch, length_mask, row_lengths
from posttrain.workers.policy.optim import build_scheduler, init_sgd_state
from posttrain.workers.policy.step_metrics import StepMetrics
from posttrain.workers.policy.token_logprobs import compute_token_logprobs
from posttrain.workers.refit import cast_floating

MEGATRON_DIR = "megatron"  # dist_checkpointing's directory inside a checkpoint
SCHEDULER_FILE = "scheduler.json"
CONTENTS_FILE = "megatron_contents.json"  # whether the optimizer state was saved
NO_CLIPPING = 1e30  # Megatron computes the grad norm only when clipping: clip at a norm never reached


def import_megatron() -> None:
    """ImportError naming the extra to install when megatron-core is missing."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "policy.backend=megatron needs megatron-core: pip install 'posttrain[megatron]'"
        ) from error


def megatron_context(on_gpu: bool) -> contextlib.AbstractContextManager:
    """Where Megatron calls run: nothing on a GPU, the CPU shim (megatron_cpu_shim.py) without one."""
    if on_gpu:
        return contextlib.nullcontext()
    from posttrain.workers.policy.megatron_cpu_shim import cpu_shim

    return cpu_shim()


def megatron_optimizer_config(cfg: PolicyConfig, bf16: bool) -> Any:
    """Megatron's OptimizerConfig for the torch.optim name and kwargs of `policy.optimizer` (AdamW, Adam,
    SGD, with torch's defaults), clipping at policy.max_grad_norm."""
    from megatron.core.optimizer import OptimizerConfig

    kwargs = optimizer_kwargs(cfg.optimizer.kwargs)
    name = cfg.optimizer.name
    betas = kwargs.get("betas", (0.9, 0.999))
    default_weight_decay = 0.01 if name == "AdamW" else 0.0  # torch's defaults
    return OptimizerConfig(
        optimizer="sgd" if name == "SGD" else "adam",
        lr=float(kwargs.get("lr", 1e-3)),
        weight_decay=float(kwargs.get("weight_decay", default_weight_decay)),
        adam_beta1=float(betas[0]),
        adam_beta2=float(betas[1]),
        adam_eps=float(kwargs.get("eps", 1e-8)),
        sgd_momentum=float(kwargs.get("momentum", 0.0)),
        decoupled_weight_decay=name == "AdamW",
        clip_grad=NO_CLIPPING if cfg.max_grad_norm is None else float(cfg.max_grad_norm),
        use_distributed_optimizer=cfg.megatron.distributed_optimizer,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """[1, 1, T, T] bool, True where attention is masked out (the future)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1).view(1, 1, seq_len, seq_len)


def pad_to(tensor: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Right/bottom zero-pad a [b, T] tensor to [rows, cols]."""
    return torch.nn.functional.pad(tensor, (0, cols - tensor.shape[1], 0, rows - tensor.shape[0]))


class MegatronPolicyWorker(PolicyWorker):
    """One rank of the policy on Megatron Core. Micro-batching, global counts, metric reductions and the
    reference-weight swap are the base worker's; the model, schedule, optimizer and state I/O are
    Megatron's."""

    reuse_process = False  # Megatron's parallel state and the CPU shim's patches outlive the worker

    def _backend(self) -> contextlib.AbstractContextManager:
        return megatron_context(self.device.type == "cuda")

    def _init_parallel(self) -> None:
        import_megatron()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        with self._backend():
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            mcfg = self.cfg.megatron
            if not parallel_state.model_parallel_is_initialized():
                parallel_state.initialize_model_parallel(
                    tensor_model_parallel_size=mcfg.tensor_model_parallel_size,
                    pipeline_model_parallel_size=mcfg.pipeline_model_parallel_size,
                    expert_model_parallel_size=self.cfg.expert_parallel_size,
                )
            if self.device.type == "cuda":
                model_parallel_cuda_manual_seed(self.cfg.seed)
            self.dp_group = parallel_state.get_data_parallel_group()
            self.dp_size = parallel_state.get_data_parallel_world_size()
            self.dp_rank = parallel_state.get_data_parallel_rank()
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
            self.tp_size = mcfg.tensor_model_parallel_size
            self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
            self.pp_group = parallel_state.get_pipeline_model_parallel_group()
            self.pp_size = mcfg.pipeline_model_parallel_size
            self.pp_last_rank = parallel_state.get_pipeline_model_parallel_last_rank()
            self.ep_group = parallel_state.get_expert_model_parallel_group()
            self.ep_size = self.cfg.expert_parallel_size
            self.expert_counter: megatron_moe_step.ExpertCounter | None = None  # set while a batch runs

    def _build_model_and_optimizer(self) -> None:
        with self._backend():
            from megatron.core import parallel_state
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import get_megatron_optimizer

            mcfg, bf16 = self.cfg.megatron, self.cfg.precision == "bfloat16"
            hf_model = load_hf_model(self.cfg)
            self.hf_config = hf_model.config
            parallel = {
                "tensor_model_parallel_size": mcfg.tensor_model_parallel_size,
                "pipeline_model_parallel_size": mcfg.pipeline_model_parallel_size,
                "sequence_parallel": mcfg.sequence_parallel,
                "expert_model_parallel_size": self.ep_size,
            }
            self.layout = megatron_convert.gpt_layout(self.hf_config, self.tp_size)
            moe = self.layout.moe
            megatron_moe_convert.check_moe_pipeline(moe, self.pp_size)
            if moe is not None and self.cfg.lora.enabled:
                raise ValueError(
                    "policy.lora.enabled=true with a mixture-of-experts model: policy.backend=megatron puts "
                    "adapters on dense models only (use policy.backend=dtensor)"
                )
            coefs = (self.cfg.moe.load_balancing_coef, self.cfg.moe.z_loss_coef)
            layers, dispatcher = self.layout.num_layers, self._token_dispatcher()
            moe_training = megatron_moe_convert.moe_training_fields(moe, layers, *coefs, dispatcher)
            self.transformer_config = megatron_convert.transformer_config(
                self.hf_config, parallel, bf16, moe_training
            )
            stages = (parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())
            model = megatron_convert.build_gpt_model(self.hf_config, self.transformer_config, *stages)
            self.layer_offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0
            names = [name for name, _ in model.named_parameters()]
            ep_rank = parallel_state.get_expert_model_parallel_rank()
            expert_offset = 0 if moe is None else ep_rank * (moe.num_experts // self.ep_size)  # first expert
            shard = (self.layer_offset, self.layout, self.tp_rank, self.tp_size, expert_offset)
            local = megatron_convert.hf_to_megatron(hf_model.state_dict(), names, *shard)
            del hf_model
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(local[name])
            model = self._prepare_model(model.to(self.device))
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                overlap_param_gather=False,
                use_distributed_optimizer=mcfg.distributed_optimizer,
                check_for_nan_in_grad=False,
            )
            self.model = DistributedDataParallel(self.transformer_config, ddp_config, model)
            self.transformer_config.finalize_model_grads_func = self._finalize_grads
            # An empty override dict: every parameter gets the configured weight decay, as in the DTensor
            # backend (Megatron's default skips biases and norms).
            self.optimizer = get_megatron_optimizer(
                megatron_optimizer_config(self.cfg, bf16), [self.model], config_overrides={}
            )
            for optimizer in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
                optimizer.init_state_fn = optimizer.init_state_fn or init_sgd_state  # Megatron gives SGD none
            self.scheduler = build_scheduler(self._torch_optimizer(), self.cfg)
            self._sync_lr()

    def _token_dispatcher(self) -> str:
        """policy.megatron.moe_token_dispatcher; alltoall needs NCCL (gloo cannot exchange its uneven
        splits)."""
        dispatcher = self.cfg.megatron.moe_token_dispatcher
        if dispatcher == "alltoall" and self.device.type != "cuda":
            raise ValueError(
                "policy.megatron.moe_token_dispatcher=alltoall needs GPUs (NCCL); use allgather on a CPU"
            )
        return dispatcher

    def _prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """This stage's GPTModel, loaded, before Megatron's DDP wraps it (the LoRA worker adds adapters)."""
        return model

    def _finalize_grads(self, model: list[torch.nn.Module], num_tokens: Any = None, **kwargs: Any) -> None:
        """Megatron's grad all-reduce (dp, expert dp, tied embeddings, sequence-parallel norms). A dense
        model's losses are already normalised by the global batch's counts: no rescaling. An MoE model's
        micro-batch losses come multiplied by the global token count and Megatron divides every gradient by
        it (`num_tokens`), the scale at which it adds its router losses (see `_run_global_batch`)."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(model, num_tokens=num_tokens if self.layout.moe else None, **kwargs)

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers inside Megatron's wrapper: one, or for an MoE model two (dense and expert
        parameters, whose gradients Megatron reduces over different groups)."""
        chained = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        return [optimizer.optimizer for optimizer in chained]

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        """The first torch optimizer: the LR schedulers drive its param groups (`_sync_lr` copies its LR to
        the others, which share its base LR)."""
        return self._torch_optimizers()[0]

    def _sync_lr(self) -> None:
        lr = self._torch_optimizer().param_groups[0]["lr"]
        for optimizer in self._torch_optimizers()[1:]:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def _microbatch_shape(self, batch_size: int, seq_len: int) -> tuple[int, int] | None:
        """Pipeline stages exchange fixed-shape activations, and the allgather token dispatcher gathers
        equal token counts from the expert-parallel ranks: then every micro-batch is padded to [rows, T]
        (with EP, T is the widest of the dp ranks' batches; a multiple of tp with sequence parallelism).
        None: each micro-batch keeps its own shape."""
        if self.pp_size == 1 and self.ep_size == 1:
            return None
        if self.ep_size > 1:  # collective over the dp ranks
            seq_len = int(self._all_reduce_dp(torch.tensor(seq_len), "max"))
        return batch_size, -(-seq_len // self.tp_size) * self.tp_size

    def _forward_step(
        self,
        data_iterator: Iterator[MicroBatch],
        model: Any,
        loss_func: Callable,
        shape: tuple[int, int] | None,
    ) -> tuple[torch.Tensor, Callable]:
        microbatch = next(data_iterator)
        input_ids = microbatch.data["input_ids"]  # [b, T_mb]
        if shape is not None:
            input_ids = pad_to(input_ids, *shape)
        elif self.cfg.megatron.sequence_parallel:
            input_ids = pad_to(
                input_ids, input_ids.shape[0], -(-input_ids.shape[1] // self.tp_size) * self.tp_size
            )
        batch_size, seq_len = input_ids.shape
        position_ids = torch.arange(seq_len).unsqueeze(0).expand(batch_size, seq_len)
        moe_inputs = {}
        if self.expert_counter is not None:  # keep-in-step repeats route no counted tokens
            self.expert_counter.counting = not microbatch.is_padding
        if self.layout.moe is not None:  # the routers' losses skip positions past each row's length
            mask = megatron_moe_step.padding_mask(microbatch, batch_size, seq_len)  # [b, T]
            moe_inputs["padding_mask"] = mask.to(self.device)
        output = model(
            input_ids.to(self.device),
            position_ids.to(self.device),
            causal_mask(seq_len, self.device),
            **moe_inputs,
        )  # last stage: logits [b, T, V_padded]; other stages: hidden states for the next
        return output, partial(loss_func, microbatch)

    def _outputs(self, microbatch: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
        """What the loss reads, from the last stage's (padded) output: [b, T_mb] fp32 logprobs, 0 past each
        length; a reward model's [b] scores, taken at each row's last token."""
        input_ids = microbatch.data["input_ids"].to(self.device)  # [b, T_mb]
        batch_size, seq_len = input_ids.shape
        if self.layout.reward_model:
            last = row_lengths(microbatch.data).to(self.device) - 1  # [b]
            return logits[torch.arange(batch_size, device=self.device), last, 0].float()  # [b]
        logits = logits[:batch_size, :seq_len, : self.layout.vocab_size]  # [b, T_mb, V]
        logprobs = compute_token_logprobs(logits, input_ids, self.cfg.logprob_temperature)  # [b, T_mb]
        return logprobs * length_mask(row_lengths(microbatch.data).to(self.device), seq_len)

    def _run_schedule(
        self,
        microbatches: list[MicroBatch],
        loss_func: Callable,
        forward_only: bool,
        batch_size: int,
        seq_len: int,
    ) -> tuple[int, int] | None:
        """Run `microbatches` through Megatron's schedule; returns their shape (see _microbatch_shape)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        shape = self._microbatch_shape(batch_size, seq_len)
        forward_backward = get_forward_backward_func()
        with torch.set_grad_enabled(not forward_only):
            forward_backward(
                forward_step_func=partial(self._forward_step, loss_func=loss_func, shape=shape),
                data_iterator=self.leased(microbatches),
                model=[self.model],
                num_microbatches=len(microbatches),
                seq_length=shape[1] if shape else seq_len,
                micro_batch_size=shape[0] if shape else batch_size,
                forward_only=forward_only,
            )
        return shape

    def _from_last_stage(self, value: Any) -> Any:
        """The last pipeline stage's `value` (a CPU tensor or a picklable object) on every stage."""
        if self.pp_size == 1:
            return value
        if isinstance(value, torch.Tensor):
            on_device = value.to(self.device)
            dist.broadcast(on_device, src=self.pp_last_rank, group=self.pp_group)
            return on_device.cpu()
        holder = [value]
        dist.broadcast_object_list(holder, src=self.pp_last_rank, group=self.pp_group)
        return holder[0]

    def _forward_all(self, data: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
        """Fill `out` ([B, T] logprobs or [B] scores) micro-batch by micro-batch (forward only), on every
        stage."""
        self.model.eval()
        microbatches = self.make_microbatches(data, self.cfg.logprob_batch_size)

        def keep_outputs(microbatch: MicroBatch, logits: torch.Tensor) -> tuple:
            if not microbatch.is_padding:
                self._store(out, microbatch, self._outputs(microbatch, logits).cpu())  # [b, T_mb] or [b]
            return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

        self._run_schedule(
            microbatches, keep_outputs, True, self.cfg.logprob_batch_size, data["input_ids"].shape[1]
        )
        return self._from_last_stage(out)

    def _run_global_batch(
        self, batch: dict[str, Any], loss_fn: LossFn, eval_mode: bool, micro_batch_size: int
    ) -> StepMetrics:
        valid_seqs, valid_toks = self._global_counts(batch)
        microbatches = self.make_microbatches(batch, micro_batch_size)
        if self.layout.moe is not None:  # the routers' tokens: every micro-batch's rows, up to their lengths
            local_tokens = sum(row_lengths(m.data).sum() for m in microbatches)
            global_tokens = self._all_reduce_dp(local_tokens, "sum").to(self.device)
        losses, parts = [], []

        def microbatch_loss(microbatch: MicroBatch, logits: torch.Tensor) -> tuple:
            outputs = self._outputs(microbatch, logits)  # [b, T_mb] logprobs or [b] scores
            loss, metrics = loss_fn(outputs, microbatch.data.to(self.device), valid_seqs, valid_toks)
            reported = float(loss.detach())
            tokens = row_lengths(microbatch.data).sum()
            if self.layout.moe is not None and not eval_mode:  # Megatron's routers add losses in training
                reported += megatron_moe_step.take_router_losses(
                    self.layout.moe, self.cfg.moe, float(tokens / global_tokens.cpu()), metrics
                )
            if not microbatch.is_padding:
                losses.append(reported)
                parts.append({k: float(v) for k, v in metrics.items()})
            loss = loss * (0.0 if microbatch.is_padding else 1.0)
            if self.layout.moe is None:
                # summed as it is (calculate_per_token_loss): it already carries the global normalisation
                return loss, torch.tensor(1, dtype=torch.int), {}
            # Megatron adds each micro-batch's router losses times its token count, then divides every
            # gradient by the summed counts: multiplied by that sum, the loss keeps its own normalisation
            # and the router losses enter weighted by the micro-batch's share of the global batch's tokens
            return loss * global_tokens, tokens.to(device=self.device, dtype=torch.int), {}

        if not eval_mode:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        self.expert_counter = megatron_moe_step.ExpertCounter(self.model, self.layout.moe)
        with self.expert_counter:
            shape = self._run_schedule(
                microbatches, microbatch_loss, eval_mode, micro_batch_size, batch["input_ids"].shape[1]
            )
        counts, self.expert_counter = self.expert_counter.result(), None
        step = StepMetrics(
            loss=sum(losses),
            num_microbatches=len(losses),
            loss_metrics=reduce_metrics(parts, metric_reductions(loss_fn)),
            num_computed_tokens=sum(
                shape[0] * shape[1] if shape else m.computed_tokens for m in microbatches
            ),
            num_real_tokens=sum(m.real_tokens for m in microbatches),
            expert_counts=counts,
        )
        step = self._from_last_stage(step)
        if not eval_mode:
            step.grad_norm, step.lr = self._optimizer_step()
        return step

    def _optimizer_step(self) -> tuple[float, float]:
        lr = float(self._torch_optimizer().param_groups[0]["lr"])
        _, grad_norm, _ = self.optimizer.step()  # clips at policy.max_grad_norm; norm over all ranks
        self.versions.bump()
        self.scheduler.step()
        self._sync_lr()
        return float(grad_norm or 0.0), lr

    def _full_weights(self) -> dict[str, torch.Tensor]:
        """Every weight in HF names and layout on rank 0 (CPU), {} elsewhere (collective, in _backend)."""
        stage: dict[str, torch.Tensor] = {}
        for name, param in self._hf_named_parameters():
            shards = [shard.cpu() for shard in self._tp_shards(param)]
            full = megatron_convert.merge_tp_shards(name, shards, self.layout)
            if megatron_moe_convert.is_expert_name(name):
                stage.update(self._all_experts(name, full))
            else:
                stage[name] = full
        return self._stages_on_rank0(megatron_convert.megatron_to_hf(stage, self.layer_offset, self.layout))

    def _tp_shards(self, param: torch.Tensor) -> list[torch.Tensor]:
        """Every TP rank's shard of `param`, in TP rank order (collective over tp)."""
        if self.tp_size == 1:
            return [param.detach()]
        shards = [torch.empty_like(param) for _ in range(self.tp_size)]
        dist.all_gather(shards, param.detach().contiguous(), group=self.tp_group)
        return shards

    def _stages_on_rank0(self, stage: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The named tensors of every pipeline stage of rank 0's pipeline, merged on rank 0; {} elsewhere."""
        if self.pp_size > 1 and self.dp_rank == 0 and self.tp_rank == 0:
            gathered: list[Any] | None = [None] * self.pp_size if self.rank == 0 else None
            dist.gather_object(stage, gathered, dst=0, group=self.pp_group)
            if self.rank == 0:
                stage = {name: t for stage_weights in gathered for name, t in stage_weights.items()}
        return stage if self.rank == 0 else {}

    def _all_experts(self, name: str, local: torch.Tensor) -> dict[str, torch.Tensor]:
        """The local expert parameter `name` of every expert-parallel rank, under global expert names
        (collective over the EP group)."""
        tensors = [local]
        if self.ep_size > 1:
            on_device = local.to(self.device).contiguous()
            tensors = [torch.empty_like(on_device) for _ in range(self.ep_size)]
            dist.all_gather(tensors, on_device, group=self.ep_group)
        num_local = self.layout.moe.num_experts // self.ep_size
        return {
            megatron_moe_convert.with_global_expert(name, rank * num_local): tensor.cpu()
            for rank, tensor in enumerate(tensors)
        }

    def _hf_named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The model's parameters that are HF weights (all of them; not LoRA adapters)."""
        return self.model.module.named_parameters()

    def _gather_weights(self, dtype: str | None) -> dict[str, torch.Tensor]:
        return cast_floating(self._full_weights(), dtype)

    def export_hf(self, out_dir: str) -> None:
        """A Hugging Face directory (safetensors, config, tokenizer) with the current weights (collective)."""
        with self._backend():
            weights = self._full_weights()
        self._write_hf_dir(weights, out_dir)

    def _write_hf_dir(self, weights: dict[str, torch.Tensor], out_dir: str) -> None:
        """Rank 0 writes `weights` (HF names) as a Hugging Face directory; all ranks wait (collective)."""
        if self.rank == 0:
            model = native_checkpoint.model_with_weights(weights, self.hf_config)
            native_checkpoint.write_hf_dir(model, self.tokenizer, Path(out_dir))
        dist.barrier()

    def _sharded_model_state(self) -> dict[str, Any]:
        return self.model.module.sharded_state_dict()

    def _load_model_state(self, state: dict[str, Any]) -> None:
        self.model.module.load_state_dict(state)

    def _sharded_state(self, with_optimizer: bool, is_loading: bool) -> dict[str, Any]:
        model_state = self._sharded_model_state()
        state = {"model": model_state}
        if with_optimizer:
            # dp_reshardable: a distributed-optimizer checkpoint loads at another tp/pp/dp layout
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
            )
        return state

    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> None:
        """`megatron/` (dist_checkpointing: model, optimizer unless not `save_optimizer`), scheduler.json,
        hf_config/, tokenizer/ and every rank's RNG states under `path` (collective)."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        (path / MEGATRON_DIR).mkdir(parents=True, exist_ok=True)
        with self._backend():
            dist_checkpointing.save(self._sharded_state(save_optimizer, False), str(path / MEGATRON_DIR))
        if self.rank == 0:
            (path / SCHEDULER_FILE).write_text(json.dumps(self.scheduler.state_dict()))
            (path / CONTENTS_FILE).write_text(json.dumps({"optimizer": save_optimizer}))
            self.hf_config.save_pretrained(path / native_checkpoint.HF_CONFIG_DIR)
            self.tokenizer.save_pretrained(path / native_checkpoint.TOKENIZER_DIR)
        native_checkpoint.save_rng_state(path, self.rank)
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what save_checkpoint wrote, at any tp/pp/dp layout (collective)."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        if not (path / MEGATRON_DIR).is_dir():
            raise FileNotFoundError(f"{path} holds no Megatron checkpoint ({MEGATRON_DIR}/ is missing)")
        with self._backend():
            with_optimizer = json.loads((path / CONTENTS_FILE).read_text())["optimizer"]
            state = dist_checkpointing.load(
                self._sharded_state(with_optimizer, True), str(path / MEGATRON_DIR)
            )
            self._load_model_state(state["model"])
            if with_optimizer:
                with torch.no_grad():
                    self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(json.loads((path / SCHEDULER_FILE).read_text()))
        self._sync_lr()
        native_checkpoint.load_rng_state_if_saved(path, self.rank)
        self.versions.bump()

    def offload(self) -> None:
        """No-op: Megatron's contiguous parameter/gradient buffers stay where they are."""

    def onload(self) -> None:
        """No-op (see offload)."""

    def describe(self) -> dict[str, Any]:
        parallel = {"tp": self.tp_size, "pp": self.pp_size, "dp": self.dp_size, "ep": self.ep_size}
        return {**super().describe(), "backend_name": "megatron", **parallel, "pid": os.getpid()}
