"""Optimizer, learning-rate schedulers and gradient clipping of the DTensor policy worker (the scheduler is
shared with the Megatron worker, whose optimizer is Megatron's)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from posttrain.workers.policy.config import PolicyConfig, optimizer_kwargs

FUSED_OPTIMIZERS = ("Adam", "AdamW")


@torch.no_grad()
def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Global L2 norm of all gradients (DTensor shards on any mesh included); scale them to max_norm if
    above."""
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


def build_optimizer(model: torch.nn.Module, cfg: PolicyConfig) -> torch.optim.Optimizer:
    """Any torch.optim class by name (checked at config load: OptimizerConfig.validate), over the trainable
    parameters."""
    optimizer_cls = getattr(torch.optim, cfg.optimizer.name)
    kwargs = optimizer_kwargs(cfg.optimizer.kwargs)
    if (
        cfg.optimizer.name in FUSED_OPTIMIZERS
        and not cfg.cpu_offload
        and not {"fused", "foreach"} & set(kwargs)
    ):
        kwargs["fused"] = True  # one vectorised kernel per step (on a CPU too): the same update, ~4x faster
    return optimizer_cls([p for p in model.parameters() if p.requires_grad], **kwargs)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: PolicyConfig
) -> torch.optim.lr_scheduler.LRScheduler:
    """The configured schedulers (names checked at config load: SchedulerConfig.validate; constant LR when
    none; several become SequentialLR)."""
    schedulers = [
        getattr(torch.optim.lr_scheduler, scheduler.name)(optimizer, **scheduler.kwargs)
        for scheduler in cfg.scheduler
    ]
    if not schedulers:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    if len(schedulers) == 1:
        return schedulers[0]
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer, schedulers, milestones=list(cfg.scheduler_milestones)
    )


def init_sgd_state(optimizer: torch.optim.Optimizer, config: Any = None) -> None:
    """The per-parameter state SGD keeps (a momentum buffer, where momentum is on), made before a checkpoint
    loads into it: Megatron's loader fills existing state and has no initialiser of its own for SGD."""
    for group in optimizer.param_groups:
        if group.get("momentum", 0):
            for param in group["params"]:
                optimizer.state[param].setdefault("momentum_buffer", torch.zeros_like(param))
