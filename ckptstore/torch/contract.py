"""What the :class:`~ckptstore.torch.Checkpointer` needs from a store: one typed contract.

Two stores implement it: :class:`~ckptstore.CheckpointStore` (one process is
its own job) and :class:`ckptstore.distributed.RankStore` (one rank's view of
a job of many ranks, whose saves, preemption and resume fallback are
collective). The Checkpointer and its helpers (:mod:`.state`, :mod:`.restore`,
:mod:`.tensor_read`) call only these members, so ``mypy --strict`` checks both
stores against it and nothing is probed at run time. A third store (a
wrapper, a test double) implements the same members.

The members that exist for many ranks have a one-process meaning on
:class:`~ckptstore.CheckpointStore`: :meth:`agree_preemption` returns the
flag it is given, :meth:`alert` does nothing and :meth:`abandon` answers
False (no peer to wait for), :meth:`read_resume_point` is the one-process corrupt-resume-point
fallback, :meth:`make_durable` is True at once without a local tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol, TypeVar

from .. import ComponentEntry, GcReport, SaveRef
from ..protocol import AttemptRecord

T = TypeVar("T")

__all__ = ["CheckpointerStore", "OpenSave", "SaveContext"]


class OpenSave(Protocol):
    """A save being written (inside its ``with`` block)."""

    def put(self, name: str, data: Any) -> ComponentEntry:
        """Write one component (hashed while written)."""
        ...

    def put_many(self, items: Sequence[tuple[str, Any]]) -> dict[str, ComponentEntry]:
        """Write several components, made durable together (one settle: on the
        local disk one directory fsync for all of them)."""
        ...

    @property
    def ref(self) -> SaveRef | None:
        """The published save once the block exited cleanly, else None."""
        ...


class SaveContext(Protocol):
    """What ``store.save(step)`` returns: leaving the block publishes (or, on an exception, aborts)."""

    def __enter__(self) -> OpenSave: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None: ...


class CheckpointerStore(Protocol):
    """The store a :class:`~ckptstore.torch.Checkpointer` saves to and resumes from."""

    @property
    def mode(self) -> str:
        """``"w"``: opened for writing (the Checkpointer refuses anything else)."""
        ...

    @property
    def run_id(self) -> str: ...

    @property
    def attempt(self) -> AttemptRecord | None:
        """The attempt this writer belongs to (its number counts restarts in the metrics)."""
        ...

    @property
    def resumed_from(self) -> SaveRef | None:
        """The save this attempt resumes from, None on a fresh start."""
        ...

    @property
    def tiered(self) -> bool:
        """Whether saves land in a local tier first (:meth:`make_durable` then waits for the durable one)."""
        ...

    def save(
        self, step: int, *, metadata: Mapping[str, Any] | None = None, expect: list[str] | None = None
    ) -> SaveContext:
        """Begin a save of ``step`` (on many ranks: collective)."""
        ...

    def read(self, ref: SaveRef, name: str) -> bytes: ...

    def iter_read(self, ref: SaveRef, name: str, chunk: int = ...) -> Iterator[bytes]: ...

    def component(self, ref: SaveRef, name: str) -> ComponentEntry: ...

    def read_into(self, ref: SaveRef, name: str, out: Any) -> None:
        """Fill ``out`` (one writable buffer, or a list of them: a scatter
        read) with the component, verified (:meth:`CheckpointStore.read_into`)."""
        ...

    def read_range(self, ref: SaveRef, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a component, **not** verified: the restore
        reads a header with it to shape the memory of a verified read, and
        trusts nothing of it before that read's digest matched."""
        ...

    def read_resume_point(
        self, ref: SaveRef, read: Callable[[SaveRef], T], check: Callable[[T, SaveRef], None] | None = None
    ) -> tuple[T, SaveRef]:
        """Read the resume point with ``read``; when its bytes are corrupt, fall
        back to the newest older save that reads back intact (registered as a
        new attempt, recorded). ``check`` runs on what was read; its error is
        raised, never a reason to fall back."""
        ...

    def record_event(self, kind: str, payload: Mapping[str, Any]) -> str: ...

    def events(self) -> list[dict[str, Any]]:
        """The run's ledger, oldest first."""
        ...

    def gc(
        self, *, keep_last: int = ..., keep_every: int | None = ..., grace_seconds: float = ...,
        dry_run: bool = ..., deep: bool = ..., incremental: bool = ...,
    ) -> GcReport | None:
        """Retention (None where another process decides it, e.g. a member rank)."""
        ...

    def make_durable(self, timeout: float | None = None) -> bool: ...

    def agree_preemption(self, flag: bool) -> bool:
        """The job's preemption flag from this process's ``flag`` (on many ranks: collective)."""
        ...

    def alert(self) -> None:
        """A termination signal arrived (on many ranks: give up on silent peers within seconds)."""
        ...

    def abandon(self) -> bool:
        """This process is leaving: end every wait for other ranks. True when this
        store's saves wait for other ranks (then a save in flight at exit is
        abandoned and waited for briefly, :mod:`.inflight`); False for one
        process (its saves depend on the storage only and are waited for)."""
        ...
