"""`RayVirtualCluster`: start or join Ray and reserve one placement group of worker bundles.

A local Ray instance listens on 127.0.0.1 only (GCS, raylet, object manager, workers, agents), keeps
Ray's token authentication on, and runs neither the dashboard nor the dashboard agent's HTTP server
unless asked for (`cluster.include_dashboard`, `cluster.dashboard_agent`). Its workers compute at the
niceness of the command that started it, not Ray's default of 15 (`RAY_worker_niceness` overrides), which
keeps Ray's daemons responsive but lets any normal process on the machine take the workers' cores."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from posttrain.config import ConfigError
from posttrain.distributed.placement import (
    ClusterResourceError,
    ResourceRequest,
    UnplaceableError,
    check_placeable,
    describe_nodes,
    live_nodes,
)

logger = logging.getLogger(__name__)


class ClusterConnectionError(ConnectionError):
    """`cluster.address` (or RAY_ADDRESS) does not answer."""


@dataclass
class ClusterConfig:
    """Where workers run: a local Ray instance or a running cluster, and the bundles to reserve."""

    address: str | None = None
    """Ray address to join (auto, ray://...); None: RAY_ADDRESS or a local instance"""
    num_nodes: int = 1
    """nodes the workers span"""
    workers_per_node: int = 1
    """training workers per node (one per GPU, or per CPU bundle)"""
    num_cpus_per_worker: float | None = None
    """CPUs in each worker bundle (None: a local instance's cores shared by workers_per_node, at least 1; 1
    on a running cluster)"""
    num_gpus_per_worker: float = 0.0
    """GPUs in each worker bundle"""
    num_cpus: int | None = None
    """logical CPUs of a local Ray start (None: enough for the bundles)"""
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] | None = None
    """STRICT_PACK, PACK, SPREAD or STRICT_SPREAD (None: STRICT_PACK on 1 node, else PACK)"""
    include_dashboard: bool = False
    """start Ray's dashboard with a local instance"""
    dashboard_agent: bool = False
    """run Ray's full dashboard agent on a local instance (job API, metrics export that logger.monitor_gpus
    reads); off: the minimal agent, no HTTP server"""
    connect_timeout_s: float = 10.0
    """seconds to wait for cluster.address to answer before failing"""
    dashboard_host: str = "127.0.0.1"
    """address the dashboard binds to"""
    resource_timeout_s: float = 60.0
    """seconds to wait for the bundles before failing"""
    master_port_range: list[int] = field(default_factory=lambda: [29500, 29999])
    """ports for torch.distributed rendezvous"""
    max_restarts: int = 3
    """times a run rebuilds its workers (on the nodes left, or ones that join) and resumes from its latest
    intact checkpoint after a worker or its node dies; 0: the run stops. Also the times Hugging Face
    generation workers apart from the policy that die mid-generate are replaced, regenerating only their
    samples"""

    def validate(self) -> None:
        minimums = {"num_nodes": 1, "workers_per_node": 1, "max_restarts": 0}
        minimums.update(num_cpus_per_worker=0, num_gpus_per_worker=0)
        for key, least in minimums.items():
            value = getattr(self, key)
            if value is not None and value < least:
                raise ConfigError(key, f"must be >= {least}, got {value}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(
                "num_cpus", f"must be >= 1 (or null: enough for the bundles), got {self.num_cpus}"
            )
        if len(self.master_port_range) != 2 or self.master_port_range[0] > self.master_port_range[1]:
            raise ConfigError("master_port_range", f"must be [low, high], got {self.master_port_range}")
        # A local start may not promise more CPUs than the machine has (set num_cpus to oversubscribe).
        local = self.address is None and not os.environ.get("RAY_ADDRESS") and not ray.is_initialized()
        needed = self.num_nodes * self.workers_per_node * cpus_per_worker(self)
        if local and self.num_cpus is None and needed > (os.cpu_count() or 1):
            raise ConfigError(
                "workers_per_node",
                f"{self.num_nodes} x {self.workers_per_node} workers x {cpus_per_worker(self):g} "
                f"CPUs = {needed:g} CPUs, but this machine has {os.cpu_count()} for a local Ray instance "
                "(lower workers_per_node or num_cpus_per_worker, or set cluster.num_cpus to oversubscribe)",
            )


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
        join_ray(address, cfg.connect_timeout_s)
        return True
    needed = cfg.num_nodes * cfg.workers_per_node * cpus_per_worker(cfg)
    # Two logical CPUs beyond the bundles: environment actors, and generation workers placed apart from the
    # policy (async GRPO), which would otherwise wait forever for a bundle. Threads follow the bundles.
    num_cpus = cfg.num_cpus or max(os.cpu_count() or 1, int(needed + 0.999)) + 2
    start_local_ray(num_cpus, cfg.include_dashboard, cfg.dashboard_agent, cfg.dashboard_host)
    return True


def join_ray(address: str, timeout_s: float = 10.0, log_to_driver: bool = True) -> None:
    """Connect this driver to a running cluster; one on this machine's loopback (a local instance
    started by posttrain) is joined as a loopback node too, or the driver would wait for a raylet on the
    machine's outward IP."""
    check_reachable(address, timeout_s)
    from ray._private import services

    bootstrap = services.canonicalize_bootstrap_address(address, None) if address == "auto" else address
    host = urlparse(f"tcp://{bootstrap}").hostname if bootstrap and "://" not in bootstrap else None
    local = host is not None and (host == "localhost" or host.startswith("127."))
    with _loopback_only() if local else contextlib.nullcontext():
        ray.init(address=address, log_to_driver=log_to_driver)


