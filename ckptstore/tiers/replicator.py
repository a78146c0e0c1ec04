"""Background replication of local publications to the durable tier, in
commit order (PROTOCOL.md §"Tiers").

One thread per tiered store. Each queued save is copied
(:func:`~ckptstore.tiers.durable_copy.copy_save`) component by component
from the local tier (every chunk verified against the manifest on the way: a
corrupt local copy is never replicated), its durable inventory is
checked, the durable pre-commit fence is passed, and the *same commit record
bytes* are created with the durable backend's create-if-absent, then the
post-commit fence. Failures are retried with the one backoff policy and never
reach the training loop; a writer fenced off in the durable tier stops
replicating for good. When more than ``max_lag`` saves wait, the oldest are
dropped (the newest wins) and that is recorded.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.bounded_io import RunIO
from ..core.fencing import AttemptLog
from ..core.intents import PieceTiming
from ..errors import (
    CkptStoreError,
    CommitConflictError,
    CorruptionError,
    SupersededError,
)
from ..protocol.selection import SaveRef
from ..retry import RetryPolicy
from ..util.redact import redact_text
from .durable_copy import EarlyUploads, copy_save
from .durable_intent import DurableIntent


@dataclass(frozen=True)
class PeerStatus:
    """One copy pair as this rank sees it: ``role`` "sends-to" (this rank's
    part goes to ``peer``) or "receives-from" (this rank holds ``peer``'s part)."""

    peer: int
    role: str
    last_step: int | None
    copies: int
    bytes: int
    skipped: int
    failures: int
    last_error: str | None
    stopped: bool

    def to_json(self) -> dict[str, Any]:
        return {"peer": self.peer, "role": self.role, "last_step": self.last_step, "copies": self.copies,
                "bytes": self.bytes, "skipped": self.skipped, "failures": self.failures,
                "last_error": self.last_error, "stopped": self.stopped}


@dataclass(frozen=True)
class ReplicationStatus:
    """Where replication stands: ``pending`` the steps committed locally and
    not yet durable (oldest first), ``lag`` their number; the newest durable
    step and when it became durable (seconds since the epoch; in this
    process); ``skipped`` (step, reason) of saves that will not be made
    durable; ``fenced`` once a newer attempt owns the run (nothing of this
    writer is replicated any more)."""

    pending: tuple[int, ...]
    last_local_step: int | None
    last_durable_step: int | None
    last_durable_at: float | None
    replicated: int
    skipped: tuple[tuple[int, str], ...]
    failures: int
    last_error: str | None
    fenced: bool
    #: many ranks: this rank's peer copy pairs (``docs/tiers.md`` "Peer copies")
    peers: tuple[PeerStatus, ...] = ()
    #: many ranks: "on", "stopped: <why>", or why they are off; None for one process
    peer_copies: str | None = None

    @property
    def lag(self) -> int:
        return len(self.pending)

    def durable_age_seconds(self, at: float | None = None) -> float | None:
        """Seconds since the newest durable save became durable (None: none yet in this process)."""
        if self.last_durable_at is None:
            return None
        return max(0.0, (time.time() if at is None else at) - self.last_durable_at)

    def to_json(self) -> dict[str, Any]:
        age = self.durable_age_seconds()
        return {
            "lag": self.lag, "pending": list(self.pending), "last_local_step": self.last_local_step,
            "last_durable_step": self.last_durable_step,
            "durable_age_seconds": None if age is None else round(age, 3), "replicated": self.replicated,
            "skipped": [[s, r] for s, r in self.skipped[-20:]], "failures": self.failures,
            "last_error": self.last_error, "fenced": self.fenced,
            "peers": [p.to_json() for p in self.peers], "peer_copies": self.peer_copies,
        }


#: ledger entries waiting for the durable tier, at most
MAX_OUTBOX = 1000


@dataclass
class _State:
    queue: deque[SaveRef] = field(default_factory=deque)
    busy: SaveRef | None = None
    last_local: int | None = None
    last_durable: int | None = None
    last_durable_at: float | None = None
    durable_ids: set[str] = field(default_factory=set)
    replicated: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)
    failures: int = 0
    last_error: str | None = None
    fenced: bool = False
    seen: int = 0


