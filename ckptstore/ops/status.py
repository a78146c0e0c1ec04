"""``ckptstore status``: one line per run, and an exit status a cron job, a
Kubernetes probe or a Nagios-style check can act on.

:func:`run_status` reads the store alone (nothing is written): the newest
complete save and its age, the newest incomplete attempt (a save newer than
it that never completed), how often a resume fell back to an older save,
and the budget spent (from the validated ledger, :mod:`.budget`). A run is
``ok`` unless it has no complete save, its newest complete save is older
than ``max_age``, or its budget is spent; each problem is named.

:func:`status_samples` gives the same facts as Prometheus samples
(:mod:`ckptstore.util.prometheus`), for ``status --prom FILE``;
:func:`status_registry` the same as a ``prometheus_client`` registry to serve
from an endpoint of your own (both need the ``metrics`` extra).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError
from ..protocol.selection import SaveState
from ..store import CheckpointStore
from ..util.prometheus import Sample, registry
from .budget import Budget, account
from .events import validate_events

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str) -> float:
    """``"90"``, ``"90s"``, ``"30m"``, ``"2h"``, ``"1d"`` -> seconds (positive)."""
    m = _AGE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise InvalidInputError(f"age {text!r}: expected a positive number with an optional unit s, m, h or d")
    return float(m.group(1)) * _UNIT[m.group(2)]


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


@dataclass
class RunStatus:
    run_id: str
    latest_step: int | None
    latest_age_s: float | None
    latest_save_id: str | None
    incomplete: dict[str, Any] | None
    fallbacks: int
    spent_gpu_hours: float
    limit_gpu_hours: float
    wasted_steps: int
    restarts: int
    last_save_seconds: float | None
    last_save_bytes: int | None
    saves_completed: int
    saves_incomplete: int
    first_step_seconds: float | None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**{k: v for k, v in self.__dict__.items()}, "ok": self.ok}

    def line(self) -> str:
        latest = "no complete save" if self.latest_step is None else \
            f"latest complete step {self.latest_step} ({human_age(self.latest_age_s)} old)"
        inc = "none" if self.incomplete is None else \
            f"step {self.incomplete['step']} attempt {self.incomplete['attempt']} ({self.incomplete['state']})"
        verdict = "OK" if self.ok else "ALERT: " + "; ".join(self.problems)
        return (f"{self.run_id}: {latest}; newest incomplete: {inc}; fallbacks {self.fallbacks}; "
                f"budget {self.spent_gpu_hours:.2f}/{self.limit_gpu_hours:.2f} GPU-h; {verdict}")


def run_status(store: CheckpointStore, *, max_age: float | None = None, budget: Budget | None = None,
               now: float | None = None) -> RunStatus:
    """The run's status; ``problems`` says why it is not ``ok`` (see the module docstring)."""
    budget = budget or Budget()
    now = time.time() if now is None else now
    saves = store.list_saves(deep=False)
    sel = store.latest_complete(deep=False)
    created = {(i.step, i.attempt): i.created_at for i in saves}
    age = None
    if sel is not None:
        at = created.get((sel.step, sel.attempt)) or sel.record.created_at
        age = max(0.0, now - at)
    newer = [i for i in saves if i.state in (SaveState.PARTIAL, SaveState.IN_PROGRESS, SaveState.CORRUPT)
             and (sel is None or (i.step, i.attempt) > (sel.step, sel.attempt))]
    newest = max(newer, key=lambda i: (i.step, i.attempt), default=None)
    attempts = store.attempts()
    raw = store.events()
    ledger = validate_events(raw, attempts, identity=store.run_record.get("identity"),
                             min_step_seconds=budget.min_step_seconds)
    acc = account(attempts, ledger.accepted, budget)
    last_save = next((s for a in reversed(acc.attempts) for s in reversed(a.saves)), None)
    firsts = [a.first_step_seconds for a in acc.attempts if a.first_step_seconds is not None]
    st = RunStatus(
        run_id=store.run_id,
        latest_step=None if sel is None else sel.step,
        latest_age_s=None if age is None else round(age, 3),
        latest_save_id=None if sel is None else sel.save_id,
        incomplete=None if newest is None else {"step": newest.step, "attempt": newest.attempt,
                                                "state": newest.state.value},
        fallbacks=sum(1 for e in raw if e.get("event") == "resume-fallback"),
        spent_gpu_hours=round(acc.spent_gpu_hours, 4),
        limit_gpu_hours=budget.limit_gpu_hours,
        wasted_steps=acc.wasted_steps,
        restarts=acc.restarts,
        last_save_seconds=None if last_save is None else _num(last_save.get("seconds")),
        last_save_bytes=None if last_save is None else _int(last_save.get("bytes")),
        saves_completed=sum(1 for i in saves if i.state is SaveState.COMMITTED),
        saves_incomplete=sum(1 for i in saves if i.state in (SaveState.PARTIAL, SaveState.CORRUPT)),
        first_step_seconds=firsts[-1] if firsts else None,
    )
    if sel is None:
        st.problems.append("no complete save")
    elif max_age is not None and age is not None and age > max_age:
        st.problems.append(f"the newest complete save is {human_age(age)} old, more than {human_age(max_age)}")
    if acc.spent_gpu_hours >= budget.limit_gpu_hours:
        st.problems.append(f"budget spent ({acc.spent_gpu_hours:.2f} of {budget.limit_gpu_hours:.2f} GPU-h)")
    return st


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _int(x: Any) -> int | None:
    return x if type(x) is int else None


