"""Shared-prefix rows: rows with a common prompt computed as one tree-masked row give the logprobs and
gradients of the plain rows at every trained position."""

from types import SimpleNamespace

import pytest
import torch

from posttrain.models.build import ModelFromConfig, build_model_dir, load_model
from posttrain.workers.policy.shared_prefix import (
    attention_cost_ratio,
    build_shared_prefix_rows,
    prefix_groups,
    shared_prefix_logprobs,
)
from posttrain.workers.policy.token_logprobs import compute_token_logprobs

CPU = torch.device("cpu")


def batch(
    rows: list[tuple[list[int], list[int]]], width: int
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """(prompt, continuation) pairs as right-padded input_ids, lengths and a token_mask on continuations."""
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    token_mask = torch.zeros(len(rows), width)
    lengths = []
    for i, (prompt, continuation) in enumerate(rows):
        ids = prompt + continuation
        input_ids[i, : len(ids)] = torch.tensor(ids)
        token_mask[i, len(prompt) : len(ids)] = 1
        lengths.append(len(ids))
    return input_ids, lengths, token_mask


def test_rows_group_by_the_tokens_before_the_last_prompt_token():
    # Rows 0, 2 share prompt [5, 6, 7]; row 1 differs in its last prompt token only, which is not shared
    # (it is the position whose logits score the first trained token), so it joins them; row 3 differs.
    input_ids, lengths, token_mask = batch(
        [([5, 6, 7], [1, 2]), ([5, 6, 8], [3]), ([5, 6, 7], [4, 4, 4]), ([9, 6, 7], [1])], width=6
    )
    assert prefix_groups(input_ids, lengths, token_mask) == [[0, 1, 2], [3]]


def test_a_group_becomes_one_row_with_restarting_positions_and_a_tree_mask():
    input_ids, lengths, token_mask = batch([([5, 6, 7], [1, 2]), ([5, 6, 7], [3])], width=5)
    rows = build_shared_prefix_rows(input_ids, lengths, token_mask)
    # Shared: [5, 6] (L = 2); continuations [7, 1, 2] and [7, 3] at positions 2, 3, 4 and 2, 3.
    assert rows.input_ids.tolist() == [[5, 6, 7, 1, 2, 7, 3]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3]]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 1, 0],  # the second continuation sees the prompt and itself, not the first one
            [1, 1, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(rows.attention_mask[0, 0], expected)
    assert [(p.row, p.start, p.prefix_length) for p in rows.placements] == [(0, 2, 2), (1, 5, 2)]


def test_no_shared_prompt_means_plain_rows():
    input_ids, lengths, token_mask = batch([([5, 6, 7], [1, 2]), ([8, 6, 7], [3])], width=5)
    assert build_shared_prefix_rows(input_ids, lengths, token_mask) is None


def test_long_continuations_after_a_short_prompt_stay_in_plain_rows():
    """A 3-token prompt and 8 continuations of 40: plain 8 rows x 43 tokens; one tree row of the 2 shared
    tokens + 8 x 41 = 330. Linear cost alone favours the tree row (330 < 344); with attention at 1e-3 per
    pair per token of linear cost, 330 x 1.33 = 438.9 > 8 x 43 x 1.043 = 358.8: the rows stay plain."""
    input_ids, lengths, token_mask = batch([([5, 6, 8], [7] * 40)] * 8, width=43)
    assert build_shared_prefix_rows(input_ids, lengths, token_mask, attention_ratio=0.0) is not None
    assert build_shared_prefix_rows(input_ids, lengths, token_mask, attention_ratio=1e-3) is None


def test_attention_cost_ratio_of_a_llama_layer():
    """SmolLM2-135M: hidden 576, 9 heads of 64 with 3 key/value heads (kv width 192), MLP 1536:
    2 / (1152 + 384 + 4608) = 2 / 6144."""
    config = SimpleNamespace(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3
    )
    assert attention_cost_ratio(config) == pytest.approx(2 / 6144)
    assert attention_cost_ratio(SimpleNamespace()) == 0.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    model_dir = build_model_dir(
        ModelFromConfig(
            hidden_size=64,
            num_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            tokenizer="byte",
            seed=0,
        ),
        tmp_path_factory.mktemp("model"),
    )
    return load_model(model_dir)


def random_groups(vocab: int, seed: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Two groups of 4 and 3 continuations (prompts of 11 and 7 tokens), and one row alone, shuffled."""
    generator = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, vocab, (n,), generator=generator).tolist()  # noqa: E731
    rows = []
    for prompt_length, size in ((11, 4), (7, 3), (9, 1)):
        prompt = draw(prompt_length)
        rows += [(prompt, draw(int(torch.randint(1, 12, (), generator=generator)))) for _ in range(size)]
    order = torch.randperm(len(rows), generator=generator).tolist()
    return batch([rows[i] for i in order], width=24)


def test_logprobs_and_gradients_equal_the_plain_rows(tiny_model):
    input_ids, lengths, token_mask = random_groups(tiny_model.config.vocab_size, seed=0)
    attention_mask = (torch.arange(input_ids.shape[1])[None] < torch.tensor(lengths)[:, None]).long()
    weights = torch.randn(token_mask.shape, generator=torch.Generator().manual_seed(1)) * token_mask

    tiny_model.zero_grad()
    plain = compute_token_logprobs(
        tiny_model(input_ids=input_ids, attention_mask=attention_mask).logits, input_ids
    )
    (plain * weights).sum().backward()
    plain_grads = {name: p.grad.clone() for name, p in tiny_model.named_parameters()}

    tiny_model.zero_grad()
    shared = shared_prefix_logprobs(tiny_model, input_ids, lengths, token_mask, 1.0, CPU)
    (shared * weights).sum().backward()

    trained = token_mask.bool()
    assert torch.allclose(shared[trained], plain[trained], atol=1e-5, rtol=0)
    for name, p in tiny_model.named_parameters():
        assert torch.allclose(p.grad, plain_grads[name], atol=1e-5, rtol=1e-4), name


def test_temperature_scales_the_logits_as_in_plain_rows(tiny_model):
    input_ids, lengths, token_mask = random_groups(tiny_model.config.vocab_size, seed=2)
    with torch.no_grad():
        plain = compute_token_logprobs(tiny_model(input_ids=input_ids).logits, input_ids, temperature=0.7)
        shared = shared_prefix_logprobs(tiny_model, input_ids, lengths, token_mask, 0.7, CPU)
    trained = token_mask.bool()
    assert torch.allclose(shared[trained], plain[trained], atol=1e-5, rtol=0)
