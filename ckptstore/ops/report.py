"""The operator record, rebuilt from the store alone (a fresh process).

``build_record(store, budget)`` reads the run record, attempts, ledger events
and saves, and returns a JSON-able dict; ``render_table`` and
``render_timeline_svg`` present it. Nothing here writes to the store.

What it trusts (protocol_spec/THREATS.md): the protocol records. Ledger events
are claims, validated and confirmed against the records by
:mod:`ckptstore.ops.events`; the ones that fail are listed under
``rejected_events`` and count for nothing. Promotion is ``eligible`` only
when the records confirm the finish; without ``planned_steps`` in the
identity (outside ``auth_policy="require"``) it is ``unconfirmed`` — not
eligible (protocol_spec/THREATS.md §4.9).
"""

from __future__ import annotations

import html
import time
from typing import Any

from ..protocol.auth import AuthPolicy
from ..protocol.selection import SaveInfo, SaveRef, SaveState
from ..store import CheckpointStore
from ..util.redact import redact_url
from .budget import Accounting, Budget, account, compare_costs
from .events import RejectedEvent, confirm_budget_stop, confirm_finished, planned_steps, validate_events
from .tier_record import render_rows, tier_summary


def build_record(store: CheckpointStore, budget: Budget | None = None, *, deep: bool = True) -> dict[str, Any]:
    """The operator record of the run (module docstring): read, validate, account, judge, present."""
    budget = budget or Budget()
    run = store.run_record
    attempts = store.attempts()
    ledger = validate_events(store.events(), attempts, identity=run.get("identity"),
                             min_step_seconds=budget.min_step_seconds)
    events = ledger.accepted
    rejected = list(ledger.rejected)
    acc = account(attempts, events, budget)
    sel = store.latest_complete(deep=deep, explain=True)
    saves = store.list_saves(deep=deep)
    latest = sel.latest
    newest_attempt = max((a.number for a in attempts), default=None)
    finished, budget_stops = _confirmed_verdicts(events, rejected, acc, budget, latest, newest_attempt, run)
    final = finished[-1]["payload"] if finished else None
    reasons, unconfirmed = _promotion_reasons(store, run, latest, final, finished, budget_stops, deep)
    eligible = not reasons
    status = "eligible" if eligible else "unconfirmed" if unconfirmed else "not-eligible"
    return {
        "run_id": store.run_id,
        "store": redact_url(store.backend.url),
        "identity": run["identity"],
        "lineage": run.get("lineage"),
        "budget": budget.to_json(),
        "interruptions": acc.interruptions,
        "restarts": acc.restarts,
        "attempts": _attempts_json(acc),
        "last_valid_checkpoint": None if latest is None else {
            "step": latest.step, "attempt": latest.attempt, "save_id": latest.save_id,
            "manifest_digest": latest.manifest_digest, "bytes": latest.total_bytes,
            "bytes_written": latest.record.bytes_written(),
        },
        "skipped_newer_candidates": [s.to_json() for s in sel.skipped],
        "discarded_checkpoints": _discarded(saves),
        "save_bytes": _save_bytes(saves),
        "recovered_steps": [a.resumed_from for a in acc.attempts[1:]],
        "executed_steps": acc.executed_steps,
        "accepted_steps": acc.accepted_steps,
        "wasted_steps": acc.wasted_steps,
        "wasted_gpu_hours": round(acc.wasted_gpu_hours, 4),
        "spent_gpu_hours": round(acc.spent_gpu_hours, 4),
        "budget_remaining_gpu_hours": round(budget.limit_gpu_hours - acc.spent_gpu_hours, 4),
        "budget_stopped": bool(budget_stops),
        "cost": _cost(saves, acc, budget),
        "age_of_last_complete_recovery_point_s": _recovery_point_age(saves, latest, events),
        "save_completion_s": [s.get("seconds") for a in acc.attempts for s in a.saves],
        "final": final,
        "promotion": {
            "eligible": eligible,
            "status": status,
            "reasons": reasons or ["finished, final save complete and verified, linked to its manifest"],
            "artifact_manifest_digest": latest.manifest_digest if (latest and eligible) else None,
        },
        "timeline": _timeline(events),
        "rejected_events": [r.to_json() for r in rejected],
        "tiers": tier_summary(saves, events, time.time()),
    }


