"""Micro-batch planning without a process group: fixed-size micro-batches keep the rows in order unless
taking them longest first computes less (padding, attention, prompts shared by a group), with the
positions each plan computes derived by hand."""

from __future__ import annotations

import torch

from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.workers.policy.config import PolicyConfig
from posttrain.workers.policy.microbatches import ForwardCost, plan_microbatches

CFG = PolicyConfig(model_name="unused")


def rows(lengths: list[int], prompts: list[list[int]] | None = None) -> BatchedDataDict:
    """Right-padded rows; with `prompts`, row i starts with prompts[i] and trains on the rest."""
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    token_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, length in enumerate(lengths):
        prompt = prompts[i] if prompts else [1]
        input_ids[i, :length] = torch.tensor(prompt + [50 + i * 10 + t for t in range(length - len(prompt))])
        token_mask[i, len(prompt) : length] = 1
    return BatchedDataDict(input_ids=input_ids, input_lengths=torch.tensor(lengths), token_mask=token_mask)


def plan(data: BatchedDataDict, cost: ForwardCost | None) -> tuple[list[list[int]], int, int]:
    microbatches = plan_microbatches(data, 2, CFG, cost, reorder=cost is not None)
    return (
        [m.indices for m in microbatches],
        sum(m.computed_tokens for m in microbatches),
        sum(m.real_tokens for m in microbatches),
    )


def test_uneven_rows_are_taken_longest_first_when_a_cost_model_is_given():
    """Lengths [10, 2, 9, 3]: in order (10, 2) and (9, 3) compute 2*10 + 2*9 = 38 positions; longest first
    (10, 9) and (3, 2) compute 2*10 + 2*3 = 26. Without a cost model the order is kept."""
    data = rows([10, 2, 9, 3])
    assert plan(data, None) == ([[0, 1], [2, 3]], 38, 24)
    assert plan(data, ForwardCost()) == ([[0, 2], [3, 1]], 26, 24)


def test_rows_of_equal_length_keep_their_order():
    assert plan(rows([6, 6, 6, 6]), ForwardCost())[0] == [[0, 1], [2, 3]]


def test_a_group_sharing_its_prompt_stays_together_when_that_is_cheaper():
    """Rows 0, 1 share prompt A and rows 2, 3 prompt B (8 tokens each; the shared part is the 7 before the
    position preceding the first trained token). Lengths [10, 12, 11, 9]. In order, each pair is one tree
    row: 7 + 3 + 5 = 15 and 7 + 4 + 2 = 13 positions (28). Longest first would pair rows of different
    prompts, (12, 11) and (10, 9): 24 + 20 = 44 padded positions. The order is kept; 28 computed, 28 held
    tokens (each prompt counted once)."""
    prompt_a, prompt_b = list(range(2, 10)), list(range(20, 28))
    data = rows([10, 12, 11, 9], [prompt_a, prompt_a, prompt_b, prompt_b])
    assert plan(data, ForwardCost(share_prefixes=True)) == ([[0, 1], [2, 3]], 28, 28)
    assert plan(data, ForwardCost(share_prefixes=False)) == ([[1, 2], [0, 3]], 44, 42)
    in_order = plan_microbatches(data, 2, CFG, ForwardCost(share_prefixes=True), reorder=False)
    assert [(m.computed_tokens, m.real_tokens) for m in in_order] == [(15, 15), (13, 13)]
