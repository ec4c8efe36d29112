"""A run that outlives its workers: when a worker or its whole node dies, the run's worker groups are
rebuilt (on the nodes left, or on nodes that joined) and training continues from the latest intact
checkpoint, in the same process, up to `cluster.max_restarts` times; then `RunLostError` says what was
lost and how to resume by hand."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from posttrain.distributed.virtual_cluster import ClusterResourceError
from posttrain.distributed.worker_group import WorkerDiedError, wait_until_marked_dead

logger = logging.getLogger(__name__)

RunT = TypeVar("RunT")
ResultT = TypeVar("ResultT")


class RunLostError(RuntimeError):
    """Workers died and no restart is left (or no nodes are left to rebuild them on)."""


def _stop(run: Any) -> None:
    """Shut a run down after a loss; what is already dead cannot answer, so errors are only logged."""
    try:
        run.shutdown()
    except Exception as error:  # a dead actor, a process group that cannot be left
        logger.warning("shutting down after the loss: %s", error)


def _resume_hint(cfg: Any) -> str:
    if not cfg.checkpointing.enabled:
        return "checkpointing is off, so a new run starts from step 0"
    return (
        f"run the same command again with logger.log_dir={cfg.logger.log_dir}: it resumes from the latest "
        f"intact checkpoint in {cfg.checkpointing.checkpoint_dir}"
    )


def train_with_restarts(
    cfg: Any,
    setup: Callable[[Any], RunT],
    train: Callable[[RunT], ResultT],
    max_restarts: int | None = None,
) -> tuple[RunT, ResultT]:
    """`train(setup(cfg))`, shut down at the end; when a worker dies (`WorkerDiedError`), shut the run
    down, set it up again from its own (resolved) config, which resumes from the latest intact
    checkpoint, and train on, at most `max_restarts` times (default `cfg.cluster.max_restarts`). Returns
    the last run and what `train` returned."""
    limit = cfg.cluster.max_restarts if max_restarts is None else max_restarts
    restarts, run_cfg = 0, cfg
    while True:
        run = None
        try:
            run = setup(run_cfg)
            run_cfg = run.cfg  # log and checkpoint directories resolved: a restart finds the same ones
            result = train(run)
            run.shutdown()
            return run, result
        except BaseException as raised:
            error = _loss_in(raised)
            if error is None:  # not a loss of workers: stop as any failure does
                if run is not None:
                    run.shutdown()
                raise
            if isinstance(error, WorkerDiedError) and error.lost_nodes and run_cfg is not cfg:
                # Placed again before Ray counts the node dead, workers could land on it once more (and the
                # run's shutdown may leave Ray, so wait while still connected).
                if not wait_until_marked_dead(set(error.lost_nodes)):
                    logger.warning(
                        "Ray still counts node(s) %s alive; placing the workers anyway", error.lost_nodes
                    )
            if run is not None:
                _stop(run)
            if run_cfg is cfg:
                raise  # the first start failed: nothing was lost, and trying again would fail the same way
            lost = _describe_loss(error)
            if isinstance(error, ClusterResourceError) or restarts >= limit:
                why = "no restart left" if restarts >= limit else "the workers cannot be placed again"
                raise RunLostError(
                    f"{lost}; {why} (cluster.max_restarts={limit}, {restarts} used): {_resume_hint(run_cfg)}"
                    f"\n{error}"
                ) from error
            restarts += 1
            logger.warning(
                "%s; rebuilding the workers and resuming from the latest checkpoint (restart %d of %d)",
                lost,
                restarts,
                limit,
            )
            print(f"{lost}; restart {restarts} of {limit} from the latest checkpoint", flush=True)
            checkpointing = dataclasses.replace(run_cfg.checkpointing, resume_from=None)
            run_cfg = dataclasses.replace(run_cfg, checkpointing=checkpointing)


def _loss_in(error: BaseException) -> WorkerDiedError | ClusterResourceError | None:
    """The worker death (or the failure to place workers) that `error` is or was caused by: a loss seen
    by a background thread (asynchronous GRPO's producer) reaches the loop as the error it caused."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (WorkerDiedError, ClusterResourceError)):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _describe_loss(error: Exception) -> str:
    """ "lost node(s) N (workers A, B)" from a WorkerDiedError, or the error's first line."""
    if isinstance(error, WorkerDiedError):
        nodes = ", ".join(error.lost_nodes) or "none (the worker process died)"
        workers = ", ".join(error.dead_workers) or "unknown"
        return f"lost node(s): {nodes}; lost workers: {workers}"
    return str(error).splitlines()[0]
