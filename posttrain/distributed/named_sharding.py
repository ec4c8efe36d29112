"""`NamedSharding`: an N-d array of worker ranks with named axes (`dp`, `tp`, `pp`, `cp`)."""

from __future__ import annotations

from typing import Any

import numpy as np


class NamedSharding:
    """Ranks laid out on named axes, e.g. `NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])`."""

    def __init__(self, layout: Any, names: list[str]):
        values = np.asarray(layout, dtype=object)  # each rank as given: 1.5 or "1" is refused, never cast
        integral = (isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values.flatten())
        bad = [v for v, ok in zip(values.flatten().tolist(), integral) if not ok]
        if bad:
            raise ValueError(f"layout ranks must be integers, got {bad[0]!r} in {values.tolist()}")
        self.layout = values.astype(int)
        self.names = list(names)
        if self.layout.ndim != len(self.names):
            raise ValueError(
                f"layout has {self.layout.ndim} dimensions but {len(self.names)} names {self.names}"
            )
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"axis names must be unique, got {self.names}")
        ranks = sorted(self.layout.flatten().tolist())
        if ranks != list(range(len(ranks))):
            raise ValueError(f"layout must hold each rank 0..{len(ranks) - 1} once, got {ranks}")

    @classmethod
    def data_parallel(cls, num_workers: int) -> NamedSharding:
        return cls(np.arange(num_workers), ["dp"])

    @property
    def size(self) -> int:
        return int(self.layout.size)

    def get_axis_size(self, name: str) -> int:
        if name not in self.names:
            raise ValueError(f"unknown axis {name!r}; axes are {self.names}")
        return int(self.layout.shape[self.names.index(name)])

    def get_worker_coords(self, rank: int) -> dict[str, int]:
        positions = np.argwhere(self.layout == rank)
        if len(positions) == 0:
            raise IndexError(
                f"rank {rank} is not in this sharding (ranks {sorted(self.layout.flatten().tolist())})"
            )
        return {name: int(value) for name, value in zip(self.names, positions[0])}

    def __repr__(self) -> str:
        return f"NamedSharding({self.layout.tolist()}, {self.names})"
