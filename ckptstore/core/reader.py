"""Reading a published save: every byte handed out is verified against the
commit record (PROTOCOL.md §4.4 step 5), except through :meth:`Reader.read_range`,
whose caller verifies with its own per-item digest."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import blake3

from ..errors import CorruptionError, InvalidInputError, NotFoundError
from ..protocol import ComponentEntry, component_key
from ..protocol.selection import SaveRef, SkipReason, describe_superseder, superseded_by
from .catalog import Catalog
from .hashing import CHUNK, Scatter
from .piece_reads import iter_pieced, read_pieced_into, read_pieced_range


@dataclass
class VerifyReport:
    """The answer of ``verify()``: an empty ``problems`` list means the save checks out."""

    ref: SaveRef
    deep: bool
    problems: list[tuple[SkipReason, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _writable_view(out: object) -> memoryview:
    """A flat byte view of a writable, contiguous buffer; :class:`InvalidInputError` for anything else."""
    try:
        view = memoryview(out).cast("B")  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInputError(f"read_into needs a writable contiguous buffer, got {type(out).__name__}") from None
    if view.readonly:
        raise InvalidInputError("read_into needs a writable buffer, got a read-only one")
    return view


class Reader:
    """Verified reads of one run's saves."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.io = catalog.io

    def _component(self, ref: SaveRef, name: str) -> tuple[str, ComponentEntry]:
        if ref.run_id != self.io.run_id:
            raise InvalidInputError(f"save {ref.save_id} belongs to run {ref.run_id!r}, not {self.io.run_id!r}")
        comp = ref.components.get(name)
        if comp is None:
            raise NotFoundError(
                f"save {ref.save_id} (step {ref.step}) has no component {name!r}; "
                f"it has: {', '.join(sorted(ref.components)[:20]) or 'none'}"
            )
        return component_key(self.io.run_id, ref.save_id, name), comp

    def component(self, ref: SaveRef, name: str) -> ComponentEntry:
        return self._component(ref, name)[1]

    def iter_read(self, ref: SaveRef, name: str, chunk: int = CHUNK) -> Iterator[bytes]:
        key, comp = self._component(ref, name)
        if comp.pieces is not None:
            return iter_pieced(self.io, comp, f"component {name!r} of save {ref.save_id}", chunk)
        return self.io.verified_chunks(key, comp, f"component {name!r} of save {ref.save_id}", chunk)

    def read(self, ref: SaveRef, name: str) -> bytes:
        return b"".join(self.iter_read(ref, name))

    def read_into(self, ref: SaveRef, name: str, out: object) -> None:
        """``out``: a writable, contiguous buffer of exactly the component's
        size, or a list or tuple of such buffers whose sizes add up to it
        (filled in order, as one: a scatter read, e.g. one buffer per tensor)."""
        key, comp = self._component(ref, name)
        parts = out if isinstance(out, (list, tuple)) else [out]
        views = [_writable_view(b) for b in parts]
        total = sum(len(v) for v in views)
        if total != comp.size:
            what = f"{len(views)} buffers of {total} bytes in all" if isinstance(out, (list, tuple)) else f"buffer of {total} bytes"
            raise InvalidInputError(f"read_into: {what} for component {name!r} of {comp.size}")
        dest = views[0] if len(views) == 1 else Scatter(views)
        if comp.pieces is not None:
            read_pieced_into(self.io, comp, f"component {name!r} of save {ref.save_id}", dest)
            return
        self.io.read_verified_into(key, comp, f"component {name!r} of save {ref.save_id}", dest)

    def read_range(self, ref: SaveRef, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a component, **not** verified: for readers
        that hold a digest of exactly that range (see :meth:`read_verified_range`)."""
        key, comp = self._component(ref, name)
        if not 0 <= start <= end <= comp.size:
            raise InvalidInputError(f"range [{start}, {end}) is outside component {name!r} of {comp.size} bytes")
        if comp.pieces is not None:
            data = read_pieced_range(self.io, comp, start, end)
        else:
            data = self.io.retry.call(lambda: self.io.backend.get_range(key, start, end))
        if len(data) != end - start:
            raise CorruptionError(f"{self.io.where(key)}: short read ({len(data)} of {end - start} bytes)")
        return data

    def read_verified_range(self, ref: SaveRef, name: str, start: int, end: int, digest: str) -> bytes:
        """Bytes ``[start, end)`` checked against ``digest`` (BLAKE3 hex of
        exactly those bytes, e.g. a per-item digest kept in a hashed index
        component); a mismatch raises :class:`CorruptionError`."""
        data = self.read_range(ref, name, start, end)
        if blake3.blake3(data).hexdigest() != digest:
            raise CorruptionError(
                f"{self.io.where(component_key(self.io.run_id, ref.save_id, name))}: bytes [{start}, {end}) "
                "do not match their digest"
            )
        return data

    def verify(self, ref: SaveRef, *, deep: bool = True) -> VerifyReport:
        """Check one save against its record (sizes; with ``deep`` every digest)."""
        report = VerifyReport(ref, deep)
        later = superseded_by(ref.step, ref.attempt, self.catalog.attempts.load().effective)
        if later is not None:
            report.problems.append((SkipReason.SUPERSEDED, describe_superseder(later)))
        try:
            current = self.catalog.load_commit(ref.step, ref.attempt)
        except (NotFoundError, CorruptionError) as exc:
            report.problems.append((SkipReason.UNREADABLE_RECORD, str(exc)))
            return report
        if current.version != self.io.layout.version:
            report.problems.append((SkipReason.UNREADABLE_RECORD, f"the record states protocol_version "
                                    f"{current.version}, the run record {self.io.layout.version} (THREATS.md §4.13)"))
        why = self.catalog.auth.judge(current, self.io.run_id, self.io, self.catalog.commit_key(ref.step, ref.attempt))
        if why is not None:
            report.problems.append((SkipReason.UNAUTHENTICATED, why))
        if current.encode() != ref.record.encode():
            report.problems.append((SkipReason.UNREADABLE_RECORD, "commit record changed since it was read"))
        report.problems.extend(self.catalog.check_components(current, None, deep))
        return report
