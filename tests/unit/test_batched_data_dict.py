"""BatchedDataDict: padding, sharding by global batch, micro-batching, dynamic batching, packing, reordering."""

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


def test_select_slice_repeat_chunk():
    batch = BatchedDataDict(x=torch.tensor([10, 11, 12]), tag=["a", "b", "c"])
    assert batch.select_indices([2, 0])["tag"] == ["c", "a"]
    assert batch.slice(1, 3)["x"].tolist() == [11, 12]
    assert batch.repeat_interleave(2)["tag"] == ["a", "a", "b", "b", "c", "c"]
    assert [batch.chunk(r, 2)["x"].tolist() for r in range(2)] == [[10, 11], [12]]


def test_microbatch_iterator_sizes():
    batch = BatchedDataDict(x=torch.arange(10))
    assert [mb.size for mb in batch.make_microbatch_iterator(4)] == [4, 4, 2]


def test_dynamic_batching_stays_under_budget_and_reorder_restores_order():
    lengths = [5, 17, 3, 9, 16, 2, 8, 12]
    input_ids = torch.zeros(8, 17, dtype=torch.long)
    for i, n in enumerate(lengths):
        input_ids[i, :n] = i + 1
    batch = BatchedDataDict(input_ids=input_ids, input_lengths=torch.tensor(lengths), idx=list(range(8)))
    microbatches, permutation = batch.make_dynamic_microbatches(max_tokens=40, length_round=4)
    for mb in microbatches:
        assert mb["input_ids"].shape[0] * mb["input_ids"].shape[1] <= 40
    assert sorted(permutation) == list(range(8))
    assert [i for mb in microbatches for i in mb["idx"]] == permutation
    restored = BatchedDataDict.reorder_data(batch.select_indices(permutation), permutation)
    assert restored["idx"] == list(range(8)) and torch.equal(restored["input_ids"], input_ids)


def test_packing_keeps_every_sample_once_and_bins_under_budget():
    lengths = [7, 3, 9, 1, 4, 6, 2, 8]
    bins = pack_sequences(lengths, max_tokens_per_bin=10)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 4  # 40 tokens in bins of 10: first-fit-decreasing finds the optimum here
    with pytest.raises(ValueError, match="over the bin budget"):
        pack_sequences([11], 10)


def test_dynamic_and_packing_together_is_an_error():
    batch = BatchedDataDict(input_lengths=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="cannot both be enabled"):
        batch.shard_by_batch_size(1, dynamic_batching_args={"max_tokens_per_microbatch": 8},
                                  sequence_packing_args={"max_tokens_per_bin": 8})


def test_shard_with_dynamic_batching_records_micro_batch_plan():
    batch = BatchedDataDict(input_lengths=torch.tensor([4, 4, 2, 2, 4, 4, 2, 2]))
    shards = batch.shard_by_batch_size(2, batch_size=4, dynamic_batching_args={"max_tokens_per_microbatch": 8})
    assert shards[0].micro_batch_indices == [[[0, 1]], [[0, 1]]]  # per local batch: rows of 4 tokens fit 2 x 4
    tight = batch.shard_by_batch_size(2, batch_size=4, dynamic_batching_args={"max_tokens_per_microbatch": 4})
    assert tight[0].micro_batch_indices == [[[0], [1]], [[0], [1]]] and tight[1].micro_batch_indices == [[[0, 1]]] * 2
    assert dynamic_microbatch_indices([4, 4, 2, 2], 8) == [[0, 1], [2, 3]]
