"""Ledger events are claims: validate them before anything counts them.

Anyone who can write to the storage can add an event (``events/`` entries are
plain records, not yet authenticated — protocol_spec/THREATS.md). The operator
record and the budget accounting therefore *trust* only the protocol records —
the run record, attempt records and commit records with their component
digests — and treat each event as a claim that is

1. **well-formed** (:func:`validate_events`): the fields the accounting reads
   have the right types and ranges (an integer step within the protocol's
   range, a finite non-negative number of seconds, a 64-hex manifest digest…);
2. **consistent with the records**: it names a registered attempt (only an
   operator's ``budget-exhausted`` may name none), a progress step lies after
   the attempt's resume point and, when the run's identity declares its
   planned length (``planned_steps``, or the drill's ``train_config.steps``),
   before the end of the run; a ``resume`` names the step its attempt record
   says it resumed from;
3. **confirmed before it decides anything** (:func:`confirm_finished`,
   :func:`confirm_budget_stop`): a ``finished`` event makes a run promotable
   only if it comes from the newest attempt, names the manifest digest of the
   newest complete save, that save was committed by the same attempt at the
   final step, and the final step agrees with the planned length when the
   identity declares one; a ``budget-exhausted`` event counts only if the
   report's own accounting agrees that the budget is spent;
4. **bounded by wall-clock time**: an event's ``at`` lies neither in the
   future nor before its attempt registered (both within
   :data:`CLOCK_SKEW_S`), and a progress claim of step ``k`` by an attempt
   that resumed from ``r`` (``-1``: from scratch) and registered at ``c`` is believed only if
   ``k - r <= (at - c + CLOCK_SKEW_S) / min_step_seconds`` — no attempt is
   credited more steps (hence GPU-hours) than the time it has existed allows.

Without ``planned_steps`` in the identity (and outside ``auth_policy="require"``)
a ``finished`` event cannot be confirmed by any record: the report marks
promotion *unconfirmed*, never eligible (:mod:`ckptstore.ops.report`).

Every rejected event is returned with its reason (the record lists them);
nothing here raises on malformed input.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

from ..errors import InvalidInputError
from ..protocol.layout import MAX_STEP
from .budget import MIN_STEP_SECONDS

if TYPE_CHECKING:
    from .budget import Accounting, Budget

#: Plausible wall-clock range of an event's ``at`` (seconds since the epoch).
MAX_AT = 1e11
#: How far the clocks of the run's writers and of the reader may disagree (seconds).
CLOCK_SKEW_S = 300.0
KNOWN_KINDS = frozenset({"start", "resume", "progress", "first-step", "save", "preempted", "budget-exhausted",
                         "finished"})
#: Kinds that may be recorded without an attempt (by an operator, or by a job refused before it registered one).
NO_ATTEMPT_OK = frozenset({"budget-exhausted"})
_KIND = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class RejectedEvent:
    """An event that was not counted, and why."""

    event: str
    attempt: Any
    at: Any
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"event": self.event, "attempt": self.attempt, "at": self.at, "reason": self.reason}


@dataclass
class Ledger:
    accepted: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[RejectedEvent] = field(default_factory=list)


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _short(v: Any) -> Any:
    """A JSON-safe, bounded rendering of a field of a rejected event."""
    if v is None or isinstance(v, bool) or _is_num(v):
        return v
    s = str(v) if isinstance(v, str) else type(v).__name__
    return s[:80]


def planned_steps(identity: Mapping[str, Any] | None) -> int | None:
    """The run's planned number of steps, if its (trusted) identity declares it:
    ``planned_steps``, or ``train_config.steps`` as the drill's trainer records it."""
    if not isinstance(identity, Mapping):
        return None
    v = identity.get("planned_steps")
    if v is None and isinstance(identity.get("train_config"), Mapping):
        v = identity["train_config"].get("steps")
    return v if _is_int(v) and 1 <= v <= MAX_STEP + 1 else None


