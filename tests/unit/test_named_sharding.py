"""NamedSharding queries and errors."""

import pytest

from posttrain.distributed.named_sharding import NamedSharding


def test_queries_on_a_dp_by_tp_layout():
    sharding = NamedSharding([[0, 1], [2, 3], [4, 5]], ["dp", "tp"])
    assert sharding.size == 6 and repr(sharding) == "NamedSharding([[0, 1], [2, 3], [4, 5]], ['dp', 'tp'])"
    assert sharding.get_axis_size("dp") == 3 and sharding.get_axis_size("tp") == 2
    assert sharding.get_worker_coords(5) == {"dp": 2, "tp": 1}
    assert sharding.get_worker_coords(3) == {"dp": 1, "tp": 1}


def test_unknown_axis_and_unknown_rank_name_both():
    sharding = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    with pytest.raises(ValueError, match="unknown axis 'pp'; axes are \\['dp', 'tp'\\]"):
        sharding.get_axis_size("pp")
    with pytest.raises(IndexError, match=r"rank 4 is not in this sharding \(ranks \[0, 1, 2, 3\]\)"):
        sharding.get_worker_coords(4)
    with pytest.raises(ValueError, match="each rank"):
        NamedSharding([0, 0], ["dp"])


@pytest.mark.parametrize("layout, culprit", [([[0, 1.5], [2, 3]], "1.5"), ([[0, 1], ["2", 3]], "'2'")])
def test_a_non_integer_rank_is_refused_naming_the_value(layout, culprit):
    with pytest.raises(ValueError, match=f"ranks must be integers, got {culprit}"):
        NamedSharding(layout, ["dp", "tp"])
