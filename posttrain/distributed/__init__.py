"""Distributed core: Ray virtual clusters, worker groups, named shardings and the batch container."""

from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.named_sharding import NamedSharding
from posttrain.distributed.virtual_cluster import ClusterConfig, ClusterResourceError, RayVirtualCluster
from posttrain.distributed.worker_group import RayWorkerGroup, WorkerDiedError, init_torch_distributed

__all__ = [
    "BatchedDataDict",
    "ClusterConfig",
    "ClusterResourceError",
    "NamedSharding",
    "RayVirtualCluster",
    "RayWorkerGroup",
    "WorkerDiedError",
    "init_torch_distributed",
]