def status_samples(st: RunStatus) -> list[Sample]:
    """Prometheus samples of a run's status (label ``run``)."""
    lab = {"run": st.run_id}
    vals: list[tuple[str, float | None, str, str]] = [
        ("ckptstore_last_complete_save_age_seconds", st.latest_age_s, "gauge", "Age of the newest complete save"),
        ("ckptstore_last_complete_step", st.latest_step, "gauge", "Step of the newest complete save"),
        ("ckptstore_last_save_duration_seconds", st.last_save_seconds, "gauge", "Seconds the last save took"),
        ("ckptstore_last_save_bytes", st.last_save_bytes, "gauge", "Bytes of the last save"),
        ("ckptstore_saves_completed_total", st.saves_completed, "counter", "Committed saves of the run"),
        ("ckptstore_saves_failed_total", st.saves_incomplete, "counter", "Partial or corrupt saves of the run"),
        ("ckptstore_resume_fallbacks_total", st.fallbacks, "counter", "Resumes that fell back to an older save"),
        ("ckptstore_wasted_steps", st.wasted_steps, "gauge", "Steps done again after interruptions"),
        ("ckptstore_restarts", st.restarts, "gauge", "Restarts of the run"),
        ("ckptstore_time_to_first_useful_step_seconds", st.first_step_seconds, "gauge",
         "Seconds from the last attempt's start to its first useful step"),
        ("ckptstore_budget_spent_gpu_hours", st.spent_gpu_hours, "gauge", "GPU-hours spent"),
        ("ckptstore_budget_limit_gpu_hours", st.limit_gpu_hours, "gauge", "GPU-hour budget"),
        ("ckptstore_status_ok", 1.0 if st.ok else 0.0, "gauge", "1 when the run is fresh and within budget"),
    ]
    return [Sample(n, float(v), h, k, lab) for n, v, k, h in vals if v is not None]


def status_registry(statuses: Iterable[RunStatus]) -> CollectorRegistry:
    """A ``prometheus_client.CollectorRegistry`` of these runs' status samples
    (the ones ``status --prom`` writes), to expose from an HTTP endpoint of your
    own; needs the ``metrics`` extra (``pip install 'ckptstore[metrics]'``)."""
    return registry([s for st in statuses for s in status_samples(st)])
