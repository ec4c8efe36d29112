"""A data loader over records that shuffles with a seed per epoch and saves/restores its position exactly."""

from __future__ import annotations

from typing import Any

import torch


class StatefulDataLoader:
    """Batches of `batch_size` records, epoch after epoch; `state_dict()` resumes at the same batch."""

    def __init__(
        self, records: list[Any], batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(records) < batch_size and drop_last:
            raise ValueError(f"{len(records)} records cannot fill one batch of {batch_size}")
        self.records, self.batch_size = records, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.records), generator=generator).tolist()

    def __len__(self) -> int:
        full, rest = divmod(len(self.records), self.batch_size)
        return full if self.drop_last or not rest else full + 1

    def next_batch(self) -> list[Any]:
        """The next batch, starting a new (reshuffled) epoch when this one is used up."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        start = self.position * self.batch_size
        self.position += 1
        return [self.records[i] for i in self._order[start : start + self.batch_size]]

    def __iter__(self):
        """One epoch from the current position."""
        while self.position < len(self):
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_records": len(self.records),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("num_records", len(self.records)) != len(self.records):
            raise ValueError(
                f"loader state is for {state['num_records']} records, this loader has {len(self.records)}"
            )
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state.get("seed", self.seed)
        self._order = self._epoch_order(self.epoch)
