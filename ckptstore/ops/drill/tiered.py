"""The drill's two-tier scenario (``docs/tiers.md``): a local directory as the
fast tier in front of the drill's store (standing for durable storage).

1. A tiered run killed before a checkpoint; the local disk is wiped (the VM
   is replaced); the restart resumes from the newest durable save and runs to
   the end, bit for bit the clean run.
2. A bit of the newest local copy is flipped; a fresh writer falls back to
   the durable copy of the same step.

The checkpoint interval is computed per tier from each tier's measured save
cost (local commit, replication)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

from ...options import OpenOptions, TierOptions
from ...protocol import component_key
from ...protocol.layout import piece_key
from ...store import CheckpointStore
from ..budget import young_daly_interval
from .proc import ProcResult

RUN = "receipts-tiered"


class DrillLike(Protocol):
    interval: int
    clean_result: dict[str, Any]

    def run(self, run_id: str, *extra: str, kill_on: str | None = None, delay: float = 0.0,
            **kw: Any) -> ProcResult: ...
    def check(self, name: str, ok: bool, detail: str = "") -> bool: ...
    def stage(self, title: str) -> None: ...
    def reader(self, run_id: str) -> CheckpointStore: ...
    def log(self, text: str) -> None: ...


def _resumed(r: ProcResult) -> int | None:
    line = r.first("RESUMED")
    return int(line.split()[1]) if line else None


def _last_resume_tier(st: CheckpointStore) -> dict[str, Any]:
    ev = [e["payload"] for e in st.events() if e["event"] == "resume-tier"]
    return ev[-1] if ev else {}


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else 0.0


def run_tiered(d: DrillLike, mtbi_steps: float, step_seconds: float) -> dict[str, Any]:
    """Stage 4b of the drill; returns what the record keeps."""
    d.stage("4b. two tiers: a local disk in front of durable storage; the disk wiped, a local copy corrupted")
    k = d.interval
    local = Path(tempfile.mkdtemp(prefix="ckptstore-drill-local-"))
    out: dict[str, Any] = {}
    try:
        tier = ("--sync", "--local-tier", str(local))
        r = d.run(RUN, *tier, kill_on=f"STEP {2 * k - 2}")
        d.check("tiered run killed before its second checkpoint", r.killed)
        newest_durable = d.reader(RUN).latest_complete(deep=True)
        shutil.rmtree(local)  # the VM is replaced: its disk is gone
        want = newest_durable.step if newest_durable else None
        r = d.run(RUN, *tier)
        ev = _last_resume_tier(d.reader(RUN))
        d.check("after the local disk was wiped, the restart resumed from the newest durable save",
                _resumed(r) == want and ev.get("tier") == "durable",
                f"RESUMED {_resumed(r)}, expected {want}; steps lost with the local tier: "
                f"{ev.get('steps_lost_with_local_tier')}")
        out["steps_lost_with_wiped_local_tier"] = ev.get("steps_lost_with_local_tier")
        final = r.first("FINAL")
        d.check("the tiered run finished bit for bit the clean run",
                r.returncode == 0 and final is not None and final.split()[1] == d.clean_result["final_digest"])
        # corrupt the newest local copy: one bit of its optimizer state; a fresh writer must not trust it
        reader = d.reader(RUN)
        newest = CheckpointStore.open(reader.backend, RUN, mode="r", options=OpenOptions(tiers=TierOptions(local))).latest_complete()
        flipped = False
        if newest is not None and newest.tier != "durable":
            entry = newest.components["optimizer.safetensors"]
            own = [p for p in entry.pieces or () if p.holder == newest.save_id] or list(entry.pieces or ())
            # a whole component's file, or (protocol version 3) a piece of it, preferably one this save wrote
            f = local / (piece_key(RUN, own[-1].holder, own[-1].digest) if own
                         else component_key(RUN, newest.save_id, "optimizer.safetensors"))
            if f.exists():
                b = bytearray(f.read_bytes())
                b[len(b) // 2] ^= 0x01
                f.write_bytes(bytes(b))
                flipped = True
        d.check("a bit of the newest local copy flipped", flipped)
        identity = reader.run_record["identity"]
        with CheckpointStore.open(reader.backend, RUN, identity=identity,
                                  options=OpenOptions(tiers=TierOptions(local))) as w:
            got = w.resumed_from
            ev = _last_resume_tier(w)
            d.check("a corrupt local copy fell back to the durable copy of the same step",
                    newest is not None and got is not None and got.step == newest.step and got.tier == "durable"
                    and bool(ev.get("local_reasons")),
                    f"resumed step {got.step if got else None} from the {got.tier if got else '-'} tier")
        events = d.reader(RUN).events()
        local_s = [float(e["payload"]["seconds"]) for e in events if e["event"] == "save"]
        durable_s = [float(e["payload"]["seconds"]) for e in events if e["event"] == "replicated"]
        per_tier = {}
        for name, xs in (("local", local_s), ("durable", durable_s)):
            cost_steps = _median(xs) / max(step_seconds, 1e-9)
            per_tier[name] = {"save_seconds_median": round(_median(xs), 4), "saves": len(xs),
                              "young_daly_steps": round(young_daly_interval(cost_steps, mtbi_steps), 2)}
            d.log(f"    {name} tier: save cost median {_median(xs) * 1000:.1f} ms over {len(xs)} saves -> "
                  f"Young/Daly every {per_tier[name]['young_daly_steps']:.1f} steps")
        out["interval_per_tier"] = per_tier
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return out
