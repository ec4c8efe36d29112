"""A bounded, thread-safe buffer of finished trajectories for asynchronous GRPO: the generation side puts one
step's worth of rollouts at a time, tagged with the policy version that generated them; the trainer takes them
in order and never receives a batch older than the staleness bound (those are dropped and counted)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


class BufferClosed(RuntimeError):
    """The buffer was closed (the run is stopping, or the producer failed: see `__cause__`)."""


@dataclass
class TrajectoryBatch:
    """One step's worth of finished rollouts and where they came from."""

    rollouts: Any  # BatchedDataDict of the step's groups, with `rewards`
    metrics: dict[str, float]  # rollout metrics of the batch
    index: int  # the training step the batch was produced for (1-based); its sampling seeds derive from it
    policy_version: int  # optimizer steps taken by the weights that generated it
    loader_state: dict[str, Any] = field(default_factory=dict)  # data-loader position after its prompts

    @property
    def num_trajectories(self) -> int:
        return len(self.rollouts["message_log"]) if self.rollouts is not None else 0


@dataclass
class TakeResult:
    """What `TrajectoryBuffer.take` hands the trainer: the batch and the accounting of the wait."""

    batch: TrajectoryBatch
    wait_s: float  # seconds the trainer waited for it
    num_dropped: int  # trajectories dropped as too old while looking for it
    num_buffered: int  # trajectories left in the buffer afterwards


def trajectory_age(current_version: int, policy_version: int) -> int:
    """Optimizer steps between the weights that generated a trajectory and the weights being trained."""
    return current_version - policy_version


class TrajectoryBuffer:
    """FIFO of at most `capacity` TrajectoryBatches. `put` blocks while full; `take(current_version)`
    blocks until a batch at most `max_age` versions old is there, dropping (and counting) older ones."""

    def __init__(self, capacity: int, max_age: int) -> None:
        if capacity < 1:
            raise ValueError(f"TrajectoryBuffer capacity must be >= 1, got {capacity}")
        if max_age < 0:
            raise ValueError(f"TrajectoryBuffer max_age must be >= 0, got {max_age}")
        self.capacity, self.max_age = capacity, max_age
        self._batches: deque[TrajectoryBatch] = deque()
        self._condition = threading.Condition()
        self._closed_by: BaseException | None = None
        self._closed = False

    def put(self, batch: TrajectoryBatch) -> float:
        """Append `batch`, waiting while the buffer is full; returns the seconds waited."""
        start = time.perf_counter()
        with self._condition:
            self._condition.wait_for(lambda: self._closed or len(self._batches) < self.capacity)
            self._raise_if_closed()
            self._batches.append(batch)
            self._condition.notify_all()
        return time.perf_counter() - start

    def take(self, current_version: int, timeout: float | None = None) -> TakeResult:
        """The oldest batch whose age against `current_version` is within the bound; waits for one.

        Older batches are removed and counted in `num_dropped` (they are never trained on)."""
        start, num_dropped = time.perf_counter(), 0
        with self._condition:
            while True:
                if not self._condition.wait_for(lambda: self._closed or self._batches, timeout):
                    raise TimeoutError(f"no trajectories within {timeout} s")
                if not self._batches:
                    self._raise_if_closed()
                batch = self._batches.popleft()
                self._condition.notify_all()
                if trajectory_age(current_version, batch.policy_version) <= self.max_age:
                    return TakeResult(batch, time.perf_counter() - start, num_dropped, self._num_buffered())
                num_dropped += batch.num_trajectories

    def close(self, cause: BaseException | None = None) -> None:
        """Wake every waiter; later puts raise, takes raise once the buffer is empty."""
        with self._condition:
            self._closed, self._closed_by = True, cause
            self._condition.notify_all()

    def clear(self) -> int:
        """Remove every batch; returns the number of trajectories removed."""
        with self._condition:
            removed = self._num_buffered()
            self._batches.clear()
            self._condition.notify_all()
            return removed

    @property
    def num_trajectories(self) -> int:
        with self._condition:
            return self._num_buffered()

    def __len__(self) -> int:
        with self._condition:
            return len(self._batches)

    def _num_buffered(self) -> int:
        return sum(batch.num_trajectories for batch in self._batches)

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise BufferClosed("the trajectory buffer is closed") from self._closed_by
