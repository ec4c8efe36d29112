"""Mixture-of-experts routers of Hugging Face models: finding them, recording and replaying the experts they
choose (router replay), and the router losses and expert-load statistics computed from their logits.

transformers' MoE layers (Qwen3-MoE, Qwen2-MoE, Mixtral, ...) route with a `*TopKRouter` module whose forward
maps the layer's hidden states [N, H] (N = batch x positions, flattened) to `(router_logits [N, E],
top_k_weights [N, k], top_k_index [N, k])`; the experts then mix their outputs with those weights. A
`RouterTap` puts a forward hook on every router: it keeps each call's logits and chosen experts and, when
given recorded choices, replaces the chosen experts by them.

What router replay replays: the top-k expert *indices* only. The router still computes its logits from
the current hidden states; the weights of the replayed experts are recomputed from them exactly as the router
computes its own (softmax over all experts in fp32, the k chosen probabilities, renormalised to sum to 1
where the router renormalises), so the router's weights get gradients through the replayed experts. A
position with no recorded choice (index -1) keeps the router's own."""

from __future__ import annotations

from typing import Any

import torch

NOT_RECORDED = -1  # an index of positions whose routing was not recorded (the router chooses)


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of `model`, one per MoE layer, in layer order ([] for a dense model)."""
    return [module for module in model.modules() if type(module).__name__.endswith("TopKRouter")]


def is_moe_model(model: torch.nn.Module) -> bool:
    return bool(moe_routers(model))


def replay_weights(router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The router's top-k weights [N, k] for the experts `indices` [N, k] from its logits [N, E]: the
    softmax probabilities of those experts, renormalised where the router renormalises (Mixtral always,
    Qwen MoE models when `norm_topk_prob`)."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, indices)  # [N, k]
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


class RouterTap:
    """Forward hooks on every router of a model while entered. Each router call appends its logits [N, E]
    (with their graph) and the experts it used [N, k] to `logits[l]` / `indices[l]` for layer l. With
    `replay` ([N, L, k] recorded experts of the tokens the next forward sees, flattened in the order the
    routers see them), the routers use the recorded experts (see the module docstring); `replay` may be
    changed between forwards. Keeping the tap entered through backward makes
    activation-checkpointing recomputation replay the same experts."""

    def __init__(self, model: torch.nn.Module, replay: torch.Tensor | None = None, keep_logits: bool = True):
        self.routers = moe_routers(model)
        self.keep_logits = keep_logits
        self.replay = replay
        self.logits: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.indices: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.handles: list[Any] = []

    def clear(self) -> None:
        self.logits = [[] for _ in self.routers]
        self.indices = [[] for _ in self.routers]

    def _hook(self, layer: int):
        def hook(router: torch.nn.Module, inputs: Any, outputs: Any) -> Any:
            logits, weights, indices = outputs
            if self.replay is not None:
                recorded = self.replay[:, layer].to(indices.device).long()  # [N, k]
                if recorded.shape != indices.shape:
                    raise ValueError(
                        f"router replay: recorded experts of shape {tuple(recorded.shape)} for a router call "
                        f"choosing {tuple(indices.shape)} (layer {layer})"
                    )
                indices = torch.where(recorded == NOT_RECORDED, indices, recorded)
                weights = replay_weights(router, logits, indices).to(weights.dtype)
            self.indices[layer].append(indices.detach())
            if self.keep_logits:
                self.logits[layer].append(logits)
            return logits, weights, indices

        return hook

    def __enter__(self) -> RouterTap:
        self.handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(self.routers)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def layer_logits(self) -> list[torch.Tensor]:
        """Per layer, the logits of every recorded call concatenated: L x [N, E]."""
        return [torch.cat(calls) for calls in self.logits]

    def layer_indices(self) -> torch.Tensor:
        """The experts used by every recorded call, [N, L, k]."""
        return torch.stack([torch.cat(calls) for calls in self.indices], dim=1)


def expert_counts(indices: torch.Tensor, token_mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert of each layer, [L, E] float, from the experts used [N, L, k] at the
    positions with token_mask [N] = 1 (each of a token's k experts counts it once)."""
    mask = token_mask.float().to(indices.device)[:, None].expand(-1, indices.shape[2]).reshape(-1)  # [N*k]
    counts = torch.zeros(indices.shape[1], num_experts, device=indices.device)  # [L, E]
    for layer in range(indices.shape[1]):
        counts[layer].index_add_(0, indices[:, layer].reshape(-1).long(), mask)
    return counts


def load_balancing_loss(
    logits: list[torch.Tensor], indices: torch.Tensor, token_mask: torch.Tensor
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4-6) as transformers computes it for
    its MoE models, pooled over layers: E * sum_e f_e * P_e, where over all layers' (token, layer) pairs
    with token_mask = 1, f_e is the mean number of the k chosen experts that are e (sum_e f_e = k) and P_e
    the mean router probability of e. Perfectly balanced routing with uniform probabilities gives k.
    logits: L x [N, E]; indices [N, L, k] (the experts used); token_mask [N]. Gradients flow through P."""
    num_experts = logits[0].shape[-1]
    mask = token_mask.float().to(logits[0].device)  # [N]
    num_rows = mask.sum() * len(logits)
    counts = expert_counts(indices, token_mask, num_experts).to(logits[0].device).sum(0)  # [E]
    prob_sums = sum((torch.softmax(x.float(), -1) * mask[:, None]).sum(0) for x in logits)  # [E]
    return num_experts * torch.sum((counts / num_rows) * (prob_sums / num_rows))


def router_z_loss(logits: list[torch.Tensor], token_mask: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): the mean over layers and masked tokens of
    logsumexp(router logits)^2. logits: L x [N, E]; token_mask [N]."""
    mask = token_mask.float().to(logits[0].device)
    squares = sum((torch.logsumexp(x.float(), -1) ** 2 * mask).sum() for x in logits)
    return squares / (mask.sum() * len(logits)).clamp(min=1)


def expert_load_metrics(counts: torch.Tensor) -> dict[str, float]:
    """Summary of tokens per expert [L, E] (summed over a step): the fewest and most tokens any expert of
    any layer got, and the smallest and largest share of a layer's routed tokens one expert took (balanced:
    1 / E each). HF MoE layers route every token (no capacity), so no token is ever dropped."""
    shares = counts / counts.sum(-1, keepdim=True).clamp(min=1)  # [L, E]
    return {
        "moe_tokens_per_expert_min": float(counts.min()),
        "moe_tokens_per_expert_max": float(counts.max()),
        "moe_expert_share_min": float(shares.min()),
        "moe_expert_share_max": float(shares.max()),
    }
