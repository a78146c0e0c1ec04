"""Temporary shim for the core seams this package is written against.

The lead is adding ``CheckpointStore.new_save_id / stage / publish / read_range``
and ``CheckpointStore.open(..., join_attempt=N)`` to the core. Until that lands,
these functions provide the same behaviour from outside the core (using its
internals). Every function prefers the real seam when the store has it, so the
shim becomes dead code the moment the core grows the methods; delete it then.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol

from .. import protocol as P
from ..errors import (
    CommitConflictError,
    CommitUnknownError,
    CorruptionError,
    InvalidInputError,
    SaveAbortedError,
    StoreUnavailableError,
    SupersededError,
)
from ..store import CheckpointStore, SaveRef, SaveWriter


class Staged(Protocol):
    """What ``store.stage(step, save_id=...)`` returns (the seam's shape)."""

    save_id: str

    def put(self, name: str, data: Any) -> P.ComponentEntry: ...

    @property
    def components(self) -> dict[str, P.ComponentEntry]: ...

    def abort(self) -> None: ...

    def __enter__(self) -> Staged: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class _ShimStaged(SaveWriter):
    def __init__(self, store: CheckpointStore, step: int, save_id: str) -> None:
        super().__init__(store, step, {}, [])
        self.save_id = save_id

    def __enter__(self) -> _ShimStaged:
        return self

    def abort(self) -> None:
        self._abort()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None and not self._closed:
            self._abort()


def new_save_id(store: CheckpointStore, step: int) -> str:
    if hasattr(store, "new_save_id"):
        return str(store.new_save_id(step))
    if store.attempt is None:
        raise InvalidInputError("this store was opened read-only")
    P.validate_step(step)
    return P.new_save_id(step, store.attempt.number)


def stage(store: CheckpointStore, step: int, save_id: str) -> Staged:
    if hasattr(store, "stage"):
        return store.stage(step, save_id=save_id)  # type: ignore[no-any-return]
    if store.attempt is None:
        raise InvalidInputError("this store was opened read-only")
    P.validate_step(step)
    sa = P.parse_save_id(save_id)
    if sa is None or sa[0] != step:
        raise InvalidInputError(f"save ID {save_id!r} does not name step {step}")
    return _ShimStaged(store, step, save_id)


def publish(
    store: CheckpointStore,
    step: int,
    save_id: str,
    components: Mapping[str, P.ComponentEntry],
    *,
    metadata: Mapping[str, Any] | None = None,
    ranks: Mapping[int, Sequence[str]] | None = None,
    world_size: int | None = None,
) -> SaveRef:
    if hasattr(store, "publish"):
        return store.publish(  # type: ignore[no-any-return]
            step, save_id, components, metadata=metadata, ranks=ranks, world_size=world_size
        )
    assert store.attempt is not None
    comps = dict(components)
    if not comps:
        raise SaveAbortedError(f"save of step {step} has no components; nothing was published")
    prefix = P.save_prefix(store.run_id, save_id)
    listed = {o.key[len(prefix) :]: o for o in store._retry.call(lambda: store.backend.list(prefix))}
    for n, c in comps.items():
        o = listed.get(n)
        if o is None or o.size != c.size:
            raise SaveAbortedError(
                f"save of step {step}: component {n!r} did not land intact "
                f"({'missing' if o is None else f'{o.size} bytes, wrote {c.size}'}); nothing was published"
            )
    store._check_not_superseded(step, committed=False)
    md = dict(metadata or {})
    # The real seam records these as top-level commit-record fields; the shim
    # can only carry them in the metadata.
    if ranks is not None:
        md["ranks"] = {str(r): sorted(v) for r, v in sorted(ranks.items())}
    if world_size is not None:
        md["world_size"] = world_size
    record = P.CommitRecord(
        run_id=store.run_id, step=step, attempt=store.attempt.number, save_id=save_id, writer_id=store.writer_id,
        identity_digest=store.identity_digest, components=comps, created_at=P.now(), metadata=md,
    )
    key = P.commit_key(store.run_id, step, store.attempt.number)
    if not store._create(key, record.encode(), what="commit record"):
        raise CommitConflictError(f"run {store.run_id!r}: step {step} was already committed in this attempt")
    try:
        store._check_not_superseded(step, committed=True)
    except SupersededError:
        raise
    except (StoreUnavailableError, CorruptionError) as exc:
        raise CommitUnknownError(f"post-commit fence of step {step} failed ({exc})") from exc
    return store._ref(record)


def read_range(store: CheckpointStore, ref: SaveRef, name: str, start: int, end: int) -> bytes:
    if hasattr(store, "read_range"):
        return store.read_range(ref, name, start, end)  # type: ignore[no-any-return]
    key, comp = store._component(ref, name)
    if start < 0 or end > comp.size or start > end:
        raise InvalidInputError(f"range [{start}, {end}) is outside component {name!r} ({comp.size} bytes)")
    if start == end:
        return b""
    return store._retry.call(lambda: store.backend.get_range(key, start, end))


def join(
    url: str | os.PathLike[str],
    run_id: str,
    *,
    identity: Mapping[str, Any],
    attempt: int,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointStore:
    """A member rank's handle on the attempt the coordinator registered."""
    try:
        return CheckpointStore.open(  # type: ignore[call-arg]
            url, run_id, identity=identity, join_attempt=attempt, storage_options=storage_options
        )
    except TypeError:
        pass
    store = CheckpointStore.open(url, run_id, identity=identity, mode="r", storage_options=storage_options)
    rec = store._load_attempts().get(attempt)
    if rec is None:
        raise StoreUnavailableError(f"run {run_id!r}: attempt {attempt} is not registered")
    store.attempt = rec
    store.mode = "w"
    return store


def commit_world_size(ref: SaveRef) -> int | None:
    """The world size a save was written with, if recorded (seam field, or shim metadata)."""
    raw = getattr(ref.record, "world_size", None)
    if raw is None:
        raw = ref.metadata.get("world_size")
    return int(raw) if isinstance(raw, int) else None


def commit_ranks(ref: SaveRef) -> dict[int, list[str]] | None:
    raw = getattr(ref.record, "ranks", None)
    if raw is None:
        raw = ref.metadata.get("ranks")
    if not isinstance(raw, Mapping):
        return None
    return {int(k): list(v) for k, v in raw.items()}
