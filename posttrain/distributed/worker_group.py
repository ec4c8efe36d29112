"""`RayWorkerGroup`: one Ray actor per bundle of a `RayVirtualCluster`, wired for torch.distributed, with
calls on all workers or a subset, sharded dispatch of `BatchedDataDict`s, and loud worker deaths.

The ranks of a group on one machine meet through a rendezvous file (torch's FileStore), with gloo's and
NCCL's sockets on the loopback interface: nothing listens on the network. A group across machines meets at
a TCP store that rank 0 serves on its node's Ray address only (torch's TCPStore, left to itself, listens on
every interface), and each rank's gloo/NCCL sockets use the interface holding its own node's address."""

from __future__ import annotations

import contextlib
import datetime
import gc
import glob
import math
import os
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as OnNode
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as InGroup

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


@ray.remote
class WorkerProcess:
    """The Ray actor of a group's rank: a process holding workers (instances of plain classes) by name, its
    group's and those of groups hosted in it. A worker starts with its group's environment (rank,
    rendezvous, threads) in place of the last one's. `reset` drops the workers, leaves torch.distributed's
    process group, and says whether the process may serve another group: every class it held allows that
    (`reuse_process`) and it holds no GPU."""

    def __init__(self) -> None:
        self.workers: dict[str, Any] = {}
        self.env: dict[str, str] = {}
        self.reusable = True

    def info(self) -> dict[str, Any]:
        node_id = ray.get_runtime_context().get_node_id()
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "node_id": node_id}

    def start(self, name: str, cls: type, init_kwargs: dict[str, Any], env: dict[str, str]) -> None:
        if env:
            for key in self.env.keys() - env.keys():
                os.environ.pop(key, None)
            os.environ.update(env)
            self.env = env
            if "torch" in sys.modules:  # imported already: its threads were set by an earlier group
                sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
        self.reusable = self.reusable and getattr(cls, "reuse_process", False)
        self.workers[name] = cls(**init_kwargs)

    def call(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.workers[name], method)(*args, **kwargs)

    def drop(self, name: str) -> None:
        self.workers.pop(name, None)

    def reset(self) -> bool:
        self.workers.clear()
        if "torch" in sys.modules and sys.modules["torch"].distributed.is_initialized():
            sys.modules["torch"].distributed.destroy_process_group()
        if "torch.distributed.tensor" in sys.modules:  # DTensor's caches keep the old group's meshes
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache

            _clear_sharding_prop_cache()
        gc.collect()
        return self.reusable and not ray.get_gpu_ids()


_idle: list[tuple[str, Any]] = []  # (node id, process): processes of finished groups, kept for the next


