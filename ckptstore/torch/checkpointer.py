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

On many ranks (a RankStore) the preemption is agreed by an all-reduce at
every ``step_end`` (:mod:`ckptstore.distributed.agreement`): every rank saves
the same step or none; a signal makes saves give up on silent peers within
seconds; saves in flight at exit are abandoned (:mod:`.inflight`).

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
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import torch

from .. import (
    Backend,
    CheckpointStore,
    InvalidInputError,
    OpenOptions,
    RunIdentity,
    SaveRef,
)
from ..options import FLAT_KEYWORDS, options_from_keywords
from . import retention
from .codec import flatten
from .contract import CheckpointerStore
from .inflight import SaveQueue
from .loaders import (
    ResumableLoader,
    fix_stateful_dataloader_resume,
    is_stateful_dataloader,
    live_iterator_problem,
    plain_loader_problem,
    warn_inexact_resume,
)
from .metrics import CheckpointerMetrics, save_event, wasted_since
from .restore import (
    ConfigDiff,
    apply_state,
    check_fit,
    config_diffs,
    read_with_fallback,
    take_configured,
)
from .sampler import ResumableSampler
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
    snapshot,
    summarize,
    write_snapshot,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

ConfigChoice = Literal["keep-saved", "take-new", "refuse"]

#: the exit status after "saved and exiting on preemption" (sysexits.h EX_TEMPFAIL)
EX_TEMPFAIL = 75


class ConfigChangeWarning(UserWarning):
    """Configured hyperparameters differ from the saved ones; the saved ones were kept."""


def _check_choices(
    store: CheckpointerStore, every_steps: int | None, every_seconds: float | None, keep_last: int | None,
    keep_every: int | None, on_config_change: str, max_inflight: int, preempt_exit_code: int,
) -> None:
    """Refuse a Checkpointer's unusable choices (:class:`InvalidInputError`) before anything is built."""
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


