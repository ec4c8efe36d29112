"""`RayWorkerGroup`: one Ray actor per bundle of a `RayVirtualCluster`, wired for torch.distributed, with
calls on all workers or a subset, sharded dispatch of `BatchedDataDict`s, and loud worker deaths.

The ranks of a group on one machine meet through a rendezvous file (torch's FileStore), with gloo's and
NCCL's sockets on the loopback interface: nothing listens on the network. A group across machines meets at
a TCP store that rank 0 serves on its node's Ray address only (torch's TCPStore, left to itself, listens on
every interface), and each rank's gloo/NCCL sockets use the interface holding its own node's address."""

from __future__ import annotations

import datetime
import glob
import math
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.named_sharding import NamedSharding
from posttrain.distributed.placement import ClusterResourceError
from posttrain.distributed.virtual_cluster import RayVirtualCluster

LOG_TAIL_LINES = 20
HEALTH_CHECK_S = 2.0  # while waiting for workers, check this often that their nodes are alive
PING_TIMEOUT_S = 5.0  # a worker that does not answer a ping after a death is counted dead
STORE_TIMEOUT_S = 300.0  # how long a rank waits for the others to arrive at the TCP store
RENDEZVOUS_FILE_ENV = "POSTTRAIN_RENDEZVOUS_FILE"  # a one-machine group's rendezvous file
NODE_IP_ENV = "POSTTRAIN_NODE_IP"  # the address Ray gives a rank's node
_listeners: list[socket.socket] = []  # rank 0's listening sockets: the TCP stores serve on them for life


class WorkerDiedError(RuntimeError):
    """A worker process died; the message names it, its node and the tail of its log. `lost_nodes`: the
    Ray node ids found dead, `dead_workers`: the workers' names."""

    def __init__(self, message: str, lost_nodes: Sequence[str] = (), dead_workers: Sequence[str] = ()):
        super().__init__(message)
        self.lost_nodes, self.dead_workers = list(lost_nodes), list(dead_workers)


