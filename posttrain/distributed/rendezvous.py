"""torch.distributed's rendezvous for a group that spans machines, held by a Ray actor.

torch's TCPStore would listen on every interface of rank 0's machine and answer anyone; this store is a
small Ray actor instead, so the ranks meet through Ray's own (token-authenticated) connections. Only the
collectives' sockets (gloo, NCCL) open ports, on the interface that holds each node's Ray address."""

from __future__ import annotations

import datetime
import time

import ray
import torch.distributed as dist

STORE_TIMEOUT_S = 300.0  # how long a rank waits for the others' keys
POLL_S = 0.02


class KeyValueActor:
    """The store's state: bytes by key (a Ray actor with no CPU of its own)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    def add(self, key: str, amount: int) -> int:
        total = int(self.values.get(key, b"0")) + amount
        self.values[key] = str(total).encode()
        return total

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """torch's contract: set `desired` when the key holds `expected` (or is absent and `expected` is
        empty); return what the key holds afterwards (`expected` when absent and not set)."""
        current = self.values.get(key)
        if current == expected or (current is None and expected == b""):
            self.values[key] = desired
            return desired
        return expected if current is None else current

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def delete_key(self, key: str) -> bool:
        return self.values.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self.values)


def start_store(name: str, node_id: str) -> ray.actor.ActorHandle:
    """The store actor `name`, on node `node_id` (the driver's: it outlives any worker node)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return (
        ray.remote(KeyValueActor)
        .options(
            name=name,
            num_cpus=0,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=True),
        )
        .remote()
    )


def _bytes(value: str | bytes | list[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class RayActorStore(dist.Store):
    """A `torch.distributed.Store` whose keys live in the `KeyValueActor` named `name`."""

    def __init__(self, name: str, timeout_s: float = STORE_TIMEOUT_S) -> None:
        super().__init__()
        self.actor = ray.get_actor(name)
        self.timeout_s = timeout_s

    def set(self, key: str, value: str | bytes) -> None:
        ray.get(self.actor.set.remote(key, _bytes(value)))

    def get(self, key: str) -> bytes:
        self.wait([key])
        return ray.get(self.actor.get.remote(key))

    def add(self, key: str, amount: int) -> int:
        return ray.get(self.actor.add.remote(key, amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return ray.get(self.actor.compare_set.remote(key, _bytes(expected), _bytes(desired)))

    def check(self, keys: list[str]) -> bool:
        return ray.get(self.actor.check.remote(list(keys)))

    def delete_key(self, key: str) -> bool:
        return ray.get(self.actor.delete_key.remote(key))

    def num_keys(self) -> int:
        return ray.get(self.actor.num_keys.remote())

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = timeout.total_seconds() if timeout else self.timeout_s
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous: keys {list(keys)} not set after {limit:g}s")
            time.sleep(POLL_S)
