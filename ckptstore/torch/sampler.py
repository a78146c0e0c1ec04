"""A resumable, seeded sampler for a plain ``torch.utils.data.DataLoader``.

The order of epoch ``e`` is a permutation drawn from ``torch.Generator`` seeded
with ``seed + e``: reproducible in a fresh process, independent of global RNG
state. The position is ``(epoch, offset)``: ``offset`` counts the indices the
sampler has handed out in this epoch. With ``num_workers=0`` the DataLoader
pulls indices batch by batch, so at a step boundary ``offset`` is exactly the
number of samples consumed. With worker processes the loader prefetches; then
call :meth:`set_position` with the consumed count before saving, or use
torchdata's ``StatefulDataLoader``, which tracks it for you.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from ..errors import InvalidInputError


class ResumableSampler(Sampler[int]):
    def __init__(self, num_samples: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples <= 0:
            raise InvalidInputError("num_samples must be positive")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.epoch)
        while self.offset < self.num_samples:
            i = order[self.offset]
            self.offset += 1
            yield i
        # epoch finished: the next iteration starts the next epoch
        self.epoch += 1
        self.offset = 0

    def __len__(self) -> int:
        return self.num_samples - self.offset

    def set_position(self, epoch: int, offset: int) -> None:
        if not 0 <= offset <= self.num_samples:
            raise InvalidInputError(f"offset {offset} outside 0..{self.num_samples}")
        self.epoch, self.offset = epoch, offset

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "offset": self.offset,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("num_samples", "seed", "shuffle"):
            if state.get(k) != getattr(self, k):
                raise InvalidInputError(
                    f"sampler {k} differs: saved {state.get(k)!r}, this sampler {getattr(self, k)!r} "
                    "(a different data set or order is a different experiment)"
                )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
