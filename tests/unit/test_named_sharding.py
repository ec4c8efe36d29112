"""NamedSharding queries and errors."""

import pytest

from posttrain.distributed.named_sharding import NamedSharding


def test_queries_on_a_dp_by_tp_layout():
    sharding = NamedSharding([[0, 1], [2, 3], [4, 5]], ["dp", "tp"])
    assert sharding.shape == {"dp": 3, "tp": 2} and sharding.size == 6
    assert sharding.get_ranks(dp=2, tp=1) == 5
    sub = sharding.get_ranks(dp=1)
    assert sub.names == ["tp"] and sub.layout.tolist() == [2, 3]
    assert sharding.get_worker_coords(3) == {"dp": 1, "tp": 1}
    assert sharding.get_ranks_by_coord(tp=0) == [0, 2, 4]


def test_unknown_axis_and_out_of_bounds_name_both():
    sharding = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    with pytest.raises(ValueError, match="unknown axis 'pp'; axes are \\['dp', 'tp'\\]"):
        sharding.get_ranks(pp=0)
    with pytest.raises(IndexError, match="index 2 out of bounds for axis 'tp' of size 2"):
        sharding.get_ranks(tp=2)
    with pytest.raises(ValueError, match="each rank"):
        NamedSharding([0, 0], ["dp"])
