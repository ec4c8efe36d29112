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


def gpu_node(cpus: float, gpus: float) -> dict:
    free = {"CPU": cpus, "GPU": gpus}
    return {"id": "gpu-node", "ip": "10.0.0.2", "free": free, "total": dict(free)}


def test_the_gpu_grpo_recipes_give_each_worker_a_gpu_and_fit_their_machine():
    """A placement dry run of configs/grpo_qwen_1gpu.yaml and grpo_qwen_8gpu.yaml (validated from the files):
    every policy worker's bundle holds one GPU, generation shares it (colocated: nothing more is placed but
    the environment actors), and everything fits one node of 1 GPU / 16 CPUs and 8 GPUs / 64 CPUs, while 7
    GPUs are too few for the 8-GPU recipe."""
    from pathlib import Path

    from posttrain.algorithms.grpo import placed_beside_policy
    from posttrain.algorithms.grpo_config import GRPOConfig
    from posttrain.config import load_typed_config

    configs = Path(__file__).parents[2] / "configs"
    for name, gpus, cpus in (("grpo_qwen_1gpu", 1, 16), ("grpo_qwen_8gpu", 8, 64)):
        cfg = load_typed_config(GRPOConfig, configs / f"{name}.yaml")
        assert cfg.generation.colocated and cfg.policy.precision == "bfloat16"
        bundle = {"CPU": cfg.cluster.num_cpus_per_worker, "GPU": cfg.cluster.num_gpus_per_worker}
        workers = ResourceRequest("cluster", bundle, cfg.cluster.workers_per_node, one_node=True)
        assert workers.count == gpus and bundle["GPU"] == 1
        beside = placed_beside_policy(cfg)
        assert all(request.resources.get("GPU", 0) == 0 for request in beside)
        assert place([workers, *beside], [gpu_node(cpus, gpus)]) is None
    assert place([workers, *beside], [gpu_node(64, 7)]) is workers