class Checkpointer:
    """Saves and resumes a whole training state at optimizer-step boundaries.

    What it promises:

    - **Nothing unverified is applied.** :meth:`resume` reads the attempt's
      resume point in one pass, every byte checked against its BLAKE3 digest
      in the commit record while it is read, and checks the saved state
      against every live object (keys, shapes, dtypes, optimizer class and
      layout) before anything is loaded. A save whose bytes are corrupt is
      skipped for the newest older one that reads back intact (recorded as a
      new attempt and a ``resume-fallback`` event); nothing of the corrupt
      one reaches the objects.
    - **A step is saved whole or not at all.** A save named ``step`` holds
      the state after that step (every object, the RNG states, the data
      position); it is published by one atomic commit, so a crash leaves the
      previous save as the newest complete one.
    - **Training waits only for the copy.** With ``async_save`` (default),
      :meth:`step_end` blocks while the state is copied into reused host
      buffers; writing, verifying and committing happen in the background,
      commits in step order, at most ``max_inflight`` saves in flight. A
      background failure is raised at the next :meth:`step_end`,
      :meth:`save` or :meth:`close`.
    - **Preemption is an extra chance.** On SIGTERM / SIGUSR1 the next
      :meth:`step_end` saves, waits, and exits with ``preempt_exit_code``
      (on many ranks: every rank the same step, or none).

    The one-call way in is :meth:`open` (store and Checkpointer together,
    resuming in one verified pass); the constructor takes a store opened for
    writing. See the module docstring for the full behaviour.
    """

    @classmethod
    def open(
        cls,
        url: str | os.PathLike[str] | Backend,
        run_id: str,
        identity: RunIdentity | Mapping[str, Any],
        objects: Mapping[str, Any],
        *,
        options: OpenOptions | None = None,
        resume_from: int | None | Literal["latest"] = "latest",
        storage_options: Mapping[str, Any] | None = None,
        **keywords: Any,
    ) -> Checkpointer:
        """Open run ``run_id`` of the store at ``url`` for writing and build a
        Checkpointer of ``objects`` on it: the fast path, in one call.

        ``options``, ``resume_from`` and ``storage_options`` mean what they mean
        to :meth:`CheckpointStore.open` (the store's choices: one
        :class:`~ckptstore.options.OpenOptions`, the same object every entry
        point takes); every other keyword (``every_steps``, ``async_save``,
        ``keep_last``, ...) is the constructor's. The store is opened with the
        resume point chosen by its sizes (``resume_verify="cheap"``, whatever
        ``options`` says): its digests are checked once, by :meth:`resume`,
        while its bytes are read into memory, and a save that fails that check
        is never applied (the next older intact one is resumed instead,
        recorded). The guarantee is the one of a deep check at open, for one
        read of the bytes instead of two. :meth:`close` (or leaving a ``with``
        block) also closes the store. ::

            with Checkpointer.open("/ckpt", "run-1", identity, {"model": m, "optimizer": opt},
                                   every_steps=100) as ckpt:
                for step in range(ckpt.resume(), total_steps):
                    ...
                    ckpt.step_end(step)
        """
        flat = {k: keywords.pop(k) for k in list(keywords) if k in FLAT_KEYWORDS}
        o = options_from_keywords(options, flat, "Checkpointer.open")
        store = CheckpointStore.open(url, run_id, identity=identity, mode="w", resume_from=resume_from,
                                     options=replace(o, resume_verify="cheap"), storage_options=storage_options)
        try:
            ckpt = cls(store, objects, **keywords)
        except BaseException:
            store.close()
            raise
        ckpt._owned_store = store
        return ckpt

    def __init__(
        self,
        store: CheckpointerStore,
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
        metrics_path: str | None = None,
        preempt_flush_seconds: float = 60.0,
    ) -> None:
        """Build on ``store``, opened for writing: a :class:`CheckpointStore`, or on
        many ranks a :class:`ckptstore.distributed.RankStore` — any store that keeps
        the typed contract :class:`~ckptstore.torch.contract.CheckpointerStore`
        (the only members called). Every choice is checked here, and every
        object validated, before anything else happens."""
        _check_choices(store, every_steps, every_seconds, keep_last, keep_every, on_config_change, max_inflight,
                       preempt_exit_code)
        if metrics_path is not None and not str(metrics_path).endswith(".prom"):
            raise InvalidInputError("metrics_path must end in .prom (node_exporter's textfile collector reads only those)")
        self.store = store
        #: Prometheus metrics (:mod:`.metrics`), written to ``metrics_path`` when given; None when off
        self.metrics = CheckpointerMetrics(metrics_path, store.run_id) if metrics_path is not None else None
        self.objects = dict(objects)
        self._validate_objects()
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.retention_deep = retention_deep
        self.preempt_exit_code = preempt_exit_code
        #: on a tiered store, how long a preemption waits for its save to reach the durable tier
        self.preempt_flush_seconds = preempt_flush_seconds
        #: after a preemption on a tiered store: whether the last save reached the durable tier
        self.preempt_durable: bool | None = None
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
        self._start_saving()
        if self.store.resumed_from is None:
            # a fresh run: nothing will be restored, the shapes are known now, so
            # the first save's host buffers are allocated from here on, in the
            # background (with a resume point: after the restore, by resume())
            self._prepare_buffers()
        self._owned_store: CheckpointStore | None = None  # built by open(): close() closes the store too
        self._preempted = threading.Event()
        self._old_handlers: dict[int, Any] = {}
        if handle_signals:
            self._install_signal_handlers(signals)

    def _start_saving(self) -> None:
        """The host buffers, the background queue and the save bookkeeping."""
        self._buffers = HostBuffers()
        self._queue: SaveQueue | None = (
            SaveQueue(self.max_inflight, self._buffers, abandon=self.store.abandon)
            if self.async_save else None
        )
        self._retain_lock = threading.Lock()
        self._stepped = False  # whether step_end ran once (it prepares the buffers of what the first step created)
        self._last_save_time = time.monotonic()
        self._last_scheduled_step: int | None = None
        self.saves: list[dict[str, Any]] = []
        self.last_blocking_seconds = 0.0

    def _install_signal_handlers(self, signals: tuple[int, ...]) -> None:
        """Catch the preemption signals (only possible on the main thread; elsewhere none are caught)."""
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._old_handlers[s] = signal.signal(s, self._on_signal)

    def _validate_objects(self) -> None:
        """Refuse, now rather than at the first due save, what cannot be saved."""
        for name, obj in self.objects.items():
            check_name(name)
            problem = plain_loader_problem(name, obj)
            if problem:
                raise InvalidInputError(problem)
            warn_inexact_resume(name, obj)  # worker RNG, persistent workers, replacement: the one-line fix
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
        self.store.alert()  # many ranks: give up on silent peers within seconds

    def _agreed_preemption(self) -> bool:
        """This rank's flag, or on many ranks the job's agreed one (collective)."""
        return self.store.agree_preemption(self.preempted)

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
            self._metrics_resumed(None, None)
            if self.record_events:
                self.store.record_event("start", {"resumed_from": None})
            self._prepare_buffers()
            return 0
        choice = on_config_change or self.on_config_change
        for name, obj in self.objects.items():
            problem = live_iterator_problem(name, obj)
            if problem:
                raise InvalidInputError(problem)
        # checked before anything is loaded (on many ranks: on every rank, one outcome for all)
        first_choice = ref
        saved, ref = read_with_fallback(self.store, ref, lambda st, r: check_fit(self.objects, st, r), self.objects)
        self._metrics_resumed(ref, first_choice)
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
        self._arm_loaders(saved, restore_rng_state)
        self._prepare_buffers()
        if self.record_events:
            self.store.record_event("resume", {"resumed_from": ref.step, "save_id": ref.save_id})
        return ref.step + 1

    def _metrics_resumed(self, ref: SaveRef | None, first_choice: SaveRef | None) -> None:
        if self.metrics is None:
            return
        attempt = self.store.attempt.number if self.store.attempt is not None else 1
        events = self.store.events()
        self.metrics.resumed(
            restarts=max(0, attempt - 1),
            wasted_steps=wasted_since(events, attempt, None if ref is None else ref.step),
            fell_back=ref is not None and first_choice is not None and ref.save_id != first_choice.save_id,
            step=None if ref is None else ref.step,
            committed_at=None if ref is None else ref.record.created_at,
            last_save=None if ref is None else save_event(events, ref.save_id),
        )

    @property
    def host_buffer_bytes(self) -> int:
        """Bytes of host memory allocated so far for async saves' copies (the
        idle buffer sets; a set held by a save in flight is not counted)."""
        if self._queue is None:
            return 0
        return sum(b.nbytes for b in list(self._queue.idle))

    @property
    def preparing_host_buffers(self) -> bool:
        """Whether the background allocation of the first save's host buffers
        is still under way (False once every buffer it started is allocated, or
        when none was started)."""
        return self._queue is not None and self._buffers.preparing

    def _prepare_buffers(self) -> None:
        """Async saves: allocate the first save's host buffers in the background,
        once the state has its final shapes: at construction on a fresh run (no
        resume point: nothing will be restored), else after the restore by
        :meth:`resume` (so the restore's peak memory is not raised by them);
        again at the first :meth:`step_end` that saves nothing, for the tensors
        the first step created (an optimizer's moments on a fresh run). Buffers
        already allocated or being allocated are not allocated again; a save
        that starts before this finished shares the work (:class:`HostBuffers`)."""
        if self._queue is not None:
            self._buffers.prepare_for(self.objects)

    def _arm_loaders(self, saved: SavedState, restore_rng_state: bool) -> None:
        global_rng = torch.get_rng_state() if restore_rng_state else None
        gens = saved.trees.get(RNG_KEY, {}).get("generators", {}) if restore_rng_state else {}
        for name, obj in self.objects.items():
            if isinstance(obj, (ResumableSampler, ResumableLoader)) and global_rng is not None:
                obj.arm_after_resume(global_rng)
            elif is_stateful_dataloader(obj):
                fix_stateful_dataloader_resume(obj, dict(gens.get(name, {})), global_rng)

    def metrics_registry(self) -> CollectorRegistry:
        """A ``prometheus_client.CollectorRegistry`` of this Checkpointer's
        metrics (:mod:`ckptstore.torch.metrics`: the same names and values as the
        ``metrics_path`` textfile), read afresh at every scrape. Serve it from
        the training process's own endpoint, e.g.
        ``prometheus_client.start_http_server(9100, registry=ckpt.metrics_registry())``.

        Needs the ``metrics`` extra (``pip install 'ckptstore[metrics]'``;
        :class:`~ckptstore.ExtraRequiredError` otherwise). Without
        ``metrics_path`` the metrics are kept in memory from this call on: call
        it before :meth:`resume` so the resume's figures are in."""
        if self.metrics is None:
            self.metrics = CheckpointerMetrics(None, self.store.run_id)
        return self.metrics.registry()

    # ------------------------------------------------------------ saving
    def _raise_background(self) -> None:
        if self._queue is None:
            return
        self._queue.collect_done()
        err = self._queue.take_error()
        if err is not None:
            raise err

    def wait(self) -> None:
        """Block until every save in flight is committed; raise the first error."""
        if self._queue is not None:
            self._queue.make_room(everything=True)
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
        if self._queue is not None:
            self._queue.make_room(everything=blocking)
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
        queue = None if blocking else self._queue
        if not blocking and queue is None:
            raise InvalidInputError("this Checkpointer was built with async_save=False; save(blocking=False) needs it")
        bufs = queue.buffers() if queue is not None else None
        try:
            snap = snapshot(state, bufs, streams=self.streams)
        except BaseException:
            if queue is not None and bufs is not None:
                queue.idle.append(bufs)
            raise
        snap.objects = meta
        md = dict(self.metadata(step)) if self.metadata else {}
        md.update({"accumulating": accumulating})
        if queue is None:
            ref = self._write(step, snap, md, t0)
            self.last_blocking_seconds = time.perf_counter() - t0
            return ref
        self.last_blocking_seconds = time.perf_counter() - t0
        assert bufs is not None
        queue.submit(lambda in_order: self._write(step, snap, md, t0, in_order), bufs)
        return None

    def _write(
        self, step: int, snap: Any, md: dict[str, Any], t0: float, in_order: Callable[[], None] | None = None
    ) -> SaveRef:
        try:
            ref = write_snapshot(self.store, step, snap, metadata=md, before_publish=in_order)
        except BaseException:
            if self.metrics is not None:
                self.metrics.failed()
            raise
        took = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.saved(step, took, ref.total_bytes)
        self._last_save_time = time.monotonic()
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
            # incremental: the cost follows what is deleted, not the history (PROTOCOL.md §4.5.1)
            self.store.gc(keep_last=self.keep_last, keep_every=self.keep_every, deep=self.retention_deep,
                          incremental=True)
        except Exception as exc:  # noqa: BLE001 - the save is committed; retention must not fail it
            msg = f"retention after a save failed: {type(exc).__name__}: {exc}"
            self.retention_errors.append(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            if self.record_events:
                self.store.record_event("retention-failed", {"error": msg[:500]})

    def step_end(self, step: int, **save_kw: Any) -> bool:
        """Call after each optimizer step. Saves when due; on preemption saves
        synchronously and exits (or returns True). Returns False otherwise."""
        if self.metrics is not None:
            self.metrics.step_done()
        self._raise_background()
        if self._agreed_preemption():
            self.wait()
            if self._last_scheduled_step != step:
                self.save(step, blocking=True, **save_kw)
            self._flush_on_preempt(step)
            if self.record_events:
                self.store.record_event("preempted", {"step": step})
            self.close()
            if self.exit_on_preempt:
                raise SystemExit(self.preempt_exit_code)
            return True
        if self.due(step):
            self.save(step, **save_kw)
        elif not self._stepped and self._queue is not None:
            # the first step created the state resume() could not see (an
            # optimizer's moments on a fresh run): allocate its host buffers
            # now, in the background, not in the first save's copy
            self._prepare_buffers()
        self._stepped = True
        return False

    def _flush_on_preempt(self, step: int, event: str = "preempt-flush") -> None:
        """On a tiered store: wait up to ``preempt_flush_seconds`` for the last
        save to become durable (on preemption and at :meth:`finish`); record
        and warn the outcome."""
        if not self.store.tiered:
            return
        t0 = time.perf_counter()
        self.preempt_durable = self.store.make_durable(self.preempt_flush_seconds)
        info = {"step": step, "durable": self.preempt_durable, "seconds": round(time.perf_counter() - t0, 3)}
        if self.record_events:
            self.store.record_event(event, info)
        if not self.preempt_durable:
            when = "preempted" if event == "preempt-flush" else "finished"
            warnings.warn(f"{when} at step {step}: the last save is committed locally but did not reach the "
                          f"durable tier within {self.preempt_flush_seconds} s", RuntimeWarning, stacklevel=3)

    def finish(self, step: int) -> SaveRef | None:
        """End of training: make sure ``step`` (the last one) is saved, wait, close. On a tiered
        store, first wait up to ``preempt_flush_seconds`` for it to become durable (``finish-flush``)."""
        ref = None
        if self._last_scheduled_step != step:
            ref = self.save(step, blocking=True)
        self.wait()
        self._flush_on_preempt(step, event="finish-flush")  # tiered: the final save reaches the durable tier
        self.close()
        return ref

    def close(self) -> None:
        """Wait for the in-flight save, restore signal handlers, raise a pending error."""
        try:
            self.wait()
        finally:
            if self._queue is not None:
                self._queue.shutdown()
            for s, h in self._old_handlers.items():
                try:
                    signal.signal(s, h)
                except (ValueError, TypeError):
                    pass
            self._old_handlers.clear()
            owned, self._owned_store = self._owned_store, None
            if owned is not None:
                owned.close()

    def __enter__(self) -> Checkpointer:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
