"""An in-memory :class:`~ckptstore.tiers.PeerLink` for tests: the peer copies'
frames travel between threads of one process as they travel between
processes over ``GlooPeerLink``. Test modules import it (``from tests.peer_wire
import Wire``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ckptstore.tiers import PeerCopyError

WAIT = 0.3  # seconds a receive waits for bytes by default


class Wire:
    """Every rank's end of an in-memory link: one byte stream per (sender,
    receiver), so a lying sender may send any bytes in any cut. A receive
    that does not get its bytes in :data:`WAIT` seconds is :class:`PeerCopyError`
    (as ``GlooPeerLink`` on the group's timeout)."""

    def __init__(self, wait: float = WAIT) -> None:
        self.wait = wait
        self.cond = threading.Condition()
        self.streams: dict[tuple[int, int], bytearray] = {}

    def end(self, rank: int) -> End:
        return End(self, rank)

    def left(self, src: int, dst: int) -> bytes:
        with self.cond:
            return bytes(self.streams.get((src, dst), b""))


@dataclass
class End:
    wire: Wire
    rank: int

    def send(self, dst: int, data: bytes | bytearray | memoryview) -> None:
        with self.wire.cond:
            self.wire.streams.setdefault((self.rank, dst), bytearray()).extend(bytes(data))
            self.wire.cond.notify_all()

    def recv(self, src: int, n: int) -> bytes:
        with self.wire.cond:
            buf = self.wire.streams.setdefault((src, self.rank), bytearray())
            if not self.wire.cond.wait_for(lambda: len(buf) >= n, self.wire.wait):
                raise PeerCopyError(f"rank {self.rank}: rank {src} did not answer in time")
            out = bytes(buf[:n])
            del buf[:n]
            return out
