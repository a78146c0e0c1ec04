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
from ..protocol.selection import SaveState
from ..store import CheckpointStore
from ..util.redact import redact_url
from .budget import Budget, account, compare_costs
from .events import RejectedEvent, confirm_budget_stop, confirm_finished, planned_steps, validate_events
from .tier_record import render_rows, tier_summary


def build_record(store: CheckpointStore, budget: Budget | None = None, *, deep: bool = True) -> dict[str, Any]:
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
    # verdict-bearing claims count only when the records bear them out
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
    final = finished[-1]["payload"] if finished else None
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
    eligible = not reasons
    status = "eligible" if eligible else "unconfirmed" if unconfirmed else "not-eligible"
    commit_times = {(i.step, i.attempt): i.created_at for i in saves if i.created_at}
    now = time.time()
    last_commit_at = commit_times.get((latest.step, latest.attempt)) if latest else None
    ended_at = max((float(e["at"]) for e in events), default=now)
    total_bytes = sum(i.bytes for i in saves)
    storage_gb = total_bytes / 1e9
    billed = acc.spent_gpu_hours
    ordinary = acc.accepted_steps * budget.gpu_hours_per_step
    costs = compare_costs(ordinary, billed, budget.ordinary_price_per_gpu_hour, budget.price_per_gpu_hour)
    storage_cost = storage_gb * budget.storage_price_per_gb_month
    transfer_cost = storage_gb * budget.transfer_price_per_gb
    discarded = [
        {"step": i.step, "attempt": i.attempt, "save_id": i.save_id, "state": i.state.value, "detail": i.detail}
        for i in saves
        if i.state in (SaveState.PARTIAL, SaveState.IN_PROGRESS, SaveState.CORRUPT, SaveState.SUPERSEDED)
    ]
    timeline = []
    for e in events:
        timeline.append({"at": e["at"], "attempt": e.get("attempt"), "event": e["event"], **{
            k: v for k, v in e.get("payload", {}).items() if k in ("step", "seconds", "resumed_from", "save_id")}})
    return {
        "run_id": store.run_id,
        "store": redact_url(store.backend.url),
        "identity": run["identity"],
        "lineage": run.get("lineage"),
        "budget": budget.to_json(),
        "interruptions": acc.interruptions,
        "restarts": acc.restarts,
        "attempts": [
            {
                **a.to_json(),
                "recovered_step": a.resumed_from,
                "time_to_first_useful_step_s": a.first_step_seconds,
                "save_completion_s": [s.get("seconds") for s in a.saves],
            }
            for a in acc.attempts
        ],
        "last_valid_checkpoint": None if latest is None else {
            "step": latest.step, "attempt": latest.attempt, "save_id": latest.save_id,
            "manifest_digest": latest.manifest_digest, "bytes": latest.total_bytes,
        },
        "skipped_newer_candidates": [s.to_json() for s in sel.skipped],
        "discarded_checkpoints": discarded,
        "recovered_steps": [a.resumed_from for a in acc.attempts[1:]],
        "executed_steps": acc.executed_steps,
        "accepted_steps": acc.accepted_steps,
        "wasted_steps": acc.wasted_steps,
        "wasted_gpu_hours": round(acc.wasted_gpu_hours, 4),
        "spent_gpu_hours": round(acc.spent_gpu_hours, 4),
        "budget_remaining_gpu_hours": round(budget.limit_gpu_hours - acc.spent_gpu_hours, 4),
        "budget_stopped": bool(budget_stops),
        "cost": {
            "compute": round(billed * budget.price_per_gpu_hour, 4),
            "storage_per_month": round(storage_cost, 6),
            "transfer": round(transfer_cost, 6),
            "total": round(billed * budget.price_per_gpu_hour + storage_cost + transfer_cost, 4),
            "per_accepted_step": round(billed * budget.price_per_gpu_hour / acc.accepted_steps, 6)
            if acc.accepted_steps else None,
            "interruptible_vs_ordinary": costs.to_json(),
        },
        "age_of_last_complete_recovery_point_s": None if last_commit_at is None else round(ended_at - last_commit_at, 3),
        "save_completion_s": [s.get("seconds") for a in acc.attempts for s in a.saves],
        "final": final,
        "promotion": {
            "eligible": eligible,
            "status": status,
            "reasons": reasons or ["finished, final save complete and verified, linked to its manifest"],
            "artifact_manifest_digest": latest.manifest_digest if (latest and eligible) else None,
        },
        "timeline": timeline,
        "rejected_events": [r.to_json() for r in rejected],
        "tiers": tier_summary(saves, events, now),
    }


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


