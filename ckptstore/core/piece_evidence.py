"""When a known piece may be reused without reading it (PROTOCOL.md §9.2
"Evidence"): the one rule, for every place that skips a piece it believes it
holds — a writer's saves (:class:`~ckptstore.core.pieces.PieceWriter`) and a
holder's peer copies (:mod:`ckptstore.tiers.peer_copies`).

A piece is *known* when this process wrote it, or re-hashed it, and named it
since. Its *evidence* is the ``(size, mtime, version)`` its listing showed
right after; it is reused unread while a new listing shows the same, unless it
is among the ``ceil(n / REHASH_EVERY)`` known pieces checked longest ago (so
every piece is read at least once every :data:`REHASH_EVERY` uses: damage
that kept size, time and version is found). A piece with no evidence (learned
from a commit another process wrote), whose listing changed, or that is due,
is re-hashed before its first reuse; one missing or of another size is not
reused at all.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Collection, Mapping

from ..errors import NotFoundError
from ..protocol.layout import parse_piece_key, piece_key, pieces_prefix
from ..protocol.pieces import ListedPiece
from .bounded_io import RunIO

__all__ = ["MAX_HOLDER_LISTINGS", "REHASH_EVERY", "Evidence", "PieceEvidence", "list_holders", "list_pieces"]

#: Every known piece a user reuses is re-hashed at least once every this many uses (§9.2 "Evidence").
REHASH_EVERY = 8

#: (size, mtime, version) as a listing showed it
Evidence = tuple[int, float, str]
_HD = tuple[str, str]


def list_pieces(io: RunIO, holder: str | None = None, foreign: list[str] | None = None
                ) -> dict[tuple[str, str], ListedPiece]:
    """The run's pieces (or one holder's), by (holder, digest); other keys under
    ``pieces/`` are not ckptstore's: never read nor deleted (appended to ``foreign``)."""
    prefix = pieces_prefix(io.run_id) + (f"{holder}/" if holder is not None else "")
    out: dict[tuple[str, str], ListedPiece] = {}
    for o in io.list(prefix):
        hd = parse_piece_key(io.run_id, o.key)
        if hd is not None:
            out[hd] = ListedPiece(o.key, hd[0], hd[1], o.size, o.mtime, o.version)
        elif foreign is not None:
            foreign.append(o.key)
    return out


#: Holders listed one by one at most; a record naming more is checked against one listing of the
#: run's whole ``pieces/`` (bounded by what the store holds, never by what a record claims: a forged
#: record naming 100,000 holders costs one listing, not 100,000)
MAX_HOLDER_LISTINGS = 16


def list_holders(io: RunIO, holders: Collection[str]) -> dict[tuple[str, str], ListedPiece]:
    """The pieces of ``holders``, by (holder, digest): one listing per holder, or,
    for more than :data:`MAX_HOLDER_LISTINGS` of them, one of the run's ``pieces/``."""
    wanted = set(holders)
    if len(wanted) > MAX_HOLDER_LISTINGS:
        return {hd: lp for hd, lp in list_pieces(io).items() if hd[0] in wanted}
    out: dict[tuple[str, str], ListedPiece] = {}
    for h in sorted(wanted):
        out.update(list_pieces(io, h))
    return out


class PieceEvidence:
    """What one process knows of the pieces of one run's folder it wrote or
    re-hashed. ``uses`` counts the saves (or copies) begun: the clock of the
    periodic re-hash. Thread-safe."""

    def __init__(self, io: RunIO) -> None:
        self.io = io
        self._lock = threading.Lock()
        #: saves (or copies) begun
        self.uses = 0
        #: (holder, digest) -> the listing that showed the piece intact
        self.evidence: dict[_HD, Evidence] = {}
        #: (holder, digest) -> ``uses`` when the piece was last written or re-hashed
        self.checked: dict[_HD, int] = {}
        #: pieces re-hashed by :meth:`recheck` (tests and benchmarks count them)
        self.rehashed = 0

    def begin(self) -> int:
        """One more use begins; returns its number."""
        with self._lock:
            self.uses += 1
            return self.uses

    def retain(self, names: Collection[_HD], fresh: Collection[_HD] = ()) -> None:
        """Only ``names`` are known from now on; those of ``fresh`` were just
        written or hashed whole (checked now; :meth:`take` records their listing)."""
        keep = set(names)
        with self._lock:
            self.evidence = {hd: e for hd, e in self.evidence.items() if hd in keep}
            self.checked = {hd: n for hd, n in self.checked.items() if hd in keep}
            for hd in fresh:
                self.checked[hd] = self.uses
                self.evidence.pop(hd, None)

    def take(self, sizes: Mapping[_HD, int]) -> None:
        """Record the listing of these pieces (one listing per holder) as their
        evidence, for those listed with the size given."""
        there = self._listing({h for h, _ in sizes})
        with self._lock:
            for hd, size in sizes.items():
                got = there.get(hd)
                if got is not None and got[0] == size:
                    self.evidence[hd] = got

    def _listing(self, holders: Collection[str]) -> dict[_HD, Evidence]:
        return {hd: lp.evidence for hd, lp in list_holders(self.io, holders).items()}

    def triage(self, known: Mapping[_HD, int]) -> tuple[dict[_HD, Evidence], dict[_HD, str]]:
        """Before a use reuses ``known`` ((holder, digest) -> size): one listing
        per holder. Returns the pieces to re-hash before their first reuse
        (with the listing to record when they pass: no evidence, a changed
        listing, or due) and those not to reuse at all, with why ("" when
        missing: swept or removed; a line to report when of another size)."""
        there = self._listing({h for h, _ in known})
        with self._lock:
            checked, evidence = dict(self.checked), dict(self.evidence)
        order = sorted(known, key=lambda hd: (checked.get(hd, -1), hd))
        due = set(order[: math.ceil(len(order) / REHASH_EVERY)])
        suspect: dict[_HD, Evidence] = {}
        dropped: dict[_HD, str] = {}
        for hd, size in known.items():
            got = there.get(hd)
            if got is None:
                dropped[hd] = ""
            elif got[0] != size:
                dropped[hd] = (f"piece {hd[1][:16]} of save {hd[0]} has {got[0]} bytes, the commit that named it "
                               f"says {size}")
            elif not (hd in checked and evidence.get(hd) == got and hd not in due):
                suspect[hd] = got
        return suspect, dropped

    def recheck(self, hd: _HD, size: int, listed: Evidence) -> str | None:
        """Re-hash one known piece: None when it still matches its digest (its
        listing is then its evidence again), else why not ("" when it is gone)."""
        with self._lock:
            self.rehashed += 1
            n = self.uses
        try:
            seen, digest = self.io.hash_object(piece_key(self.io.run_id, *hd), size)
        except NotFoundError:
            return ""
        if seen != size or digest != hd[1]:
            return f"piece {hd[1][:16]} of save {hd[0]} no longer matches its BLAKE3 (damaged since it was written)"
        with self._lock:
            self.checked[hd] = n
            self.evidence[hd] = listed
        return None
