"""One tier: the placement of a store whose saves live in its backend alone.

:class:`~ckptstore.CheckpointStore` delegates everything that depends on where
saves live to a *placement* (the interface is :class:`ckptstore.placement.Placement`):
this one, or :class:`ckptstore.tiers.tiered.TierSet` (a local tier in front of
this one, which it wraps as its durable tier). The facade holds no branch on
which it has; a new placement (a peer tier) is a third implementation.

This placement is also what every other one is built on: the durable tier's
I/O, attempts, ledger, catalog and reader, and the writer context of a save.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from ..errors import InvalidInputError
from ..protocol import AttemptRecord, CommitRecord, ComponentEntry
from ..protocol.selection import SaveInfo, SaveRef, Selection
from .bounded_io import RunIO
from .catalog import Catalog
from .collector import GcReport
from .fencing import AttemptLog, AttemptView
from .intents import PieceTiming
from .ledger import Ledger
from .piece_deadlines import PieceDeadline
from .pieces import PieceWriter
from .reader import Reader, VerifyReport
from .record_auth import RecordAuth
from .resume_point import resume_point
from .writer import StagedSave, WriterContext, publish

T = TypeVar("T")


class OneTier:
    """Saves written, selected, read and collected in one backend (the durable tier)."""

    #: whether a local tier stands in front (``CheckpointStore.tiered``)
    tiered = False

    def __init__(self, io: RunIO, attempts: AttemptLog, ledger: Ledger, identity_digest: str, auth: RecordAuth,
                 timing: PieceTiming) -> None:
        self.io, self.attempts, self.ledger = io, attempts, ledger
        self.identity_digest, self.auth, self.timing = identity_digest, auth, timing
        self.catalog = Catalog(io, attempts, identity_digest)
        self.reader = Reader(self.catalog)
        #: version 3 (pieces, PROTOCOL.md §9): this writer's piece writer, set by :meth:`begin`
        self.pieces: PieceWriter | None = None

    def context(self, attempt: AttemptRecord, writer_id: str) -> WriterContext:
        """What a writer of ``attempt`` needs in this tier (its fences, its pieces)."""
        return WriterContext(self.io, self.attempts, attempt, writer_id, self.identity_digest, self.auth, self.pieces)

    # ------------------------------------------------------------------ open
    def prepare(self) -> None:
        """Before a writer registers or joins an attempt: nothing to prepare in one tier."""

    def resume_point(self, view: AttemptView, deep: bool, memo: set[str] | None, writer_id: str) -> SaveRef | None:
        """The save a new attempt resumes from (``core.resume_point``: the one rule)."""
        return resume_point(self.catalog, view, deep, memo, self.ledger, writer_id)

    def begin(self, attempt: AttemptRecord, writer_id: str, resumed: SaveRef | None, *, verified: bool,
              joined: bool) -> None:
        """``attempt`` was registered (resuming from ``resumed``) or ``joined``:
        version 3, the piece writer starts, knowing the resumed save's pieces
        (``verified``: they were re-hashed by the resume check)."""
        if self.io.layout.pieces:
            self._new_pieces(attempt, resumed.record if resumed is not None else None, verified)

    def _new_pieces(self, attempt: AttemptRecord, known: CommitRecord | None, verified: bool) -> None:
        if self.pieces is not None:
            self.pieces.close()
        self.pieces = PieceWriter(self.io, attempt.number, self.timing)
        self.pieces.learn(known, verified=verified)

    def adopt(self, attempt: AttemptRecord) -> None:
        """``fall_back`` registered ``attempt``: its intents are the new
        attempt's, and nothing is known (the resume point was given up)."""
        if self.pieces is not None:
            self._new_pieces(attempt, None, False)

    def adopt_resume_point(self, ref: SaveRef) -> None:
        """A member rank learnt the job's resume point: nothing to do in one tier."""

    # ------------------------------------------------------------------ save
    def stage(self, ctx: WriterContext, step: int, save_id: str) -> StagedSave:
        return StagedSave(ctx, step, save_id)

    def publish(
        self, ctx: WriterContext, step: int, save_id: str, components: Mapping[str, ComponentEntry], *,
        metadata: Mapping[str, Any] | None, ranks: Mapping[int, Sequence[str]] | None, world_size: int | None,
        expect: Sequence[str], rank_pieces: Mapping[int, PieceDeadline] | None = None,
    ) -> SaveRef:
        return publish(ctx, step, save_id, components, metadata=metadata, ranks=ranks, world_size=world_size,
                       expect=expect, rank_pieces=rank_pieces)

    def learn_published(self, ref: SaveRef) -> None:
        """``ref`` was published by another process and is the newest commit:
        the next save skips its pieces (version 3; nothing otherwise)."""
        if self.pieces is not None and ref.run_id == self.io.run_id:
            self.pieces.learn(ref.record)

    def acknowledged(self, ref: SaveRef) -> None:
        """Every rank of a job committed its part of ``ref``: nothing to do in one tier."""

    def publish_record(self, ctx: WriterContext, data: bytes) -> SaveRef:
        raise InvalidInputError("publish_record needs a store opened with a local tier on many ranks "
                                "(ckptstore.distributed.open_distributed(..., options=OpenOptions(tiers=...)))")

    # ------------------------------------------------------------- selection
    def select(self, deep: bool, explain: bool) -> Selection:
        return self.catalog.select(deep, explain=explain)

    def get_save(self, step: int, attempt: int | None) -> SaveRef:
        return self.catalog.get_save(step, attempt)

    def list_saves(self, deep: bool, grace: float) -> list[SaveInfo]:
        return self.catalog.list_saves(self.catalog.scan(), deep, grace)

    def newest_step(self) -> int | None:
        """The newest selectable step (cheap check), None when there is none or it cannot be told now."""
        try:
            ref = self.catalog.select(False, explain=False).latest
        except Exception:  # noqa: BLE001 - for the record only
            return None
        return ref.step if ref is not None else None

    # --------------------------------------------------------------- reading
    def read(self, ref: SaveRef, how: Callable[[Reader], T]) -> T:
        """``how`` run on the reader of the tier that holds ``ref``."""
        return how(self.reader)

    def stream(self, ref: SaveRef, how: Callable[[Reader], Iterator[bytes]]) -> Iterator[bytes]:
        """``how``'s stream from the tier that holds ``ref``."""
        return how(self.reader)

    def verify(self, ref: SaveRef, deep: bool) -> VerifyReport:
        return self.reader.verify(ref, deep=deep)

    # ------------------------------------------------------------ operations
    def queue_event(self, kind: str, payload: Mapping[str, Any]) -> bool:
        """The ledger is away: False, nothing can carry the entry later in one tier."""
        return False

    def status(self) -> None:
        """No replication in one tier."""
        return None

    def flush(self, timeout: float | None) -> bool:
        return True

    def make_durable(self, timeout: float | None) -> bool:
        return True

    def is_durable(self, ref: SaveRef) -> bool:
        return True

    def gc_local(self, *, keep_last: int, dry_run: bool, deep: bool, grace_seconds: float) -> GcReport:
        raise InvalidInputError("this store has no local tier (open it with options=OpenOptions(tiers=TierOptions(...)))")

    def close(self) -> None:
        """End this writer's save intent (version 3): its commits mark their
        pieces now; a killed writer's intent expires instead."""
        if self.pieces is not None:
            self.pieces.close()
