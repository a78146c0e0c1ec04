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
