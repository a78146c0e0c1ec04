"""The seeds' scenarios, the accounting and the operator record; the drill end to end."""

from __future__ import annotations

import json

import pytest

from ckptstore import CheckpointStore
from ckptstore.backends.memory import MemoryBackend
from ckptstore.errors import InvalidInputError
from ckptstore.ops.budget import Budget, account, compare_costs, young_daly_interval
from ckptstore.ops.decision import Action, plan_resume
from ckptstore.ops.report import build_record, render_table, render_timeline_svg
from ckptstore.protocol import AttemptRecord
from tests.helpers import IDENT


def ev(at: float, attempt: int, kind: str, **payload):  # type: ignore[no-untyped-def]
    return {"at": at, "attempt": attempt, "event": kind, "payload": payload}


def test_seed_300_step_run_recovers_at_240_and_counts_60_recomputed_steps() -> None:
    b = MemoryBackend()
    st = CheckpointStore.open(b, "receipts", identity=IDENT)
    for step in range(0, 301):
        st.record_event("progress", {"step": step}) if step % 20 == 0 or step == 300 else None
        if step == 240:
            with st.save(240) as s:
                s.put("model", b"weights@240")
    w = st.save(280)  # interrupted while writing: no commit
    w.put("model", b"half")
    # the worker disappears at step 300; a fresh process decides and resumes
    d = plan_resume(b, "receipts", IDENT)
    assert d.action is Action.RESUME and d.saved_step == 240 and d.next_step == 241
    assert [(x.step, x.reason.value) for x in d.discarded] == [(280, "no-commit")]
    st2 = CheckpointStore.open(b, "receipts", identity=IDENT)
    assert st2.resumed_from.step == 240
    st2.record_event("progress", {"step": 241})
    acc = account(st2.attempts(), st2.events(), Budget())
    assert acc.attempts[0].wasted_steps == 60
    assert acc.wasted_steps == 60 and acc.interruptions == 1
    rec = build_record(CheckpointStore.open(b, "receipts", mode="r"))
    assert rec["wasted_steps"] == 60 and rec["recovered_steps"] == [240]
    assert [d["step"] for d in rec["discarded_checkpoints"]] == [280]
    assert rec["discarded_checkpoints"][0]["state"] == "partial"  # its attempt was superseded
    assert not rec["promotion"]["eligible"]  # not finished


def test_accounting_from_events() -> None:
    attempts = [AttemptRecord("r", 1, None, "w", 0), AttemptRecord("r", 2, 9, "w", 10),
                AttemptRecord("r", 3, 19, "w", 20)]
    events = [ev(1, 1, "progress", step=14), ev(11, 2, "progress", step=25), ev(21, 3, "progress", step=39),
              ev(22, 3, "finished")]
    b = Budget(limit_gpu_hours=10, gpu_hours_per_step=0.1, restart_gpu_hours=0.5)
    acc = account(attempts, events, b)
    assert [a.executed_steps for a in acc.attempts] == [15, 16, 20]
    assert [a.wasted_steps for a in acc.attempts] == [5, 6, 0]
    assert acc.accepted_steps == 40 and acc.restarts == 2 and acc.interruptions == 2
    assert acc.spent_gpu_hours == pytest.approx(51 * 0.1 + 2 * 0.5)
    assert acc.wasted_gpu_hours == pytest.approx(11 * 0.1 + 2 * 0.5)


def test_seed_cost_arithmetic_is_thirty_percent_not_fifty() -> None:
    c = compare_costs(ordinary_hours=10, interruptible_hours=14, ordinary_price=1.0, interruptible_price=0.5)
    assert c.interruptible_cost == 7.0 and c.saving_fraction == pytest.approx(0.30)


def test_admission_and_young_daly() -> None:
    b = Budget(limit_gpu_hours=23, gpu_hours_per_step=0.1)
    assert b.admit(200)[0] and not b.admit(240)[0]
    assert young_daly_interval(2.0, 100.0) == pytest.approx(20.0)
    with pytest.raises(InvalidInputError):
        Budget(limit_gpu_hours=0)


def test_run_record_renders_as_table_and_timeline(tmp_path) -> None:  # type: ignore[no-untyped-def]
    b = MemoryBackend()
    st = CheckpointStore.open(b, "r", identity={**IDENT, "planned_steps": 3})  # no plan: "unconfirmed" (§4.9)
    for step in range(3):
        st.record_event("progress", {"step": step})
    with st.save(2) as s:
        s.put("m", b"x")
    st.record_event("save", {"step": 2, "seconds": 0.01, "bytes": 1})
    st.record_event("finished", {"steps": 3, "final_manifest_digest": st.latest_complete().manifest_digest})
    rec = build_record(CheckpointStore.open(b, "r", mode="r"))
    assert rec["promotion"]["eligible"] and rec["interruptions"] == 0
    assert "PROMOTION ELIGIBLE" in render_table(rec)
    svg = render_timeline_svg(rec)
    assert svg.startswith("<svg") and "polyline" in svg
    json.dumps(rec)


@pytest.mark.slow
def test_the_drill_end_to_end(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from ckptstore.cli.commands import main

    out = tmp_path / "out"
    rc = main(["drill", "--store", str(tmp_path / "store"), "--out", str(out), "--steps", "40"])
    text = capsys.readouterr().out
    assert rc == 0, text[-3000:]
    assert "drill PASSED" in text
    rec = json.loads((out / "record.json").read_text())
    assert rec["interruptions"] == 4 and rec["promotion"]["eligible"]
    assert rec["drill"]["bit_identical_to_clean"]
    assert rec["drill"]["budget_breach"]["budget_stopped"] and not rec["drill"]["budget_breach"]["promotion"]["eligible"]
    assert rec["drill"]["perturbed_earliest_changed_stage"].startswith("batch-order")
    # the last stage: the recovered run promoted and verified, the budget-stopped run's promotion refused
    assert rec["drill"]["promotion"]["verified"] and (out / "artifact-receipts" / "provenance.json").exists()
    refused = rec["drill"]["budget_breach"]["promotion_refused"]
    assert refused["refused"] and any(r.startswith("budget-stopped") for r in refused["reasons"])
    assert main(["verify-artifact", str(out / "artifact-receipts"), "--store", str(tmp_path / "store")]) == 0
    capsys.readouterr()
    # the record's numbers agree with the store: a fresh report rebuilds the same facts
    assert main(["report", str(tmp_path / "store"), "receipts", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    for k in ("interruptions", "wasted_steps", "executed_steps", "last_valid_checkpoint", "recovered_steps"):
        assert again[k] == rec[k], k
    assert (out / "timeline.svg").read_text().startswith("<svg")
