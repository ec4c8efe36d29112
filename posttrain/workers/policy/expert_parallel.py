"""Expert parallelism of the DTensor backend (`policy.expert_parallel_size`): the experts of every MoE layer
split over ep ranks, tokens sent to the rank owning their expert and back with all-to-all.

Layout: the W workers form a (W/ep, ep) mesh ("edp", "ep"); ranks r*ep .. r*ep+ep-1 are one EP group, each
holding num_experts/ep consecutive experts of every MoE layer as a DTensor placed (Replicate, Shard(0)):
replicated over the edp ranks that hold the same experts, split along the expert dimension over ep. Every
rank still trains on its own share of the batch (EP ranks are data-parallel ranks); the dense parameters
(attention, norms, routers, embeddings) stay FSDP2-sharded over all W ranks.

Forward of one MoE layer on one rank (top-k routing computed locally by the model's own router):
1. sort the (token, k) pairs by expert, hence by owning rank; exchange the counts (all_to_all_single);
2. all_to_all_single the hidden states of those pairs to their owners (uneven splits), run each local
   expert's SwiGLU on the rows it received, all_to_all_single the results back;
3. scale each result by its routing weight and sum a token's k results (index_add), as the HF module does.
The all-to-all is differentiable (its backward is the reverse all-to-all), so an expert's gradient on its
owner sums over the tokens of its whole EP group; `reduce_expert_gradients` then sums it over the edp group,
giving the gradient of a single process (gloo has all_to_all_single with uneven splits since torch 2.x: no
all-gather fallback is needed). Checkpoints (DCP) save each shard once; HF export, refit and full weights
gather the experts back with the DTensor machinery (`full_tensor`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven row splits; backward sends the gradients back the reverse way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def experts_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, attribute, experts) for every fused-experts module (HF's 3-D `gate_up_proj` [E, 2I, H] and
    `down_proj` [E, H, I] layout, e.g. Qwen3-MoE's `mlp.experts`)."""
    found = []
    for parent in model.modules():
        for attribute, child in parent.named_children():
            gate_up = getattr(child, "gate_up_proj", None)
            if isinstance(gate_up, torch.nn.Parameter) and gate_up.dim() == 3:
                found.append((parent, attribute, child))
    return found


class ExpertParallelExperts(torch.nn.Module):
    """One MoE layer's experts, num_experts/ep of them on this rank, with the HF experts module's call
    signature (hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) and parameter names."""

    def __init__(self, experts: torch.nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.group = mesh["ep"].get_group()
        self.ep_size, self.ep_rank = mesh["ep"].size(), mesh["ep"].get_local_rank()
        self.num_local = self.num_experts // self.ep_size
        self.act_fn = experts.act_fn
        start = self.ep_rank * self.num_local
        for name in ("gate_up_proj", "down_proj"):
            local = getattr(experts, name).detach()[start : start + self.num_local].clone()
            shard = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False)
            setattr(self, name, torch.nn.Parameter(shard))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        top_k = top_k_index.shape[1]
        expert_ids = top_k_index.reshape(-1)  # [N*k]
        order = torch.argsort(expert_ids, stable=True)  # pairs grouped by expert, hence by owner rank
        sorted_ids = expert_ids[order]
        send_counts = torch.bincount(sorted_ids // self.num_local, minlength=self.ep_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = _AllToAll.apply(hidden_states[order // top_k], recv, send, self.group)  # [R, H]
        local_ids = torch.empty(sum(recv), dtype=sorted_ids.dtype, device=sorted_ids.device)
        dist.all_to_all_single(local_ids, sorted_ids % self.num_local, recv, send, group=self.group)
        outputs = self._local_experts(rows, local_ids)  # [R, H]
        returned = _AllToAll.apply(outputs, send, recv, self.group)  # [N*k, H], in `order`
        weighted = returned * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add(0, order // top_k, weighted.to(hidden_states.dtype))

    def _local_experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
        outputs = torch.zeros_like(rows)
        for e in range(self.num_local):
            idx = (local_ids == e).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            gate, up = torch.nn.functional.linear(rows[idx], gate_up[e]).chunk(2, dim=-1)
            outputs = outputs.index_add(0, idx, torch.nn.functional.linear(self.act_fn(gate) * up, down[e]))
        return outputs


def apply_expert_parallel(model: torch.nn.Module, mesh: DeviceMesh) -> set[torch.nn.Parameter]:
    """Replace every experts module by this rank's ExpertParallelExperts; returns the expert parameters
    (FSDP2 must leave them alone: `fully_shard(..., ignored_params=...)`). `Policy` has checked that ep
    divides the experts (handle.check_expert_split)."""
    params: set[torch.nn.Parameter] = set()
    for parent, attribute, experts in experts_modules(model):
        sharded = ExpertParallelExperts(experts, mesh)
        setattr(parent, attribute, sharded)
        params |= {sharded.gate_up_proj, sharded.down_proj}
    return params


@torch.no_grad()
def reduce_expert_gradients(model: torch.nn.Module, edp_group) -> None:
    """Sum every expert gradient over the ranks holding the same experts (a rank whose experts got no
    tokens has none: zeros), so each equals the full-batch gradient, as FSDP's reduction does for the rest."""
    for module in model.modules():
        if not isinstance(module, ExpertParallelExperts):
            continue
        for param in (module.gate_up_proj, module.down_proj):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad.to_local(), group=edp_group)
