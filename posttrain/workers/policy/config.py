"""Typed configuration of the training backend: model, precision, batching, optimizer and schedulers."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.config import ConfigError
from posttrain.models.build import MOE_ARCHITECTURES, ModelFromConfig
from posttrain.models.lora import DEFAULT_TARGET_MODULES, LoraConfig


@dataclass
class OptimizerConfig:
    """Any `torch.optim` class by name, built with these keyword arguments."""

    name: str = "AdamW"
    """Class name in torch.optim (AdamW, Adam, SGD, ...)."""
    kwargs: dict[str, Any] = field(
        default_factory=lambda: {"lr": 1e-4, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}
    )
    """Keyword arguments of the optimizer class (lr, weight_decay, betas, eps, ...); a file that sets some
    keeps the defaults of the others (unless it changes name)."""

    def validate(self) -> None:
        """Build the optimizer over one dummy parameter: an unknown name, keyword or value fails here,
        on the driver, instead of inside every worker."""
        import torch

        optimizer_cls = _torch_class(torch.optim, self.name, torch.optim.Optimizer, "torch.optim")
        kwargs = optimizer_kwargs(self.kwargs)
        try:
            optimizer_cls([torch.zeros(1, requires_grad=True)], **kwargs)
        except (TypeError, ValueError) as error:
            raise ConfigError("kwargs", f"{self.name}(**{self.kwargs}) fails: {error}") from None


@dataclass
class SchedulerConfig:
    """One `torch.optim.lr_scheduler` class by name, built with these keyword arguments."""

    name: str = "ConstantLR"
    """Class name in torch.optim.lr_scheduler."""
    kwargs: dict[str, Any] = field(default_factory=lambda: {"factor": 1.0, "total_iters": 1})
    """Keyword arguments of the scheduler class (without the optimizer)."""

    def validate(self) -> None:
        """Build the scheduler on a dummy optimizer: an unknown name, keyword or value fails here."""
        import torch

        schedulers = torch.optim.lr_scheduler
        scheduler_cls = _torch_class(
            schedulers, self.name, schedulers.LRScheduler, "torch.optim.lr_scheduler"
        )
        try:
            scheduler_cls(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), **self.kwargs)
        except (TypeError, ValueError) as error:
            raise ConfigError("kwargs", f"{self.name}(**{self.kwargs}) fails: {error}") from None


def policy_with_lr(lr: float, **fields: Any) -> PolicyConfig:
    """The default policy section with AdamW at learning rate `lr` (an algorithm's own default), the
    other optimizer defaults kept."""
    optimizer = OptimizerConfig()
    optimizer.kwargs["lr"] = lr
    return PolicyConfig(optimizer=optimizer, **fields)


def optimizer_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """YAML lists where torch wants tuples (betas)."""
    return {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in kwargs.items()}


def _torch_class(module: Any, name: str, base: type, where: str) -> type:
    found = getattr(module, name, None)
    if isinstance(found, type) and issubclass(found, base) and found is not base:
        return found
    names = [
        n
        for n in dir(module)
        if isinstance(getattr(module, n), type) and issubclass(getattr(module, n), base)
    ]
    guess = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean {guess[0]!r}?" if guess else f" (one of {sorted(names)})"
    raise ConfigError("name", f"{where} has no {base.__name__} named {name!r}{hint}")


@dataclass
class DynamicBatchingConfig:
    """Micro-batches cut by a token budget instead of a fixed number of sequences."""

    enabled: bool = False
    """Cut micro-batches by token budget."""
    max_tokens_per_microbatch: int = 4096
    """Token budget of one micro-batch (padded length x rows)."""
    sequence_length_round: int = 16
    """Sequence lengths are rounded up to a multiple of this."""


@dataclass
class SequencePackingConfig:
    """Several sequences per row, kept apart by position ids and a block-diagonal causal mask."""

    enabled: bool = False
    """Pack sequences into rows (bins)."""
    max_tokens_per_bin: int = 4096
    """Token budget of one packed row."""


@dataclass
class MoeConfig:
    """Mixture-of-experts training: router losses added to the training loss, and router replay."""

    load_balancing_coef: float = 0.0
    """Weight of the Switch-style load-balancing loss (as transformers computes it: k when perfectly
    balanced) added to the training loss; 0: logged, not trained on."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss, mean logsumexp(router logits)^2; 0: logged only."""
    router_replay: bool | None = None
    """Training and logprob forwards route each generated token to the experts the generator chose for it
    (recorded during generation; the HF backend). None: on for MoE models on the dtensor backend, off on
    megatron (which does not replay: true is refused there)."""


@dataclass
class PolicyModelConfig:
    """Offline alternative to `policy.model_name`: build the model from an architecture config."""

    from_config: ModelFromConfig | None = None
    """Architecture of a seeded random model + the built-in tokenizer (None: use model_name)."""


@dataclass
class MegatronConfig:
    """Parallelism of the Megatron Core backend (`policy.backend: megatron`); dp = workers / (tp x pp)."""

    tensor_model_parallel_size: int = 1
    """Ranks splitting each layer's matrices (attention heads, FFN, vocabulary)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages (consecutive blocks of layers), run with the 1F1B schedule."""
    sequence_parallel: bool = False
    """Split norms and dropout along the sequence over TP ranks (needs tp > 1)."""
    distributed_optimizer: bool = False
    """Shard optimizer state (and fp32 master weights) over data-parallel ranks."""
    moe_token_dispatcher: Literal["allgather", "alltoall"] = "allgather"
    """How an MoE layer sends tokens to the expert-parallel ranks owning their experts: allgather (every
    rank sees its EP group's tokens; runs on gloo/CPU) or alltoall (only the routed tokens; GPUs/NCCL)."""


MEGATRON_OPTIMIZERS = {
    "AdamW": {"lr", "weight_decay", "betas", "eps"},
    "Adam": {"lr", "weight_decay", "betas", "eps"},
    "SGD": {"lr", "weight_decay", "momentum"},
}


@dataclass
class PolicyConfig:
    """The trainable model and how it is trained (one section: `policy`)."""

    model_name: str | None = None
    """Hugging Face model directory or hub name."""
    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)
    """model.from_config builds a tiny model into <log_dir>/initial_model and sets model_name."""
    tokenizer_name: str | None = None
    """Tokenizer directory or hub name (None: same as model_name)."""
    model_kind: Literal["causal_lm", "reward_model", "value_model"] = "causal_lm"
    """causal_lm: token logprobs; reward_model: one scalar score per sequence; value_model: one value per
    token (a PPO critic)."""
    precision: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype; bfloat16 = mixed precision with fp32 master weights."""
    train_global_batch_size: int = 32
    """Sequences per optimizer step, summed over data-parallel ranks."""
    train_micro_batch_size: int = 4
    """Sequences per forward/backward on one rank (gradient accumulation)."""
    logprob_batch_size: int = 8
    """Sequences per forward in get_logprobs."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (None: no clipping)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer."""
    scheduler: list[SchedulerConfig] = field(default_factory=list)
    """LR schedulers stepped once per optimizer step; several become SequentialLR."""
    scheduler_milestones: list[int] = field(default_factory=list)
    """SequentialLR milestones (len(scheduler) - 1 steps)."""
    dynamic_batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    """Micro-batches by token budget."""
    sequence_packing: SequencePackingConfig = field(default_factory=SequencePackingConfig)
    """Several sequences per row."""
    prefix_sharing: bool = True
    """Rows that share a prompt (a GRPO group, a DPO pair) compute it once: one row holds the prompt and
    every continuation, each continuation attending over the prompt and itself (tree attention). Same
    logprobs and gradients at trained positions, fewer tokens and no padding between continuations
    (causal_lm, unpacked)."""
    length_bucketing: bool = True
    """Fixed-size micro-batches take the rows longest first when that computes fewer padded positions than
    keeping them in order (shared prompts counted), for losses whose rows are independent (SFT, GRPO, PPO,
    distillation; not DPO or reward-model pairs) and for logprobs."""
    activation_checkpointing: bool = False
    """Recompute decoder-layer activations in backward to save memory."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on CPU (FSDP2)."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks per model replica (Qwen2/Llama layouts)."""
    context_parallel_size: int = 1
    """Ranks splitting each sequence along its length (load-balanced chunks; attention all-gathers keys and
    values): causal LMs on the dtensor backend; dp = workers / (tp x cp); shared prompts (prefix_sharing)
    are not shared under it."""
    expert_parallel_size: int = 1
    """Ranks splitting the experts of each MoE layer; they remain data-parallel ranks. Divides the
    data-parallel workers and num_experts; no TP, CP or LoRA."""
    backend: Literal["dtensor", "megatron"] = "dtensor"
    """Training backend: dtensor (FSDP2 + TP) or megatron (Megatron Core: TP, PP, distributed optimizer;
    needs posttrain[megatron])."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Megatron Core parallelism (policy.backend=megatron)."""
    logprob_temperature: float = 1.0
    """Logprobs come from logits / temperature, to match sampling."""
    seed: int = 42
    """Seed of torch's RNG on every worker."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (peft): only they train, refit and checkpoint (lora.enabled)."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """Mixture-of-experts router losses and router replay."""
    stop_on_nonfinite_loss: bool = True
    """A NaN/inf training loss stops the run with NonFiniteLossError (before any checkpoint of that step);
    false: keep training."""

    def validate(self) -> None:
        validate_policy_config(self)


def validate_policy_config(cfg: PolicyConfig) -> None:
    """Raise ValueError naming the first impossible setting of the `policy` section (the schema has checked
    each field's type and allowed values)."""
    if cfg.model_kind == "value_model" and (cfg.backend != "dtensor" or cfg.lora.enabled):
        raise ValueError("policy.model_kind 'value_model' trains in full on the dtensor backend (no LoRA)")
    batch_sizes = ("train_global_batch_size", "train_micro_batch_size", "logprob_batch_size")
    for key in (*batch_sizes, "tensor_parallel_size", "context_parallel_size", "expert_parallel_size"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"policy.{key}: must be >= 1, got {getattr(cfg, key)}")
    if cfg.logprob_temperature <= 0:
        raise ValueError(f"policy.logprob_temperature: must be > 0, got {cfg.logprob_temperature}")
    if cfg.backend == "megatron":
        validate_megatron_policy(cfg)
    if cfg.dynamic_batching.enabled and cfg.sequence_packing.enabled:
        raise ValueError("policy.dynamic_batching.enabled and policy.sequence_packing.enabled: choose one")
    if cfg.sequence_packing.enabled and cfg.model_kind != "causal_lm":
        raise ValueError("policy.sequence_packing: only for model_kind='causal_lm'")
    if cfg.context_parallel_size > 1:
        validate_context_parallel(cfg)
    split = sorted(set(cfg.lora.modules_to_save or []) & set(DEFAULT_TARGET_MODULES))
    if cfg.lora.enabled and cfg.tensor_parallel_size > 1 and split:
        raise ValueError(
            f"policy.lora.modules_to_save={split} with policy.tensor_parallel_size="
            f"{cfg.tensor_parallel_size}: tensor parallelism splits these projections, so they cannot "
            "be trained in full beside the adapters; name them in policy.lora.target_modules instead "
            "or set policy.tensor_parallel_size=1"
        )
    if cfg.lora.enabled and cfg.backend == "megatron":
        validate_megatron_lora(cfg)
    validate_moe(cfg)
    if cfg.expert_parallel_size > 1:
        validate_expert_parallel(cfg)
    if len(cfg.scheduler) > 1 and len(cfg.scheduler_milestones) != len(cfg.scheduler) - 1:
        raise ValueError(
            f"policy.scheduler_milestones: {len(cfg.scheduler)} schedulers need "
            f"{len(cfg.scheduler) - 1} milestones, got {cfg.scheduler_milestones}"
        )


def validate_moe(cfg: PolicyConfig) -> None:
    """Router losses are non-negative; router replay needs an MoE model (checked here for a from-config
    model, by the worker once it holds the model) on the dtensor backend."""
    for key in ("load_balancing_coef", "z_loss_coef"):
        if getattr(cfg.moe, key) < 0:
            raise ValueError(f"policy.moe.{key}: must be >= 0, got {getattr(cfg.moe, key)}")
    if not cfg.moe.router_replay:
        return
    if cfg.backend != "dtensor":
        raise ValueError(f"policy.moe.router_replay runs on the dtensor backend, not {cfg.backend!r}")
    from_config = cfg.model.from_config
    if from_config is not None and from_config.architecture not in MOE_ARCHITECTURES:
        raise ValueError(dense_replay_error(from_config.architecture))


def dense_replay_error(model: str) -> str:
    return (
        f"policy.moe.router_replay=true but {model} is a dense model (no mixture-of-experts router): "
        "set policy.moe.router_replay to false or null"
    )


def validate_context_parallel(cfg: PolicyConfig) -> None:
    """What context parallelism (`policy.context_parallel_size` > 1) runs with."""
    cp = cfg.context_parallel_size
    if cfg.backend != "dtensor":
        raise ValueError(
            f"policy.context_parallel_size={cp} with policy.backend={cfg.backend}: context parallelism runs "
            "on the dtensor backend only (Megatron Core's needs Transformer Engine); set it to 1"
        )
    if cfg.model_kind != "causal_lm":
        raise ValueError(
            f"policy.context_parallel_size={cp} with policy.model_kind={cfg.model_kind}: only causal_lm "
            "splits sequences; set it to 1"
        )
    round_to = cfg.dynamic_batching.sequence_length_round
    if cfg.dynamic_batching.enabled and round_to % (2 * cp):
        raise ValueError(
            f"policy.dynamic_batching.sequence_length_round={round_to} must be a multiple of 2 x "
            f"policy.context_parallel_size = {2 * cp} (each sequence is cut into 2 x cp equal chunks)"
        )


def validate_expert_parallel(cfg: PolicyConfig) -> None:
    """What policy.expert_parallel_size combines with: data parallelism only (not tensor, pipeline or
    context parallelism, not LoRA)."""
    ep = cfg.expert_parallel_size
    tp, pp = cfg.megatron.tensor_model_parallel_size, cfg.megatron.pipeline_model_parallel_size
    conflict = None
    if cfg.backend == "megatron" and tp > 1:
        conflict = f"policy.megatron.tensor_model_parallel_size={tp} (set it to 1"
    elif cfg.backend == "megatron" and pp > 1:
        conflict = f"policy.megatron.pipeline_model_parallel_size={pp} (set it to 1"
    elif cfg.tensor_parallel_size > 1:
        conflict = f"policy.tensor_parallel_size={cfg.tensor_parallel_size} (set it to 1"
    elif cfg.lora.enabled:
        conflict = "policy.lora.enabled=true (train the MoE in full"
    elif cfg.context_parallel_size > 1:
        conflict = f"policy.context_parallel_size={cfg.context_parallel_size} (set it to 1"
    if conflict:
        raise ValueError(
            f"policy.expert_parallel_size={ep} with {conflict}, or set policy.expert_parallel_size=1)"
        )


def model_parallel_size(cfg: PolicyConfig) -> int:
    """Workers holding one model replica: tp x cp (dtensor) or tp x pp (megatron); dp = workers / this."""
    if cfg.backend == "megatron":
        return cfg.megatron.tensor_model_parallel_size * cfg.megatron.pipeline_model_parallel_size
    return cfg.tensor_parallel_size * cfg.context_parallel_size


def check_parallel_sizes(cfg: PolicyConfig, num_workers: int, workers: str) -> None:
    """ConfigError unless the model-parallel size (policy.tensor_parallel_size, or policy.megatron tp x pp)
    divides the `num_workers` workers (described by `workers`, e.g. "cluster.num_nodes x
    cluster.workers_per_node"). The one place this is checked: at config load, and by `Policy` for a cluster
    built in Python."""
    if num_workers % cfg.expert_parallel_size:
        raise ConfigError(
            "policy.expert_parallel_size",
            f"{cfg.expert_parallel_size} does not divide the {num_workers} workers ({workers})",
        )
    model_parallel = model_parallel_size(cfg)
    if num_workers % model_parallel == 0:
        return
    key, product = "policy.tensor_parallel_size", ""
    if cfg.backend == "megatron":
        key, product = "policy.megatron", "tensor_model_parallel_size x pipeline_model_parallel_size = "
    elif cfg.context_parallel_size > 1:
        cp, tp = cfg.context_parallel_size, cfg.tensor_parallel_size
        key, product = "policy.context_parallel_size", f"{cp} x policy.tensor_parallel_size {tp} = "
    raise ConfigError(key, f"{product}{model_parallel} does not divide the {num_workers} workers ({workers})")


def validate_megatron_policy(cfg: PolicyConfig) -> None:
    """Raise ValueError naming the first setting the Megatron backend does not take."""
    mcfg = cfg.megatron
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if getattr(mcfg, key) < 1:
            raise ValueError(f"policy.megatron.{key}: must be >= 1, got {getattr(mcfg, key)}")
    if mcfg.sequence_parallel and mcfg.tensor_model_parallel_size < 2:
        raise ValueError(
            "policy.megatron.sequence_parallel: needs policy.megatron.tensor_model_parallel_size > 1"
        )
    if cfg.tensor_parallel_size != 1:
        raise ValueError(
            "policy.tensor_parallel_size: the dtensor backend's setting; with policy.backend=megatron "
            "set policy.megatron.tensor_model_parallel_size"
        )
    unsupported = {
        "dynamic_batching.enabled": cfg.dynamic_batching.enabled,
        "sequence_packing.enabled": cfg.sequence_packing.enabled,
        "activation_checkpointing": cfg.activation_checkpointing,
        "cpu_offload": cfg.cpu_offload,
    }
    for key, is_set in unsupported.items():
        if is_set:
            raise ValueError(
                f"policy.{key}: not supported with policy.backend=megatron (use policy.backend=dtensor)"
            )
    allowed = MEGATRON_OPTIMIZERS.get(cfg.optimizer.name)
    if allowed is None:
        raise ValueError(
            f"policy.optimizer.name: policy.backend=megatron runs {sorted(MEGATRON_OPTIMIZERS)}, "
            f"got {cfg.optimizer.name!r}"
        )
    extra = set(cfg.optimizer.kwargs) - allowed
    if extra:
        raise ValueError(
            f"policy.optimizer.kwargs: {sorted(extra)} not supported by the Megatron "
            f"{cfg.optimizer.name} (takes {sorted(allowed)})"
        )


MEGATRON_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def validate_megatron_lora(cfg: PolicyConfig) -> None:
    """What LoRA covers on the Megatron backend: adapters on a causal LM's attention/MLP linears."""
    if cfg.model_kind != "causal_lm":
        raise ValueError(
            "policy.lora.enabled=true with policy.backend=megatron and policy.model_kind=reward_model: "
            "not supported (the score head would have to train beside the adapters); use "
            "policy.backend=dtensor for a LoRA reward model"
        )
    if cfg.lora.modules_to_save:
        raise ValueError(
            f"policy.lora.modules_to_save={cfg.lora.modules_to_save}: not supported with "
            "policy.backend=megatron (adapters only); leave it unset or use policy.backend=dtensor"
        )
    unknown = sorted(set(cfg.lora.target_modules) - set(MEGATRON_LORA_TARGETS))
    if unknown:
        raise ValueError(
            f"policy.lora.target_modules: {unknown} cannot take adapters with policy.backend=megatron "
            f"(it maps {list(MEGATRON_LORA_TARGETS)} to Megatron's parallel linears)"
        )
