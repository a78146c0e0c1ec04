"""The tier part of the operator record (``docs/tiers.md``): the age of the
last durable and the last local recovery point, the replication lag and what
lost local tiers cost, from the store's listing and its ledger alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..protocol.selection import SaveInfo, SaveState


def tier_summary(saves: Sequence[SaveInfo], events: Sequence[Mapping[str, Any]], now: float) -> dict[str, Any] | None:
    """None when the store was read without a local tier and its ledger has no tier events."""
    committed = [i for i in saves if i.state is SaveState.COMMITTED and i.ref is not None]
    tiered = any(i.ref is not None and i.ref.tier != "durable" for i in committed)
    tier_events = [e for e in events if str(e.get("event", "")).startswith(("replicat", "resume-tier", "preempt-flush"))]
    if not tiered and not tier_events:
        return None
    durable = [i for i in committed if i.ref is not None and i.ref.tier in ("durable", "both")]
    local = [i for i in committed if i.ref is not None and i.ref.tier in ("local", "both")]

    def newest(xs: list[SaveInfo]) -> dict[str, Any] | None:
        if not xs:
            return None
        top = max(xs, key=lambda i: (i.step, i.attempt))
        age = None if top.created_at is None else round(max(0.0, now - top.created_at), 3)
        return {"step": top.step, "attempt": top.attempt, "age_s": age}

    top_durable = max((i.step for i in durable), default=-1)
    lag = sorted(i.step for i in committed if i.ref is not None and i.ref.tier == "local" and i.step > top_durable)
    resumes = [e.get("payload", {}) for e in events if e.get("event") == "resume-tier"]
    lost = [int(p.get("steps_lost_with_local_tier") or 0) for p in resumes]
    return {
        "last_durable": newest(durable),
        "last_local": newest(local) if tiered else None,
        "replication_lag_steps": lag,
        "replicated": sum(1 for e in events if e.get("event") == "replicated"),
        "replication_failures": sum(1 for e in events if e.get("event") == "replication-failed"),
        "replication_skipped": sum(1 for e in events if e.get("event") == "replication-skipped"),
        "fenced": sum(1 for e in events if e.get("event") == "replication-fenced"),
        "resumes": [{"tier": p.get("tier"), "step": p.get("step"), "steps_lost": p.get("steps_lost_with_local_tier")}
                    for p in resumes[-20:]],
        "steps_lost_with_local_tiers": sum(lost),
    }


def render_rows(summary: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    if summary is None:
        return []

    def point(p: Mapping[str, Any] | None) -> str:
        return "none" if p is None else f"step {p['step']} ({p['age_s']} s old)"

    return [
        ("last durable recovery point", point(summary["last_durable"])),
        ("last local recovery point", point(summary["last_local"])),
        ("replication lag (steps not durable)", ", ".join(map(str, summary["replication_lag_steps"])) or "0"),
        ("replicated / failed tries / skipped", f"{summary['replicated']} / {summary['replication_failures']} / "
                                                f"{summary['replication_skipped']}"),
        ("steps lost with local tiers", str(summary["steps_lost_with_local_tiers"])),
    ]
