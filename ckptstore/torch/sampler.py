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

Many ranks (``num_replicas``, ``rank``): rank ``r`` of ``R`` gets exactly the
indices ``torch.utils.data.DistributedSampler`` gives it (the epoch's
permutation, padded by repeating its start to a multiple of ``R`` — or cut,
``drop_last=True`` — then every ``R``-th index from ``r``), so it replaces a
``DistributedSampler`` one for one; the epoch advances by itself (there is no
``set_epoch``: read ``sampler.epoch``). Each rank saves its own position.
A position saved with another number of ranks carries over when it can be
exact: the ranks consumed the first ``offset * R`` positions of the epoch's
order together, so on ``R'`` ranks each resumes at ``offset * R / R'`` when that
divides evenly (a finished epoch stays finished); otherwise loading it is
refused (:class:`InvalidInputError`), never rounded.

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
from ..shims.torch_private import feeding_worker_processes


class RngPitfallWarning(UserWarning):
    """The global RNG was used in a way that makes a resumed run diverge from
    the uninterrupted one (e.g. between ``resume()`` and the first batch)."""


class InexactResumeWarning(RngPitfallWarning):
    """A data-loading set-up whose resume would not match the uninterrupted run
    (the position or the workers' randomness is not what is saved); the message
    names the one-line fix. ``warnings.simplefilter("error", InexactResumeWarning)``
    makes it a refusal."""


#: what :class:`ResumableSampler` says when a DataLoader with worker processes reads it
WORKERS_READ_SAMPLER = (
    "ResumableSampler is read by a DataLoader with worker processes (num_workers > 0): {what} "
    "Fix: ckptstore.torch.ResumableLoader(dataset, batch_size=..., num_workers=...) in place of "
    "DataLoader(dataset, sampler=ResumableSampler(...)) (its position counts the batches trained on and each "
    "sample's augmentation is seeded by (seed, epoch, index)), or num_workers=0."
)


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


