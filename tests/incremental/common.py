"""Shared pieces of the incremental-save tests (PROTOCOL.md §9)."""

from __future__ import annotations

import os
import time

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.core.pieces import PieceTiming
from ckptstore.protocol.pieces import PACK_BYTES, PIECE_BYTES

IDENT = {"data_digest": "data-21", "code_digest": "code-21"}
RUN = "inc"
#: short times, so that intents expire and pieces age within a test
TIMING = PieceTiming(window=0.2, intent_ttl=1.0)
GRACE = 1.0
#: a frozen backbone of two large pieces (the last one short) before the head
FROZEN = os.urandom(PIECE_BYTES + PACK_BYTES + 12345)


def open_store(backend: Backend, **kw: object) -> CheckpointStore:
    return CheckpointStore.open(backend, RUN, identity=IDENT, protocol_version=3, piece_timing=TIMING, **kw)  # type: ignore[arg-type]


def head(step: int) -> bytes:
    return f"head@{step}".encode() * 5000


def save(store: CheckpointStore, step: int, frozen: bytes = FROZEN) -> bytes:
    """One save of a frozen part and a changing head; the model bytes it saved."""
    with store.save(step) as w:
        w.put("model", [memoryview(frozen), memoryview(head(step))])
        w.put("state.json", f'{{"step": {step}}}'.encode())
    return frozen + head(step)


def age_past_grace() -> None:
    time.sleep(GRACE + 0.1)


#: an intent lifetime (and gc grace) no test step overruns: races are decided by the injected clocks below
LONG = 3600.0


class Clock:
    """An injected wall clock (``PieceTiming.clock``): the real one shifted by
    ``offset`` seconds, or ``fixed`` when set. Tests age intents and pieces by
    moving it, never by waiting for a window a loaded machine overruns."""

    def __init__(self, offset: float = 0.0, fixed: float | None = None) -> None:
        self.offset, self.fixed = offset, fixed

    def __call__(self) -> float:
        return self.fixed if self.fixed is not None else time.time() + self.offset


def long_timing(clock: Clock | None = None) -> PieceTiming:
    return PieceTiming(window=TIMING.window, intent_ttl=LONG, clock=clock or Clock())


def gc_clock_past(backend: Backend, holder: str) -> Clock:
    """A gc clock (for a grace of LONG) at which every piece ``holder`` wrote is
    just old enough to sweep, and every piece written a second or more later
    is still young (object stores list times in whole seconds)."""
    from ckptstore.protocol.layout import pieces_prefix

    times = [o.mtime for o in backend.list(pieces_prefix(RUN) + f"{holder}/")]
    assert times, f"no pieces under {holder}"
    return Clock(fixed=max(times) + LONG + 0.5)
