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
present); a background thread writes, verifies and commits. At most
``max_inflight`` saves (default 1) are in flight, each with its own set of
host buffers (so host memory is bounded by ``max_inflight`` copies of the
state): a save that falls due while that many are still being written waits
for the oldest. Saves in flight write concurrently but commit in the order
they were taken (a save publishes only after the one before it finished), so
the newest commit is always the newest state. A background failure is raised
at the next ``step_end`` / ``save`` / ``close``.

A preemption signal (SIGTERM, SIGUSR1) is an extra chance, never the only one:
periodic saves carry the recovery promise. On a signal the next ``step_end``
saves synchronously, waits, and exits with status ``preempt_exit_code``
(default 75, ``EX_TEMPFAIL`` from sysexits.h: "temporary failure, retry
later"), so a supervisor that restarts until success (systemd
``Restart=on-failure``, Kubernetes ``restartPolicy: OnFailure``, a Slurm
requeue loop) restarts a preempted run and stops after a finished one (exit
0). ``exit_on_preempt=False`` returns True instead.

Built: every registered object is validated (saveable without pickle, a
plain DataLoader refused with the fix). Resume: the saved state is checked
against every live object before anything is loaded (classes, layouts,
shapes); hyperparameters that differ from the saved ones are reported and the
saved ones kept (``on_config_change="keep-saved"``, exact continuation), or
the configured ones taken and recorded (``"take-new"``), or refused
(``"refuse"``). A newest save that turns out corrupt while being read falls
back to the previous complete one (recorded as ``resume-fallback``).
Retention (``keep_last``, ``keep_every``) runs after each commit.
"""

from __future__ import annotations

import inspect
import signal
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch

from .. import (
    CheckpointStore,
    CorruptionError,
    InvalidInputError,
    SaveRef,
    SaveState,
)
from . import retention
from .codec import flatten
from .loaders import (
    ResumableLoader,
    fix_stateful_dataloader_resume,
    generator_pitfall,
    is_stateful_dataloader,
    live_iterator_problem,
    plain_loader_problem,
)
from .restore import (
    ConfigDiff,
    apply_state,
    check_fit,
    config_diffs,
    take_configured,
)
from .sampler import ResumableSampler, RngPitfallWarning
from .state import (
    RNG_KEY,
    CheckpointMismatchError,
    CopyStreams,
    HostBuffers,
    SavedState,
    check_name,
    collect,
    describe,
    has_state,
    read_save,
    snapshot,
    summarize,
    write_snapshot,
)

ConfigChoice = Literal["keep-saved", "take-new", "refuse"]

#: the exit status after "saved and exiting on preemption" (sysexits.h EX_TEMPFAIL)
EX_TEMPFAIL = 75


class ConfigChangeWarning(UserWarning):
    """Configured hyperparameters differ from the saved ones; the saved ones were kept."""


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
        keep_last: int | None = None,
        keep_every: int | None = None,
        retention_deep: bool = True,
        preempt_exit_code: int = EX_TEMPFAIL,
        on_config_change: ConfigChoice = "keep-saved",
        streams: CopyStreams | None = None,
        max_inflight: int = 1,
    ) -> None:
        if store.mode != "w":
            raise InvalidInputError("Checkpointer needs a store opened for writing (with an identity)")
        if every_steps is not None and every_steps <= 0:
            raise InvalidInputError("every_steps must be positive")
        if every_seconds is not None and every_seconds <= 0:
            raise InvalidInputError("every_seconds must be positive")
        retention.validate(keep_last, keep_every)
        if on_config_change not in ("keep-saved", "take-new", "refuse"):
            raise InvalidInputError("on_config_change must be 'keep-saved', 'take-new' or 'refuse'")
        if type(max_inflight) is not int or max_inflight < 1:
            raise InvalidInputError("max_inflight must be a positive integer")
        if not 0 <= preempt_exit_code <= 255:
            raise InvalidInputError("preempt_exit_code must be an exit status (0..255)")
        self.store = store
        self.objects = dict(objects)
        self._validate_objects()
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.retention_deep = retention_deep
        self.preempt_exit_code = preempt_exit_code
        self.on_config_change: ConfigChoice = on_config_change
        self.streams = streams
        #: hyperparameters that differed at resume (see on_config_change)
        self.config_diffs: list[ConfigDiff] = []
        #: problems retention met (it never stops training; each is also warned and recorded)
        self.retention_errors: list[str] = []
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.async_save = async_save
        self.exit_on_preempt = exit_on_preempt
        self.metadata = metadata
        self.record_events = record_events
        #: the module whose ``.grad`` tensors are saved with ``include_grads``
        self.model = model or next((o for o in self.objects.values() if hasattr(o, "named_parameters")), None)
        self.max_inflight = max_inflight
        self._buffers = HostBuffers()
        #: host-buffer sets not used by a save in flight (at most max_inflight sets ever exist)
        self._idle_buffers: list[HostBuffers] = [self._buffers]
        self._pool = (
            ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="ckptstore-save") if async_save else None
        )
        #: saves in flight, oldest first, with the buffers each holds
        self._inflight: deque[tuple[Future[SaveRef], HostBuffers]] = deque()
        self._retain_lock = threading.Lock()
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

    def _validate_objects(self) -> None:
        """Refuse, now rather than at the first due save, what cannot be saved."""
        for name, obj in self.objects.items():
            check_name(name)
            problem = plain_loader_problem(name, obj)
            if problem:
                raise InvalidInputError(problem)
            pitfall = generator_pitfall(name, obj)
            if pitfall:
                warnings.warn(pitfall, RngPitfallWarning, stacklevel=3)
            if is_stateful_dataloader(obj):
                continue  # its state_dict() would create an iterator (and start workers)
            try:
                flatten(obj.state_dict() if has_state(obj) else obj)
            except InvalidInputError as exc:
                raise InvalidInputError(f"{name}: cannot be saved: {exc}".replace("state[", f"state[{name!r}][", 1)
                                        ) from None
            if isinstance(obj, torch.optim.lr_scheduler.LambdaLR) and any(
                inspect.isfunction(f) for f in obj.lr_lambdas
            ):
                warnings.warn(
                    f"{name}: LambdaLR with a function: its horizon is not in its state, so a changed schedule "
                    "cannot be detected at resume; prefer a callable object (its attributes are saved) or "
                    "CosineAnnealingLR / OneCycleLR / SequentialLR",
                    ConfigChangeWarning,
                    stacklevel=3,
                )

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
    def resume(self, *, restore_rng_state: bool = True, on_config_change: ConfigChoice | None = None) -> int:
        """Restore the save this attempt resumed from; return the next step (0: fresh).

        Call it before creating any data iterator. Checks everything before
        loading anything; see the module docstring for ``on_config_change``."""
        ref = self.store.resumed_from
        if ref is None:
            if self.record_events:
                self.store.record_event("start", {"resumed_from": None})
            return 0
        choice = on_config_change or self.on_config_change
        for name, obj in self.objects.items():
            problem = live_iterator_problem(name, obj)
            if problem:
                raise InvalidInputError(problem)
        saved, ref = self._read_with_fallback(ref)
        check_fit(self.objects, saved, ref)
        diffs = config_diffs(self.objects, saved.trees)
        if diffs and choice == "refuse":
            raise CheckpointMismatchError(summarize(
                f"step {ref.step}: configured hyperparameters differ from the saved ones", [d.describe() for d in diffs]
            ))
        apply_state(self.objects, saved.trees, restore_rng_state=restore_rng_state)
        self.config_diffs = diffs
        if diffs:
            payload = {"step": ref.step, "choice": choice, "differences": [d.to_json() for d in diffs]}
            if choice == "take-new":
                take_configured(self.objects, diffs)
                self.store.record_event("config-change", payload)
            else:
                self.store.record_event("config-differs", payload)
                warnings.warn(
                    summarize(
                        f"resuming step {ref.step}: configured hyperparameters differ from the saved ones; the saved "
                        "ones are kept (exact continuation). Pass on_config_change='take-new' to change the "
                        "experiment (recorded), or 'refuse'",
                        [d.describe() for d in diffs],
                    ),
                    ConfigChangeWarning,
                    stacklevel=2,
                )
        self._last_scheduled_step = ref.step
        grads = saved.trees.get("grads")
        if grads and self.model is not None:
            for n, p in self.model.named_parameters():
                if n in grads:
                    p.grad = grads[n].to(p.device).clone()
        self._last_saved_step = ref.step
        self._arm_loaders(saved, restore_rng_state)
        if self.record_events:
            self.store.record_event("resume", {"resumed_from": ref.step, "save_id": ref.save_id})
        return ref.step + 1

    def _arm_loaders(self, saved: SavedState, restore_rng_state: bool) -> None:
        global_rng = torch.get_rng_state() if restore_rng_state else None
        gens = saved.trees.get(RNG_KEY, {}).get("generators", {}) if restore_rng_state else {}
        for name, obj in self.objects.items():
            if isinstance(obj, (ResumableSampler, ResumableLoader)) and global_rng is not None:
                obj.arm_after_resume(global_rng)
            elif is_stateful_dataloader(obj):
                fix_stateful_dataloader_resume(obj, dict(gens.get(name, {})), global_rng)

    def _read_with_fallback(self, ref: SaveRef) -> tuple[SavedState, SaveRef]:
        """Read the resume point; if its bytes turn out corrupt (possible with
        ``resume_verify="cheap"``, which checks sizes only), fall back to the
        newest older complete save that reads back intact, register an attempt
        that resumes from it (so the corrupt save leaves the run's history) and
        record why. Nothing has been applied when this returns."""
        try:
            return read_save(self.store, ref), ref
        except CorruptionError as exc:
            failures = [f"step {ref.step} ({ref.save_id}): {exc}"]
        candidates = [
            i.ref for i in self.store.list_saves()
            if i.state is SaveState.COMMITTED and i.ref is not None and (i.step, i.attempt) < (ref.step, ref.attempt)
        ]
        for cand in candidates:
            try:
                saved = read_save(self.store, cand)
            except CorruptionError as exc:
                failures.append(f"step {cand.step} ({cand.save_id}): {exc}")
                continue
            self.store.fall_back(cand, failures)  # a new attempt: the corrupt save leaves the run's history
            warnings.warn(summarize(
                f"resume point step {ref.step} is corrupt; resuming from step {cand.step} instead "
                f"(attempt {self.store.attempt.number if self.store.attempt else '?'} registered)",
                failures), RuntimeWarning, stacklevel=3)
            return saved, cand
        raise CorruptionError(summarize(
            f"run {self.store.run_id!r}: no complete save could be read back intact", failures
        ))

    # ------------------------------------------------------------ saving
    def _raise_background(self) -> None:
        while self._inflight and self._inflight[0][0].done():
            self._collect_oldest()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _collect_oldest(self) -> None:
        """Wait for the oldest save in flight; keep its error (the first one wins)."""
        fut, bufs = self._inflight.popleft()
        try:
            fut.result()
        except BaseException as exc:  # noqa: BLE001
            if self._error is None:
                self._error = exc
        finally:
            self._idle_buffers.append(bufs)

    def _collect(self) -> None:
        while self._inflight:
            self._collect_oldest()

    def wait(self) -> None:
        """Block until every save in flight is committed; raise the first error."""
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
        # a synchronous save waits for every save in flight; an asynchronous one for a free slot
        while self._inflight and (blocking or len(self._inflight) >= self.max_inflight):
            self._collect_oldest()
        self._raise_background()
        t0 = time.perf_counter()
        self._last_scheduled_step = step
        objects = dict(self.objects)
        state = collect(objects)
        meta = describe(objects)
        if include_grads:
            if self.model is None:
                raise InvalidInputError("include_grads needs a model among the objects")
            state["grads"] = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}
        bufs = None if blocking else (self._idle_buffers.pop() if self._idle_buffers else HostBuffers())
        try:
            snap = snapshot(state, bufs, streams=self.streams)
        except BaseException:
            if bufs is not None:
                self._idle_buffers.append(bufs)
            raise
        snap.objects = meta
        md = dict(self.metadata(step)) if self.metadata else {}
        md.update({"accumulating": accumulating})
        if blocking:
            ref = self._write(step, snap, md, t0, None)
            self.last_blocking_seconds = time.perf_counter() - t0
            return ref
        self.last_blocking_seconds = time.perf_counter() - t0
        assert self._pool is not None and bufs is not None
        before = self._inflight[-1][0] if self._inflight else None
        self._inflight.append((self._pool.submit(self._write, step, snap, md, t0, before), bufs))
        return None

    def _write(self, step: int, snap: Any, md: dict[str, Any], t0: float, before: Future[SaveRef] | None) -> SaveRef:
        def in_order() -> None:
            if before is not None:  # commit after the save taken before this one (its error is its own)
                try:
                    before.result()
                except BaseException:  # noqa: BLE001, S110 - collected and raised by the training thread
                    pass

        ref = write_snapshot(self.store, step, snap, metadata=md, before_publish=in_order)
        took = time.perf_counter() - t0
        self._last_save_time = time.monotonic()
        self._last_saved_step = step
        info = {"step": step, "seconds": round(took, 4), "bytes": ref.total_bytes, "save_id": ref.save_id}
        self.saves.append(info)
        if self.record_events:
            self.store.record_event("save", info)
        if self.keep_last is not None:
            with self._retain_lock:
                self._retain()
        return ref

    def _retain(self) -> None:
        """Retention after a commit, with gc's safety rules (the newest complete
        save is never deleted; in-flight and corrupt saves are kept). A failure
        never stops training: it is warned, recorded and kept in ``retention_errors``."""
        assert self.keep_last is not None
        try:
            self.store.gc(keep_last=self.keep_last, keep_every=self.keep_every, deep=self.retention_deep)
        except Exception as exc:  # noqa: BLE001 - the save is committed; retention must not fail it
            msg = f"retention after a save failed: {type(exc).__name__}: {exc}"
            self.retention_errors.append(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            if self.record_events:
                self.store.record_event("retention-failed", {"error": msg[:500]})

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
                raise SystemExit(self.preempt_exit_code)
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

    def __enter__(self) -> Checkpointer:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
