"""Where a store's saves live: the interface :class:`~ckptstore.CheckpointStore` delegates to.

The facade holds the run's identity, attempts and ledger, checks arguments and
speaks the public API; everything that depends on *where* saves live — one
tier, or a local tier in front of the durable one — is a :class:`Placement`:

* :class:`ckptstore.core.one_tier.OneTier`: the backend alone (the durable tier);
* :class:`ckptstore.tiers.tiered.TierSet`: a local directory in front of a
  ``OneTier`` (``docs/tiers.md``), on one process or as one rank of many.

A new placement (e.g. peer copies of each rank's part) is one more class with
these methods; nothing in ``store.py`` changes. :func:`open_placement` is the
one place that chooses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from .core.collector import GcReport
from .core.fencing import AttemptView
from .core.one_tier import OneTier
from .core.piece_deadlines import PieceDeadline
from .core.pieces import PieceWriter
from .core.reader import Reader, VerifyReport
from .core.writer import StagedSave, WriterContext
from .options import TierOptions
from .protocol import AttemptRecord, ComponentEntry
from .protocol.selection import SaveInfo, SaveRef, Selection
from .retry import RetryPolicy
from .tiers.replicator import ReplicationStatus
from .tiers.tiered import TierSet

__all__ = ["Placement", "open_placement"]

T = TypeVar("T")


class Placement(Protocol):
    """What the facade asks of the place its saves live (see the module docstring)."""

    #: whether a local tier stands in front of the durable one
    tiered: bool
    #: version 3: the piece writer of this writer's saves (None otherwise)
    pieces: PieceWriter | None

    # open: prepare -> (register with resume_point | join) -> begin; fall_back -> adopt
    def prepare(self) -> None: ...
    def resume_point(self, view: AttemptView, deep: bool, memo: set[str] | None, writer_id: str
                     ) -> SaveRef | None: ...
    def begin(self, attempt: AttemptRecord, writer_id: str, resumed: SaveRef | None, *, verified: bool,
              joined: bool) -> None: ...
    def adopt(self, attempt: AttemptRecord) -> None: ...
    def adopt_resume_point(self, ref: SaveRef) -> None: ...

    # save
    def stage(self, ctx: WriterContext, step: int, save_id: str) -> StagedSave: ...
    def publish(
        self, ctx: WriterContext, step: int, save_id: str, components: Mapping[str, ComponentEntry], *,
        metadata: Mapping[str, Any] | None, ranks: Mapping[int, Sequence[str]] | None, world_size: int | None,
        expect: Sequence[str], rank_pieces: Mapping[int, PieceDeadline] | None = None,
    ) -> SaveRef: ...
    def learn_published(self, ref: SaveRef) -> None: ...
    def acknowledged(self, ref: SaveRef) -> None: ...
    def publish_record(self, ctx: WriterContext, data: bytes) -> SaveRef: ...

    # selection and reading
    def select(self, deep: bool, explain: bool) -> Selection: ...
    def get_save(self, step: int, attempt: int | None) -> SaveRef: ...
    def list_saves(self, deep: bool, grace: float) -> list[SaveInfo]: ...
    def read(self, ref: SaveRef, how: Callable[[Reader], T]) -> T: ...
    def stream(self, ref: SaveRef, how: Callable[[Reader], Iterator[bytes]]) -> Iterator[bytes]: ...
    def verify(self, ref: SaveRef, deep: bool) -> VerifyReport: ...

    # operations
    def queue_event(self, kind: str, payload: Mapping[str, Any]) -> bool: ...
    def status(self) -> ReplicationStatus | None: ...
    def flush(self, timeout: float | None) -> bool: ...
    def make_durable(self, timeout: float | None) -> bool: ...
    def is_durable(self, ref: SaveRef) -> bool: ...
    def gc_local(self, *, keep_last: int, dry_run: bool, deep: bool, grace_seconds: float) -> GcReport: ...
    def close(self) -> None: ...


def open_placement(durable: OneTier, tiers: TierOptions | None, retry: RetryPolicy | None) -> Placement:
    """The one choice of placement: ``durable`` alone, or a local tier in front of it."""
    if tiers is None:
        return durable
    return TierSet(tiers.path, durable, retry, keep=tiers.keep, every=tiers.replicate_every, max_lag=tiers.max_lag,
                   early=tiers.early_replication, rank=tiers.rank, peers=tiers.peers,
                   exit_flush_seconds=tiers.close_flush_seconds, peer_job=tiers.peer_job,
                   peer_copies=tiers.peer_copies)
