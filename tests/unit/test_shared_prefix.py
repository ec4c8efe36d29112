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
    rows_cost,
    shared_prefix_logprobs,
    tree_rows_cost,
)
from posttrain.workers.policy.token_logprobs import compute_token_logprobs
from posttrain.workers.policy.tree_attention import (
    ATTENTION_NAME,
    layout_replaces_mask,
    use_layout_attention,
    uses_tree_attention,
)

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


def test_a_layout_lists_what_each_continuation_sees():
    """The example above: prompt [5, 6] at row positions 0-1, continuations of 3 and 2 tokens at positions
    2-4 and 5-6. Each continuation attends over the prompt and itself; the prompt's outputs come from the
    first continuation's attention (outputs 0-1), its continuation's from 2-4, the second's from 7-8."""
    input_ids, lengths, token_mask = batch([([5, 6, 7], [1, 2]), ([5, 6, 7], [3])], width=5)
    layout = build_shared_prefix_rows(input_ids, lengths, token_mask).layout
    assert [positions.tolist() for positions in layout.sequences] == [[0, 1, 2, 3, 4], [0, 1, 5, 6]]
    assert layout.source_index.tolist() == [0, 1, 2, 3, 4, 7, 8]


def test_tree_rows_cost_counts_the_pairs_tree_attention_computes():
    """A 3-token prompt and 8 continuations of 40: plain, 8 rows x 43 tokens cost 8 x (43 + 1e-3 x 43^2)
    = 358.792; one tree row of the 2 shared tokens + 8 x 41 = 330 positions, with attention over each
    sequence (8 x 43^2): 330 + 1e-3 x 14792 = 344.792."""
    assert tree_rows_cost([330], [43] * 8, 1e-3) == pytest.approx(344.792)
    assert rows_cost(8, 43, 1e-3) == pytest.approx(358.792)
    input_ids, lengths, token_mask = batch([([5, 6, 8], [7] * 40)] * 8, width=43)
    assert build_shared_prefix_rows(input_ids, lengths, token_mask, attention_ratio=1e-3) is not None


def test_a_short_group_padded_to_a_long_groups_row_stays_in_plain_rows():
    """Group A: 4 continuations of 40 after [5, 6] (tree row 2 + 4 x 41 = 166); group B: 2 of 2 tokens
    (row 6). Two tree rows padded to 166 = 332 positions against 6 plain rows of 43 = 258: plain."""
    rows = [([5, 6, 8], [7] * 40)] * 4 + [([9, 6, 8], [7])] * 2
    input_ids, lengths, token_mask = batch(rows, width=43)
    assert tree_rows_cost([166, 6], [43] * 4 + [4] * 2, 0.0) == 332
    assert build_shared_prefix_rows(input_ids, lengths, token_mask, attention_ratio=0.0) is None


def test_attention_cost_ratio_of_a_llama_layer():
    """SmolLM2-135M: hidden 576, 9 heads of 64 with 3 key/value heads (kv width 192), MLP 1536:
    2 / (1152 + 384 + 4608) = 2 / 6144."""
    config = SimpleNamespace(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3
    )
    assert attention_cost_ratio(config) == pytest.approx(2 / 6144)
    assert attention_cost_ratio(SimpleNamespace()) == 0.0


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_model_dir(
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


@pytest.fixture(scope="module", params=["tree_attention", "dense_mask"])
def tiny_model(tiny_model_dir, request):
    """The model with layout_attention (what the policy worker runs), or with HF's SDPA, which
    ignores the layout and applies the rows' dense tree mask."""
    model = load_model(tiny_model_dir)
    if request.param == "tree_attention":
        assert use_layout_attention(model) and uses_tree_attention(model)
    assert uses_tree_attention(model) == (request.param == "tree_attention")
    return model


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


def test_tree_attention_equals_the_dense_tree_mask_and_plain_sdpa_without_a_layout(tiny_model_dir):
    """Layer outputs at every real position of the tree rows: layout_attention with the layout (and
    no tree mask) equals SDPA with the dense mask; without a layout the switched model is HF's SDPA model."""
    tree, dense = load_model(tiny_model_dir), load_model(tiny_model_dir)
    use_layout_attention(tree)
    assert tree.config._attn_implementation == ATTENTION_NAME
    assert layout_replaces_mask(tree) and not layout_replaces_mask(dense)
    input_ids, lengths, token_mask = random_groups(tree.config.vocab_size, seed=3)
    rows = build_shared_prefix_rows(input_ids, lengths, token_mask)
    unmasked = build_shared_prefix_rows(input_ids, lengths, token_mask, dense_mask=False)
    assert torch.equal(unmasked.attention_mask, torch.ones(rows.input_ids.shape, dtype=torch.long))
    assert torch.equal(unmasked.input_ids, rows.input_ids)
    assert [torch.equal(a, b) for a, b in zip(unmasked.layout.sequences, rows.layout.sequences)] == [True] * 8
    with torch.no_grad():
        out_tree = tree(
            input_ids=unmasked.input_ids,
            position_ids=unmasked.position_ids,
            attention_mask=unmasked.attention_mask,
            attention_layout=unmasked.layout,
        ).logits
        out_dense = dense(
            input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=rows.attention_mask
        ).logits
        plain_tree = tree(input_ids=input_ids).logits
        plain_dense = dense(input_ids=input_ids).logits
    real = torch.zeros(rows.input_ids.shape, dtype=torch.bool)
    for p in rows.placements:
        real[p.tree_row, : p.prefix_length] = True
        real[p.tree_row, p.start : p.start + p.length - p.prefix_length] = True
    assert torch.allclose(out_tree[real], out_dense[real], atol=1e-5, rtol=0)
    assert torch.equal(plain_tree, plain_dense)


def test_a_sliding_window_or_soft_cap_keeps_the_dense_tree_mask(tiny_model_dir):
    model = load_model(tiny_model_dir)
    use_layout_attention(model)
    assert layout_replaces_mask(model)
    model.config.sliding_window = 16
    assert not layout_replaces_mask(model)
    model.config.sliding_window, model.config.attn_logit_softcapping = None, 50.0
    assert not layout_replaces_mask(model)