def find_free_port(low: int, high: int) -> int:
    """A port in [low, high] that nothing listens on right now."""
    start = low + uuid.uuid4().int % (high - low + 1)  # spread concurrent groups over the range
    for offset in range(high - low + 1):
        port = low + (start - low + offset) % (high - low + 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in cluster.master_port_range [{low}, {high}]")


def rank_env_vars(
    rank: int,
    world_size: int,
    workers_per_node: int,
    master_addr: str,
    master_port: int,
    num_threads: int,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of worker `rank`: its place in the group (global, local and node rank), the
    rendezvous address, OMP/MKL threads, and the `extra` variables (rendezvous file, node address)."""
    return {
        "OMP_NUM_THREADS": str(num_threads),
        "MKL_NUM_THREADS": str(num_threads),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % workers_per_node),
        "NODE_RANK": str(rank // workers_per_node),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        **(extra or {}),
    }


def assigned_device() -> Any:
    """The torch device this process computes on: its GPU when it was given one, else the CPU.

    Inside a Ray actor that is what Ray assigned (a GPU share in its bundle): an actor without one stays
    on the CPU even on a GPU machine, where CUDA is still visible to it. Outside Ray: CUDA if available."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    if in_actor and not ray.get_gpu_ids():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def init_torch_distributed(backend: str | None = None) -> None:
    """Join the group described by RANK/WORLD_SIZE as the module docstring says (outside a worker group:
    as torch's env:// says), with gloo on CPU, NCCL on GPU."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = backend or ("nccl" if assigned_device().type == "cuda" else "gloo")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get(NODE_IP_ENV) and not os.environ.get(RENDEZVOUS_FILE_ENV):  # a group across machines
        pin_socket_interface(os.environ[NODE_IP_ENV])
        store = bound_tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        return
    path = os.environ.get(RENDEZVOUS_FILE_ENV)  # one machine: no listening socket
    init_method = f"file://{path}" if path else "env://"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


def bound_tcp_store(master_addr: str, master_port: int, rank: int, world_size: int) -> Any:
    """Rank 0: a TCP store listening on `master_addr:master_port` only (rank 0 binds the socket and hands
    it to the store); the others: its clients."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    if rank != 0:
        return dist.TCPStore(master_addr, master_port, world_size, False, timeout=timeout)
    listener = socket.socket(socket.AF_INET6 if ":" in master_addr else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((master_addr, master_port))
    except OSError as error:
        listener.close()
        raise RuntimeError(
            f"rank 0 cannot listen on {master_addr}:{master_port} for the rendezvous ({error.strerror}): "
            "another process holds the port; pick a free range with cluster.master_port_range"
        ) from error
    listener.listen(128)
    store = dist.TCPStore(
        master_addr, master_port, world_size, True, timeout=timeout, master_listen_fd=listener.fileno()
    )
    _listeners.append(listener)
    return store


def pin_socket_interface(node_ip: str) -> None:
    """Gloo's and NCCL's sockets on the interface holding the address Ray gives this node (not whichever
    interface they would pick), unless the user chose one (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)."""
    import psutil

    holders = [
        name for name, addrs in psutil.net_if_addrs().items() if any(a.address == node_ip for a in addrs)
    ]
    if not holders:
        raise RuntimeError(
            f"no network interface of this machine holds its Ray node address {node_ip}: set "
            "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface the nodes reach each other on"
        )
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, holders[0])


def loopback_rendezvous_env() -> dict[str, str]:
    """Env vars that keep a one-machine group off the network: a fresh rendezvous file, and gloo's and
    NCCL's sockets on the loopback interface."""
    import psutil

    interfaces = psutil.net_if_addrs().items()
    ipv4_loopback = (name for name, addrs in interfaces if any(a.address.startswith("127.") for a in addrs))
    loopback = next(ipv4_loopback, "lo")
    path = os.path.join(tempfile.gettempdir(), f"posttrain-rendezvous-{uuid.uuid4().hex}")
    return {RENDEZVOUS_FILE_ENV: path, "GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback}


def dead_nodes(node_ids: set[str]) -> set[str]:
    """Those of `node_ids` that Ray counts dead, or whose raylet no longer accepts connections: Ray's own
    health checks take tens of seconds to declare a node dead, a refused connection takes milliseconds."""
    dead = set()
    for node in ray.nodes():
        if node["NodeID"] not in node_ids:
            continue
        if not node["Alive"]:
            dead.add(node["NodeID"])
            continue
        try:
            socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=2).close()
        except OSError:
            dead.add(node["NodeID"])
    return dead


def wait_until_marked_dead(node_ids: set[str], timeout_s: float = 120.0) -> bool:
    """Wait until Ray itself counts `node_ids` dead (so nothing is placed on them again); False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        if not alive & set(node_ids):
            return True
        time.sleep(0.5)
    return False


def _with_group_methods(worker_cls: type) -> type:
    """The worker class plus a method that reports where the actor runs (for error messages), and three that
    keep, call and drop the workers of groups hosted in the actor's process (RayWorkerGroup's `host`)."""

    def group_worker_info(self) -> dict[str, Any]:
        node_id = ray.get_runtime_context().get_node_id()
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "node_id": node_id}

    def start_hosted(self, name: str, cls: type, init_kwargs: dict[str, Any]) -> None:
        vars(self).setdefault("hosted_workers", {})[name] = cls(**init_kwargs)

    def call_hosted(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.hosted_workers[name], method)(*args, **kwargs)

    def drop_hosted(self, name: str) -> None:
        self.hosted_workers.pop(name, None)

    methods = {f.__name__: f for f in (group_worker_info, start_hosted, call_hosted, drop_hosted)}
    return type(worker_cls.__name__, (worker_cls,), methods)


def _log_tail(pid: int) -> str:
    """The last lines of a local worker's stdout/stderr files in Ray's session log directory."""
    try:
        session_dir = ray._private.worker._global_node.get_session_dir_path()
    except AttributeError:
        return "(no local Ray session directory)"
    lines: list[str] = []
    for path in sorted(glob.glob(os.path.join(session_dir, "logs", f"worker-*-{pid}.*"))):
        with open(path, errors="replace") as f:
            tail = f.readlines()[-LOG_TAIL_LINES:]
        if tail:
            lines.append(f"--- {path}\n" + "".join(tail))
    return "\n".join(lines) or f"(no log file for pid {pid})"


class RayWorkerGroup:
    """`world_size` actors of `worker_cls` (a plain class), actor i on bundle i. With `host` (a group on the
    same cluster), worker i lives in host actor i's process instead: no process or start-up of its own; it
    dies with its host, is never replaced, and `shutdown` drops it and leaves the host running."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        worker_cls: type,
        *,
        init_kwargs: dict[str, Any] | None = None,
        sharding: NamedSharding | None = None,
        name_prefix: str = "worker",
        num_cpus_per_worker: float | None = None,
        num_gpus_per_worker: float | None = None,
        host: RayWorkerGroup | None = None,
    ):
        self.cluster, self.host = cluster, host
        self.world_size = cluster.world_size
        self.sharding = sharding or NamedSharding.data_parallel(self.world_size)
        # Half a bundle by default, so a colocated generation group fits beside a training group.
        num_cpus = cluster.num_cpus_per_worker / 2 if num_cpus_per_worker is None else num_cpus_per_worker
        num_gpus = cluster.cfg.num_gpus_per_worker / 2 if num_gpus_per_worker is None else num_gpus_per_worker
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.init_kwargs = init_kwargs or {}
        self.name_prefix, self.name_suffix = name_prefix, uuid.uuid4().hex[:6]
        self.names = [f"{name_prefix}-{rank}-{self.name_suffix}" for rank in range(self.world_size)]
        self.num_replaced = 0  # workers started in place of dead ones (see replace_workers)
        if host is not None:
            self.workers, self.info = list(host.workers), host.info
            hosted = zip(self.workers, self.names)
            starts = [actor.start_hosted.remote(name, worker_cls, self.init_kwargs) for actor, name in hosted]
            self.get(starts)
            return
        node_ips = cluster.bundle_node_ips()
        port = find_free_port(*cluster.cfg.master_port_range)
        num_nodes = len(set(cluster.bundle_node_ids()))  # nodes, not addresses: several may share one
        local = num_nodes == 1  # one machine: the file rendezvous
        self.remote_cls = ray.remote(_with_group_methods(worker_cls))
        rendezvous = loopback_rendezvous_env() if local else {}
        # A phase runs alone in its bundle (colocated groups take turns), so each actor computes with as
        # many threads as its bundle has CPUs, not as its (half) share: every core is busy in every phase.
        threads = max(1, int(cluster.num_cpus_per_worker))
        per_node = cluster.cfg.workers_per_node
        self.env_vars = [
            rank_env_vars(rank, self.world_size, per_node, node_ips[0], port, threads, extra)
            for rank, extra in enumerate({**rendezvous, NODE_IP_ENV: ip} for ip in node_ips)
        ]
        self.workers = [self._start_actor(rank) for rank in range(self.world_size)]
        self.info: list[dict[str, Any]] = []  # where each rank runs, once all have started
        self.info = self.get([w.group_worker_info.remote() for w in self.workers])
        if not local:  # where each rank runs, for whoever must find a lost node's workers in the log
            places = ", ".join(f"rank {rank} on {info['node_ip']}" for rank, info in enumerate(self.info))
            print(f"{name_prefix}: {self.world_size} workers on {num_nodes} nodes: {places}", flush=True)

    def _start_actor(self, rank: int) -> Any:
        """An actor of the worker class for `rank`, in bundle `rank` of the cluster's placement group."""
        strategy = PlacementGroupSchedulingStrategy(
            self.cluster.placement_group, placement_group_bundle_index=rank
        )
        return self.remote_cls.options(
            num_cpus=self.num_cpus,
            num_gpus=self.num_gpus,
            scheduling_strategy=strategy,
            name=self.names[rank],
            runtime_env={"env_vars": self.env_vars[rank]},
            max_restarts=0,
        ).remote(**self.init_kwargs)

    def replace_workers(self, ranks: Sequence[int], timeout_s: float) -> None:
        """Start a new actor for each of `ranks`, whose actors died, with the same arguments and environment,
        in the rank's bundle: Ray moves the bundles of a node it counts dead to a node with room. For
        workers that form no process group (generation): a new rank would not join the others'
        collectives. Raises ClusterResourceError when the new actors have not all started within
        `timeout_s` (no room for a bundle), RayActorError when a constructor fails."""
        actors = {}
        for rank in ranks:
            ray.kill(self.workers[rank], no_restart=True)  # dead already, or stuck on a lost node
            self.num_replaced += 1
            self.names[rank] = f"{self.name_prefix}-{rank}-{self.name_suffix}-r{self.num_replaced}"
            actors[rank] = self._start_actor(rank)
        pings = [actor.group_worker_info.remote() for actor in actors.values()]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        if len(ready) < len(pings):
            for actor in actors.values():
                ray.kill(actor, no_restart=True)
            raise ClusterResourceError(
                f"{self.name_prefix}: replacements for ranks {list(ranks)} did not all start within "
                f"{timeout_s:g}s: no room for their bundles"
            )
        for rank, info in zip(actors, ray.get(pings)):
            self.info[rank] = info
            self.workers[rank] = actors[rank]

    # -- calls ----------------------------------------------------------------------------------------
    def get(self, refs: Sequence[ray.ObjectRef]) -> list[Any]:
        """Wait for results; a dead worker, or one whose node has died (its peers may wait for it in a
        collective, or fail in one), raises WorkerDiedError (names, nodes, log tails) within seconds, never
        hangs."""
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(
                    pending, num_returns=len(pending), timeout=HEALTH_CHECK_S, fetch_local=False
                )
                ray.get(ready)  # a failed call raises here
                lost = dead_nodes({info["node_id"] for info in self.info}) if pending else set()
                if lost:
                    raise ray.exceptions.NodeDiedError(f"node(s) {sorted(lost)} died")
            return ray.get(list(refs))
        except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError) as error:
            raise self._died_error(error) from error
        except ray.exceptions.RayTaskError as error:  # a collective that lost its peer fails like this
            died = self._died_error(error)
            if died.dead_workers:
                raise died from error
            raise

    def _dead_ranks(self, lost_nodes: set[str]) -> list[int]:
        """Ranks that do not answer a ping (an error, not a busy worker) or live on a lost node."""
        pings = [worker.group_worker_info.remote() for worker in self.workers]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=PING_TIMEOUT_S)
        dead = {rank for rank, info in enumerate(self.info) if info["node_id"] in lost_nodes}
        for rank, ping in enumerate(pings):
            if ping in ready:
                try:
                    ray.get(ping)
                except Exception:
                    dead.add(rank)
        return sorted(dead)

    def _died_error(self, error: Exception) -> WorkerDiedError:
        """Which workers died and where."""
        infos = self.info
        lost = sorted(dead_nodes({info["node_id"] for info in infos}))
        dead = self._dead_ranks(set(lost))
        parts = []
        for rank in dead or range(self.world_size):
            where = f"node {infos[rank]['node_ip']}, pid {infos[rank]['pid']}" if infos else "during start-up"
            tail = _log_tail(infos[rank]["pid"]) if infos else ""
            parts.append(f"worker rank {rank} ({self.names[rank]}, {where}) died\n{tail}")
        nodes_line = f"lost node(s): {', '.join(lost)}\n" if lost else ""
        return WorkerDiedError(
            nodes_line + "\n".join(parts) + f"\ncause: {error}",
            lost_nodes=lost,
            dead_workers=[self.names[rank] for rank in dead],
        )

    def call(self, rank: int, method: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Call `method` on worker `rank`, without waiting."""
        if self.host is not None:
            return self.workers[rank].call_hosted.remote(self.names[rank], method, *args, **kwargs)
        return getattr(self.workers[rank], method).remote(*args, **kwargs)

    def run_all_async(self, method: str, **kwargs: Any) -> list[ray.ObjectRef]:
        return [self.call(rank, method, **kwargs) for rank in range(len(self.workers))]

    def run_all(self, method: str, **kwargs: Any) -> list[Any]:
        """Call `method` on every worker; results in rank order."""
        return self.get(self.run_all_async(method, **kwargs))

    def run_on(self, ranks: Sequence[int], method: str, **kwargs: Any) -> list[Any]:
        return self.get([self.call(rank, method, **kwargs) for rank in ranks])

    def run_sharded(
        self,
        method: str,
        shards: Sequence[BatchedDataDict],
        in_sharded_axes: Sequence[str],
        replicate_on_axes: Sequence[str] = (),
        output_is_replicated: Sequence[str] = (),
        **common_kwargs: Any,
    ) -> list[Any]:
        """Give each worker the shard at its coordinates on `in_sharded_axes` (`shards` in row-major order
        of those axes), the same shard to every worker along
        `replicate_on_axes`; axes in neither are "free": only their coordinate 0 is called. Results come
        from the workers at coordinate 0 of `output_is_replicated`, ordered like the shards."""
        shape = [self.sharding.get_axis_size(axis) for axis in in_sharded_axes]
        if len(shards) != math.prod(shape):
            raise ValueError(f"{len(shards)} shards for axes {list(in_sharded_axes)} of sizes {shape}")
        shard_refs = [ray.put(shard) for shard in shards]
        calls, outputs = [], []
        for rank in range(self.world_size):
            coords = self.sharding.get_worker_coords(rank)
            free = [a for a in self.sharding.names if a not in in_sharded_axes and a not in replicate_on_axes]
            if any(coords[a] for a in free):
                continue
            index = 0
            for axis, size in zip(in_sharded_axes, shape):
                index = index * size + coords[axis]
            ref = self.call(rank, method, data=shard_refs[index], **common_kwargs)
            calls.append(ref)
            if not any(coords[a] for a in output_is_replicated):
                outputs.append((index, ref))
        self.get(calls)  # surface errors of replicas too
        return self.get([ref for _, ref in sorted(outputs, key=lambda pair: pair[0])])

    def shutdown(self) -> None:
        for worker, name in zip(self.workers, self.names):
            if self.host is not None:
                worker.drop_hosted.remote(name)
            else:
                ray.kill(worker, no_restart=True)
        self.workers = []
