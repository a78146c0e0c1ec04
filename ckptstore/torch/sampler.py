"""A resumable, seeded sampler for a plain ``torch.utils.data.DataLoader``.

The order of epoch ``e`` is a permutation drawn from ``torch.Generator`` seeded
with ``seed + e``: reproducible in a fresh process, independent of global RNG
state. The saved position is ``(epoch, offset)``: the samples of epoch
``epoch`` that were *consumed*.

Two ways to keep that position, and which to use:

* ``num_workers=0`` (automatic): the DataLoader pulls indices batch by batch,
  so at a step boundary the indices handed out are exactly those consumed; the
  sampler counts them.
* worker processes: the loader prefetches, so the indices handed out run ahead
  of what the training loop consumed. Use :class:`~ckptstore.torch.ResumableLoader`
  (it counts batches as they reach the loop), or tell the sampler yourself:
  call :meth:`advance` with ``len(batch)`` for every batch you consume (or
  :meth:`set_position`). From the first such call the sampler is in *manual*
  mode: the saved position is what you reported, and the live iterator keeps
  its own cursor — reporting a position never rewinds it (so no sample is
  handed out twice). The next iterator starts at the reported position.

After :meth:`~ckptstore.torch.Checkpointer.resume` the sampler also undoes the
pitfall of a DataLoader without its own ``generator=``: creating the iterator
draws one number from the global torch RNG, a draw the uninterrupted run made
long before; at its first iteration after a resume the sampler puts the
restored global RNG state back (and warns if something else used the global
RNG in between, which it cannot undo).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from ..errors import InvalidInputError


class RngPitfallWarning(UserWarning):
    """The global RNG was used in a way that makes a resumed run diverge from
    the uninterrupted one (e.g. between ``resume()`` and the first batch)."""


def _after_one_draw(state: torch.Tensor) -> torch.Tensor:
    """The CPU RNG state after the one int64 draw a DataLoader iterator makes for its base seed."""
    g = torch.Generator()
    g.set_state(state)
    torch.empty((), dtype=torch.int64).random_(generator=g)
    return g.get_state()


def settle_global_rng(expected: torch.Tensor, where: str, *, epoch_start: bool = False) -> str:
    """Called at the first data iteration after a resume, with the global torch
    RNG state that resume() restored. Returns what was found:

    * ``"untouched"``: the state is still the restored one;
    * ``"undone"``: exactly one base-seed draw happened (a DataLoader without
      ``generator=`` created its iterator) where the uninterrupted run had a
      live iterator (mid-epoch); the restored state is put back;
    * ``"expected"``: that draw happened at an epoch start, where the
      uninterrupted run created a new iterator too: it is kept;
    * ``"diverged"``: something else used the global RNG; a
      :class:`RngPitfallWarning` says so (it cannot be undone).
    """
    cur = torch.get_rng_state()
    if torch.equal(cur, expected):
        return "untouched"
    if torch.equal(cur, _after_one_draw(expected)):
        if epoch_start:
            return "expected"
        torch.set_rng_state(expected)
        return "undone"
    warn_diverged(where)
    return "diverged"


def warn_diverged(where: str) -> None:
    warnings.warn(
        f"{where}: the global torch RNG was used between resume() and the first batch (other than one "
        "DataLoader base-seed draw); the resumed run will not match the uninterrupted one. Create the "
        "iterator right after resume() and draw no random numbers before the first batch.",
        RngPitfallWarning,
        stacklevel=4,
    )


class ResumableSampler(Sampler[int]):
    def __init__(self, num_samples: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples <= 0:
            raise InvalidInputError("num_samples must be positive")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        #: the saved position: epoch and samples of it consumed
        self.epoch = 0
        self.offset = 0
        self.manual = False
        #: yield ``epoch * num_samples + index`` instead of ``index`` (ResumableLoader's per-sample seeding)
        self._keyed = False
        self._live = 0  # iterators started and not finished
        self._start_pos = (0, 0)  # where the latest iterator started
        self._armed: torch.Tensor | None = None
        #: what the first iteration after a resume found (see settle_global_rng)
        self.rng_after_resume: str | None = None

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def arm_after_resume(self, global_rng: torch.Tensor) -> None:
        """Check (and where possible repair) the global RNG at the first iteration."""
        self._armed = global_rng.clone()

    @property
    def live(self) -> bool:
        """Whether an iterator has started and not finished."""
        return self._live > 0

    def __iter__(self) -> Iterator[int]:
        if self._armed is not None:
            expected, self._armed = self._armed, None
            self.rng_after_resume = settle_global_rng(expected, "ResumableSampler",
                                                      epoch_start=self.offset >= self.num_samples)
        epoch, offset = self.epoch, self.offset
        if offset >= self.num_samples:  # the saved position is the end of an epoch
            epoch, offset = epoch + 1, 0
            if not self.manual:
                self.epoch, self.offset = epoch, offset
        order = self.order(epoch)
        base = epoch * self.num_samples if self._keyed else 0
        self._start_pos = (epoch, offset)
        self._live += 1
        try:
            while offset < self.num_samples:
                i = order[offset]
                offset += 1
                if not self.manual:
                    self.epoch, self.offset = epoch, offset
                yield base + i
        finally:
            self._live -= 1
        # epoch finished: in automatic mode the next iteration starts the next epoch
        if not self.manual:
            self.epoch, self.offset = epoch + 1, 0

    def __len__(self) -> int:
        return self.num_samples - min(self.offset, self.num_samples)

    def set_position(self, epoch: int, offset: int) -> None:
        """Report the consumed position (manual mode). Never moves a live iterator."""
        if epoch < 0 or not 0 <= offset <= self.num_samples:
            raise InvalidInputError(
                f"position (epoch {epoch}, offset {offset}) outside epochs >= 0, offsets 0..{self.num_samples}"
            )
        self.manual = True
        self.epoch, self.offset = epoch, offset

    def advance(self, n: int) -> None:
        """Report ``n`` more samples consumed (manual mode); rolls into the next
        epoch when the epoch's samples are used up (``drop_last=False``)."""
        if n < 0:
            raise InvalidInputError("advance: n must be >= 0")
        if not self.manual and self._live:
            # the first report: count from where the live iterator started, not from what it handed out
            self.epoch, self.offset = self._start_pos
        epoch, offset = self.epoch, self.offset
        if offset >= self.num_samples:
            epoch, offset = epoch + 1, 0
        if offset + n > self.num_samples:
            raise InvalidInputError(
                f"advance({n}) at offset {offset} passes the end of the epoch ({self.num_samples} samples): "
                "a batch never spans two epochs; report len(batch) of each consumed batch"
            )
        self.manual = True
        self.epoch, self.offset = epoch, offset + n

    def _start(self, epoch: int, offset: int) -> None:
        """ResumableLoader: where the next iterator starts (the loader keeps the position)."""
        self.manual = True
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
        epoch, offset = state.get("epoch"), state.get("offset")
        if not isinstance(epoch, int) or not isinstance(offset, int) or epoch < 0 or not 0 <= offset <= self.num_samples:
            raise InvalidInputError(f"saved sampler position (epoch {epoch!r}, offset {offset!r}) is not valid")
        self.epoch, self.offset = epoch, offset
