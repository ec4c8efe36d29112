"""`NamedSharding`: an N-d array of worker ranks with named axes (`dp`, `tp`, `pp`, `cp`)."""

from __future__ import annotations

from typing import Any

import numpy as np


class NamedSharding:
    """Ranks laid out on named axes, e.g. `NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])`."""

    def __init__(self, layout: Any, names: list[str]):
        self.layout = np.asarray(layout, dtype=int)
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
    def shape(self) -> dict[str, int]:
        return dict(zip(self.names, self.layout.shape))

    @property
    def ndim(self) -> int:
        return len(self.names)

    @property
    def size(self) -> int:
        return int(self.layout.size)

    def get_axis_size(self, name: str) -> int:
        return int(self.layout.shape[self._axis(name)])

    def _axis(self, name: str) -> int:
        if name not in self.names:
            raise ValueError(f"unknown axis {name!r}; axes are {self.names}")
        return self.names.index(name)

    def _index(self, coords: dict[str, int]) -> tuple:
        index: list[Any] = [slice(None)] * self.ndim
        for name, value in coords.items():
            axis = self._axis(name)
            size = self.layout.shape[axis]
            if not 0 <= value < size:
                raise IndexError(
                    f"index {value} out of bounds for axis {name!r} of size {size} (valid 0..{size - 1})"
                )
            index[axis] = value
        return tuple(index)

    def get_ranks(self, **coords: int) -> int | NamedSharding:
        """The rank at full coordinates, or the sub-sharding over the axes left free."""
        selected = self.layout[self._index(coords)]
        if np.ndim(selected) == 0:
            return int(selected)
        free = [name for name in self.names if name not in coords]
        return NamedSharding._unchecked(selected, free)

    @classmethod
    def _unchecked(cls, layout: np.ndarray, names: list[str]) -> NamedSharding:
        sharding = cls.__new__(cls)
        sharding.layout, sharding.names = np.asarray(layout, dtype=int), list(names)
        return sharding

    def get_ranks_by_coord(self, **coords: int) -> list[int]:
        """All ranks whose coordinates match `coords` (other axes free), sorted."""
        return sorted(np.asarray(self.layout[self._index(coords)]).flatten().tolist())

    def get_worker_coords(self, rank: int) -> dict[str, int]:
        positions = np.argwhere(self.layout == rank)
        if len(positions) == 0:
            raise IndexError(
                f"rank {rank} is not in this sharding (ranks {sorted(self.layout.flatten().tolist())})"
            )
        return {name: int(value) for name, value in zip(self.names, positions[0])}

    def __repr__(self) -> str:
        return f"NamedSharding(shape={self.shape}, layout={self.layout.tolist()})"
