"""The Megatron worker's mixture-of-experts parts of a micro-batch: the routers' padding mask, the router
losses Megatron added during its forward, read back from Megatron's logging tracker into the loss and
metrics posttrain reports, and the tokens each expert received (`ExpertCounter`).

Megatron adds its router losses itself (inside the routers' backward) for the layers it trains, summed over
layers with the coefficients of `megatron_moe_convert.moe_training_fields`; what is read back here is the
same sum, in posttrain's terms: the mean over layers of each loss (load balancing in transformers' scale, k
when balanced), weighted by the micro-batch's share of the global batch's tokens. A loss whose coefficient
is 0 is not computed by Megatron, hence not reported."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from posttrain.workers.policy.config import MoeConfig
from posttrain.workers.policy.megatron_moe_convert import MoeLayout
from posttrain.workers.policy.microbatches import MicroBatch, length_mask, row_lengths

TRACKED_LOSSES = {  # Megatron's tracker name -> (posttrain metric, policy.moe coefficient)
    "load_balancing_loss": ("moe_load_balancing_loss", "load_balancing_coef"),
    "z_loss": ("moe_z_loss", "z_loss_coef"),
}


def padding_mask(microbatch: MicroBatch, batch_size: int, seq_len: int) -> torch.Tensor:
    """[batch_size, seq_len] bool, True at the positions of the (padded) micro-batch past each row's
    length, which Megatron's routers leave out of their losses."""
    lengths = torch.zeros(batch_size, dtype=torch.long)
    real_lengths = row_lengths(microbatch.data)  # [b]
    lengths[: real_lengths.shape[0]] = real_lengths
    return length_mask(lengths, seq_len) == 0


def take_router_losses(moe: MoeLayout, cfg: MoeConfig, share: float, metrics: dict[str, float]) -> float:
    """The weighted router losses of the micro-batch just run forward (its share of the global batch's
    tokens times each loss's coefficient and value), writing their `share`-weighted values into
    `metrics`; clears Megatron's tracker for the next micro-batch."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    total = 0.0
    for name, (metric, coef_key) in TRACKED_LOSSES.items():
        if name not in tracker or getattr(cfg, coef_key) == 0:
            continue
        value = float(tracker[name]["values"].mean())  # per layer: this micro-batch's loss
        if name == "load_balancing_loss":
            value *= moe.top_k
        metrics[metric] = share * value
        total += share * getattr(cfg, coef_key) * value
    clear_aux_losses_tracker()
    return total


class ExpertCounter:
    """Tokens per expert [L, E] (float64, summed) of the real tokens that the model's routers route while
    the counter is entered and `counting` is True: a forward hook on each of Megatron's routers reads its
    routing map [T * b, E] and leaves out the positions its padding mask marks (the same tokens the dtensor
    backend counts: every row's tokens up to its length). Layers in module order (this stage's). A dense
    model's counter counts nothing."""

    def __init__(self, model: torch.nn.Module, moe: MoeLayout | None):
        self.routers: list[torch.nn.Module] = []
        if moe is not None:  # a dense model: no routers, no counts
            from megatron.core.transformer.moe.router import Router

            self.routers = [module for module in model.modules() if isinstance(module, Router)]
        self.counts = torch.zeros(len(self.routers), moe.num_experts if moe else 0, dtype=torch.float64)
        self.counting = True
        self._handles: list[Any] = []

    def result(self) -> torch.Tensor | None:
        """The counts, or None for a dense model."""
        return self.counts if self.routers else None

    def __enter__(self) -> ExpertCounter:
        self._handles = [
            router.register_forward_hook(partial(self._count, layer))
            for layer, router in enumerate(self.routers)
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _count(self, layer: int, module: torch.nn.Module, args: tuple, output: tuple) -> None:
        if not self.counting:
            return
        routing_map = output[1]  # [T * b, E] bool
        padding = args[1] if len(args) > 1 else None  # [T, b], True at padding
        if padding is not None:
            routing_map = routing_map[~padding.reshape(-1)]
        self.counts[layer] += routing_map.sum(0).double().cpu()
