"""Checkpointer: the training-loop integration.

    ckpt = Checkpointer(store, {"model": model, "optimizer": opt, "scheduler": sched,
                                "scaler": scaler, "sampler": sampler}, every_steps=100)
    start = ckpt.resume()                     # next step to run (0 on a fresh run)
    for step in range(start, total_steps):
        ...one optimizer step...
        ckpt.step_end(step)                   # saves when due; on SIGTERM/SIGUSR1 saves and exits
    ckpt.close()                              # waits for the last save; raises its error if any

Saves happen at optimizer-step boundaries, after the step's update: a save
named ``step`` holds the state after step ``step``, and resuming continues at
``step + 1``.

Asynchronous saving (default): ``step_end`` blocks only while the state is
copied into reused host buffers (pinned, on a side stream, when CUDA is
present); a background thread writes, verifies and commits. At most one save
is in flight: a save that falls due while another is still being written
waits for it. A background failure is raised at the next ``step_end`` /
``save`` / ``close``.

A preemption signal (SIGTERM, SIGUSR1) is an extra chance, never the only one:
periodic saves carry the recovery promise. On a signal the next ``step_end``
saves synchronously, waits, and exits with status 0 (or returns True with
``exit_on_preempt=False``).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import InvalidInputError
from ..store import CheckpointStore, SaveRef
from .state import HostBuffers, collect, restore_state, snapshot, write_snapshot


class Checkpointer:
    def __init__(
        self,
        store: CheckpointStore,
        objects: Mapping[str, Any],
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        async_save: bool = True,
        handle_signals: bool = True,
        exit_on_preempt: bool = True,
        signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1),
        metadata: Callable[[int], Mapping[str, Any]] | None = None,
        record_events: bool = True,
        model: Any = None,
    ) -> None:
        if store.mode != "w":
            raise InvalidInputError("Checkpointer needs a store opened for writing (with an identity)")
        if every_steps is not None and every_steps <= 0:
            raise InvalidInputError("every_steps must be positive")
        if every_seconds is not None and every_seconds <= 0:
            raise InvalidInputError("every_seconds must be positive")
        self.store = store
        self.objects = dict(objects)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.async_save = async_save
        self.exit_on_preempt = exit_on_preempt
        self.metadata = metadata
        self.record_events = record_events
        #: the module whose ``.grad`` tensors are saved with ``include_grads``
        self.model = model or next((o for o in self.objects.values() if hasattr(o, "named_parameters")), None)
        self._buffers = HostBuffers()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptstore-save") if async_save else None
        self._inflight: Future[SaveRef] | None = None
        self._error: BaseException | None = None
        self._last_save_time = time.monotonic()
        self._last_saved_step: int | None = None
        self._last_scheduled_step: int | None = None
        self._preempted = threading.Event()
        self._old_handlers: dict[int, Any] = {}
        self.saves: list[dict[str, Any]] = []
        self.last_blocking_seconds = 0.0
        if handle_signals and threading.current_thread() is threading.main_thread():
            for s in signals:
                self._old_handlers[s] = signal.signal(s, self._on_signal)

    # ------------------------------------------------------------ signals
    def _on_signal(self, signum: int, frame: Any) -> None:
        self._preempted.set()

    @property
    def preempted(self) -> bool:
        return self._preempted.is_set()

    def request_preemption(self) -> None:
        """What a signal does; for schedulers that announce preemption otherwise."""
        self._preempted.set()

    # ------------------------------------------------------------ resume
    def resume(self, *, restore_rng_state: bool = True) -> int:
        """Restore the save this attempt resumed from; return the next step (0: fresh)."""
        ref = self.store.resumed_from
        if ref is None:
            if self.record_events:
                self.store.record_event("start", {"resumed_from": None})
            return 0
        saved = restore_state(self.store, ref, self.objects, restore_rng_state=restore_rng_state)
        self._last_scheduled_step = ref.step
        grads = saved.get("grads")
        if grads and self.model is not None:
            for n, p in self.model.named_parameters():
                if n in grads:
                    p.grad = grads[n].to(p.device).clone()
        self._last_saved_step = ref.step
        if self.record_events:
            self.store.record_event("resume", {"resumed_from": ref.step, "save_id": ref.save_id})
        return ref.step + 1

    # ------------------------------------------------------------ saving
    def _raise_background(self) -> None:
        if self._inflight is not None and self._inflight.done():
            self._collect()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _collect(self) -> None:
        fut, self._inflight = self._inflight, None
        if fut is None:
            return
        try:
            fut.result()
        except BaseException as exc:  # noqa: BLE001
            self._error = exc

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; raise its error."""
        self._collect()
        self._raise_background()

    def due(self, step: int) -> bool:
        if self.every_steps is not None and (step + 1) % self.every_steps == 0:
            return True
        return self.every_seconds is not None and time.monotonic() - self._last_save_time >= self.every_seconds

    def save(
        self, step: int, *, blocking: bool | None = None, accumulating: bool = False, include_grads: bool = False
    ) -> SaveRef | None:
        """Save now. ``accumulating=True`` declares that a gradient-accumulation
        cycle is open; such a save is refused unless ``include_grads=True``,
        which saves the accumulated ``.grad`` tensors too (restored on resume).
        Returns the ref when the save is synchronous, else None."""
        self._raise_background()
        if accumulating and not include_grads:
            raise InvalidInputError(
                f"step {step}: refusing to save in the middle of a gradient-accumulation cycle; the accumulated "
                "gradients would be lost. Save at the optimizer-step boundary, or pass include_grads=True."
            )
        blocking = (not self.async_save) if blocking is None else blocking
        # at most one save in flight
        if self._inflight is not None:
            self._collect()
            self._raise_background()
        t0 = time.perf_counter()
        self._last_scheduled_step = step
        objects = dict(self.objects)
        state = collect(objects)
        if include_grads:
            if self.model is None:
                raise InvalidInputError("include_grads needs a model among the objects")
            state["grads"] = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}
        snap = snapshot(state, self._buffers if not blocking else None)
        md = dict(self.metadata(step)) if self.metadata else {}
        md.update({"accumulating": accumulating})
        if blocking:
            ref = self._write(step, snap, md, t0)
            self.last_blocking_seconds = time.perf_counter() - t0
            return ref
        self.last_blocking_seconds = time.perf_counter() - t0
        assert self._pool is not None
        self._inflight = self._pool.submit(self._write, step, snap, md, t0)
        return None

    def _write(self, step: int, snap: Any, md: dict[str, Any], t0: float) -> SaveRef:
        ref = write_snapshot(self.store, step, snap, metadata=md)
        took = time.perf_counter() - t0
        self._last_save_time = time.monotonic()
        self._last_saved_step = step
        info = {"step": step, "seconds": round(took, 4), "bytes": ref.total_bytes, "save_id": ref.save_id}
        self.saves.append(info)
        if self.record_events:
            self.store.record_event("save", info)
        return ref

    def step_end(self, step: int, **save_kw: Any) -> bool:
        """Call after each optimizer step. Saves when due; on preemption saves
        synchronously and exits (or returns True). Returns False otherwise."""
        self._raise_background()
        if self.preempted:
            self.wait()
            if self._last_scheduled_step != step:
                self.save(step, blocking=True, **save_kw)
            if self.record_events:
                self.store.record_event("preempted", {"step": step})
            self.close()
            if self.exit_on_preempt:
                raise SystemExit(0)
            return True
        if self.due(step):
            self.save(step, **save_kw)
        return False

    def finish(self, step: int) -> SaveRef | None:
        """End of training: make sure ``step`` (the last one) is saved, wait, close."""
        ref = None
        if self._last_scheduled_step != step:
            ref = self.save(step, blocking=True)
        self.close()
        return ref

    def close(self) -> None:
        """Wait for the in-flight save, restore signal handlers, raise a pending error."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            for s, h in self._old_handlers.items():
                try:
                    signal.signal(s, h)
                except (ValueError, TypeError):
                    pass
            self._old_handlers.clear()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
