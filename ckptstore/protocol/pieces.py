"""Pieces addressed by content (PROTOCOL.md §9): where a component's bytes are
cut, and what a piece sweep may delete. Pure: no I/O.

**Cutting.** A component arrives as a sequence of buffers (the torch adapter
hands one per tensor, after a header). A buffer of at least
:data:`PACK_BYTES` is cut into pieces of :data:`PIECE_BYTES` from its start
(the last one shorter); smaller buffers are packed, in order, into one piece
until it holds at least :data:`PACK_BYTES`. The cut points depend only on the
buffers' sizes, never on their bytes: a save of tensors of the same shapes
cuts at the same places, so a tensor that did not change gives the same
pieces, and the same digests, as before.

**Packing what changes.** :func:`cut_planned` is the same rule for the
buffers a writer expects to be stable, and packs each run of the buffers it
expects to change (``changing``: their indices) into pieces of up to
:data:`CHANGING_PIECE_BYTES`, each a list of views of the buffers (no copy).
The expectation only moves cut points: a buffer expected to change that did
not is written again (bytes, never a wrong restore); one expected stable that
changed gets pieces of its own, as under :func:`cut_pieces`.

**Sweeping.** :func:`plan_sweep` decides which listed pieces gc deletes:
only pieces that nothing marks (no kept commit, no live save intent) and whose
last write is older than the grace period or whose holder's commit gc read
(a committed save writes nothing under its own ID again).
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

#: Large buffers are cut into pieces of this many bytes.
PIECE_BYTES = 8 << 20
#: Buffers smaller than this are packed together until a piece holds this many bytes.
PACK_BYTES = 1 << 20
#: The largest piece a run of buffers expected to change is packed into (:func:`cut_planned`).
CHANGING_PIECE_BYTES = 32 << 20


def cut_pieces(buffers: Iterable[memoryview]) -> Iterator[memoryview]:
    """The pieces of a component given as ``buffers`` (flat byte views), in
    order; their concatenation is the concatenation of the buffers. A large
    buffer's pieces are views into it (no copy); packed small buffers are
    copied into one piece."""
    pack: list[memoryview] = []
    packed = 0
    for buf in buffers:
        if len(buf) == 0:
            continue
        if len(buf) >= PACK_BYTES:
            if pack:
                yield memoryview(b"".join(pack))
                pack, packed = [], 0
            for off in range(0, len(buf), PIECE_BYTES):
                yield buf[off : off + PIECE_BYTES]
            continue
        pack.append(buf)
        packed += len(buf)
        if packed >= PACK_BYTES:
            yield memoryview(b"".join(pack))
            pack, packed = [], 0
    if pack:
        yield memoryview(b"".join(pack))



def cut_planned(buffers: Iterable[memoryview], changing: Container[int]) -> Iterator[tuple[list[memoryview], set[int]]]:
    """The pieces of a component given as ``buffers``, each as (its views, in
    order; the indices of the buffers it holds bytes of). Buffers whose index
    is not in ``changing`` are cut as :func:`cut_pieces` cuts them (a run of
    them cut alone: small ones are packed until a changing buffer or the
    end); each run of buffers in ``changing`` is packed into pieces of up to
    :data:`CHANGING_PIECE_BYTES` made of views of the buffers (no copy; a
    buffer is split across pieces where a piece fills up). Empty buffers hold
    no bytes and are in no piece. With ``changing`` empty, the cuts are
    exactly :func:`cut_pieces`'s."""
    pack: list[memoryview] = []  # stable small buffers being packed
    packed_idx: set[int] = set()
    packed = 0
    run: list[memoryview] = []  # the open piece of a changing run
    run_idx: set[int] = set()
    room = CHANGING_PIECE_BYTES

    def flush_pack() -> Iterator[tuple[list[memoryview], set[int]]]:
        nonlocal pack, packed_idx, packed
        if pack:
            yield [memoryview(b"".join(pack))], packed_idx
            pack, packed_idx, packed = [], set(), 0

    def flush_run() -> Iterator[tuple[list[memoryview], set[int]]]:
        nonlocal run, run_idx, room
        if run:
            yield run, run_idx
            run, run_idx, room = [], set(), CHANGING_PIECE_BYTES

    for i, buf in enumerate(buffers):
        if len(buf) == 0:
            continue
        if i in changing:
            yield from flush_pack()
            off = 0
            while off < len(buf):
                take = min(room, len(buf) - off)
                run.append(buf[off : off + take])
                run_idx.add(i)
                off += take
                room -= take
                if room == 0:
                    yield from flush_run()
            continue
        yield from flush_run()
        if len(buf) >= PACK_BYTES:
            yield from flush_pack()
            for off in range(0, len(buf), PIECE_BYTES):
                yield [buf[off : off + PIECE_BYTES]], {i}
            continue
        pack.append(buf)
        packed_idx.add(i)
        packed += len(buf)
        if packed >= PACK_BYTES:
            yield from flush_pack()
    yield from flush_run()
    yield from flush_pack()


@dataclass(frozen=True)
class ListedPiece:
    """A piece as a listing of ``pieces/`` showed it."""

    key: str
    holder: str
    digest: str
    size: int
    mtime: float
    #: the backend's content version (ObjectInfo.version; "" where it reports none)
    version: str = ""

    @property
    def evidence(self) -> tuple[int, float, str]:
        """What a later listing must show again for the piece to count as unchanged (§9.2 "Evidence")."""
        return (self.size, self.mtime, self.version)


@dataclass
class SweepPlan:
    delete: list[ListedPiece] = field(default_factory=list)
    #: marked pieces (kept by a commit or a live intent)
    marked: int = 0
    #: unmarked pieces younger than the grace period (a save in progress may be writing them)
    young: int = 0

    @property
    def bytes(self) -> int:
        return sum(p.size for p in self.delete)


def plan_sweep(
    listed: Iterable[ListedPiece], marks: Mapping[tuple[str, str], object] | set[tuple[str, str]], *,
    now: float, grace_seconds: float, settled: Collection[str] = (),
) -> SweepPlan:
    """Which listed pieces may go: those whose (holder, digest) no mark names
    and whose last write is at least ``grace_seconds`` before ``now`` — or,
    whatever their age, whose holder is in ``settled`` (save IDs of commit
    records gc read: a committed save writes no piece under its own ID again,
    and anything else writes under another save's ID only while an intent
    names the piece, §9.5 step 5). A piece a mark names is never in the plan."""
    plan = SweepPlan()
    for p in listed:
        if (p.holder, p.digest) in marks:
            plan.marked += 1
        elif p.holder not in settled and now - p.mtime < grace_seconds:
            plan.young += 1
        else:
            plan.delete.append(p)
    plan.delete.sort(key=lambda p: p.key)
    return plan
