"""What one optimizer step of a policy worker produced, and its reduction over data-parallel ranks, written
against an `all_reduce(values, op)` callable so that it runs (and is tested) without a process group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.models.moe import expert_load_metrics
from posttrain.utils.metrics import reduction_of

AllReduce = Callable[[torch.Tensor, str], torch.Tensor]  # (values, "sum" | "min" | "max") -> reduced over dp


@dataclass
class StepMetrics:
    """What one global batch (one optimizer step) produced on this rank, before the cross-rank reduction."""

    loss: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0
    num_microbatches: int = 0
    loss_metrics: dict[str, float] = field(default_factory=dict)
    num_computed_tokens: int = 0  # positions the forwards computed, padding and keep-in-step repeats included
    num_real_tokens: int = 0  # of those, positions holding a token of a row (shared prompts counted once)
    expert_counts: torch.Tensor | None = None  # [L, E] tokens per expert of an MoE model (None: dense)

    def add_expert_counts(self, counts: torch.Tensor | None) -> None:
        if counts is not None:
            self.expert_counts = counts if self.expert_counts is None else self.expert_counts + counts


COUNTS = ("loss", "num_microbatches", "num_computed_tokens", "num_real_tokens")  # summed over dp ranks


def step_value(step: StepMetrics, name: str) -> float:
    """A named number of a step: its loss, a count (COUNTS) or one of the loss function's metrics."""
    if name in COUNTS:
        return float(getattr(step, name))
    return step.loss_metrics[name]


def reduce_steps(
    steps: list[StepMetrics], eval_mode: bool, reductions: dict[str, str], all_reduce: AllReduce
) -> dict[str, Any]:
    """Per-step lists reduced over dp ranks, each loss metric by its reduction (`reduction_of`: named by the
    loss function, else `*_min` / `*_max` by min / max, else sum; a mean is over all micro-batches of all
    ranks); losses, micro-batch and token counts summed; an MoE model's tokens per expert summed, then
    summarised (moe.expert_load_metrics); grad norm and lr are global already. Every rank must have the
    same metric keys."""
    keys = sorted({key for step in steps for key in step.loss_metrics} - set(COUNTS))
    columns: dict[str, list[str]] = {"sum": list(COUNTS), "min": [], "max": [], "mean": []}
    for key in keys:
        columns[reduction_of(key, reductions)].append(key)
    counts = torch.tensor([float(step.num_microbatches) for step in steps], dtype=torch.float64)  # [S]
    result: dict[str, Any] = {}
    for kind, names in columns.items():
        if not names:
            continue
        rows = [[step_value(step, name) for name in names] for step in steps]
        values = torch.tensor(rows, dtype=torch.float64)  # [num_steps, num_names]
        if kind == "mean":  # each rank's micro-batch mean weighted by its micro-batch count
            values = all_reduce(values * counts[:, None], "sum")
            values = values / all_reduce(counts.clone(), "sum")[:, None].clamp(min=1)
        else:
            values = all_reduce(values, kind)
        for column, name in enumerate(names):
            result.setdefault(name, values[:, column].tolist())
    if steps and steps[0].expert_counts is not None:  # an MoE model: every rank has counts
        counts = all_reduce(torch.stack([step.expert_counts for step in steps]).double(), "sum")  # [S, L, E]
        for step_counts in counts:
            for name, value in expert_load_metrics(step_counts).items():
                result.setdefault(name, []).append(value)
    if not eval_mode:
        result["grad_norm"] = [step.grad_norm for step in steps]
        result["lr"] = [step.lr for step in steps]
    return result
