"""Integration tests for RayVirtualCluster: placement groups and the resource-timeout error."""

import time

import pytest

from posttrain.distributed.virtual_cluster import ClusterConfig, ClusterResourceError, RayVirtualCluster


def test_cluster_creates_bundles_and_reuses_running_ray(ray_session) -> None:
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=2, num_cpus_per_worker=0.5))
    assert cluster.world_size == 2
    assert len(cluster.bundle_node_ips()) == 2
    cluster.shutdown()
    import ray

    assert ray.is_initialized()


def test_impossible_request_fails_within_timeout_naming_cpus(ray_session) -> None:
    start = time.monotonic()
    with pytest.raises(ClusterResourceError, match="CPU"):
        RayVirtualCluster(ClusterConfig(num_cpus_per_worker=1000.0, resource_timeout_s=3.0))
    assert time.monotonic() - start < 15


def test_workers_compute_at_the_niceness_of_the_command(ray_session) -> None:
    """Ray renices workers by 15 unless told otherwise; posttrain's local Ray keeps them at the driver's
    niceness, so that a normal process beside the run does not take their cores."""
    import os

    import ray

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote()) == os.nice(0)
