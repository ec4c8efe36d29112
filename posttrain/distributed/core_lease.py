"""Core lending between the trainer and the generator of an asynchronous run on one machine: the side
that waits lends its CPU threads to the side that works.

A `CoreLease` actor holds which side may use the other's threads now: "trainer", "generator" or
nobody (None). The asynchronous rollout producer sets it as its state changes (generation finished and
the next batch's weights not yet published: the trainer; validation, during which the trainer waits:
the generator; a batch being generated: nobody). Each worker reads it at its own boundaries (a policy
worker before every micro-batch, a generation worker before every generate call) and sets torch's
intra-op threads to its own count, plus the lent ones while its side holds the lease.

Departure from a fixed split: the thread counts follow timing, and a float reduction's result can
depend on the thread count, so a run that lends cores is not bitwise reproducible; lending is opt-in
(`grpo.async_grpo.lend_idle_cores`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import torch

TRAINER, GENERATOR = "trainer", "generator"


@ray.remote(num_cpus=0)
class CoreLease:
    """Which side holds the lease: "trainer", "generator" or None."""

    def __init__(self) -> None:
        self.holder: str | None = None

    def set(self, holder: str | None) -> None:
        self.holder = holder

    def get(self) -> str | None:
        return self.holder


class LeasedThreads:
    """A worker's side of the lease: `own` threads (torch's count when made), `own + lent` while `side`
    holds the lease."""

    def __init__(self, lease: Any, side: str, lent: int) -> None:
        self.lease, self.side, self.lent = lease, side, lent
        self.own = torch.get_num_threads()

    def adjust(self) -> int:
        """Read the lease and set torch's thread count to match; returns the count."""
        holder = ray.get(self.lease.get.remote())
        threads = self.own + (self.lent if holder == self.side else 0)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads


def lent_threads(borrowers: int, lenders: int, lender_threads: int) -> int:
    """Threads each of `borrowers` workers gets from `lenders` workers of `lender_threads` each (all the
    lenders' threads shared evenly, rounded down)."""
    return lenders * lender_threads // borrowers


def lend_cores(
    trainer_group: Any, generator_group: Any, generation_backend: str
) -> Callable[[str | None], None] | None:
    """Connect both worker groups to a new `CoreLease` and return the setter of its holder; None (and a
    line saying why) when the generation backend is not hf, or the groups do not all run on one node,
    where there is nothing to lend."""
    nodes = {info["node_id"] for group in (trainer_group, generator_group) for info in group.info}
    not_lent = (
        f"the {generation_backend} generation backend sets its own threads"
        if generation_backend != "hf"
        else f"trainer and generator run on {len(nodes)} nodes, not one"
        if len(nodes) > 1
        else None
    )
    if not_lent:
        print(f"grpo.async_grpo.lend_idle_cores: {not_lent}: no cores are lent", flush=True)
        return None
    lease = CoreLease.remote()
    trainers, generators = trainer_group.world_size, generator_group.world_size
    to_trainer = lent_threads(trainers, generators, int(generator_group.env_vars[0]["OMP_NUM_THREADS"]))
    to_generator = lent_threads(generators, trainers, int(trainer_group.env_vars[0]["OMP_NUM_THREADS"]))
    trainer_group.run_all("set_core_lease", lease=lease, side=TRAINER, lent=to_trainer)
    generator_group.run_all("set_core_lease", lease=lease, side=GENERATOR, lent=to_generator)
    print(
        f"grpo.async_grpo.lend_idle_cores: each trainer worker borrows {to_trainer} thread(s) while the "
        f"generator waits, each generator worker {to_generator} during validation",
        flush=True,
    )
    return lambda holder: lease.set.remote(holder)