class Replicator:
    """The background thread of one tiered store (see the module docstring)."""

    def __init__(
        self, local: RunIO, durable: RunIO, attempts: AttemptLog, *, every: int, max_lag: int,
        retry: RetryPolicy, record: Callable[[str, Mapping[str, Any]], None],
        after: Callable[[int], None] | None = None,
        on_component: Callable[[str], None] | None = None,
        intent: DurableIntent | None = None,
        early: EarlyUploads | None = None,
        timing: PieceTiming | None = None,
        copy: Callable[[RunIO, RunIO, AttemptLog, SaveRef, Callable[[str], None] | None], bool] | None = None,
    ) -> None:
        self.local, self.durable, self.attempts = local, durable, attempts
        #: uploads of components begun before their save was committed locally
        self.early = early
        #: version 3: the save intent that protects the durable pieces a replication reuses
        self.intent = intent
        #: version 3: the run's window and intent lifetime (every intent of this replicator is judged by them)
        self.timing = timing if timing is not None else (intent.timing if intent is not None else PieceTiming())
        #: the step that makes one save durable in place of :func:`copy_save` (one rank of many:
        #: ``tiers.parts``, which holds its own intent; it takes no ``early``)
        self.copy = copy
        self.every, self.max_lag, self.retry = every, max_lag, retry
        self._record, self._after, self._on_component = record, after, on_component
        self._s = _State()
        self._outbox: deque[tuple[str, dict[str, Any]]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ckptstore-replicate", daemon=True)
        self._thread.start()

    def _event(self, kind: str, payload: Mapping[str, Any]) -> None:
        """Queue a ledger entry; the replication thread sends it (the ledger is
        in the durable tier, which may be away: entries wait, at most
        :data:`MAX_OUTBOX`, the oldest dropped first)."""
        with self._cond:
            self._outbox.append((kind, dict(payload)))
            while len(self._outbox) > MAX_OUTBOX:
                self._outbox.popleft()
            self._cond.notify_all()

    def _send_outbox(self) -> bool:
        """Send the waiting ledger entries, oldest first; False when the durable tier refused one."""
        while True:
            with self._cond:
                if not self._outbox:
                    return True
                kind, payload = self._outbox[0]
            try:
                self._record(kind, payload)
            except Exception:  # noqa: BLE001 - the durable tier is away: try again later
                return False
            with self._cond:
                if self._outbox and self._outbox[0][0] == kind:
                    self._outbox.popleft()
                self._cond.notify_all()

    # ---------------------------------------------------------------- input
    def submit(self, ref: SaveRef, *, force: bool = False) -> None:
        """Queue a local publication (``force``: regardless of ``every``)."""
        dropped: list[SaveRef] = []
        with self._cond:
            s = self._s
            s.last_local = ref.step if s.last_local is None else max(s.last_local, ref.step)
            s.seen += 1
            if s.fenced:
                s.skipped.append((ref.step, "fenced"))
                return
            if not force and (s.seen - 1) % self.every != 0:
                s.skipped.append((ref.step, f"replicate_every={self.every}"))
                return
            s.queue.append(ref)
            while len(s.queue) > self.max_lag:
                dropped.append(s.queue.popleft())
            for d in dropped:
                s.skipped.append((d.step, "behind"))
            self._cond.notify_all()
        for d in dropped:
            self._event("replication-skipped", {"step": d.step, "save_id": d.save_id, "reason": "behind",
                                                "newer_step": ref.step, "max_lag": self.max_lag})

    def mark_durable(self, ref: SaveRef) -> None:
        with self._cond:
            self._s.durable_ids.add(ref.save_id)
            if self._s.last_durable is None or ref.step >= self._s.last_durable:
                self._s.last_durable = ref.step

    def is_durable(self, save_id: str) -> bool:
        with self._cond:
            return save_id in self._s.durable_ids

    def takes_next(self) -> bool:
        """Whether the next local save would be replicated at once: not fenced,
        nothing waiting or being copied, and ``every`` picks it."""
        with self._cond:
            s = self._s
            return not s.fenced and not s.queue and s.busy is None and s.seen % self.every == 0

    def is_queued(self, save_id: str) -> bool:
        with self._cond:
            busy = self._s.busy
            return (busy is not None and busy.save_id == save_id) or any(r.save_id == save_id for r in self._s.queue)

    def status(self) -> ReplicationStatus:
        with self._cond:
            s = self._s
            pending = ([s.busy.step] if s.busy is not None else []) + [r.step for r in s.queue]
            return ReplicationStatus(tuple(pending), s.last_local, s.last_durable, s.last_durable_at, s.replicated,
                                     tuple(s.skipped), s.failures, s.last_error, s.fenced)

    def flush(self, timeout: float | None) -> bool:
        """Wait until nothing is pending (True) or ``timeout`` seconds passed (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._s.queue or self._s.busy is not None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
            # the ledger entries of what was just replicated, within what is left of the timeout (max 5 s)
            until = time.monotonic() + 5.0 if end is None else min(end, time.monotonic() + 5.0)
            while self._outbox and time.monotonic() < until:
                self._cond.wait(0.02)
            return True

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self._send_outbox()  # last try; what the durable tier cannot take now is lost with the process
        if self.intent is not None and not self._thread.is_alive():
            self.intent.close()
        if self.early is not None:
            self.early.close()

    def queue_event(self, kind: str, payload: Mapping[str, Any]) -> None:
        """A ledger entry the durable tier could not take now: sent later by the replication thread."""
        self._event(kind, payload)

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        while True:
            sent = self._send_outbox()
            with self._cond:
                while not self._s.queue and not self._stop:
                    if self._outbox:
                        if not sent:  # the durable tier refused an entry: look again in a while
                            self._cond.wait(1.0)
                        break  # (entries queued since the last send go at once)
                    self._cond.wait()
                if self._stop:
                    return
                if not self._s.queue:
                    continue
                ref = self._s.busy = self._s.queue.popleft()
            try:
                self._one(ref)
            except Exception as exc:  # noqa: BLE001 - a defect: say so and go on, never die holding ``busy``
                with self._cond:
                    self._s.failures += 1
                    self._s.last_error = f"{type(exc).__name__}: {redact_text(str(exc))}"[:500]
                self._skip(ref, "error", exc)
            with self._cond:
                self._s.busy = None
                self._cond.notify_all()
            if self._after is not None:
                try:
                    self._after(len(self._s.queue))
                except Exception:  # noqa: BLE001 - local retention must not stop replication
                    pass

    def _newer_waiting(self) -> bool:
        with self._cond:
            return bool(self._s.queue) and len(self._s.queue) >= self.max_lag

    def _one(self, ref: SaveRef) -> None:
        failures = 0
        early = self.early.take(ref.save_id) if self.early is not None else None
        while True:
            with self._cond:
                if self._stop:
                    return
            t0 = time.perf_counter()
            try:
                if self.copy is not None:
                    created = self.copy(self.local, self.durable, self.attempts, ref, self._on_component)
                else:
                    created = copy_save(self.local, self.durable, self.attempts, ref, self._on_component,
                                        timing=self.timing, intent=self.intent, early=early)
                early = None  # a retry uploads everything again
            except SupersededError as exc:
                with self._cond:
                    self._s.fenced = True
                    self._s.skipped.append((ref.step, "fenced"))
                    self._s.skipped += [(r.step, "fenced") for r in self._s.queue]
                    self._s.queue.clear()
                self._event("replication-fenced", {"step": ref.step, "save_id": ref.save_id,
                                                   "error": redact_text(str(exc))[:500]})
                return
            except (CorruptionError, CommitConflictError) as exc:
                self._skip(ref, "local-copy-bad" if isinstance(exc, CorruptionError) else "conflict", exc)
                return
            except (CkptStoreError, OSError) as exc:
                failures += 1
                msg = f"{type(exc).__name__}: {redact_text(str(exc))}"[:500]
                with self._cond:
                    self._s.failures += 1
                    self._s.last_error = msg
                if failures in (1, 10) or failures % 100 == 0:
                    self._event("replication-failed", {"step": ref.step, "save_id": ref.save_id,
                                                       "tries": failures, "error": msg})
                if self._newer_waiting():  # newer saves are waiting and the bound is reached: the newest wins
                    self._skip(ref, "behind", exc)
                    return
                self._sleep(failures)
                continue
            took = time.perf_counter() - t0
            with self._cond:
                s = self._s
                s.durable_ids.add(ref.save_id)
                s.replicated += 1
                s.last_error = None
                if s.last_durable is None or ref.step >= s.last_durable:
                    s.last_durable, s.last_durable_at = ref.step, time.time()
            self._event("replicated", {"step": ref.step, "save_id": ref.save_id, "bytes": ref.total_bytes,
                                       "seconds": round(took, 4), "created": created, "tries": failures + 1})
            return

    def _sleep(self, failures: int) -> None:
        delay = min(self.retry.max_delay, self.retry.base_delay * (2 ** min(failures, 30)))
        with self._cond:
            self._cond.wait(delay)

    def _skip(self, ref: SaveRef, reason: str, exc: BaseException) -> None:
        with self._cond:
            self._s.skipped.append((ref.step, reason))
        self._event("replication-skipped", {"step": ref.step, "save_id": ref.save_id, "reason": reason,
                                            "error": redact_text(str(exc))[:500]})