def _attempt_starts(attempts: Iterable[Any]) -> dict[int, tuple[int | None, float | None]]:
    """attempt number → (resume point, registration time), from attempt records
    (``AttemptRecord`` objects, or their JSON form with ``attempt``,
    ``resumed_from`` and ``created_at``)."""
    out: dict[int, tuple[int | None, float | None]] = {}
    for a in attempts:
        if isinstance(a, Mapping):
            n, r, c = a.get("attempt"), a.get("resumed_from"), a.get("created_at")
        else:
            n, r, c = getattr(a, "number", None), getattr(a, "resumed_from", None), getattr(a, "created_at", None)
        if _is_int(n):
            out[n] = (r if _is_int(r) else None, float(c) if _is_num(c) else None)
    return out


def _check_time(kind: str, n: Any, at: float, step: Any, start: int, created: float | None, now: float,
                min_step_seconds: float) -> str | None:
    """Why an event's time, or the progress it claims in that time, is not believable (None: it is)."""
    if at > now + CLOCK_SKEW_S:
        return f"'at' lies {at - now:.0f} s in the future"
    if n is None:
        return None
    if created is None:
        return f"attempt {n}'s registration time is unknown, so its claims cannot be bounded"
    if at < created - CLOCK_SKEW_S:
        return f"'at' is {created - at:.0f} s before attempt {n} registered"
    if kind == "progress" and _is_int(step):
        allowed = (max(0.0, at - created) + CLOCK_SKEW_S) / min_step_seconds
        if step - start > allowed:
            return (f"progress step {step} claims {step - start} steps in the {max(0.0, at - created):.0f} s since "
                    f"attempt {n} registered; at most {allowed:.0f} at {min_step_seconds:g} s per step")
    return None


def _check_payload(kind: str, p: Mapping[str, Any], start: int, planned: int | None) -> str | None:
    """Why the payload of a well-formed event of ``kind`` is not acceptable (None: it is)."""
    step = p.get("step")
    if step is not None and (not _is_int(step) or not -1 <= step <= MAX_STEP):
        return "payload step is not an integer step"
    if kind == "progress":
        if not _is_int(step):
            return "progress without an integer step"
        if step <= start:
            return f"progress step {step} is not after the attempt's resume point {start}"
        if planned is not None and step >= planned:
            return f"progress step {step} is beyond the run's planned {planned} steps"
    for k in ("seconds", "spent_gpu_hours", "limit_gpu_hours"):
        v = p.get(k)
        if v is not None and (not _is_num(v) or v < 0):
            return f"payload {k} is not a finite non-negative number"
    if "resumed_from" in p and p["resumed_from"] is not None and not _is_int(p["resumed_from"]):
        return "payload resumed_from is not an integer step"
    for k in ("save_id", "final_save_id"):
        v = p.get(k)
        if v is not None and (not isinstance(v, str) or len(v) > 256):
            return f"payload {k} is not a short string"
    if "bytes" in p and p["bytes"] is not None and (not _is_int(p["bytes"]) or p["bytes"] < 0):
        return "payload bytes is not a non-negative integer"
    if kind == "resume":
        r = p.get("resumed_from")
        if r != (None if start < 0 else start):
            return f"resume claims step {_short(r)}, the attempt record says {None if start < 0 else start}"
    if kind == "finished":
        steps, digest = p.get("steps"), p.get("final_manifest_digest")
        if not _is_int(steps) or not 1 <= steps <= MAX_STEP + 1:
            return "finished without an integer number of steps"
        if digest is not None and (not isinstance(digest, str) or not _HEX64.fullmatch(digest)):
            return "finished names a malformed manifest digest"
    return None


