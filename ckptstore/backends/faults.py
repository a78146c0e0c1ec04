"""A fault-injecting wrapper around any backend.

Public: the recovery drill kills its trainer processes with it, and the test
suites inject every fault of PROTOCOL.md with it.

Faults are scheduled by operation number (every backend call counts, reads
included) or by a predicate on (op, key). Each call is recorded in ``trace`` so
a failing test can print the exact sequence of operations.

Faults:

* ``crash_at(n)``: operation ``n`` and everything after it raise
  :class:`Crashed` without touching storage (the process "died" before it).
* ``fail(n, exc, persistent=False)``: operation ``n`` (and, if persistent,
  every later operation of the same kind) raises ``exc`` without effect.
* ``torn(n, keep)``: a write lands with only its first ``keep`` bytes, then the
  call raises :class:`Crashed` (power loss mid-write on a backend that does not
  write atomically).
* ``flip_at_rest(key, offset)``: flips one bit of a stored object.
* ``flip_in_flight(n, offset)``: the data of write ``n`` lands with a bit flipped
  (the caller believes it wrote the original) — or a read returns a flipped bit.
* ``lose_ack(n)``: the write/create lands, then the call raises
  :class:`TransientError` (the reply was lost).
* ``slow(n, seconds)``: the call sleeps first.
* ``drop_put(n)``: a put is acknowledged but **nothing lands** (the bytes are
  consumed, the call returns normally, the object does not exist).
* ``short_put(n, missing)``: a put is acknowledged but the object holds its
  first ``size - missing`` bytes only (a server or cache that lost the tail).
"""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import TransientError
from .base import Backend, Buffer, ObjectInfo

__all__ = ["Crashed", "Fault", "FaultyBackend", "TraceEntry", "transient"]


class Crashed(BaseException):
    """The simulated process died. A BaseException, so ``except Exception``
    in the code under test cannot swallow it (a real SIGKILL cannot be caught)."""


@dataclass
class Fault:
    kind: str
    at: int | None = None
    predicate: Callable[[str, str], bool] | None = None
    exc: BaseException | None = None
    persistent: bool = False
    keep: int = 0
    offset: int = 0
    seconds: float = 0.0
    fired: bool = False

    def matches(self, n: int, op: str, key: str) -> bool:
        if self.fired and not self.persistent:
            return False
        if self.at is not None and n != self.at and not (self.persistent and self.fired and n > self.at):
            return False
        return self.predicate is None or self.predicate(op, key)


@dataclass
class TraceEntry:
    n: int
    op: str
    key: str
    outcome: str

    def __str__(self) -> str:
        return f"#{self.n} {self.op}({self.key}) -> {self.outcome}"


