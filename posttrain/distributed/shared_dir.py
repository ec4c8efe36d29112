"""Is a directory the same on every node? Checkpoints are written by the workers on their nodes and read
back by whichever workers a resumed run gets, so the checkpoint and log directories must be one shared
file system (NFS, a cluster file system) seen at the same path everywhere. Checked once at start: the
driver writes a marker, a task on each node reads it and writes one of its own, the driver reads those."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path

import ray

CHECK_TIMEOUT_S = 60.0


class SharedDirectoryError(RuntimeError):
    """A node does not see the run's directory as the driver does."""


def _check_on_node(directories: list[str], token: str, node_id: str) -> list[str]:
    """On one node: read the driver's marker in each directory and leave one of this node's; returns the
    problems found."""
    problems = []
    for directory in directories:
        marker = Path(directory) / f".posttrain-shared-{token}"
        try:
            if marker.read_text() != token:
                problems.append(f"{directory}: the driver's marker file has other contents here")
                continue
            (Path(directory) / f".posttrain-shared-{token}-{node_id}").write_text(node_id)
        except OSError as error:
            problems.append(f"{directory}: {error.strerror or error} ({type(error).__name__})")
    return problems


def check_shared_directories(directories: dict[str, str], node_ids: Sequence[str]) -> None:
    """Raise `SharedDirectoryError` naming the node and the config key when a node of `node_ids` cannot read
    what the driver wrote in a directory of `directories` (config key -> path) or write there itself.
    Nodes that are the driver's own are skipped."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    own = ray.get_runtime_context().get_node_id()
    others = sorted(set(node_ids) - {own})
    if not others:
        return
    token = uuid.uuid4().hex
    paths = {key: Path(path).resolve() for key, path in directories.items()}
    for path in paths.values():
        path.mkdir(parents=True, exist_ok=True)
        (path / f".posttrain-shared-{token}").write_text(token)
    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    check = ray.remote(num_cpus=0, max_retries=0)(_check_on_node)
    refs = {
        node: check.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            [str(p) for p in paths.values()], token, node
        )
        for node in others
    }
    try:
        found = dict(zip(refs, ray.get(list(refs.values()), timeout=CHECK_TIMEOUT_S)))
        missing = "the node's marker file does not appear here"
        errors = [
            f"node {node[:12]} ({ips.get(node, '?')}) cannot share {key}={path}: "
            + ("; ".join(p for p in found[node] if p.startswith(str(path))) or missing)
            for node in others
            for key, path in paths.items()
            if not (path / f".posttrain-shared-{token}-{node}").exists()
        ]
        if errors:
            raise SharedDirectoryError(
                "every node must see the run's directories at the same path (a shared file system):\n  "
                + "\n  ".join(errors)
                + "\nset logger.log_dir / checkpointing.checkpoint_dir to a directory all nodes mount"
            )
    finally:
        for path in paths.values():
            for marker in path.glob(f".posttrain-shared-{token}*"):
                marker.unlink(missing_ok=True)
