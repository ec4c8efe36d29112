"""RayWorkerGroup on a real local Ray: a gloo process group, sharded dispatch, dead workers, placement."""

import os
import time

import pytest
import torch

from posttrain.distributed import (
    BatchedDataDict,
    ClusterConfig,
    ClusterResourceError,
    NamedSharding,
    RayVirtualCluster,
    RayWorkerGroup,
    WorkerDiedError,
    init_torch_distributed,
)


class EchoWorker:
    def all_reduce_rank_plus_one(self) -> float:
        import torch.distributed as dist

        init_torch_distributed()
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        return value.item()

    def environment(self) -> dict:
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"]
        return {key: os.environ[key] for key in keys}

    def echo(self, data, tag: str = "") -> tuple:
        return int(os.environ["RANK"]), data["x"].tolist(), tag

    def crash(self) -> None:
        print("about to crash on purpose")
        os._exit(3)


class ReusableEchoWorker(EchoWorker):
    reuse_process = True

    def threads(self) -> int:
        return torch.get_num_threads()


@pytest.fixture(scope="module")
def cluster(ray_session):
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=2, num_cpus_per_worker=0.5))
    yield cluster
    cluster.shutdown()


def test_two_workers_form_a_gloo_group_and_all_reduce(cluster):
    group = RayWorkerGroup(cluster, EchoWorker)
    assert group.run_all("all_reduce_rank_plus_one") == [3.0, 3.0]  # 1 + 2 on both ranks
    envs = group.run_all("environment")
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and 29500 <= int(envs[0]["MASTER_PORT"]) <= 29999
    group.shutdown()


def test_sharded_dispatch_reaches_the_right_workers(cluster):
    group = RayWorkerGroup(cluster, EchoWorker)
    data = BatchedDataDict(x=torch.arange(8))
    results = group.run_sharded(
        "echo", data.shard_by_batch_size(2, batch_size=4), in_sharded_axes=["dp"], tag="t"
    )
    assert results == [(0, [0, 1, 4, 5], "t"), (1, [2, 3, 6, 7], "t")]
    group.shutdown()


def test_replicated_and_free_axes(cluster):
    # one dp shard replicated over a 2-wide tp axis: both workers get it, only tp=0 answers
    group = RayWorkerGroup(cluster, EchoWorker, sharding=NamedSharding([[0, 1]], ["dp", "tp"]))
    data = [BatchedDataDict(x=torch.tensor([7, 8]))]
    assert group.run_sharded(
        "echo", data, in_sharded_axes=["dp"], replicate_on_axes=["tp"], output_is_replicated=["tp"]
    ) == [(0, [7, 8], "")]
    # tp free: only coordinate 0 is called at all
    assert group.run_sharded("echo", data, in_sharded_axes=["dp"]) == [(0, [7, 8], "")]
    group.shutdown()


def test_a_dead_worker_raises_naming_it_within_seconds_and_a_replacement_takes_its_rank(cluster):
    group = RayWorkerGroup(cluster, EchoWorker, name_prefix="crashy")
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as error:
        group.run_on([1], "crash")
    assert time.monotonic() - start < 15
    message = str(error.value)
    assert "worker rank 1 (crashy-1-" in message and "node " in message
    assert error.value.dead_workers == [group.names[1]]
    before = group.run_on([0], "environment")[0]
    group.replace_workers([1], timeout_s=30)  # in bundle 1, with rank 1's environment
    assert group.names[1].startswith("crashy-1-") and group.names[1] not in error.value.dead_workers
    assert group.run_all("environment") == [before, {**before, "RANK": "1", "LOCAL_RANK": "1"}]
    group.shutdown()


def test_kept_processes_serve_the_next_group_with_its_own_environment(cluster, monkeypatch):
    """POSTTRAIN_KEEP_WORKERS=n: a finished group's processes (of a class that allows it) serve the next
    group (the same pids), with that group's rank, rendezvous and threads; a process that died, or that
    held a class that does not allow it, is not kept; a value that is not a count is refused by name."""
    monkeypatch.setenv("POSTTRAIN_KEEP_WORKERS", "2")
    first = RayWorkerGroup(cluster, ReusableEchoWorker)
    assert first.run_all("all_reduce_rank_plus_one") == [3.0, 3.0]
    pids, port = [info["pid"] for info in first.info], first.run_on([0], "environment")[0]["MASTER_PORT"]
    first.shutdown()
    wide = RayVirtualCluster(ClusterConfig(workers_per_node=1, num_cpus_per_worker=2.0))
    try:
        alone = RayWorkerGroup(wide, ReusableEchoWorker)  # one of the two, alone, with 2 threads
        assert alone.info[0]["pid"] in pids and alone.run_all("threads") == [2]
        assert alone.run_all("all_reduce_rank_plus_one") == [1.0]
        alone.shutdown()
    finally:
        wide.shutdown()
    second = RayWorkerGroup(cluster, ReusableEchoWorker)
    assert sorted(info["pid"] for info in second.info) == sorted(pids)
    assert second.run_all("threads") == [1, 1] and second.run_all("all_reduce_rank_plus_one") == [3.0, 3.0]
    assert second.run_on([0], "environment")[0]["MASTER_PORT"] != port
    with pytest.raises(WorkerDiedError):
        second.run_on([1], "crash")
    second.shutdown()  # a worker died: none of its processes is kept
    third = RayWorkerGroup(cluster, EchoWorker)  # new processes; not kept, this class does not allow it
    assert not {info["pid"] for info in third.info} & set(pids)
    third_pids = [info["pid"] for info in third.info]
    third.shutdown()
    fourth = RayWorkerGroup(cluster, ReusableEchoWorker)
    assert not {info["pid"] for info in fourth.info} & {*pids, *third_pids}
    fourth.shutdown()
    monkeypatch.setenv("POSTTRAIN_KEEP_WORKERS", "all")
    with pytest.raises(ValueError, match="POSTTRAIN_KEEP_WORKERS='all': must be a number"):
        RayWorkerGroup(cluster, ReusableEchoWorker)


def test_asking_for_more_cpus_than_exist_fails_fast_with_what_was_asked(ray_session):
    start = time.monotonic()
    with pytest.raises(ClusterResourceError) as error:
        RayVirtualCluster(ClusterConfig(workers_per_node=2, num_cpus_per_worker=1000, resource_timeout_s=3))
    assert time.monotonic() - start < 10
    message = str(error.value)  # the config keys that asked, and what every node has free
    assert message.startswith(
        "cluster.num_nodes x workers_per_node x num_cpus_per_worker asks for 2 x {CPU: 1000} on one node"
    )
    assert "1 live node(s) have:" in message and "CPUs, 0 GPUs free" in message
