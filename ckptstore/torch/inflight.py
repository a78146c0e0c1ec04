"""Asynchronous saves in flight: how many, which host buffers each holds, and
the order they commit in (used by :class:`~ckptstore.torch.Checkpointer`).

Each save runs on its own daemon thread, so a save that waits for a dead
peer never keeps the interpreter alive. At interpreter exit the saves still
in flight are waited for (one process: they depend on the storage only), or,
on many ranks (``abandon`` given and answering True), their waits for other ranks are abandoned
and they are waited for at most :data:`EXIT_WAIT_RANKS` seconds; an abandoned
save publishes nothing."""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

from ..protocol.selection import SaveRef
from ..util.shutdown import before_pools_stop
from .state import HostBuffers

#: what a queued save runs: it gets ``in_order``, to call just before it publishes
SaveJob = Callable[[Callable[[], None]], SaveRef]
#: seconds a save still in flight at interpreter exit is waited for on many ranks
EXIT_WAIT_RANKS = 10.0


class SaveQueue:
    """At most ``limit`` saves in flight, each with its own set of host buffers
    (so host memory is bounded by ``limit`` copies of the state); they write
    concurrently but commit in the order they were queued, and the first
    background error is kept for the training thread to raise."""

    def __init__(self, limit: int, first: HostBuffers, *, abandon: Callable[[], bool] | None = None) -> None:
        self.limit = limit
        self.abandon = abandon
        #: buffer sets not held by a save in flight (at most ``limit`` sets ever exist)
        self.idle: list[HostBuffers] = [first]
        self._open = True
        _OPEN.add(self)
        self._items: deque[tuple[Future[SaveRef], HostBuffers]] = deque()
        self.error: BaseException | None = None

    def __len__(self) -> int:
        return len(self._items)

    def buffers(self) -> HostBuffers:
        """A free buffer set (call :meth:`make_room` first)."""
        return self.idle.pop() if self.idle else HostBuffers()

    def submit(self, job: SaveJob, bufs: HostBuffers) -> None:
        """Queue a save that holds ``bufs`` until it finishes."""
        if not self._open:
            raise RuntimeError("the save queue is shut down")
        before = self._items[-1][0] if self._items else None

        def in_order() -> None:
            if before is not None:  # commit after the save queued before this one (its error is its own)
                try:
                    before.result()
                except BaseException:  # noqa: BLE001, S110 - collected and raised by the training thread
                    pass

        fut: Future[SaveRef] = Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(job(in_order))
            except BaseException as exc:  # noqa: BLE001 - kept for the training thread
                fut.set_exception(exc)

        # at most ``limit`` are in flight: the caller made room first
        threading.Thread(target=run, name="ckptstore-save", daemon=True).start()
        self._items.append((fut, bufs))

    def collect_oldest(self) -> None:
        """Wait for the oldest save in flight; keep its error (the first one wins)."""
        fut, bufs = self._items.popleft()
        try:
            fut.result()
        except BaseException as exc:  # noqa: BLE001
            if self.error is None:
                self.error = exc
        finally:
            self.idle.append(bufs)

    def collect_done(self) -> None:
        while self._items and self._items[0][0].done():
            self.collect_oldest()

    def make_room(self, *, everything: bool) -> None:
        """Wait until a slot is free (``everything``: until nothing is in flight)."""
        while self._items and (everything or len(self._items) >= self.limit):
            self.collect_oldest()

    def take_error(self) -> BaseException | None:
        err, self.error = self.error, None
        return err

    def wait_all(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: no bound) for every save in
        flight to finish, without collecting them; True if none is left running."""
        _, running = wait_futures([f for f, _ in self._items], timeout=timeout)
        return not running

    def shutdown(self) -> None:
        self.make_room(everything=True)
        self._open = False
        _OPEN.discard(self)

    def leave(self) -> None:
        """At interpreter exit: settle the saves still in flight (module docstring)."""
        if not self._items:
            return
        waits_for_ranks = self.abandon() if self.abandon is not None else False
        self.wait_all(EXIT_WAIT_RANKS if waits_for_ranks else None)


# Queues not shut down yet (their Checkpointer was not closed).
_OPEN: weakref.WeakSet[SaveQueue] = weakref.WeakSet()


def _settle_at_exit() -> None:
    for queue in list(_OPEN):
        queue.leave()


before_pools_stop(_settle_at_exit)  # util.shutdown: while pools take work, before the tiers flush
