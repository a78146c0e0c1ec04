"""Data loaders whose position (and augmentation randomness) survives a kill.

:class:`ResumableLoader` — a DataLoader that is exact with any ``num_workers``:

* the position is counted in *batches handed to the training loop* (in the
  main process), never in indices the workers prefetched, so saving never
  rewinds or skips anything;
* random augmentation is reproducible by a seeding scheme, not by capturing
  worker RNG: before sample ``i`` of epoch ``e`` is fetched, ``random``,
  NumPy's global generator and the torch CPU generator are seeded with
  ``sample_seed(seed, e, i)``. A sample's augmentation is then a pure function
  of (seed, epoch, index) — the same with 0 or N workers, with or without a
  restart. In the main process (``num_workers=0``) the global RNG states are
  saved around the fetch, so training randomness (dropout) is untouched;
* the loader has its own generator, so creating an iterator never draws from
  the global RNG.

For torchdata's ``StatefulDataLoader`` this module has two helpers:

* :class:`WorkerRngState` wraps a map-style dataset so that each worker's RNG
  states (``random``, NumPy, torch) travel with torchdata's per-worker
  snapshots and are restored in the worker after a resume (augmentation in
  workers exact); it does nothing in the main process.
* :func:`fix_stateful_dataloader_resume` (the Checkpointer applies it): works
  around torchdata 0.11 restoring the shuffle generator to its state from
  *before* the iterator's base-seed draw, which makes the first epoch boundary
  after a resume draw another permutation (with ``num_workers=0``).
"""

from __future__ import annotations

import hashlib
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler

from ..errors import InvalidInputError
from ..shims.torch_private import hook_next_iterator
from .sampler import InexactResumeWarning, ResumableSampler, carry_position, settle_global_rng, shard_length, warn_diverged


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index`` in epoch ``epoch`` (63 bits, stable across versions)."""
    h = hashlib.blake2b(f"ckptstore-sample:{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _seed_all(s: int) -> None:
    random.seed(s)
    np.random.seed(s % (1 << 32))
    torch.manual_seed(s)


class _SeededDataset(Dataset[Any]):
    """Receives ``epoch * n + index`` keys from the loader's sampler."""

    def __init__(self, dataset: Any, n: int, seed: int) -> None:
        self.dataset, self.n, self.seed = dataset, n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: int) -> Any:
        epoch, index = divmod(int(key), self.n)
        s = sample_seed(self.seed, epoch, index)
        if get_worker_info() is not None:  # a worker's RNG serves only the data
            _seed_all(s)
            return self.dataset[index]
        saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        try:
            _seed_all(s)
            return self.dataset[index]
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            torch.set_rng_state(saved[2])