def start_local_ray(
    num_cpus: int,
    include_dashboard: bool = False,
    dashboard_agent: bool = False,
    dashboard_host: str = "127.0.0.1",
    runtime_env: dict | None = None,
    log_to_driver: bool = True,
) -> None:
    """A Ray instance on this machine, reachable on 127.0.0.1 only, with token authentication."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        logger.warning("RAY_AUTH_MODE=disabled: this Ray instance accepts unauthenticated requests")
    # Every worker would draw its own bars for loading and saving weights (transformers' tqdm); the
    # workers inherit this process's environment, and the run's own progress line says what happens.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("RAY_worker_niceness", "0")  # the workers are the run (see the module docstring)
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")  # no idle task workers: all are actors
    with _loopback_only(), _agent_and_notice(minimal_agent=not (include_dashboard or dashboard_agent)):
        ray.init(
            address="local",  # a new instance: never join a cluster that happens to run on this machine
            num_cpus=num_cpus,  # GPUs: Ray detects them
            include_dashboard=include_dashboard,
            dashboard_host=dashboard_host,
            log_to_driver=log_to_driver,
            runtime_env=runtime_env,
        )
    _restrict_token_file()


@contextlib.contextmanager
def _loopback_only():
    """Ray takes the machine's outward IP as the node address (and binds its servers to it) unless it
    thinks multi-node clusters are off; this is that switch, held while the local instance starts."""
    from ray._private import ray_constants

    saved_env = os.environ.get(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR)
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"  # for the processes ray.init spawns
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, None)
        else:
            os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = saved_env


@contextlib.contextmanager
def _agent_and_notice(minimal_agent: bool):
    """While posttrain starts its own local instance: with `minimal_agent`, Ray starts its per-node
    dashboard agent in "minimal" mode (no HTTP server: no job API, no metrics export), which it does only
    when the dashboard's packages are missing, so it is made to believe so; and its "Token authentication
    is enabled" notice is silenced (posttrain turns it on itself and says so in docs/security.md)."""
    from ray._private import utils

    token_logger = logging.getLogger("ray._private.authentication.authentication_token_setup")

    def notice_filter(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")

    saved = utils.get_dashboard_dependency_error
    if minimal_agent:
        utils.get_dashboard_dependency_error = lambda: ImportError("posttrain: dashboard agent not requested")
    token_logger.addFilter(notice_filter)
    try:
        yield
    finally:
        token_logger.removeFilter(notice_filter)
        utils.get_dashboard_dependency_error = saved


def _restrict_token_file() -> None:
    """Ray writes its generated token world-readable; make it readable by its owner only."""
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    with contextlib.suppress(OSError):
        if path.stat().st_uid == os.getuid() and path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            path.chmod(0o600)


def check_reachable(address: str, timeout_s: float) -> None:
    """Fail within `timeout_s` with the address when nothing answers at a host:port cluster address
    (`auto` and `local` are looked up by Ray itself)."""
    if address in ("auto", "local"):
        return
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    host, port = parsed.hostname, parsed.port or (10001 if parsed.scheme == "ray" else 6379)
    start = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        raise ClusterConnectionError(
            f"cluster.address={address!r}: nothing answers at {host}:{port} ({error or 'timed out'} after "
            f"{time.monotonic() - start:.1f}s); is the cluster running and reachable from here?"
        ) from error


class RayVirtualCluster:
    """One placement group of `num_nodes x workers_per_node` bundles {CPU, GPU}; fails fast when it cannot."""

    def __init__(
        self,
        cfg: ClusterConfig,
        also_needs: Sequence[ResourceRequest] = (),
        key: str = "cluster.num_nodes x workers_per_node x num_cpus_per_worker",
    ) -> None:
        """`also_needs`: what the run places beside these bundles (environment actors, generation apart),
        checked with them before anything is created; `key`: the config keys that size these bundles, named
        in errors."""
        self.cfg = cfg
        self.num_cpus_per_worker = cpus_per_worker(cfg)
        self.owns_ray = init_ray(cfg)
        bundle = {"CPU": self.num_cpus_per_worker}
        if cfg.num_gpus_per_worker:
            bundle["GPU"] = cfg.num_gpus_per_worker
        strategy = cfg.placement_strategy or ("STRICT_PACK" if cfg.num_nodes == 1 else "PACK")
        own = ResourceRequest(key, bundle, self.world_size, strategy == "STRICT_PACK")
        try:
            check_placeable([own, *also_needs])
        except UnplaceableError:
            self.shutdown()
            raise
        self.placement_group = placement_group(
            [dict(bundle) for _ in range(self.world_size)], strategy=strategy
        )
        if not self.placement_group.wait(timeout_seconds=cfg.resource_timeout_s):  # taken since the check
            nodes = describe_nodes(live_nodes())
            self.shutdown()
            raise ClusterResourceError(
                f"could not reserve {self.world_size} bundles of {bundle} ({strategy}) for {key} within "
                f"{cfg.resource_timeout_s:g}s; the live nodes have:\n{nodes}"
            )

    @property
    def world_size(self) -> int:
        return self.cfg.num_nodes * self.cfg.workers_per_node

    def bundle_node_ids(self) -> list[str]:
        """The Ray node id of each bundle, in bundle order."""
        table = ray.util.placement_group_table(self.placement_group)
        return [table["bundles_to_node_id"][i] for i in range(self.world_size)]

    def bundle_node_ips(self) -> list[str]:
        """The node IP of each bundle, in bundle order."""
        node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return [node_ips.get(node_id, "127.0.0.1") for node_id in self.bundle_node_ids()]

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
