"""How the generation handle deals a batch to its workers and which shards it decodes again after a loss:
contiguous shards whose sizes differ by at most one, and the ranks a WorkerDiedError names."""

from posttrain.workers.generation.interface import lost_ranks, split_contiguous


def test_shards_are_contiguous_and_differ_by_at_most_one():
    """10 samples on 3 workers: 4 + 3 + 3; fewer samples than workers leaves the last shards empty."""
    assert split_contiguous(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_contiguous(16, 2) == [(0, 8), (8, 16)]
    assert split_contiguous(1, 3) == [(0, 1), (1, 1), (1, 1)]


def test_the_shards_to_decode_again_are_those_of_the_named_workers_in_rank_order():
    names = ["hf_generation-0-ab12", "hf_generation-1-ab12", "hf_generation-2-ab12"]
    assert lost_ranks(["hf_generation-2-ab12", "hf_generation-0-ab12"], names) == [0, 2]
    assert lost_ranks(["hf_generation-1-ab12-r1"], names) == []  # no current worker has that name
    assert lost_ranks([], names) == []
