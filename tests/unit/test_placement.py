"""Packing a run's resource requests into nodes (`distributed.placement.place`), by hand-checked cases."""

from posttrain.distributed.placement import ResourceRequest, describe_nodes, place


def node(name: str, cpus: float, total: float | None = None) -> dict:
    return {
        "id": name,
        "ip": "10.0.0.1",
        "free": {"CPU": cpus},
        "total": {"CPU": cpus if total is None else total},
    }


def test_bundles_spread_over_nodes_and_what_is_left_takes_the_actors():
    """2 x 1 CPU bundles on two 1.5-CPU nodes leave 0.5 + 0.5: two 0.5-CPU actors fit, a third does not."""
    nodes = [node("a", 1.5), node("b", 1.5)]
    bundles = ResourceRequest("cluster", {"CPU": 1.0}, 2)
    assert place([bundles, ResourceRequest("env.x", {"CPU": 0.5}, 2)], nodes) is None
    too_many = ResourceRequest("env.x", {"CPU": 0.5}, 3)
    assert place([bundles, too_many], nodes) is too_many


def test_one_node_requests_need_their_whole_sum_on_a_single_node():
    """2 x 1 CPU on one node: two nodes of 1 free CPU each hold 2 CPUs, but no single node does."""
    nodes = [node("a", 1.0), node("b", 1.0)]
    together = ResourceRequest("generation", {"CPU": 1.0}, 2, one_node=True)
    assert place([together], nodes) is together
    assert place([ResourceRequest("generation", {"CPU": 1.0}, 2)], nodes) is None


def test_total_resources_tell_a_request_that_waiting_cannot_help():
    nodes = [node("a", 0.0, total=1.0)]
    request = ResourceRequest("cluster", {"CPU": 1.0})
    assert place([request], nodes) is request
    assert place([request], nodes, of="total") is None
    assert "node a (10.0.0.1): 0 CPUs, 0 GPUs free" in describe_nodes(nodes)
