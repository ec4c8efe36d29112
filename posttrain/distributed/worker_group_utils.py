"""Per-worker options of a `RayWorkerGroup` merged in one place: the torch.distributed environment each
rank needs, the thread counts, and the caller's extra env vars, which may add but never rewire a rank."""

from __future__ import annotations

from collections.abc import Mapping

# Set by the group for torch.distributed; a caller that overrides one would break the process group.
RESERVED_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def merge_env_vars(
    base: Mapping[str, str], extra: Mapping[str, str] | None, reserved: tuple[str, ...] = ()
) -> dict[str, str]:
    """`base` updated with `extra` (values as strings); a key of `extra` in `reserved` raises, naming it."""
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(reserved))
    if clash:
        raise ValueError(f"env_vars {clash} are set by the worker group for torch.distributed; remove them")
    return {**base, **{key: str(value) for key, value in extra.items()}}


def rank_env_vars(
    rank: int,
    world_size: int,
    workers_per_node: int,
    master_addr: str,
    master_port: int,
    num_threads: int,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of worker `rank`: its place in the group (global, local and node rank), the
    rendezvous address, OMP/MKL threads (overridable) and the caller's `extra` variables."""
    base = {
        "OMP_NUM_THREADS": str(num_threads),
        "MKL_NUM_THREADS": str(num_threads),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % workers_per_node),
        "NODE_RANK": str(rank // workers_per_node),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }
    return merge_env_vars(base, extra, RESERVED_ENV_VARS)
