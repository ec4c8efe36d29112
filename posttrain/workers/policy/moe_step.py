"""A policy worker's mixture-of-experts hooks around one forward: router replay of the generator's recorded
experts, the router losses added to a micro-batch's loss, and the tokens each expert received (see
posttrain/models/moe.py for what is replayed and how the losses are defined)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from posttrain.models.moe import RouterTap, expert_counts, is_moe_model, load_balancing_loss, router_z_loss
from posttrain.workers.policy.config import MoeConfig, dense_replay_error
from posttrain.workers.policy.microbatches import MicroBatch, length_mask, row_lengths

ROUTED_EXPERTS_KEY = "routed_experts"  # [B, T, L, k] experts the generator used per token, -1: not recorded


def router_replay_enabled(model: torch.nn.Module, cfg: MoeConfig, model_name: str | None) -> bool:
    """policy.moe.router_replay resolved for `model`: None means on for an MoE model, off for a dense one;
    true on a dense model is an error."""
    moe = is_moe_model(model)
    if cfg.router_replay and not moe:
        raise ValueError(dense_replay_error(str(model_name)))
    return moe if cfg.router_replay is None else cfg.router_replay


def router_rows(microbatch: MicroBatch, device: torch.device) -> torch.Tensor:
    """1 at the positions the routers see that hold a token, in the order they see them: [N]."""
    if microbatch.packed is not None:
        return torch.ones(sum(microbatch.packed.lengths), device=device)
    data = microbatch.data
    return length_mask(row_lengths(data).to(device), data["input_ids"].shape[1]).reshape(-1).float()


def recorded_routing(microbatch: MicroBatch) -> torch.Tensor | None:
    """The recorded experts of the micro-batch's tokens in the order the routers see them, [N, L, k]."""
    routed = microbatch.data.get(ROUTED_EXPERTS_KEY)  # [b, T_mb, L, k]
    if routed is None:
        return None
    if microbatch.packed is not None:
        return torch.cat([routed[i, :length] for i, length in enumerate(microbatch.packed.lengths)])
    return routed.reshape(-1, *routed.shape[2:])


@contextlib.contextmanager
def router_tap(
    model: torch.nn.Module, microbatch: MicroBatch, replay: bool, keep_logits: bool
) -> Iterator[RouterTap | None]:
    """A RouterTap on `model` for one micro-batch (None for a dense model), replaying the recorded experts
    when `replay` and the micro-batch has them. Keep it entered through backward."""
    if not is_moe_model(model):
        yield None
        return
    with RouterTap(model, recorded_routing(microbatch) if replay else None, keep_logits) as tap:
        yield tap


def add_router_losses(
    tap: RouterTap | None,
    microbatch: MicroBatch,
    cfg: MoeConfig,
    valid_toks: torch.Tensor,
    loss: torch.Tensor,
    metrics: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`loss` plus the weighted router losses of this micro-batch, and the tokens per expert [L, E] of its
    real tokens (None for a dense model); writes `moe_load_balancing_loss`, `moe_z_loss` and, when it
    replays, `moe_replayed_tokens` (positions routed to recorded experts) into `metrics`.

    Each micro-batch's router losses are computed over its own tokens (prompt and response, not padding)
    and weighted by its share of the global batch's trained tokens, so that summed over micro-batches and
    ranks they are a token-weighted mean of per-micro-batch losses (a batch statistic like the Switch loss
    is not additive; this is how per-micro-batch MoE training computes it)."""
    if tap is None:
        return loss, None
    device = loss.device
    rows = router_rows(microbatch, device)  # [N]
    logits, indices = tap.layer_logits(), tap.layer_indices()
    data = microbatch.data
    token_mask = data.get("token_mask")
    if token_mask is None:
        token_mask = length_mask(row_lengths(data), data["input_ids"].shape[1])
    sample_mask = data.get("sample_mask", torch.ones(token_mask.shape[0]))
    share = (token_mask.float() * sample_mask.float()[:, None]).sum().to(device) / valid_toks.clamp(min=1)
    balance, z_loss = load_balancing_loss(logits, indices, rows), router_z_loss(logits, rows)
    metrics["moe_load_balancing_loss"] = float((share * balance).detach())
    metrics["moe_z_loss"] = float((share * z_loss).detach())
    if tap.replay is not None:  # tokens routed to the generator's recorded experts (summed over the step)
        replayed = (tap.replay >= 0).all(-1).any(-1).to(device).float()  # [N]
        metrics["moe_replayed_tokens"] = float((replayed * rows).sum())
    loss = loss + share * (cfg.load_balancing_coef * balance + cfg.z_loss_coef * z_loss)
    return loss, expert_counts(indices, rows, logits[0].shape[-1]).cpu()