def _confirmed_verdicts(
    events: list[dict[str, Any]], rejected: list[RejectedEvent], acc: Accounting, budget: Budget,
    latest: SaveRef | None, newest_attempt: int | None, run: dict[str, Any],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ``finished`` and ``budget-exhausted`` claims the records bear out;
    the others are appended to ``rejected`` with the reason."""
    finished: list[dict[str, Any]] = []
    budget_stops: list[dict[str, Any]] = []
    latest_key = (latest.step, latest.attempt, latest.manifest_digest) if latest else None
    for e in events:
        if e["event"] == "finished":
            why = confirm_finished(e, newest_attempt=newest_attempt, latest=latest_key, identity=run.get("identity"))
            keep = finished
        elif e["event"] == "budget-exhausted":
            why = confirm_budget_stop(e, acc, budget)
            keep = budget_stops
        else:
            continue
        if why is None:
            keep.append(e)
        else:
            rejected.append(RejectedEvent(e["event"], e["attempt"], e["at"], why))
    return finished, budget_stops


def _promotion_reasons(
    store: CheckpointStore, run: dict[str, Any], latest: SaveRef | None, final: dict[str, Any] | None,
    finished: list[dict[str, Any]], budget_stops: list[dict[str, Any]], deep: bool,
) -> tuple[list[str], bool]:
    """Why the run is not eligible for promotion (empty: it is), and whether
    the only reason is an unconfirmed finish."""
    reasons: list[str] = []
    if budget_stops and not finished:
        reasons.append("budget-stopped: training ended before its last step")
    if not finished:
        reasons.append("not finished: no attempt completed the run")
    if latest is None:
        reasons.append("no complete save")
    elif final is not None and latest.step != int(final.get("steps", 0)) - 1:
        reasons.append(f"the newest complete save is step {latest.step}, not the final step")
    if final is not None and latest is not None and final.get("final_manifest_digest") != latest.manifest_digest:
        reasons.append("the final artifact is not linked to the newest complete manifest")
    if latest is not None and deep:
        rep = store.verify(latest, deep=True)
        if not rep.ok:
            reasons.append("the final save does not verify: " + "; ".join(d for _, d in rep.problems))
    # Without a planned length, "finished" rests on a ledger event alone, which anyone who can
    # write the store can forge (unless only key holders' events count): never enough to promote.
    unconfirmed = (not reasons and planned_steps(run.get("identity")) is None
                   and store.auth_policy is not AuthPolicy.REQUIRE)
    if unconfirmed:
        reasons.append("unconfirmed: the run's identity declares no planned_steps, so that it finished rests on a "
                       "ledger event anyone who can write the store can forge; declare planned_steps in the "
                       "identity, or read the run with auth_policy=require (signed events)")
    return reasons, unconfirmed


def _attempts_json(acc: Accounting) -> list[dict[str, Any]]:
    return [
        {
            **a.to_json(),
            "recovered_step": a.resumed_from,
            "time_to_first_useful_step_s": a.first_step_seconds,
            "save_completion_s": [s.get("seconds") for s in a.saves],
        }
        for a in acc.attempts
    ]


def _discarded(saves: list[SaveInfo]) -> list[dict[str, Any]]:
    return [
        {"step": i.step, "attempt": i.attempt, "save_id": i.save_id, "state": i.state.value, "detail": i.detail}
        for i in saves
        if i.state in (SaveState.PARTIAL, SaveState.IN_PROGRESS, SaveState.CORRUPT, SaveState.SUPERSEDED)
    ]


def _save_bytes(saves: list[SaveInfo]) -> list[dict[str, Any]]:
    """Per save, newest first: the bytes it wrote itself against the bytes its
    record names (they differ in a version-3 run, whose saves share pieces);
    an uncommitted save has written what it has, and references nothing yet."""
    return [
        {"step": i.step, "attempt": i.attempt, "save_id": i.save_id, "state": i.state.value,
         "bytes_written": i.bytes_written if i.bytes_written is not None else i.bytes,
         "bytes_referenced": i.bytes_referenced}
        for i in saves
    ]


def _cost(saves: list[SaveInfo], acc: Accounting, budget: Budget) -> dict[str, Any]:
    # pieces (PROTOCOL.md §9) counted once, by the save that holds them
    storage_gb = sum(max(i.bytes, i.bytes_written or 0) for i in saves) / 1e9
    billed = acc.spent_gpu_hours
    ordinary = acc.accepted_steps * budget.gpu_hours_per_step
    costs = compare_costs(ordinary, billed, budget.ordinary_price_per_gpu_hour, budget.price_per_gpu_hour)
    storage_cost = storage_gb * budget.storage_price_per_gb_month
    transfer_cost = storage_gb * budget.transfer_price_per_gb
    return {
        "compute": round(billed * budget.price_per_gpu_hour, 4),
        "storage_per_month": round(storage_cost, 6),
        "transfer": round(transfer_cost, 6),
        "total": round(billed * budget.price_per_gpu_hour + storage_cost + transfer_cost, 4),
        "per_accepted_step": round(billed * budget.price_per_gpu_hour / acc.accepted_steps, 6)
        if acc.accepted_steps else None,
        "interruptible_vs_ordinary": costs.to_json(),
    }


def _recovery_point_age(saves: list[SaveInfo], latest: SaveRef | None, events: list[dict[str, Any]]) -> float | None:
    """Seconds from the newest complete save's commit to the run's last event."""
    commit_times = {(i.step, i.attempt): i.created_at for i in saves if i.created_at}
    last_commit_at = commit_times.get((latest.step, latest.attempt)) if latest else None
    ended_at = max((float(e["at"]) for e in events), default=time.time())
    return None if last_commit_at is None else round(ended_at - last_commit_at, 3)


def _timeline(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"at": e["at"], "attempt": e.get("attempt"), "event": e["event"], **{
        k: v for k, v in e.get("payload", {}).items() if k in ("step", "seconds", "resumed_from", "save_id")}}
        for e in events]


def render_table(rec: dict[str, Any]) -> str:
    lines = [f"operator record — run {rec['run_id']} at {rec['store']}"]
    lc = rec["last_valid_checkpoint"]

    def row(k: str, v: Any) -> None:
        lines.append(f"  {k:<38} {v}")

    row("interruptions", rec["interruptions"])
    row("restarts (recovered at step)", f"{rec['restarts']} ({', '.join(map(str, rec['recovered_steps'])) or '-'})")
    row("last valid checkpoint", "none" if lc is None else
        f"step {lc['step']} (attempt {lc['attempt']}, manifest {lc['manifest_digest'][:16]}…)")
    row("discarded checkpoints", len(rec["discarded_checkpoints"]))
    for d in rec["discarded_checkpoints"]:
        lines.append(f"    - step {d['step']} attempt {d['attempt']}: {d['state']} ({d['detail']})")
    shared = [b for b in rec.get("save_bytes", []) if b["bytes_referenced"] not in (None, b["bytes_written"])]
    if shared:  # a version-3 run: saves share pieces
        row("bytes written / referenced per save", "")
        for b in rec["save_bytes"][:20]:
            ref = "-" if b["bytes_referenced"] is None else f"{b['bytes_referenced']:,}"
            lines.append(f"    - step {b['step']} attempt {b['attempt']} ({b['state']}): "
                         f"{b['bytes_written']:,} / {ref}")
    row("steps executed / accepted / wasted", f"{rec['executed_steps']} / {rec['accepted_steps']} / {rec['wasted_steps']}")
    row("GPU-hours spent / wasted / budget", f"{rec['spent_gpu_hours']:.2f} / {rec['wasted_gpu_hours']:.2f} / "
        f"{rec['budget']['limit_gpu_hours']:.2f}")
    c = rec["cost"]
    cmp_ = c["interruptible_vs_ordinary"]
    row("total cost (compute+storage+transfer)", f"{c['total']:.2f}")
    row("interruptible vs ordinary", f"{cmp_['interruptible_cost']:.2f} vs {cmp_['ordinary_cost']:.2f} "
        f"({cmp_['saving_fraction'] * 100:.1f} % saving on accepted progress)")
    row("age of last complete recovery point", f"{rec['age_of_last_complete_recovery_point_s']} s")
    st = [s for s in rec["save_completion_s"] if s is not None]
    row("save completion (min/median/max)", "-" if not st else
        f"{min(st):.3f} / {sorted(st)[len(st) // 2]:.3f} / {max(st):.3f} s ({len(st)} saves)")
    ttf = [a["time_to_first_useful_step_s"] for a in rec["attempts"]]
    row("time to first useful step per attempt", ", ".join("-" if t is None else f"{t:.2f}s" for t in ttf))
    for k, v in render_rows(rec.get("tiers")):
        row(k, v)
    row("budget stopped", rec["budget_stopped"])
    rejected = rec.get("rejected_events") or []
    row("ledger events rejected (not counted)", len(rejected))
    for r in rejected[:20]:
        lines.append(f"    - {r['event']} (attempt {r['attempt']}): {r['reason']}")
    if len(rejected) > 20:
        lines.append(f"    - … and {len(rejected) - 20} more (see --json)")
    p = rec["promotion"]
    row("PROMOTION ELIGIBLE", "yes" if p["eligible"] else
        "NO (unconfirmed)" if p.get("status") == "unconfirmed" else "NO")
    for r in p["reasons"]:
        lines.append(f"    - {r}")
    return "\n".join(lines)


_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]


def nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """About ``n`` round tick values (1, 2, 2.5 or 5 times a power of ten) covering ``[lo, hi]``."""
    import math

    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    out = []
    v = first
    while v <= hi + step * 1e-9:
        out.append(round(v, 10))
        v += step
    return out


def _fmt(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.3g}"


def gpu_hours_curve(rec: dict[str, Any]) -> list[tuple[float, float]]:
    """Cumulative GPU-hours against wall time, from the accepted progress events
    (one step priced ``gpu_hours_per_step``; each restart ``restart_gpu_hours``)."""
    b = rec["budget"]
    starts = {a["attempt"]: a.get("resumed_from") for a in rec["attempts"]}
    done: dict[int, int] = {}
    out: list[tuple[float, float]] = []
    seen_attempts: list[int] = []
    for e in sorted(rec["timeline"], key=lambda e: e["at"]):
        n = e.get("attempt")
        if e["event"] != "progress" or n is None or e.get("step") is None:
            continue
        if n not in seen_attempts:
            seen_attempts.append(n)
        start = starts.get(n)
        done[n] = max(done.get(n, 0), int(e["step"]) - (-1 if start is None else int(start)))
        spent = sum(done.values()) * b["gpu_hours_per_step"] + max(0, len(seen_attempts) - 1) * b["restart_gpu_hours"]
        out.append((float(e["at"]), spent))
    return out


def render_timeline_svg(rec: dict[str, Any], width: int = 1000, height: int = 440) -> str:
    """The run on one picture, plain SVG (any browser shows it): steps against
    wall time per attempt (left axis), cumulative GPU-hours and the budget line
    (right axis) with the budget stop marked, committed saves, interruptions,
    wasted work shaded, each restart annotated with the step it resumed from,
    and a legend."""
    if not [e for e in rec["timeline"] if e["event"] in ("progress", "save", "start", "resume")]:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
                '<text x="10" y="20">no events</text></svg>')
    g = _Geometry(rec, width, height)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{g.ml}" y="18" font-size="14" font-weight="bold">{html.escape(str(rec["run_id"]))}: '
           'training progress, saves, restarts and budget</text>']
    out += _axes(g)
    out += _budget_layer(rec, g)
    out += _attempt_layers(rec, g)
    out += _legend(g)
    out.append("</svg>")
    return "\n".join(out)


class _Geometry:
    """The plot area and the three scales (time, steps, GPU-hours)."""

    def __init__(self, rec: dict[str, Any], width: int, height: int) -> None:
        self.width, self.height = width, height
        self.ml, self.mr, self.mt, self.mb = 64, 230, 34, 52
        self.W, self.H = width - self.ml - self.mr, height - self.mt - self.mb
        times = [float(e["at"]) for e in rec["timeline"]]
        self.t0 = min(times)
        self.t1 = max(times) if max(times) > self.t0 else self.t0 + 1
        self.smax = max([int(e.get("step") or 0) for e in rec["timeline"]] + [1])
        self.curve = gpu_hours_curve(rec)
        self.limit = float(rec["budget"]["limit_gpu_hours"])
        self.hmax = max([self.limit] + [h for _, h in self.curve]) * 1.08

    def x(self, t: float) -> float:
        return float(self.ml + (t - self.t0) / max(1e-9, self.t1 - self.t0) * self.W)

    def y(self, s: float) -> float:
        return float(self.mt + self.H - (s + 1) / (self.smax + 1) * self.H)

    def yh(self, h: float) -> float:
        return float(self.mt + self.H - h / max(1e-9, self.hmax) * self.H)


def _axes(g: _Geometry) -> list[str]:
    bottom, right = g.mt + g.H, g.ml + g.W
    out = [f'<rect x="{g.ml}" y="{g.mt}" width="{g.W}" height="{g.H}" fill="none" stroke="#888"/>']
    for v in nice_ticks(0, g.t1 - g.t0):
        px = g.x(g.t0 + v)
        out.append(f'<line x1="{px:.1f}" y1="{g.mt}" x2="{px:.1f}" y2="{bottom}" stroke="#eee"/>')
        out.append(f'<line x1="{px:.1f}" y1="{bottom}" x2="{px:.1f}" y2="{bottom + 5}" stroke="black"/>')
        out.append(f'<text x="{px:.1f}" y="{bottom + 17}" text-anchor="middle">{_fmt(v)}</text>')
    for v in nice_ticks(0, g.smax):
        py = g.y(v)
        out.append(f'<line x1="{g.ml - 5}" y1="{py:.1f}" x2="{g.ml}" y2="{py:.1f}" stroke="black"/>')
        out.append(f'<text x="{g.ml - 8}" y="{py + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
    for v in nice_ticks(0, g.hmax):
        py = g.yh(v)
        out.append(f'<line x1="{right}" y1="{py:.1f}" x2="{right + 5}" y2="{py:.1f}" stroke="#b8860b"/>')
        out.append(f'<text x="{right + 8}" y="{py + 4:.1f}" fill="#b8860b">{_fmt(v)}</text>')
    out.append(f'<text x="{g.ml + g.W / 2}" y="{g.height - 12}" text-anchor="middle">wall time (s since the '
               f'first event; {g.t1 - g.t0:.1f} s in all)</text>')
    out.append(f'<text x="16" y="{g.mt + g.H / 2}" transform="rotate(-90 16 {g.mt + g.H / 2})" '
               'text-anchor="middle">optimizer step</text>')
    out.append(f'<text x="{right + 44}" y="{g.mt + g.H / 2}" transform="rotate(90 {right + 44} {g.mt + g.H / 2})" '
               'text-anchor="middle" fill="#b8860b">GPU-hours spent (cumulative)</text>')
    return out


def _budget_layer(rec: dict[str, Any], g: _Geometry) -> list[str]:
    right = g.ml + g.W
    py = g.yh(g.limit)
    out = [f'<line x1="{g.ml}" y1="{py:.1f}" x2="{right}" y2="{py:.1f}" stroke="#d62728" stroke-dasharray="8 4" '
           'stroke-width="1.5"/>',
           f'<text x="{right - 4}" y="{py - 5:.1f}" text-anchor="end" fill="#d62728">budget '
           f'{_fmt(g.limit)} GPU-h</text>']
    if len(g.curve) > 1:
        out.append('<polyline fill="none" stroke="#b8860b" stroke-width="1.5" stroke-dasharray="2 2" points="'
                   + " ".join(f"{g.x(t):.1f},{g.yh(h):.1f}" for t, h in g.curve) + '"/>')
    stops = [e for e in rec["timeline"] if e["event"] == "budget-exhausted"]
    for i, e in enumerate(stops):
        px = g.x(float(e["at"]))
        out.append(f'<line x1="{px:.1f}" y1="{g.mt}" x2="{px:.1f}" y2="{g.mt + g.H}" stroke="#d62728" '
                   'stroke-width="2"/>')
        out.append(f'<polygon points="{px - 6:.1f},{py - 10:.1f} {px + 6:.1f},{py - 10:.1f} {px:.1f},{py:.1f}" '
                   'fill="#d62728"/>')
        if i == 0:
            out.append(f'<text x="{px - 4:.1f}" y="{g.mt + 14}" text-anchor="end" fill="#d62728" '
                       'font-weight="bold">budget stop</text>')
    return out


def _attempt_layers(rec: dict[str, Any], g: _Geometry) -> list[str]:
    out: list[str] = []
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for e in rec["timeline"]:
        if e.get("attempt") is not None:
            by_attempt.setdefault(int(e["attempt"]), []).append(e)
    accts = {a["attempt"]: a for a in rec["attempts"]}
    for n, evs in sorted(by_attempt.items()):
        col = _COLORS[(n - 1) % len(_COLORS)]
        prog = [e for e in evs if e["event"] == "progress" and e.get("step") is not None]
        pts = [(g.x(e["at"]), g.y(e["step"])) for e in prog]
        a = accts.get(n, {})
        if a.get("wasted_steps") and pts:
            top = a.get("last_step") or 0
            low = top - a["wasted_steps"]
            xs = [g.x(e["at"]) for e in prog if (e.get("step") or 0) > low]
            if xs:
                out.append(f'<rect x="{min(xs):.1f}" y="{g.y(top):.1f}" width="{max(2.0, max(xs) - min(xs)):.1f}" '
                           f'height="{g.y(low) - g.y(top):.1f}" fill="#d62728" opacity="0.15"/>')
        if n > 1:
            t_start = min(float(e["at"]) for e in evs)
            px = g.x(t_start)
            frm = a.get("resumed_from")
            out.append(f'<line x1="{px:.1f}" y1="{g.mt}" x2="{px:.1f}" y2="{g.mt + g.H}" stroke="{col}" '
                       'stroke-dasharray="3 3"/>')
            label = f"restart #{n - 1}: from step {frm}" if frm is not None else f"restart #{n - 1}: from scratch"
            ly = g.mt + 28 + ((n - 2) % 4) * 13
            # a label near the right edge is drawn to the left of its line, so the plot never cuts it
            anchor, lx = ("end", px - 3) if px > g.ml + 0.75 * g.W else ("start", px + 3)
            out.append(f'<text x="{lx:.1f}" y="{ly}" text-anchor="{anchor}" fill="{col}">{html.escape(label)}</text>')
            if frm is not None:
                out.append(f'<circle cx="{px:.1f}" cy="{g.y(int(frm)):.1f}" r="5" fill="none" stroke="{col}" '
                           'stroke-width="2"/>')
        if len(pts) > 1:
            out.append(f'<polyline fill="none" stroke="{col}" stroke-width="2" points="'
                       + " ".join(f"{px:.1f},{py:.1f}" for px, py in pts) + '"/>')
        for e in evs:
            if e["event"] == "save" and e.get("step") is not None:
                out.append(f'<circle cx="{g.x(e["at"]):.1f}" cy="{g.y(e["step"]):.1f}" r="3.5" fill="{col}"/>')
        if pts and a.get("ended") in ("interrupted", "preempted"):
            px, py = pts[-1]
            out.append(f'<text x="{px:.1f}" y="{py + 5:.1f}" fill="#d62728" font-size="16" text-anchor="middle">✕</text>')
        if pts:
            out.append(f'<text x="{pts[0][0] + 3:.1f}" y="{pts[0][1] - 6:.1f}" fill="{col}">#{n}</text>')
    return out


def _legend(g: _Geometry) -> list[str]:
    x0, y0 = g.ml + g.W + 62, g.mt + 4
    items = [
        ('<line x1="0" y1="0" x2="18" y2="0" stroke="#1f77b4" stroke-width="2"/>', "attempt #n: steps done"),
        ('<circle cx="9" cy="0" r="3.5" fill="#1f77b4"/>', "committed save"),
        ('<text x="9" y="5" fill="#d62728" font-size="16" text-anchor="middle">✕</text>', "interrupted"),
        ('<rect x="0" y="-5" width="18" height="10" fill="#d62728" opacity="0.15"/>', "wasted (done again)"),
        ('<circle cx="9" cy="0" r="5" fill="none" stroke="#ff7f0e" stroke-width="2"/>', "recovery point"),
        ('<line x1="9" y1="-6" x2="9" y2="6" stroke="#ff7f0e" stroke-dasharray="3 3"/>', "restart"),
        ('<line x1="0" y1="0" x2="18" y2="0" stroke="#b8860b" stroke-dasharray="2 2"/>', "GPU-hours spent"),
        ('<line x1="0" y1="0" x2="18" y2="0" stroke="#d62728" stroke-dasharray="8 4"/>', "budget"),
        ('<line x1="9" y1="-6" x2="9" y2="6" stroke="#d62728" stroke-width="2"/>', "budget stop"),
    ]
    out = [f'<g transform="translate({x0},{y0})">',
           f'<rect x="-6" y="-6" width="160" height="{len(items) * 16 + 8}" fill="white" stroke="#ccc"/>']
    for i, (mark, text) in enumerate(items):
        out.append(f'<g transform="translate(0,{i * 16 + 6})">{mark}<text x="24" y="4" font-size="10">'
                   f'{html.escape(text)}</text></g>')
    out.append("</g>")
    return out