def workers_kept() -> int:
    """How many idle worker processes this driver keeps (POSTTRAIN_KEEP_WORKERS, 0 when unset)."""
    if not (value := os.environ.get("POSTTRAIN_KEEP_WORKERS") or "0").isdigit():
        raise ValueError(f"POSTTRAIN_KEEP_WORKERS={value!r}: must be a number of worker processes (0: none)")
    return int(value)


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
    """`world_size` workers of `worker_cls` (a plain class), worker i in a process (a `WorkerProcess` actor)
    of its own on bundle i. With `host` (a group on the same cluster), worker i lives in host worker i's
    process instead: no start-up of its own; it dies with its host, is never replaced, and `shutdown` drops
    it and leaves the host running.

    With POSTTRAIN_KEEP_WORKERS=n (a driver that runs one run after another: a notebook, a sweep, the test
    suite), `shutdown` keeps up to n processes of a CPU group, reset, for later groups on the same node: no
    start-up, no imports. Such a process runs on its bundle's node outside the placement group (the next run
    has its own), reserving no CPUs itself; the bundles do."""

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
        self.cluster, self.host, self.worker_cls = cluster, host, worker_cls
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
        self.lost = False  # a worker died: no process of the group is kept
        if host is not None:
            self.workers, self.info = list(host.workers), list(host.info)
            self.env_vars: list[dict[str, str]] = [{}] * self.world_size
        else:
            node_ips = cluster.bundle_node_ips()
            port = find_free_port(*cluster.cfg.master_port_range)
            num_nodes = len(set(cluster.bundle_node_ids()))  # nodes, not addresses: several may share one
            rendezvous = loopback_rendezvous_env() if num_nodes == 1 else {}  # one machine: a file
            # A phase runs alone in its bundle (colocated groups take turns), so each worker computes with as
            # many threads as its bundle has CPUs, not as its (half) share: every core is busy in every phase.
            threads = max(1, int(cluster.num_cpus_per_worker))
            per_node = cluster.cfg.workers_per_node
            self.env_vars = [
                rank_env_vars(rank, self.world_size, per_node, node_ips[0], port, threads, extra)
                for rank, extra in enumerate({**rendezvous, NODE_IP_ENV: ip} for ip in node_ips)
            ]
            self.workers = [self._process(rank) for rank in range(self.world_size)]
            self.info: list[dict[str, Any]] = []  # where each rank runs, once all have started
            self.info = self.get([w.info.remote() for w in self.workers])
            if num_nodes > 1:  # where each rank runs, for whoever must find a lost node's workers in the log
                places = ", ".join(f"rank {rank} on {info['node_ip']}" for rank, info in enumerate(self.info))
                print(f"{name_prefix}: {self.world_size} workers on {num_nodes} nodes: {places}", flush=True)
        self._start_workers(range(self.world_size))

    def _process(self, rank: int) -> Any:
        """A process for `rank`: a kept one on its bundle's node that answers, else a new one (the class)."""
        node_id = self.cluster.bundle_node_ids()[rank]
        keep = workers_kept() > 0 and not self.num_gpus
        for entry in [entry for entry in _idle if keep and entry[0] == node_id]:
            _idle.remove(entry)
            with contextlib.suppress(Exception):  # dead, or of an earlier Ray session
                ray.get(entry[1].info.remote(), timeout=PING_TIMEOUT_S)
                return entry[1]
        where = OnNode(node_id, soft=False) if keep else InGroup(self.cluster.placement_group, rank)
        return WorkerProcess.options(
            num_cpus=0 if keep else self.num_cpus,
            num_gpus=self.num_gpus,
            scheduling_strategy=where,
            name=self.names[rank],
            runtime_env={"env_vars": self.env_vars[rank]},
            max_restarts=0,
        ).remote()

    def _start_workers(self, ranks: Sequence[int]) -> None:
        """Construct the workers of `ranks` in their processes; on an error, shut the group down and raise."""
        args = self.worker_cls, self.init_kwargs
        starts = [self.workers[r].start.remote(self.names[r], *args, self.env_vars[r]) for r in ranks]
        try:
            self.get(starts)
        except BaseException:
            self.lost = True
            self.shutdown()
            raise

    def replace_workers(self, ranks: Sequence[int], timeout_s: float) -> None:
        """Start a new process and worker for each of `ranks`, whose processes died, with the same arguments
        and environment, on the rank's bundle: Ray moves the bundles of a node it counts dead to a node with
        room. For workers that form no process group (generation): a new rank would not join the others'
        collectives. Raises ClusterResourceError when the new processes have not all started within
        `timeout_s` (no room for a bundle), a constructor's error as `_start_workers` does; either way the
        group is shut down."""
        for rank in ranks:
            ray.kill(self.workers[rank], no_restart=True)  # dead already, or stuck on a lost node
            self.num_replaced += 1
            self.names[rank] = f"{self.name_prefix}-{rank}-{self.name_suffix}-r{self.num_replaced}"
            self.workers[rank] = self._process(rank)
        pings = [self.workers[rank].info.remote() for rank in ranks]
        if len(ray.wait(pings, num_returns=len(pings), timeout=timeout_s)[0]) < len(pings):
            self.lost = True
            self.shutdown()
            raise ClusterResourceError(
                f"{self.name_prefix}: replacements for ranks {list(ranks)} did not all start within "
                f"{timeout_s:g}s: no room for their bundles"
            )
        for rank, info in zip(ranks, ray.get(pings)):
            self.info[rank] = info
        self._start_workers(ranks)

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
        pings = [worker.info.remote() for worker in self.workers]
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
        infos, self.lost = self.info, True
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
        return self.workers[rank].call.remote(self.names[rank], method, *args, **kwargs)

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
        """Drop the workers; kill the group's own processes, or keep them (see the class)."""
        if self.host is not None:
            for process, name in zip(self.workers, self.names):
                process.drop.remote(name)
        else:
            keep = workers_kept()  # a group that lost a worker keeps none of its processes
            resets = [process.reset.remote() for process in self.workers] if keep and not self.lost else []
            ready, _ = ray.wait(resets, num_returns=len(resets), timeout=PING_TIMEOUT_S)
            for rank, process in enumerate(self.workers):
                with contextlib.suppress(ray.exceptions.RayError):  # a process that died is not kept
                    if resets and resets[rank] in ready and ray.get(resets[rank]) is True:
                        _idle.append((self.info[rank]["node_id"], process))
                        continue
                ray.kill(process, no_restart=True)
            while len(_idle) > keep:  # the oldest go (those of an earlier Ray session are gone already)
                with contextlib.suppress(Exception):
                    ray.kill(_idle.pop(0)[1], no_restart=True)
        self.workers = []