def validate_events(
    events: Iterable[Any],
    attempts: Iterable[Any],
    *,
    identity: Mapping[str, Any] | None = None,
    now: float | None = None,
    min_step_seconds: float = MIN_STEP_SECONDS,
) -> Ledger:
    """Split ledger records into accepted (well-formed, consistent with the
    attempt records and the identity's planned length, bounded by wall-clock
    time: rule 4 of the module docstring, ``now`` defaulting to the current
    time) and rejected (with the reason). Accepted events are returned as
    clean dicts with exactly ``event``, ``at``, ``attempt`` and ``payload``."""
    starts = _attempt_starts(attempts)
    planned = planned_steps(identity)
    now = time.time() if now is None else now
    if not min_step_seconds > 0:
        raise InvalidInputError("min_step_seconds must be positive")
    out = Ledger()
    for e in events:
        if not isinstance(e, Mapping):
            out.rejected.append(RejectedEvent("?", None, None, "not a JSON object"))
            continue
        kind, at, n, payload = e.get("event"), e.get("at"), e.get("attempt"), e.get("payload", {})

        def reject(reason: str, kind: Any = kind, n: Any = n, at: Any = at) -> None:
            out.rejected.append(RejectedEvent(_short(kind) if isinstance(kind, str) else "?", _short(n), _short(at),
                                              reason))

        if not isinstance(kind, str) or not _KIND.fullmatch(kind):
            reject("malformed event kind")
            continue
        if not _is_num(at) or not 0 <= at <= MAX_AT:
            reject("'at' is not a plausible timestamp")
            continue
        if not isinstance(payload, Mapping):
            reject("payload is not a JSON object")
            continue
        if n is None:
            if kind in KNOWN_KINDS and kind not in NO_ATTEMPT_OK:
                reject(f"a {kind!r} event must name its attempt")
                continue
            start, created = -1, None
        elif not _is_int(n) or n not in starts:
            reject("names no registered attempt")
            continue
        else:
            r, created = starts[n]
            start = -1 if r is None else r
        why = _check_payload(kind, payload, start, planned) or _check_time(
            kind, n, float(at), payload.get("step"), start, created, now, min_step_seconds)
        if why is not None:
            reject(why)
            continue
        out.accepted.append({"event": kind, "at": float(at), "attempt": n, "payload": dict(payload)})
    return out


def confirm_finished(
    event: Mapping[str, Any],
    *,
    newest_attempt: int | None,
    latest: tuple[int, int, str] | None,
    identity: Mapping[str, Any] | None,
) -> str | None:
    """Why a (validated) ``finished`` event does not establish that the run
    finished (None: it does). ``latest`` is (step, attempt, manifest digest)
    of the newest complete save."""
    p = event["payload"]
    n = event["attempt"]
    if n is None or n != newest_attempt:
        return f"finished names attempt {n}, the newest attempt is {newest_attempt}"
    if latest is None:
        return "finished, but there is no complete save"
    step, attempt, digest = latest
    if p.get("final_manifest_digest") != digest:
        return "finished names a manifest that is not the newest complete save"
    if attempt != n:
        return f"finished by attempt {n}, but the newest complete save was committed by attempt {attempt}"
    if step != int(p["steps"]) - 1:
        return f"finished claims {p['steps']} steps, the newest complete save is step {step}"
    planned = planned_steps(identity)
    if planned is not None and int(p["steps"]) != planned:
        return f"finished claims {p['steps']} steps, the run's identity plans {planned}"
    return None


def confirm_budget_stop(event: Mapping[str, Any], acc: Accounting, budget: Budget) -> str | None:
    """Why a (validated) ``budget-exhausted`` event is not borne out by the
    accounting (None: it is). The stop is confirmed when one more step or one
    more restart would reach the limit by the report's own arithmetic."""
    need = max(budget.gpu_hours_per_step, budget.restart_gpu_hours)
    if acc.spent_gpu_hours + need >= budget.limit_gpu_hours - 1e-9:
        return None
    return (f"budget-exhausted, but the accounting shows {acc.spent_gpu_hours:.2f} of "
            f"{budget.limit_gpu_hours:.2f} GPU-h spent")
