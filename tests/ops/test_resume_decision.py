"""The resume decision, with the seeds' semantics, from facts and from a real store."""

from __future__ import annotations

from ckptstore import CheckpointStore
from ckptstore import protocol as P
from ckptstore.backends.memory import MemoryBackend
from ckptstore.ops.decision import Action, decide, plan_resume
from ckptstore.protocol.selection import Skip, SkipReason

RUN = {"data_digest": "data-47", "code_digest": "code-82", "feature_contract": "receipt-v4"}


def test_seed_semantics_from_facts() -> None:
    partial = [Skip(280, 1, "s", SkipReason.NO_COMMIT, "")]
    resume = decide(run_exists=True, identity_diff=None, latest_step=129, latest_save_id="x", skipped=[],
                    spent=18, limit=23)
    assert resume.action is Action.RESUME and resume.next_step == 130
    assert decide(run_exists=True, identity_diff=None, latest_step=129, latest_save_id="x", skipped=[],
                  spent=24, limit=23).action is Action.STOP
    assert decide(run_exists=True, identity_diff=None, latest_step=None, latest_save_id=None, skipped=partial,
                  spent=18, limit=23).action is Action.START_FRESH
    changed = decide(run_exists=True, identity_diff={"data_digest": ("data-47", "data-48")}, latest_step=129,
                     latest_save_id="x", skipped=[])
    assert changed.action is Action.NEW_RUN_REQUIRED and changed.mismatched_fields == ["data_digest"]
    fallback = decide(run_exists=True, identity_diff=None, latest_step=240, latest_save_id="x", skipped=partial)
    assert fallback.action is Action.RESUME and fallback.next_step == 241 and fallback.discarded == partial


def test_plan_resume_against_a_store() -> None:
    b = MemoryBackend()
    st = CheckpointStore.open(b, "run", identity=RUN)
    assert plan_resume(b, "other", RUN).action is Action.START_FRESH
    with st.save(240) as s:
        s.put("m", b"x")
    w = st.save(280)
    w.put("m", b"partial")  # interrupted
    d = plan_resume(b, "run", RUN)
    assert d.action is Action.RESUME and d.next_step == 241
    assert [(x.step, x.reason) for x in d.discarded] == [(280, SkipReason.NO_COMMIT)]
    d = plan_resume(b, "run", {**RUN, "feature_contract": "receipt-v5"})
    assert d.action is Action.NEW_RUN_REQUIRED and d.mismatched_fields == ["feature_contract"]
    assert plan_resume(b, "run", RUN, spent=23.5, limit=23).action is Action.STOP
    assert b.list("run/attempts/") and len(b.list("run/attempts/")) == 1  # plan_resume wrote nothing


def test_new_run_from_weights_records_lineage() -> None:
    b = MemoryBackend()
    src = CheckpointStore.open(b, "run", identity=RUN)
    with src.save(280) as s:
        s.put("m", b"weights")
    ref = src.latest_complete()
    new = CheckpointStore.open(b, "run-v5", identity={**RUN, "feature_contract": "receipt-v5"},
                               lineage=src.lineage_of(ref))
    rec = new.run_record
    assert rec["lineage"]["source_run"] == "run" and rec["lineage"]["manifest_digest"] == ref.manifest_digest
    assert new.resumed_from is None  # a new run, never a continuation
    assert P.parse_save_id(rec["lineage"]["save_id"]) == (280, 1)
