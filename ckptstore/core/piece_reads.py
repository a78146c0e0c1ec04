"""Checking and reading pieced components (PROTOCOL.md §9.2, §9.4 step 3,
§9.6): every piece present with its size (and, deep, its digest), a
component's bytes read piece by piece and verified, and which pieces of a
save another store lacks (for replication)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from functools import partial

from ..backends.base import Backend
from ..errors import SaveAbortedError
from ..protocol import CommitRecord, ComponentEntry
from ..protocol.layout import parse_piece_key, piece_key, pieces_prefix
from ..protocol.pieces import ListedPiece
from ..protocol.records import PieceRef
from ..protocol.selection import SkipReason
from .bounded_io import RunIO
from .hashing import CHUNK, Scatter
from .piece_evidence import MAX_HOLDER_LISTINGS, list_holders

Problems = list[tuple[SkipReason, str]]


def check_present(io: RunIO, components: Mapping[str, ComponentEntry], save_id: str) -> None:
    """§9.4 step 3: every piece ``components`` name is there with its size, else :class:`SaveAbortedError`."""
    problems = check_pieces(io, components.values(), None, deep=False)
    if problems:
        raise SaveAbortedError(
            f"save {save_id}: {problems[0][1]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            + "; nothing was published"
        )


# ----------------------------------------------------------- checking, reading
def check_pieces(
    io: RunIO, components: Iterable[ComponentEntry], listed: Mapping[tuple[str, str], ListedPiece] | None,
    deep: bool, memo: set[tuple[str, str]] | None = None,
) -> Problems:
    """Every piece of the pieced ``components`` present with its size (from
    ``listed``, else one listing per holder); with ``deep`` each piece hashed,
    once per operation (``memo``: pieces already hashed and found good)."""
    comps = [c for c in components if c.pieces is not None]
    if not comps:
        return []
    need: dict[tuple[str, str], int] = {}
    for c in comps:
        for p in c.pieces or ():
            need[(p.holder, p.digest)] = p.size
    # the scan's listing is looked up, never copied: a listing of the run's pieces is checked once per
    # save, and a copy per save would make a listing of H saves cost H x the run's pieces
    sizes = listed if listed is not None else list_holders(io, {h for h, _ in need})
    problems: Problems = []
    for c in sorted(comps, key=lambda c: c.name):
        for p in c.pieces or ():
            hd = (p.holder, p.digest)
            found = sizes.get(hd)
            got = None if found is None else found.size
            if got is None:
                problems.append((SkipReason.MISSING_COMPONENT, f"component {c.name!r}: piece {p.digest[:16]} of save "
                                 f"{p.holder} is missing"))
            elif got != p.size:
                problems.append((SkipReason.SIZE_MISMATCH, f"component {c.name!r}: piece {p.digest[:16]} has {got} "
                                 f"bytes, record says {p.size}"))
    if problems or not deep:
        return problems
    memo = memo if memo is not None else set()
    todo = [(hd, size) for hd, size in sorted(need.items()) if hd not in memo]
    hashed = io.hash_objects([(piece_key(io.run_id, *hd), size) for hd, size in todo])
    for (hd, size), (_, result) in zip(todo, hashed, strict=True):
        if result is None:
            problems.append((SkipReason.MISSING_COMPONENT, f"piece {hd[1][:16]} of save {hd[0]} vanished while hashing"))
            continue
        seen, digest = result
        if seen != size or digest != hd[1]:
            problems.append((SkipReason.HASH_MISMATCH, f"piece {hd[1][:16]} of save {hd[0]}: BLAKE3 does not match"))
        else:
            memo.add(hd)
    return problems


def iter_pieced(io: RunIO, comp: ComponentEntry, label: str, chunk: int = CHUNK) -> Iterator[bytes]:
    """A pieced component's bytes, each piece verified before its last chunk is handed out."""
    for p in comp.pieces or ():
        yield from io.verified_chunks(piece_key(io.run_id, p.holder, p.digest), p.as_entry(),
                                      f"{label}, piece {p.digest[:16]}", chunk)


def read_pieced_into(io: RunIO, comp: ComponentEntry, label: str, out: memoryview | Scatter) -> None:
    """Fill ``out`` (exactly the component's size: one view or a scatter of
    many) piece by piece, each verified; the next piece is read while the
    last one is hashed."""
    io.read_verified_parts_into(
        [(piece_key(io.run_id, p.holder, p.digest), p.as_entry(), f"{label}, piece {p.digest[:16]}")
         for p in comp.pieces or ()], out)


def read_pieced_range(io: RunIO, comp: ComponentEntry, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a pieced component, not verified (like ``read_range``)."""
    parts: list[bytes] = []
    off = 0
    for p in comp.pieces or ():
        lo, hi = max(start, off), min(end, off + p.size)
        if lo < hi:
            key = piece_key(io.run_id, p.holder, p.digest)
            parts.append(io.retry.call(partial(io.backend.get_range, key, lo - off, hi - off)))
        off += p.size
    return b"".join(parts)


# ----------------------------------------------------------------- replication
def pieces_lacking(ref_record: CommitRecord, target: Backend, run_id: str | None = None) -> list[PieceRef]:
    """The pieces of a save that ``target`` (another store's backend, e.g. a
    durable tier) does not hold with their recorded size, once each, in the
    record's order: replication uploads only these (and the components that
    are not pieced, and the records). One listing per holder on ``target``
    (one of its whole ``pieces/`` past ``MAX_HOLDER_LISTINGS`` holders)."""
    rid = run_id or ref_record.run_id
    have: dict[tuple[str, str], int] = {}
    holders = {p.holder for c in ref_record.components.values() for p in c.pieces or ()}
    prefixes = [pieces_prefix(rid) + f"{h}/" for h in sorted(holders)] if len(holders) <= MAX_HOLDER_LISTINGS \
        else [pieces_prefix(rid)]
    for prefix in prefixes:
        for o in target.list(prefix):
            hd = parse_piece_key(rid, o.key)
            if hd is not None and hd[0] in holders:
                have[hd] = o.size
    out: list[PieceRef] = []
    seen: set[tuple[str, str]] = set()
    for c in ref_record.components.values():
        for p in c.pieces or ():
            hd = (p.holder, p.digest)
            if hd not in seen and have.get(hd) != p.size:
                out.append(p)
            seen.add(hd)
    return out
