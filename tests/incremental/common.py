"""Shared pieces of the incremental-save tests (PROTOCOL.md §9)."""

from __future__ import annotations

import os
import time

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.core.intents import PieceTiming
from ckptstore.protocol.layout import component_key, piece_key
from ckptstore.protocol.pieces import PACK_BYTES, PIECE_BYTES
from ckptstore.protocol.selection import SaveRef

IDENT = {"data_digest": "data-21", "code_digest": "code-21"}
RUN = "inc"
#: the window of every test writer and gc: short, so that a writer's wait for its intent to be old
#: enough to rely on (``window`` after it landed) costs little; a slower machine only waits longer
WINDOW = 0.2
#: a frozen backbone of two large pieces (the last one short) before the head
FROZEN = os.urandom(PIECE_BYTES + PACK_BYTES + 12345)


def open_store(backend: Backend, clock: Clock | None = None, **kw: object) -> CheckpointStore:
    """A version-3 writer with the long timing (no save of a test overruns its intent's lifetime),
    its intents dated by ``clock`` (the real one by default)."""
    return CheckpointStore.open(backend, RUN, identity=IDENT, protocol_version=3,
                                piece_timing=long_timing(clock), **kw)  # type: ignore[arg-type]


def head(step: int) -> bytes:
    return f"head@{step}".encode() * 5000


def save(store: CheckpointStore, step: int, frozen: bytes = FROZEN) -> bytes:
    """One save of a frozen part and a changing head; the model bytes it saved."""
    with store.save(step) as w:
        w.put("model", [memoryview(frozen), memoryview(head(step))])
        w.put("state.json", f'{{"step": {step}}}'.encode())
    return frozen + head(step)


#: an intent lifetime (and gc grace) no test step overruns: races are decided by the injected clocks below
LONG = 3600.0
#: gc's grace period in these tests: at least the intents' lifetime (gc refuses to sweep otherwise)
GRACE = LONG


class Clock:
    """An injected wall clock (``PieceTiming.clock``): the real one shifted by
    ``offset`` seconds, or ``fixed`` when set. Tests age intents and pieces by
    moving it, never by waiting for a window a loaded machine overruns."""

    def __init__(self, offset: float = 0.0, fixed: float | None = None) -> None:
        self.offset, self.fixed = offset, fixed

    def __call__(self) -> float:
        return self.fixed if self.fixed is not None else time.time() + self.offset


def long_timing(clock: Clock | None = None) -> PieceTiming:
    """The timing of every test writer and gc: intents live LONG (a save that takes longer than
    ``LONG - WINDOW`` is aborted, which no test step comes near), dated and judged by ``clock``."""
    return PieceTiming(window=WINDOW, intent_ttl=LONG, clock=clock or Clock())


def age_past_grace(clock: Clock) -> None:
    """Time passes for everyone who reads ``clock``: every intent dated by it so far expires and
    every piece written so far is older than GRACE (piece ages are the server's real-time
    LastModified judged against ``clock``). Only while nothing is being written that a gc at
    ``clock`` judges later: a piece written after this is as old to that gc as the ones before."""
    clock.offset += LONG + 2


def wait_for_intent(backend: Backend, timeout: float = 120.0) -> None:
    """A barrier: the intent a writer starts writing in the background after its commit is there
    (``timeout`` only bounds a hang; a slow machine just takes longer)."""
    from ckptstore.protocol.layout import intents_prefix

    end = time.monotonic() + timeout
    while not backend.list_keys(intents_prefix(RUN)):
        assert time.monotonic() < end, "the writer's save intent never appeared"
        time.sleep(0.01)


def gc_clock_past(backend: Backend, holder: str) -> Clock:
    """A gc clock (for a grace of LONG) at which every piece ``holder`` wrote is
    just old enough to sweep, and every piece written a second or more later
    is still young (object stores list times in whole seconds)."""
    from ckptstore.protocol.layout import pieces_prefix

    times = [o.mtime for o in backend.list(pieces_prefix(RUN) + f"{holder}/")]
    assert times, f"no pieces under {holder}"
    return Clock(fixed=max(times) + LONG + 0.5)


def stored_objects(run: str, ref: SaveRef, name: str) -> list[tuple[str, int, int]]:
    """Where component ``name`` of ``ref`` lies in storage, as (key, offset in the component,
    size) per object: its pieces on version 3, its one whole file on versions 1 and 2. Tests
    that damage "the save's component" damage these."""
    comp = ref.components[name]
    if comp.pieces is None:
        return [(component_key(run, ref.save_id, name), 0, comp.size)]
    out, at = [], 0
    for p in comp.pieces:
        out.append((piece_key(run, p.holder, p.digest), at, p.size))
        at += p.size
    return out


def stored_at(run: str, ref: SaveRef, name: str, offset: int) -> tuple[str, int]:
    """The object holding byte ``offset`` of component ``name`` (negative: from its end), and
    that byte's offset in the object."""
    if offset < 0:
        offset += ref.components[name].size
    for key, at, size in stored_objects(run, ref, name):
        if at <= offset < at + size:
            return key, offset - at
    raise IndexError(f"{name!r} has no byte {offset}")
