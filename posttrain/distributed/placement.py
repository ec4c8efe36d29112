"""Will every actor fit? A check on the driver before any actor or placement group is made: each request
(bundles of a placement group, or plain actors) is packed into the free resources of the live nodes, and
a request that fits nowhere fails at once with the nodes, their free resources and the config key that
asked, instead of an actor that waits forever to be placed."""

from __future__ import annotations

import time
from dataclasses import dataclass

CHECK_WAIT_S = 10.0  # resources just released (a previous run's placement group) take a moment to show


class ClusterResourceError(RuntimeError):
    """The resources asked for could not be reserved in time."""


class UnplaceableError(ClusterResourceError):
    """The actors a run asks for cannot all be placed on the cluster's nodes."""


@dataclass(frozen=True)
class ResourceRequest:
    """`count` actors or bundles of `resources` each, asked for by the config key `key`; `one_node`: all of
    them on a single node (a STRICT_PACK placement group)."""

    key: str
    resources: dict[str, float]
    count: int = 1
    one_node: bool = False


def live_nodes() -> list[dict]:
    """The live Ray nodes: id, IP, free and total resources (CPU, GPU, memory... as Ray counts them)."""
    import ray
    from ray._private import state

    free, total = state.available_resources_per_node(), state.total_resources_per_node()
    alive = [(node["NodeID"], node["NodeManagerAddress"]) for node in ray.nodes() if node["Alive"]]
    return [
        {"id": i, "ip": ip, "free": dict(free.get(i, {})), "total": dict(total.get(i, {}))} for i, ip in alive
    ]


def _take(free: dict[str, float], resources: dict[str, float]) -> bool:
    """Subtract `resources` from `free` if they fit (with a little slack for float shares)."""
    if any(free.get(name, 0.0) + 1e-6 < amount for name, amount in resources.items() if amount > 0):
        return False
    for name, amount in resources.items():
        free[name] = free.get(name, 0.0) - amount
    return True


def place(requests: list[ResourceRequest], nodes: list[dict], of: str = "free") -> ResourceRequest | None:
    """Pack the requests, largest first, into copies of the nodes' `of` ("free" or "total") resources
    (first fit); returns the first request that does not fit, or None when all do."""
    free = {node["id"]: dict(node[of]) for node in nodes}
    order = sorted(requests, key=lambda r: -r.count * sum(r.resources.values()))
    for request in order:
        if request.one_node:
            total = {name: amount * request.count for name, amount in request.resources.items()}
            if not any(_take(free[node], total) for node in free):
                return request
            continue
        for _ in range(request.count):
            if not any(_take(free[node], request.resources) for node in free):
                return request
    return None


def describe_nodes(nodes: list[dict]) -> str:
    """One line per node: id (shortened), IP and free CPUs/GPUs."""
    return "\n".join(
        f"  node {node['id'][:12]} ({node['ip']}): {node['free'].get('CPU', 0):g} CPUs, "
        f"{node['free'].get('GPU', 0):g} GPUs free"
        for node in nodes
    )


def check_placeable(requests: list[ResourceRequest], wait_s: float = CHECK_WAIT_S) -> None:
    """Raise `UnplaceableError` when the requests cannot all be placed on the live nodes' free resources:
    at once when they would not fit even into the nodes' total resources, else after `wait_s` seconds
    (resources being released, a node joining)."""
    requests = [r for r in requests if r.count > 0]
    deadline = time.monotonic() + wait_s
    while True:
        nodes = live_nodes()
        misfit = place(requests, nodes)
        if misfit is None:
            return
        # Past the deadline, or it would not fit even into empty nodes: waiting cannot help.
        if time.monotonic() > deadline or place(requests, nodes, of="total") is not None:
            break
        time.sleep(0.5)
    asked = "\n".join(f"  {r.key}: {_describe(r)}" for r in requests)
    raise UnplaceableError(
        f"{misfit.key} asks for {_describe(misfit)}, which does not fit beside the rest of the run; the "
        f"run asks for:\n{asked}\nand the {len(nodes)} live node(s) have:\n{describe_nodes(nodes)}\n"
        "lower those keys, or add nodes"
    )


def _describe(request: ResourceRequest) -> str:  # "2 x {CPU: 1, GPU: 1} on one node"
    resources = ", ".join(f"{name}: {amount:g}" for name, amount in request.resources.items() if amount)
    return f"{request.count} x {{{resources}}}{' on one node' if request.one_node else ''}"
