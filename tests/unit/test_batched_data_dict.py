"""BatchedDataDict (padding, sharding by global batch) and the micro-batch planners the policy worker uses
(dynamic batching by token budget, sequence packing)."""

import pytest
import torch

from posttrain.distributed.batched_data_dict import (
    BatchedDataDict,
    dynamic_microbatch_indices,
    pack_sequences,
)


def test_from_batches_right_pads_each_key_with_its_pad_value():
    a = {"input_ids": torch.tensor([[1, 2, 3]]), "names": ["a"]}
    b = {"input_ids": torch.tensor([[4], [5]]), "names": ["b", "c"]}
    merged = BatchedDataDict.from_batches([a, b], pad_value_dict={"input_ids": -1})
    assert merged["input_ids"].tolist() == [[1, 2, 3], [4, -1, -1], [5, -1, -1]]
    assert merged["names"] == ["a", "b", "c"] and merged.size == 3


def test_mismatched_batch_sizes_raise_naming_the_keys():
    batch = BatchedDataDict(x=torch.zeros(3), y=[1, 2])
    with pytest.raises(ValueError, match="mismatched batch sizes: {'x': 3, 'y': 2}"):
        _ = batch.size


def test_shard_by_batch_size_deals_each_global_batch_across_shards():
    batch = BatchedDataDict(x=torch.arange(8))
    shards = batch.shard_by_batch_size(2, batch_size=4)
    assert [s["x"].tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [s["x"].tolist() for s in batch.shard_by_batch_size(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="not a multiple of the global batch size 3"):
        batch.shard_by_batch_size(1, batch_size=3)


def test_select_and_slice():
    batch = BatchedDataDict(x=torch.tensor([10, 11, 12]), tag=["a", "b", "c"])
    assert batch.select_indices([2, 0])["tag"] == ["c", "a"]
    assert batch.slice(1, 3)["x"].tolist() == [11, 12]


def test_dynamic_batching_stays_under_budget_and_keeps_every_row_once():
    lengths = [5, 17, 3, 9, 16, 2, 8, 12]
    groups = dynamic_microbatch_indices(lengths, max_tokens=40, length_round=4)
    for group in groups:
        assert len(group) * max(-(-lengths[i] // 4) * 4 for i in group) <= 40
    assert sorted(i for group in groups for i in group) == list(range(8))
    assert dynamic_microbatch_indices([4, 4, 2, 2], 8) == [[0, 1], [2, 3]]


def test_packing_keeps_every_sample_once_and_bins_under_budget():
    lengths = [7, 3, 9, 1, 4, 6, 2, 8]
    bins = pack_sequences(lengths, max_tokens_per_bin=10)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 4  # 40 tokens in bins of 10: first-fit-decreasing finds the optimum here
    with pytest.raises(ValueError, match="over the bin budget"):
        pack_sequences([11], 10)