class ResumableLoader:
    """A DataLoader over a map-style dataset with an exact, saveable position.

    Register it with the Checkpointer (``{"loader": loader, ...}``); iterate it
    once per epoch (``for batch in loader``), creating the iterator after
    ``ckpt.resume()``. Other keyword arguments go to ``DataLoader``.

    Many ranks: ``num_replicas=world, rank=rank`` gives this rank the shard a
    ``DistributedSampler`` would (padded to equal length), every rank with the
    same ``seed``; each rank's position is its own. A position saved with
    another number of ranks carries over when the batches the ranks consumed
    together split evenly into whole batches on the new number (see
    :mod:`ckptstore.torch.sampler`), else loading it is refused.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        num_workers: int = 0,
        seed_samples: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        **dataloader_kw: Any,
    ) -> None:
        for k in ("sampler", "batch_sampler", "generator", "worker_init_fn"):
            if k in dataloader_kw:
                raise InvalidInputError(f"ResumableLoader chooses {k} itself (it is what makes the position exact)")
        if batch_size <= 0:
            raise InvalidInputError("batch_size must be positive")
        n = len(dataset)
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.seed_samples = seed_samples
        self.sampler = ResumableSampler(n, seed=seed, shuffle=shuffle, num_replicas=num_replicas, rank=rank)
        self.sampler.keyed = seed_samples
        self.sampler.counted_by_owner = True  # batches are counted here, as the loop receives them
        self.epoch = 0
        #: batches of ``epoch`` handed to the training loop
        self.batches = 0
        self._live = 0
        self._armed: torch.Tensor | None = None
        self.rng_after_resume: str | None = None
        ds = _SeededDataset(dataset, n, seed) if seed_samples else dataset
        self._dl: DataLoader[Any] = DataLoader(
            ds, batch_size=batch_size, sampler=self.sampler, drop_last=drop_last, num_workers=num_workers,
            collate_fn=collate_fn, generator=torch.Generator().manual_seed(seed), **dataloader_kw,
        )

    @property
    def num_workers(self) -> int:
        return int(self._dl.num_workers)

    @property
    def live(self) -> bool:
        return self._live > 0

    def arm_after_resume(self, global_rng: torch.Tensor) -> None:
        self._armed = global_rng.clone()

    def _batches_per_epoch(self, n: int | None = None) -> int:
        n = self.sampler.length if n is None else n
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __len__(self) -> int:
        return max(0, self._batches_per_epoch() - self.batches)

    def __iter__(self) -> Iterator[Any]:
        if self._armed is not None:
            expected, self._armed = self._armed, None
            self.rng_after_resume = settle_global_rng(expected, "ResumableLoader")
        if self.batches >= self._batches_per_epoch():
            self.epoch, self.batches = self.epoch + 1, 0
        self.sampler.start_at(self.epoch, min(self.batches * self.batch_size, self.sampler.length))
        self._live += 1
        try:
            for batch in self._dl:
                self.batches += 1  # counted when the training loop receives it
                yield batch
        finally:
            self._live -= 1
        self.epoch, self.batches = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batches": self.batches,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "seed_samples": self.seed_samples,
            "sampler": self.sampler.state_dict() | {"epoch": 0, "offset": 0},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("batch_size", "drop_last", "seed_samples"):
            if state.get(k) != getattr(self, k):
                raise InvalidInputError(
                    f"loader {k} differs: saved {state.get(k)!r}, this loader {getattr(self, k)!r} "
                    "(a different batching or augmentation scheme is a different experiment)"
                )
        sst = state["sampler"]
        self.sampler.load_state_dict(sst)
        epoch, batches = state.get("epoch"), state.get("batches")
        if not isinstance(epoch, int) or not isinstance(batches, int) or epoch < 0 or batches < 0:
            raise InvalidInputError(f"saved loader position (epoch {epoch!r}, batches {batches!r}) is not valid")
        replicas = sst.get("num_replicas", 1) if isinstance(sst, dict) else 1
        if replicas != self.sampler.num_replicas:  # checked by the sampler's load: a positive int
            saved_len = shard_length(self.sampler.num_samples, replicas, bool(sst.get("drop_last", False)))
            saved_bpe = self._batches_per_epoch(saved_len)
            if batches >= saved_bpe:
                batches = self._batches_per_epoch()  # a finished epoch stays finished
            else:
                batches = carry_position(
                    batches * self.batch_size, saved_len, self.sampler.length, replicas, self.sampler.num_replicas,
                    saved_rank=0, rank=0, same_cut=True, unit=self.batch_size,
                ) // self.batch_size
        self.epoch, self.batches = epoch, batches


# ------------------------------------------------------------------ torchdata


class WorkerRngState(Dataset[Any]):
    """Wrap a map-style dataset given to torchdata's ``StatefulDataLoader`` with
    workers: each worker's ``random``, NumPy and torch RNG states are part of
    the worker's snapshot and restored in that worker after a resume. In the
    main process (``num_workers=0``) it saves nothing: there the global RNG is
    the training RNG, which the Checkpointer saves itself."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def state_dict(self) -> dict[str, Any]:
        if get_worker_info() is None:
            return {}
        st: Any = np.random.get_state()
        version, internal, gauss = random.getstate()
        return {
            "python": [*internal, version],
            "python_gauss": gauss,
            "numpy": [st[0], st[1].tolist(), int(st[2]), int(st[3]), float(st[4])],
            "torch": torch.get_rng_state().tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if get_worker_info() is None or not state:
            return
        py = state["python"]
        random.setstate((int(py[-1]), tuple(int(v) for v in py[:-1]), state["python_gauss"]))
        npst = state["numpy"]
        np.random.set_state((str(npst[0]), np.array(npst[1], dtype=np.uint32), int(npst[2]), int(npst[3]),
                             float(npst[4])))
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def is_stateful_dataloader(obj: Any) -> bool:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:  # pragma: no cover - torchdata is optional
        return False
    return isinstance(obj, StatefulDataLoader)


def loader_generators(loader: Any) -> dict[str, torch.Generator]:
    """The generators whose state decides a StatefulDataLoader's next shuffle:
    its own and its sampler's (torchdata's RandomSampler without replacement)."""
    out: dict[str, torch.Generator] = {}
    g = getattr(loader, "generator", None)
    if isinstance(g, torch.Generator):
        out["loader"] = g
    s = getattr(loader, "sampler", None)
    sg = getattr(s, "generator", None)
    if isinstance(sg, torch.Generator) and sg is not g and not getattr(s, "replacement", False):
        out["sampler"] = sg
    return out


def shuffle_uses_replacement(loader: Any) -> bool:
    return bool(getattr(getattr(loader, "sampler", None), "replacement", False))


def fix_stateful_dataloader_resume(
    loader: Any, generator_states: dict[str, torch.Tensor], global_rng: torch.Tensor | None
) -> None:
    """After ``loader.load_state_dict``: at the loader's next iterator creation
    (where torchdata applies the restored state), put the shuffle generators
    back to their state at save time — torchdata restores them to their state
    from before the epoch's base-seed draw — and undo any draw the iterator
    creation made from the global RNG. One shot; the hook removes itself."""
    gens = loader_generators(loader)

    def first_iterator(original: Callable[[], Any]) -> Any:
        before = torch.get_rng_state()
        it = original()
        for k, st in generator_states.items():
            if k in gens:
                gens[k].set_state(st)
        if global_rng is not None:
            if torch.equal(before, global_rng):
                torch.set_rng_state(before)  # the uninterrupted run made no draw here: undo this one's
            else:
                warn_diverged("StatefulDataLoader")
        return it

    hook_next_iterator(loader, first_iterator)


def live_iterator_problem(name: str, obj: Any) -> str | None:
    """Why restoring ``obj`` now would silently lose the data position, if it would."""
    if isinstance(obj, (ResumableSampler, ResumableLoader)) and obj.live:
        return (f"{name}: an iterator over it is already running; its position cannot be changed any more. "
                "Call resume() before creating the DataLoader iterator (before `for batch in loader`).")
    if is_stateful_dataloader(obj) and getattr(obj, "_iterator", None) is not None and not getattr(
        obj, "_initial_iter_for_state_dict", False
    ):
        return (f"{name}: the StatefulDataLoader already has an iterator; the restored position would apply only "
                "to the next one and the live one would start from the beginning. Call resume() before iter(loader).")
    return None


def plain_loader_problem(name: str, obj: Any) -> str | None:
    """A registered object the Checkpointer cannot save exactly, with the fix."""
    fix = ("Use ckptstore.torch.ResumableSampler(len(dataset), num_replicas=world_size, rank=rank, seed=seed) in its "
           "place (the same partition, an exact saved position; register it, num_workers=0), or "
           "ckptstore.torch.ResumableLoader(dataset, batch_size=..., num_replicas=world_size, rank=rank) (any "
           "num_workers).")
    if isinstance(obj, DistributedSampler):
        return (f"{name}: torch's DistributedSampler has no state_dict(): its epoch and position in the epoch "
                f"cannot be saved. {fix}")
    if isinstance(obj, DataLoader) and isinstance(getattr(obj, "sampler", None), DistributedSampler):
        return (f"{name}: a torch DataLoader over a DistributedSampler has no state_dict(), and neither has the "
                f"sampler: the data position cannot be saved. {fix}")
    if isinstance(obj, DataLoader) and not hasattr(obj, "state_dict"):
        sampler = getattr(obj, "sampler", None)
        hint = (f"register its sampler instead ({name!r}: loader.sampler) and keep num_workers=0, or "
                if isinstance(sampler, ResumableSampler) else "")
        return (f"{name}: a torch DataLoader has no state_dict(); its position cannot be saved. Use {hint}"
                "ckptstore.torch.ResumableLoader, or torchdata's StatefulDataLoader.")
    return None


def inexact_resume_problems(name: str, obj: Any) -> list[str]:
    """Why resuming a registered loader would not match the uninterrupted run, each with its one-line fix
    (the set-ups the Checkpointer cannot make exact itself)."""
    if not is_stateful_dataloader(obj):
        return []
    out: list[str] = []
    workers = int(getattr(obj, "num_workers", 0) or 0)
    dataset = getattr(obj, "dataset", None)
    if workers > 0 and not isinstance(dataset, (WorkerRngState, IterableDataset)):
        out.append(
            f"{name}: a StatefulDataLoader with num_workers={workers} over a dataset without WorkerRngState: the "
            "workers' random, NumPy and torch RNG states are not in its state, so random augmentation in "
            "Dataset.__getitem__ differs after a resume. Fix: StatefulDataLoader(ckptstore.torch.WorkerRngState("
            "dataset), ...) (or ckptstore.torch.ResumableLoader); a dataset that draws no random numbers needs no "
            "fix."
        )
    if workers > 0 and getattr(obj, "persistent_workers", False):
        out.append(
            f"{name}: a StatefulDataLoader with persistent_workers=True keeps its workers, and their RNG, "
            "across epochs; an exact resume is not covered for it. Fix: persistent_workers=False (or "
            "ckptstore.torch.ResumableLoader, exact with persistent workers)."
        )
    if shuffle_uses_replacement(obj):
        out.append(
            f"{name}: a sampler drawing with replacement uses its generator during the epoch; an exact resume is "
            "not covered for it. Fix: shuffle=True without replacement, or ckptstore.torch.ResumableLoader."
        )
    return out


def warn_inexact_resume(name: str, obj: Any) -> None:
    """Warn (:class:`InexactResumeWarning`, at the Checkpointer's caller) for each of
    :func:`inexact_resume_problems`."""
    for problem in inexact_resume_problems(name, obj):
        warnings.warn(problem, InexactResumeWarning, stacklevel=4)