@dataclass
class FaultyBackend(Backend):
    inner: Backend
    faults: list[Fault] = field(default_factory=list)
    trace: list[TraceEntry] = field(default_factory=list)
    count: int = 0
    crashed: bool = False

    def __post_init__(self) -> None:
        self.capabilities = self.inner.capabilities
        self.url = self.inner.url
        self._lock = threading.Lock()

    # -- scheduling ------------------------------------------------------
    def crash_at(self, n: int) -> FaultyBackend:
        self.faults.append(Fault("crash", at=n, persistent=True))
        return self

    def crash_when(self, pred: Callable[[str, str], bool]) -> FaultyBackend:
        self.faults.append(Fault("crash", predicate=pred, persistent=True))
        return self

    def fail(self, n: int | None, exc: BaseException, *, persistent: bool = False,
             when: Callable[[str, str], bool] | None = None) -> FaultyBackend:
        self.faults.append(Fault("fail", at=n, predicate=when, exc=exc, persistent=persistent))
        return self

    def torn(self, n: int, keep: int) -> FaultyBackend:
        self.faults.append(Fault("torn", at=n, keep=keep))
        return self

    def flip_in_flight(self, n: int, offset: int = 0) -> FaultyBackend:
        self.faults.append(Fault("flip", at=n, offset=offset))
        return self

    def lose_ack(self, n: int | None = None, when: Callable[[str, str], bool] | None = None) -> FaultyBackend:
        self.faults.append(Fault("lose_ack", at=n, predicate=when))
        return self

    def drop_put(self, n: int | None = None, when: Callable[[str, str], bool] | None = None) -> FaultyBackend:
        """Acknowledge a put without storing anything."""
        self.faults.append(Fault("drop", at=n, predicate=when))
        return self

    def short_put(self, n: int | None = None, missing: int = 1,
                  when: Callable[[str, str], bool] | None = None) -> FaultyBackend:
        """Acknowledge a put but store it without its last ``missing`` bytes."""
        self.faults.append(Fault("short", at=n, predicate=when, keep=missing))
        return self

    def slow(self, n: int | None, seconds: float, when: Callable[[str, str], bool] | None = None) -> FaultyBackend:
        self.faults.append(Fault("slow", at=n, predicate=when, seconds=seconds, persistent=n is None))
        return self

    def slow_stream(self, seconds: float, when: Callable[[str, str], bool]) -> FaultyBackend:
        """Stall in the middle of a matching put, after its first chunk was handed
        to the inner backend: a process killed then dies *while bytes are being written*."""
        self.faults.append(Fault("slow_stream", predicate=when, seconds=seconds, persistent=True))
        return self

    def flip_at_rest(self, key: str, offset: int = 0) -> None:
        data = bytearray(self.inner.get(key))
        data[offset % max(1, len(data))] ^= 0x01
        self.inner.put(key, [bytes(data)])

    def format_trace(self) -> str:
        return "\n".join(str(t) for t in self.trace)

    # -- machinery -------------------------------------------------------
    def _begin(self, op: str, key: str) -> tuple[int, Fault | None]:
        with self._lock:
            self.count += 1
            n = self.count
            if self.crashed:
                self.trace.append(TraceEntry(n, op, key, "crashed (dead process)"))
                raise Crashed(f"op #{n} {op}({key}) after crash")
            chosen = None
            for f in self.faults:
                if f.matches(n, op, key):
                    chosen = f
                    break
            if chosen is not None and chosen.kind == "crash":
                chosen.fired = True
                self.crashed = True
                self.trace.append(TraceEntry(n, op, key, "CRASH before effect"))
                raise Crashed(f"crash injected at op #{n} {op}({key})")
            if chosen is not None and chosen.kind == "fail":
                if chosen.predicate is not None and chosen.at is None and not chosen.persistent and chosen.fired:
                    chosen = None
                else:
                    chosen.fired = True
                    self.trace.append(TraceEntry(n, op, key, f"FAIL {type(chosen.exc).__name__}"))
                    raise chosen.exc  # type: ignore[misc]
            if chosen is not None and chosen.kind == "slow":
                time.sleep(chosen.seconds)
                chosen = None
            if chosen is not None and chosen.kind in ("slow_stream", "drop", "short") and op != "put":
                chosen = None
            if chosen is not None:
                chosen.fired = True
            return n, chosen

    def _end(self, n: int, op: str, key: str, outcome: str) -> None:
        with self._lock:
            self.trace.append(TraceEntry(n, op, key, outcome))

    @staticmethod
    def _collect(chunks: Iterable[Buffer]) -> bytes:
        return b"".join(bytes(c) for c in chunks)

    @staticmethod
    def _flip(data: bytes, offset: int) -> bytes:
        if not data:
            return data
        b = bytearray(data)
        b[offset % len(b)] ^= 0x01
        return bytes(b)

    # -- interface -------------------------------------------------------
    def get(self, key: str) -> bytes:
        n, f = self._begin("get", key)
        data = self.inner.get(key)
        if f is not None and f.kind == "flip":
            data = self._flip(data, f.offset)
        self._end(n, "get", key, f"ok {len(data)}B")
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        n, f = self._begin("get_range", key)
        data = self.inner.get_range(key, start, end)
        if f is not None and f.kind == "flip":
            data = self._flip(data, f.offset)
        self._end(n, "get_range", key, f"ok {len(data)}B")
        return data

    def put(self, key: str, chunks: Iterable[Buffer]) -> None:
        n, f = self._begin("put", key)
        if f is not None and f.kind == "slow_stream":
            secs = f.seconds

            def stalled() -> Iterable[Buffer]:
                first = True
                for c in chunks:
                    mv = memoryview(c)
                    if first and len(mv) > 1:
                        yield mv[: len(mv) // 2]
                        time.sleep(secs)
                        yield mv[len(mv) // 2 :]
                    else:
                        yield mv
                    first = False

            self.inner.put(key, stalled())
            self._end(n, "put", key, f"ok (stalled {secs}s mid-write)")
            return
        if f is None:
            self.inner.put(key, chunks)
            self._end(n, "put", key, "ok")
            return
        data = self._collect(chunks)
        if f.kind == "torn":
            self.inner.put(key, [data[: f.keep]])
            with self._lock:
                self.crashed = True
            self._end(n, "put", key, f"TORN {f.keep}/{len(data)}B then crash")
            raise Crashed(f"torn write at op #{n}")
        if f.kind == "flip":
            self.inner.put(key, [self._flip(data, f.offset)])
            self._end(n, "put", key, "ok (bit flipped in flight)")
            return
        if f.kind == "drop":
            self._end(n, "put", key, f"ACKED, {len(data)}B DROPPED (nothing stored)")
            return
        if f.kind == "short":
            kept = data[: max(0, len(data) - f.keep)]
            self.inner.put(key, [kept])
            self._end(n, "put", key, f"ACKED, only {len(kept)}/{len(data)}B stored")
            return
        if f.kind == "lose_ack":
            self.inner.put(key, [data])
            self._end(n, "put", key, "landed, ACK LOST")
            raise TransientError(f"simulated lost reply for put({key})")
        self.inner.put(key, [data])
        self._end(n, "put", key, "ok")

    def create(self, key: str, data: bytes) -> bool:
        n, f = self._begin("create", key)
        if f is not None and f.kind == "torn":
            # an atomic create never tears: either nothing or everything lands
            with self._lock:
                self.crashed = True
            self._end(n, "create", key, "crash before effect (creates are atomic)")
            raise Crashed(f"crash at create op #{n}")
        if f is not None and f.kind == "flip":
            data = self._flip(data, f.offset)
        created = self.inner.create(key, data)
        if f is not None and f.kind == "lose_ack":
            self._end(n, "create", key, f"{'created' if created else 'exists'}, ACK LOST")
            raise TransientError(f"simulated lost reply for create({key})")
        self._end(n, "create", key, "created" if created else "exists")
        return created

    def list(self, prefix: str, *, flat: bool = False) -> list[ObjectInfo]:
        n, _ = self._begin("list", prefix)
        out = self.inner.list(prefix, flat=flat)
        self._end(n, "list", prefix, f"{len(out)} objects")
        return out

    def list_keys(
        self, prefix: str, *, start_after: str = "", limit: int | None = None, flat: bool = False
    ) -> builtins.list[str]:
        n, _ = self._begin("list_keys", prefix)
        out = self.inner.list_keys(prefix, start_after=start_after, limit=limit, flat=flat)
        self._end(n, "list_keys", prefix, f"{len(out)} keys")
        return out

    def size(self, key: str) -> int:
        n, _ = self._begin("size", key)
        out = self.inner.size(key)
        self._end(n, "size", key, f"{out}")
        return out

    def delete(self, key: str) -> None:
        n, _ = self._begin("delete", key)
        self.inner.delete(key)
        self._end(n, "delete", key, "ok")

    def list_incomplete(self, prefix: str, older_than: float) -> builtins.list[str]:
        n, _ = self._begin("list_incomplete", prefix)
        out = self.inner.list_incomplete(prefix, older_than)
        self._end(n, "list_incomplete", prefix, f"{len(out)} entries")
        return out

    def remove_incomplete(self, handle: str) -> None:
        n, _ = self._begin("remove_incomplete", handle)
        self.inner.remove_incomplete(handle)
        self._end(n, "remove_incomplete", handle, "ok")

    def close(self) -> None:
        self.inner.close()


def transient(msg: str = "injected 503 Slow Down") -> TransientError:
    return TransientError(msg)


