"""Direct unit tests of the pure decisions in ckptstore.protocol: the
one-history rule, candidate order, save states and gc's plan — no store, no I/O."""

from __future__ import annotations

import pytest

from ckptstore import CheckpointStore, OpenOptions
from ckptstore.backends.memory import MemoryBackend
from ckptstore.protocol import AttemptRecord
from ckptstore.protocol.gcplan import plan_gc
from ckptstore.protocol.selection import (
    SaveInfo,
    SaveState,
    Skip,
    SkipReason,
    bound_skips,
    candidate_order,
    effective_attempts,
    superseded_by,
    uncommitted_state,
)


def att(n: int, resumed: int | None, abandons: tuple[int, ...] = ()) -> AttemptRecord:
    return AttemptRecord("r", n, resumed, f"w{n}", float(n), abandons)


def test_later_attempt_that_forked_before_a_step_supersedes_it() -> None:
    attempts = {1: att(1, None), 2: att(2, 240)}
    assert superseded_by(280, 1, attempts) == attempts[2]
    assert superseded_by(240, 1, attempts) is None  # its resume point stays in history
    assert superseded_by(200, 1, attempts) is None
    assert superseded_by(280, 2, attempts) is None  # no later attempt


def test_fresh_start_supersedes_everything_older() -> None:
    attempts = {1: att(1, None), 2: att(2, None)}
    assert superseded_by(0, 1, attempts) == attempts[2]


def test_abandoned_registrations_fence_nothing() -> None:
    attempts = {1: att(1, None), 2: att(2, 5), 3: att(3, 9, abandons=(2,))}
    eff = effective_attempts(attempts)
    assert sorted(eff) == [1, 3]
    assert superseded_by(8, 1, eff) is None  # attempt 2 (resumed from 5) was abandoned


def test_candidate_order_newest_step_then_attempt() -> None:
    assert candidate_order([(5, 1), (7, 1), (7, 3), (6, 9), (7, 3)]) == [(7, 3), (7, 1), (6, 9), (5, 1)]


def test_uncommitted_state_by_grace() -> None:
    assert uncommitted_state(10, 60) is SaveState.IN_PROGRESS
    assert uncommitted_state(61, 60) is SaveState.PARTIAL


def test_bound_skips_keeps_the_newest_and_counts_the_rest() -> None:
    skips = [Skip(i, 1, None, SkipReason.NO_COMMIT, "") for i in range(250)]
    shown, more = bound_skips(skips)
    assert [s.step for s in shown[:3]] == [249, 248, 247] and len(shown) == 100 and more == 150


def info(step: int, state: SaveState, sid: str | None = None, attempt: int = 1) -> SaveInfo:
    return SaveInfo(sid or f"{step:012d}-{attempt:08d}-000000000000", step, attempt, state, "", 1, 1, None)


def test_gc_plan_keeps_newest_complete_and_evidence() -> None:
    infos = [
        info(9, SaveState.IN_PROGRESS),
        info(8, SaveState.CORRUPT),
        info(7, SaveState.COMMITTED),
        info(6, SaveState.SUPERSEDED),
        info(5, SaveState.COMMITTED),
        info(4, SaveState.COMMITTED),
        info(3, SaveState.PARTIAL),
        info(2, SaveState.UNSUPPORTED),
    ]
    plan = plan_gc(infos, keep_last=2)
    kept = sorted(i.step for i in plan.keep)
    deleted = sorted(i.step for i, _ in plan.delete)
    assert kept == [2, 5, 7, 8, 9] and deleted == [3, 4, 6]


def test_gc_plan_keep_every() -> None:
    infos = [info(s, SaveState.COMMITTED) for s in range(10, 0, -1)]
    plan = plan_gc(infos, keep_last=1, keep_every=4)
    assert sorted(i.step for i in plan.keep) == [4, 8, 10]


def test_gc_plan_never_deletes_a_save_id_something_kept_names() -> None:
    shared = "000000000007-00000001-abcdefabcdef"
    infos = [info(7, SaveState.COMMITTED, shared), info(3, SaveState.COMMITTED, shared), info(2, SaveState.COMMITTED)]
    plan = plan_gc(infos, keep_last=1)
    assert [i.save_id for i, _ in plan.delete] == [infos[2].save_id]


def test_gc_plan_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        plan_gc([], keep_last=0)
    with pytest.raises(ValueError):
        plan_gc([], keep_last=1, keep_every=0)


def test_gc_reads_only_what_it_keeps() -> None:
    """Deep gc verifies newest first until keep_last saves verified; older ones
    are deleted on the size check, so the bytes read do not grow with history."""
    st = CheckpointStore.open(MemoryBackend(), "r", identity={"data_digest": "d"})
    for step in range(1, 11):
        with st.save(step) as s:
            s.put("model", bytes([step]) * 1000)
    rep = st.gc(keep_last=2, grace_seconds=0)
    assert rep.bytes_read == 2000
    assert len(rep.deleted_saves) == 8
    assert [i.step for i in st.list_saves()] == [10, 9]


def test_fall_back_takes_the_abandoned_point_out_of_history() -> None:
    mem = MemoryBackend()
    st = CheckpointStore.open(mem, "r", identity={"data_digest": "d"})
    for step in (1, 2):
        with st.save(step) as s:
            s.put("model", bytes([step]) * 10)
    st2 = CheckpointStore.open(mem, "r", identity={"data_digest": "d"})
    assert st2.resumed_from is not None and st2.resumed_from.step == 2
    older = st2.get_save(1)
    st2.fall_back(older, ["step 2 failed its digest check during the restore"])
    assert st2.attempt is not None and st2.attempt.number == 3 and st2.resumed_from == older
    assert st2.latest_complete() == older  # step 2 is superseded by the fallback
    with st2.save(2) as s:
        s.put("model", b"again")
    latest = st2.latest_complete()
    assert latest is not None and latest.attempt == 3
    assert [e["event"] for e in st2.events()] == ["resume-fallback"]


def test_a_deep_open_reads_the_resume_point_once() -> None:
    """Registering an attempt selects twice (before and after creating the
    attempt record); the second selection does not re-hash what the first verified."""
    from ckptstore.backends.faults import FaultyBackend

    mem = MemoryBackend()
    # version 2: counts the reads of the whole component under saves/
    st = CheckpointStore.open(mem, "r", identity={"data_digest": "d"}, options=OpenOptions(protocol_version=2))
    with st.save(1) as s:
        s.put("model", b"w" * 100_000)
    fb = FaultyBackend(mem)
    st2 = CheckpointStore.open(fb, "r", identity={"data_digest": "d"})
    assert st2.resumed_from is not None
    read = sum(int(t.outcome.split()[1][:-1]) for t in fb.trace if t.op == "get_range" and "/saves/" in t.key)
    assert read == 100_000