def render_timeline_svg(rec: dict[str, Any], width: int = 900, height: int = 360) -> str:
    """Steps against wall time per attempt; saves, interruptions and wasted spans."""
    prog = [e for e in rec["timeline"] if e["event"] in ("progress", "save", "start", "resume")]
    if not prog:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"><text x="10" y="20">no events</text></svg>'
    t0 = min(e["at"] for e in rec["timeline"])
    t1 = max(e["at"] for e in rec["timeline"]) or t0 + 1
    smax = max([e.get("step") or 0 for e in rec["timeline"]] + [1])
    ml, mr, mt, mb = 60, 20, 30, 40
    W, H = width - ml - mr, height - mt - mb

    def x(t: float) -> float:
        return float(ml + (t - t0) / max(1e-9, t1 - t0) * W)

    def y(s: float) -> float:
        return mt + H - (s + 1) / (smax + 1) * H

    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{ml}" y="18" font-size="13">{html.escape(rec["run_id"])}: steps against wall time '
           '(lines: attempts; dots: committed saves; red ✕: interruptions; shaded: wasted work)</text>',
           f'<line x1="{ml}" y1="{mt + H}" x2="{ml + W}" y2="{mt + H}" stroke="black"/>',
           f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{mt + H}" stroke="black"/>',
           f'<text x="{ml + W / 2}" y="{height - 8}" text-anchor="middle">wall time (s), total {t1 - t0:.1f} s</text>',
           f'<text x="14" y="{mt + H / 2}" transform="rotate(-90 14 {mt + H / 2})" text-anchor="middle">step</text>',
           f'<text x="{ml - 6}" y="{y(smax) + 4}" text-anchor="end">{smax}</text>',
           f'<text x="{ml - 6}" y="{mt + H}" text-anchor="end">0</text>']
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for e in rec["timeline"]:
        if e.get("attempt") is not None:
            by_attempt.setdefault(int(e["attempt"]), []).append(e)
    accts = {a["attempt"]: a for a in rec["attempts"]}
    for n, evs in sorted(by_attempt.items()):
        col = colors[(n - 1) % len(colors)]
        pts = [(x(e["at"]), y(e["step"])) for e in evs if e["event"] == "progress" and e.get("step") is not None]
        a = accts.get(n, {})
        if a.get("wasted_steps") and pts:
            top = a.get("last_step") or 0
            low = top - a["wasted_steps"]
            xs = [x(e["at"]) for e in evs if e["event"] == "progress" and (e.get("step") or 0) > low]
            if xs:
                out.append(f'<rect x="{min(xs):.1f}" y="{y(top):.1f}" width="{max(2.0, max(xs) - min(xs)):.1f}" '
                           f'height="{y(low) - y(top):.1f}" fill="#d62728" opacity="0.15"/>')
        if len(pts) > 1:
            out.append(f'<polyline fill="none" stroke="{col}" stroke-width="2" points="'
                       + " ".join(f"{px:.1f},{py:.1f}" for px, py in pts) + '"/>')
        for e in evs:
            if e["event"] == "save" and e.get("step") is not None:
                out.append(f'<circle cx="{x(e["at"]):.1f}" cy="{y(e["step"]):.1f}" r="4" fill="{col}"/>')
        if pts and a.get("ended") in ("interrupted", "preempted"):
            px, py = pts[-1]
            out.append(f'<text x="{px:.1f}" y="{py + 4:.1f}" fill="#d62728" font-size="16" text-anchor="middle">✕</text>')
        if pts:
            out.append(f'<text x="{pts[0][0] + 3:.1f}" y="{pts[0][1] - 6:.1f}" fill="{col}">#{n}</text>')
    out.append("</svg>")
    return "\n".join(out)
