"""What a :class:`~ckptstore.torch.Checkpointer` exports for Prometheus (off by default).

``Checkpointer(..., metrics_path="/var/lib/node_exporter/textfile/train.prom")``
rewrites that file atomically after every event that changes a value (a save
committed or failed, a resume, the first useful step), in Prometheus's text
format, for node_exporter's textfile collector. Every sample carries the
``run`` label. The metrics (:data:`METRICS`):

* ``ckptstore_last_complete_save_timestamp_seconds`` — Unix time of the newest
  committed save (its age: ``time() - ckptstore_last_complete_save_timestamp_seconds``);
* ``ckptstore_last_complete_save_age_seconds`` — that age when the file was written;
* ``ckptstore_last_complete_step``;
* ``ckptstore_last_save_duration_seconds``, ``ckptstore_last_save_bytes``;
* ``ckptstore_saves_completed_total``, ``ckptstore_saves_failed_total``,
  ``ckptstore_resume_fallbacks_total`` (resumes that fell back to an older save);
* ``ckptstore_wasted_steps`` — steps earlier attempts did past the step this one resumed from;
* ``ckptstore_restarts`` — attempts before this one;
* ``ckptstore_time_to_first_useful_step_seconds`` — from the Checkpointer's
  construction (the process's start, if ``started_at`` is given) to the end of the first step.

The same values can be served from the training process's own HTTP endpoint:
:meth:`Checkpointer.metrics_registry() <ckptstore.torch.Checkpointer.metrics_registry>`
returns a ``prometheus_client.CollectorRegistry`` read at every scrape. Both
need the ``metrics`` extra (``pip install 'ckptstore[metrics]'``).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from ..util.prometheus import Sample, client, registry, render, write_textfile

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

METRICS = {
    "ckptstore_last_complete_save_timestamp_seconds": ("gauge", "Unix time of the newest committed save"),
    "ckptstore_last_complete_save_age_seconds": ("gauge", "Age of the newest committed save when written"),
    "ckptstore_last_complete_step": ("gauge", "Step of the newest committed save"),
    "ckptstore_last_save_duration_seconds": ("gauge", "Seconds the last save took, snapshot to commit"),
    "ckptstore_last_save_bytes": ("gauge", "Bytes of the last committed save"),
    "ckptstore_saves_completed_total": ("counter", "Saves committed by this attempt"),
    "ckptstore_saves_failed_total": ("counter", "Saves of this attempt that failed"),
    "ckptstore_resume_fallbacks_total": ("counter", "Resumes that fell back to an older complete save"),
    "ckptstore_wasted_steps": ("gauge", "Steps earlier attempts did past the step this attempt resumed from"),
    "ckptstore_restarts": ("gauge", "Attempts of this run before this one"),
    "ckptstore_time_to_first_useful_step_seconds": ("gauge", "Seconds from start to the end of the first step"),
}


class CheckpointerMetrics:
    """The values, and the textfile they are written to (``path``; None: kept in memory only)."""

    def __init__(self, path: str | None, run_id: str, *, started_at: float | None = None) -> None:
        client(f"metrics_path={path!r}" if path is not None else "the Checkpointer's metrics")  # the extra, now
        self.path = path
        self.run_id = run_id
        self.started = started_at if started_at is not None else time.monotonic()
        self.values: dict[str, float] = {"ckptstore_saves_completed_total": 0, "ckptstore_saves_failed_total": 0,
                                         "ckptstore_resume_fallbacks_total": 0}
        self._lock = threading.Lock()
        self._first_step_seen = False

    def saved(self, step: int, seconds: float, nbytes: int) -> None:
        with self._lock:
            v = self.values
            v["ckptstore_last_complete_save_timestamp_seconds"] = time.time()
            v["ckptstore_last_complete_step"] = step
            v["ckptstore_last_save_duration_seconds"] = seconds
            v["ckptstore_last_save_bytes"] = nbytes
            v["ckptstore_saves_completed_total"] += 1
        self.flush()

    def failed(self) -> None:
        with self._lock:
            self.values["ckptstore_saves_failed_total"] += 1
        self.flush()

    def resumed(self, *, restarts: int, wasted_steps: int, fell_back: bool, step: int | None,
                committed_at: float | None, last_save: dict[str, Any] | None = None) -> None:
        with self._lock:
            if last_save is not None:  # the resumed-from save's own figures, until this attempt saves
                for key, name in (("seconds", "ckptstore_last_save_duration_seconds"),
                                  ("bytes", "ckptstore_last_save_bytes")):
                    v = last_save.get(key)
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        self.values[name] = float(v)
            self.values["ckptstore_restarts"] = restarts
            self.values["ckptstore_wasted_steps"] = wasted_steps
            if fell_back:
                self.values["ckptstore_resume_fallbacks_total"] += 1
            if step is not None and committed_at is not None:
                self.values["ckptstore_last_complete_step"] = step
                self.values["ckptstore_last_complete_save_timestamp_seconds"] = committed_at
        self.flush()

    def step_done(self) -> None:
        if self._first_step_seen:
            return
        self._first_step_seen = True
        with self._lock:
            self.values["ckptstore_time_to_first_useful_step_seconds"] = time.monotonic() - self.started
        self.flush()

    def samples(self) -> list[Sample]:
        with self._lock:
            v = dict(self.values)
        ts = v.get("ckptstore_last_complete_save_timestamp_seconds")
        if ts is not None:
            v["ckptstore_last_complete_save_age_seconds"] = max(0.0, time.time() - ts)
        labels = {"run": self.run_id}
        return [Sample(name, v[name], help_, kind, labels) for name, (kind, help_) in METRICS.items() if name in v]

    def text(self) -> str:
        return render(self.samples())

    def registry(self) -> CollectorRegistry:
        """A ``prometheus_client`` registry of these metrics, read afresh at every scrape."""
        return registry(self.samples)

    def flush(self) -> None:
        if self.path is not None:
            write_textfile(self.path, self.samples())


def save_event(events: list[dict[str, Any]], save_id: str) -> dict[str, Any] | None:
    """The payload of the ``save`` event that recorded ``save_id``, if any."""
    for e in reversed(events):
        p = e.get("payload")
        if e.get("event") == "save" and isinstance(p, dict) and p.get("save_id") == save_id:
            return p
    return None


def wasted_since(events: list[dict[str, Any]], attempt: int, resumed_from: int | None) -> int:
    """Steps earlier attempts reported (progress, save, preempted events) past ``resumed_from``."""
    top = -1
    for e in events:
        n = e.get("attempt")
        step = e.get("payload", {}).get("step") if isinstance(e.get("payload"), dict) else None
        if isinstance(n, int) and n < attempt and type(step) is int:
            top = max(top, step)
    start = -1 if resumed_from is None else resumed_from
    return max(0, top - start)
