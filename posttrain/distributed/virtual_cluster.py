"""`RayVirtualCluster`: start or join Ray and reserve one placement group of worker bundles."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group

logger = logging.getLogger(__name__)


class ClusterResourceError(RuntimeError):
    """The resources asked for could not be reserved in time."""


@dataclass
class ClusterConfig:
    """Where workers run: a local Ray instance or a running cluster, and the bundles to reserve."""

    address: str | None = field(default=None, metadata={"help": "Ray address to join (auto, ray://...); None: RAY_ADDRESS or a local instance"})
    num_nodes: int = field(default=1, metadata={"help": "nodes the workers span"})
    workers_per_node: int = field(default=1, metadata={"help": "training workers per node (one per GPU, or per CPU bundle)"})
    num_cpus_per_worker: float | None = field(default=None, metadata={"help": "CPUs in each worker bundle (None: a local instance's cores shared by workers_per_node, at least 1; 1 on a running cluster)"})
    num_gpus_per_worker: float = field(default=0.0, metadata={"help": "GPUs in each worker bundle"})
    num_cpus: int | None = field(default=None, metadata={"help": "logical CPUs of a local Ray start (None: enough for the bundles)"})
    placement_strategy: str | None = field(default=None, metadata={"help": "STRICT_PACK, PACK, SPREAD or STRICT_SPREAD (None: STRICT_PACK on 1 node, else PACK)"})
    include_dashboard: bool = field(default=False, metadata={"help": "start Ray's dashboard with a local instance"})
    dashboard_host: str = field(default="127.0.0.1", metadata={"help": "address the dashboard binds to"})
    resource_timeout_s: float = field(default=60.0, metadata={"help": "seconds to wait for the bundles before failing"})
    master_port_range: list[int] = field(default_factory=lambda: [29500, 29999], metadata={"help": "ports for torch.distributed rendezvous"})

    def validate(self) -> None:
        if self.num_nodes < 1 or self.workers_per_node < 1:
            raise ValueError(f"num_nodes and workers_per_node must be >= 1, got {self.num_nodes}, {self.workers_per_node}")
        if self.placement_strategy not in (None, "STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"):
            raise ValueError(f"placement_strategy: unknown strategy {self.placement_strategy!r}")
        if len(self.master_port_range) != 2 or self.master_port_range[0] > self.master_port_range[1]:
            raise ValueError(f"master_port_range must be [low, high], got {self.master_port_range}")


def cpus_per_worker(cfg: ClusterConfig) -> float:
    """`cfg.num_cpus_per_worker`, or when unset: this machine's cores shared by the workers of a node on a
    local instance (so a single-worker run computes on every core), 1 on a running cluster."""
    if cfg.num_cpus_per_worker is not None:
        return cfg.num_cpus_per_worker
    if cfg.address or os.environ.get("RAY_ADDRESS"):
        return 1.0
    return float(max(1, (os.cpu_count() or 1) // cfg.workers_per_node))


def init_ray(cfg: ClusterConfig) -> bool:
    """Join `cfg.address` / RAY_ADDRESS, or start a local instance; returns True if this call started Ray."""
    if ray.is_initialized():
        return False
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return True
    needed = cfg.num_nodes * cfg.workers_per_node * cpus_per_worker(cfg)
    num_cpus = cfg.num_cpus or max(os.cpu_count() or 1, int(needed + 0.999) + 1)
    kwargs = {"num_cpus": num_cpus, "include_dashboard": cfg.include_dashboard}  # GPUs: Ray detects them
    if cfg.include_dashboard:
        kwargs["dashboard_host"] = cfg.dashboard_host
    ray.init(**kwargs)
    return True


class RayVirtualCluster:
    """One placement group of `num_nodes x workers_per_node` bundles {CPU, GPU}; fails fast when it cannot."""

    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.num_cpus_per_worker = cpus_per_worker(cfg)
        self.owns_ray = init_ray(cfg)
        bundle = {"CPU": self.num_cpus_per_worker}
        if cfg.num_gpus_per_worker:
            bundle["GPU"] = cfg.num_gpus_per_worker
        self.bundles = [dict(bundle) for _ in range(self.world_size)]
        strategy = cfg.placement_strategy or ("STRICT_PACK" if cfg.num_nodes == 1 else "PACK")
        self.placement_group = placement_group(self.bundles, strategy=strategy)
        if not self.placement_group.wait(timeout_seconds=cfg.resource_timeout_s):
            remove_placement_group(self.placement_group)
            message = self._resource_message(strategy)
            self.shutdown()
            raise ClusterResourceError(message)

    @property
    def world_size(self) -> int:
        return self.cfg.num_nodes * self.cfg.workers_per_node

    def _resource_message(self, strategy: str) -> str:
        total = ray.cluster_resources()
        available = ray.available_resources()
        asked_cpus = self.num_cpus_per_worker * self.world_size
        asked_gpus = self.cfg.num_gpus_per_worker * self.world_size
        return (
            f"could not reserve {self.world_size} bundles of {self.bundles[0]} ({strategy}; {asked_cpus:g} CPUs, "
            f"{asked_gpus:g} GPUs in all) within {self.cfg.resource_timeout_s:g}s: the cluster has "
            f"{total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs on {len(ray.nodes())} node(s), "
            f"{available.get('CPU', 0):g} CPUs and {available.get('GPU', 0):g} GPUs available"
        )

    def bundle_node_ips(self) -> list[str]:
        """The node IP of each bundle, in bundle order."""
        table = ray.util.placement_group_table(self.placement_group)
        node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return [node_ips.get(table["bundles_to_node_id"][i], "127.0.0.1") for i in range(self.world_size)]

    def shutdown(self) -> None:
        """Remove the placement group; stop Ray only if this cluster started it."""
        try:
            if getattr(self, "placement_group", None) is not None:
                remove_placement_group(self.placement_group)
                self.placement_group = None
        except Exception as error:  # already removed, or Ray is gone
            logger.debug("placement group removal: %s", error)
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
            self.owns_ray = False
