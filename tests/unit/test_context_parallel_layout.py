"""Context parallelism without Ray: the load-balanced chunk layout and causal masks by hand, the full
sequence's logprobs and gradients of a 1-rank CP group against a plain forward, and the config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.algorithms import sft
from posttrain.config import ConfigError, load_typed_config, validate_config
from posttrain.workers.policy.config import PolicyConfig
from posttrain.workers.policy.context_parallel import (
    ContextParallelLayout,
    chunk_mask,
    padded_length,
    segment_ids_of,
)

SFT_TINY = str(Path(__file__).resolve().parents[2] / "configs" / "sft_tiny.yaml")


def test_load_balanced_chunks_give_each_rank_an_early_and_a_late_chunk():
    """T = 8, cp = 2: 4 chunks of 2; rank 0 holds chunks 0 and 3 (positions 0,1,6,7), rank 1 chunks 1 and 2
    (2,3,4,5). Causal work (keys seen per query, 1 + position): rank 0 1+2+7+8 = 18, rank 1 3+4+5+6 = 18.
    Gathered in rank order the positions are [0,1,6,7,2,3,4,5]; global_order puts them back."""
    layouts = [ContextParallelLayout(None, 2, rank, 2) for rank in range(2)]
    assert [layout.local_positions().tolist() for layout in layouts] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [int((layout.local_positions() + 1).sum()) for layout in layouts] == [18, 18]
    gathered = torch.tensor([0, 1, 6, 7, 2, 3, 4, 5])
    assert gathered[layouts[0].global_order()].tolist() == list(range(8))
    assert [padded_length(n, 2) for n in (1, 4, 9, 12)] == [4, 4, 12, 12]
    assert padded_length(13, 3) == 18


def test_chunk_mask_is_causal_by_global_position_and_keeps_packed_sequences_apart():
    """Chunk 1 of c = 2 (positions 2, 3) sees keys 0..2 and 0..3. Packed sequences of lengths 3 and 3 (ids
    [0,0,0,1,1,1]): position 3 starts the second, so it sees only key 3 (and position 2 keys 0..2)."""
    layout = ContextParallelLayout(None, 2, 1, 2)
    assert chunk_mask(layout, 1, torch.device("cpu"))[0, 0].int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert segment_ids_of([3, 3], 8).tolist() == [[0, 0, 0, 1, 1, 1, -1, -1]]
    layout.segment_ids = segment_ids_of([3, 3], 8)
    assert chunk_mask(layout, 1, torch.device("cpu"))[0, 0].int().tolist() == [[1, 1, 1, 0], [0, 0, 0, 1]]


def config_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        load_typed_config(sft.SFTConfig, SFT_TINY, list(overrides))
    return str(error.value)


def test_context_parallel_size_that_does_not_divide_the_workers_is_an_error():
    assert config_error(
        "policy.context_parallel_size=2", "cluster.workers_per_node=3", "cluster.num_cpus=4"
    ) == (
        "policy.context_parallel_size: 2 x policy.tensor_parallel_size 1 = 2 does not divide the 3 workers "
        "(cluster.num_nodes x cluster.workers_per_node) (from command line)"
    )


def test_sequence_length_round_that_does_not_split_into_cp_chunks_is_an_error():
    message = config_error(
        "policy.context_parallel_size=4",
        "policy.dynamic_batching.enabled=true",
        "policy.dynamic_batching.sequence_length_round=4",
    )
    assert message.startswith(
        "policy: policy.dynamic_batching.sequence_length_round=4 must be a multiple of 2 x "
        "policy.context_parallel_size = 8"
    ), message


def test_context_parallel_on_megatron_or_a_reward_model_is_an_error():
    megatron = config_error("policy.context_parallel_size=2", "policy.backend=megatron")
    assert "policy.context_parallel_size=2 with policy.backend=megatron" in megatron
    assert "Transformer Engine" in megatron
    with pytest.raises(
        ConfigError, match=r"policy.context_parallel_size=2 with policy.model_kind=reward_model"
    ):
        validate_config(
            PolicyConfig, {"model_name": "m", "context_parallel_size": 2, "model_kind": "reward_model"}
        )
    assert config_error("policy.context_parallel_size=0").startswith(
        "policy: policy.context_parallel_size: must be >= 1, got 0"
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer Qwen2 (hidden 64, 4 heads over 2 key/value heads) on a 1-rank gloo group."""
    import torch.distributed as dist

    from posttrain.models.build import ModelFromConfig, build_model_dir, load_model
    from posttrain.workers.policy.base import ensure_process_group

    created = not dist.is_initialized()
    ensure_process_group()
    cfg = ModelFromConfig(
        hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
    )
    yield load_model(build_model_dir(cfg, tmp_path_factory.mktemp("cp_model")))
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_one_rank_chunked_forward_equals_a_plain_forward(tiny_model, packed):
    """cp = 1 still runs the whole path (13 positions padded to 14, two chunks of 7, the gathers, the chunk
    masks): logprobs and gradients of a weighted sum equal a plain SDPA forward's (packed: two sequences
    of 5 and 8 in one row, against the block-diagonal mask; the second's first position is not read)."""
    import copy

    import torch.distributed as dist

    from posttrain.workers.policy.context_parallel import (
        context_parallel_logprobs,
        use_context_parallel_attention,
    )
    from posttrain.workers.policy.microbatches import build_packed_row
    from posttrain.workers.policy.token_logprobs import compute_token_logprobs

    plain, chunked = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    use_context_parallel_attention(chunked)
    input_ids = torch.randint(4, 100, (1 if packed else 2, 13), generator=torch.Generator().manual_seed(0))
    weights = torch.arange(13.0)
    if packed:
        weights[5] = 0.0  # the second sequence's first position: unread
        row = build_packed_row(torch.stack([input_ids[0, :8].clone(), input_ids[0, 5:]]), [5, 8])
        expected = compute_token_logprobs(
            plain(
                input_ids=input_ids, position_ids=row.position_ids, attention_mask=row.attention_mask
            ).logits,
            input_ids,
        )
        got = context_parallel_logprobs(chunked, input_ids, row.position_ids, dist.group.WORLD, 1.0, [5, 8])
    else:
        expected = compute_token_logprobs(plain(input_ids=input_ids).logits, input_ids)
        positions = torch.arange(13).expand(2, 13)
        got = context_parallel_logprobs(chunked, input_ids, positions, dist.group.WORLD, 1.0)
    torch.testing.assert_close(got * (weights > 0), expected * (weights > 0), atol=1e-5, rtol=0)
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-5, msg=name)