def shard_length(num_samples: int, num_replicas: int, drop_last: bool) -> int:
    """Samples per epoch of each of ``num_replicas`` ranks (DistributedSampler's ``num_samples``)."""
    if drop_last and num_samples % num_replicas:
        return -(-(num_samples - num_replicas) // num_replicas)
    return -(-num_samples // num_replicas)


class ResumableSampler(Sampler[int]):
    """Seeded, resumable sampling of ``num_samples`` indices (see the module
    docstring); with ``num_replicas``/``rank``, this rank's shard, as
    DistributedSampler partitions it."""

    def __init__(
        self, num_samples: int, *, seed: int = 0, shuffle: bool = True, num_replicas: int = 1, rank: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_samples <= 0:
            raise InvalidInputError("num_samples must be positive")
        if type(num_replicas) is not int or num_replicas < 1:
            raise InvalidInputError("num_replicas must be a positive integer (the number of ranks sharing the data)")
        if type(rank) is not int or not 0 <= rank < num_replicas:
            raise InvalidInputError(f"rank must be in 0..{num_replicas - 1}, got {rank!r}")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = bool(drop_last)
        #: samples of each epoch on this rank (``num_samples`` on one rank)
        self.length = shard_length(num_samples, num_replicas, self.drop_last)
        if self.length <= 0:
            raise InvalidInputError(
                f"{num_samples} samples cannot be sharded over {num_replicas} ranks with drop_last=True"
            )
        #: the saved position: epoch and samples of it consumed
        self.epoch = 0
        self.offset = 0
        self.manual = False
        #: yield ``epoch * num_samples + index`` instead of ``index`` (ResumableLoader's per-sample seeding)
        self.keyed = False
        self._live = 0  # iterators started and not finished
        self._start_pos = (0, 0)  # where the latest iterator started
        self._armed: torch.Tensor | None = None
        #: what the first iteration after a resume found (see settle_global_rng)
        self.rng_after_resume: str | None = None
        #: the position is counted by the loader that owns this sampler (ResumableLoader): workers are fine
        self.counted_by_owner = False
        self._warned_workers = False

    def order(self, epoch: int) -> list[int]:
        """This rank's indices of epoch ``epoch``, in order (DistributedSampler's)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            indices: list[int] = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            indices = list(range(self.num_samples))
        if self.num_replicas == 1:
            return indices
        total = self.length * self.num_replicas
        while len(indices) < total:  # padded by repeating the start (drop_last=False)
            indices += indices[: total - len(indices)]
        return indices[self.rank:total:self.num_replicas]

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
                                                      epoch_start=self.offset >= self.length)
        epoch, offset = self.epoch, self.offset
        if offset >= self.length:  # the saved position is the end of an epoch
            epoch, offset = epoch + 1, 0
            if not self.manual:
                self.epoch, self.offset = epoch, offset
        order = self.order(epoch)
        base = epoch * self.num_samples if self.keyed else 0
        self._start_pos = (epoch, offset)
        self._live += 1
        try:
            if not self.counted_by_owner and not self._warned_workers and feeding_worker_processes():
                self._warned_workers = True
                what = ("the randomness drawn in the workers (augmentation in Dataset.__getitem__) is not saved, so "
                        "a resumed run draws other augmentations." if self.manual else
                        "the loader prefetches, so the position saved counts indices handed to the workers, ahead "
                        "of the batches trained on (a resume skips them), and the workers' randomness is not saved.")
                warnings.warn(WORKERS_READ_SAMPLER.format(what=what), InexactResumeWarning, stacklevel=4)
            while offset < self.length:
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
        return self.length - min(self.offset, self.length)

    def set_position(self, epoch: int, offset: int) -> None:
        """Report the consumed position (manual mode). Never moves a live iterator."""
        if epoch < 0 or not 0 <= offset <= self.length:
            raise InvalidInputError(
                f"position (epoch {epoch}, offset {offset}) outside epochs >= 0, offsets 0..{self.length}"
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
        if offset >= self.length:
            epoch, offset = epoch + 1, 0
        if offset + n > self.length:
            raise InvalidInputError(
                f"advance({n}) at offset {offset} passes the end of the epoch ({self.length} samples): "
                "a batch never spans two epochs; report len(batch) of each consumed batch"
            )
        self.manual = True
        self.epoch, self.offset = epoch, offset + n

    def start_at(self, epoch: int, offset: int) -> None:
        """Where the next iterator starts, set by an owner that keeps the
        position itself (``ResumableLoader``); from then on the sampler stops
        advancing its own position (``manual``)."""
        self.manual = True
        self.epoch, self.offset = epoch, offset

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "offset": self.offset,
        }
        if self.num_replicas != 1:  # one rank keeps the layout of earlier releases
            out.update(num_replicas=self.num_replicas, rank=self.rank, drop_last=self.drop_last)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("num_samples", "seed", "shuffle"):
            if state.get(k) != getattr(self, k):
                raise InvalidInputError(
                    f"sampler {k} differs: saved {state.get(k)!r}, this sampler {getattr(self, k)!r} "
                    "(a different data set or order is a different experiment)"
                )
        replicas, rank, drop_last = state.get("num_replicas", 1), state.get("rank", 0), state.get("drop_last", False)
        if type(replicas) is not int or replicas < 1 or type(rank) is not int or not 0 <= rank < replicas \
                or type(drop_last) is not bool:
            raise InvalidInputError(
                f"saved sampler sharding (num_replicas {replicas!r}, rank {rank!r}, drop_last {drop_last!r}) is not valid"
            )
        saved_len = shard_length(self.num_samples, replicas, drop_last)
        epoch, offset = state.get("epoch"), state.get("offset")
        if type(epoch) is not int or type(offset) is not int or epoch < 0 or not 0 <= offset <= saved_len:
            raise InvalidInputError(f"saved sampler position (epoch {epoch!r}, offset {offset!r}) is not valid")
        self.epoch, self.offset = epoch, carry_position(
            offset, saved_len, self.length, replicas, self.num_replicas, saved_rank=rank, rank=self.rank,
            same_cut=drop_last == self.drop_last, unit=1,
        )


def carry_position(
    offset: int, saved_len: int, length: int, saved_replicas: int, replicas: int, *, saved_rank: int, rank: int,
    same_cut: bool, unit: int,
) -> int:
    """This rank's offset in the epoch for a position saved as ``offset`` (of
    ``saved_len``) by rank ``saved_rank`` of ``saved_replicas``. The same world
    size: the same rank's position, as saved. Another world size: the ranks
    consumed the first ``offset * saved_replicas`` positions of the epoch's
    order together; each of ``replicas`` ranks resumes at that number divided
    by ``replicas`` when it divides evenly into whole ``unit`` s (1 sample, or
    one batch of the loader); a finished epoch stays finished. Anything else is
    refused: never rounded (that would repeat or skip samples)."""
    if saved_replicas == replicas:
        if saved_rank != rank:
            raise InvalidInputError(
                f"this position was saved by rank {saved_rank}, this sampler is rank {rank} of {replicas}: each rank "
                "restores its own position (a save's rank<r>/ state belongs to rank r)"
            )
        if not same_cut:
            raise InvalidInputError("sampler drop_last differs from the saved one (a different shard layout)")
        return offset
    if offset >= saved_len:
        return length  # the epoch was finished: the next one starts fresh on the new world size
    consumed = offset * saved_replicas
    if consumed % (replicas * unit) or consumed // replicas > length:
        raise InvalidInputError(
            f"the data position was saved on {saved_replicas} ranks ({offset} samples each, {consumed} of the epoch "
            f"in all); {consumed} does not split into whole {'batches' if unit > 1 else 'samples'} over {replicas} "
            "ranks, so it cannot carry over exactly. Resume with the saved world size, or at an epoch boundary"
        )
    return consumed // replicas
