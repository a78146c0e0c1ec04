"""A Hypothesis state machine driving the real CheckpointStore, with I/O faults
injected inside it, against an independent model (plain dicts).

Profiles (tests/conftest.py): the default suite runs a bounded number of
steps; ``pytest tests/store/test_state_machine.py --hypothesis-profile=deep`` runs
over 100,000 steps. A failure prints the rule sequence and a
``@reproduce_failure`` blob; ``--hypothesis-seed=N`` replays a seed.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from ckptstore import (
    CheckpointStore,
    CommitConflictError,
    CommitUnknownError,
    OpenOptions,
    SaveState,
    SkipReason,
    StoreUnavailableError,
    SupersededError,
)
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import Crashed, FaultyBackend
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.errors import ResumeRefusedError
from ckptstore.retry import RetryPolicy
from tests.helpers import IDENT

FAST = RetryPolicy(attempts=3, base_delay=0.0, max_delay=0.0)
RUN = "run"
# the rules damage, plant and check version 2's whole components under saves/ (version 3's pieces:
# tests/incremental, tests/fail_closed/test_peer_pieces.py)
V2 = OpenOptions(protocol_version=2)


@dataclass
class Commit:
    step: int
    attempt: int
    save_id: str
    data: dict[str, bytes]
    corrupted: bool = False
    removed: bool = False
    #: components whose size no longer matches the record (deleted or truncated)
    bad_size: set[str] = field(default_factory=set)
    #: the commit record itself was torn: gc must keep its save (THREATS.md §4.3)
    torn: bool = False


@dataclass
class Model:
    commits: dict[tuple[int, int], Commit] = field(default_factory=dict)
    attempts: dict[int, int | None] = field(default_factory=dict)  # number -> resumed_from

    def superseded(self, c: Commit) -> bool:
        return any(b > c.attempt and (r is None or r < c.step) for b, r in self.attempts.items())

    def valid(self) -> list[Commit]:
        out = [c for c in self.commits.values() if not (c.corrupted or c.removed or self.superseded(c))]
        return sorted(out, key=lambda c: (c.step, c.attempt), reverse=True)

    def selectable(self) -> list[Commit]:
        """Valid commits; of several valid commits of one step, the highest attempt."""
        seen: set[int] = set()
        out = []
        for c in self.valid():
            if c.step not in seen:
                out.append(c)
                seen.add(c.step)
        return out

    def expected_latest(self) -> Commit | None:
        s = self.selectable()
        return s[0] if s else None

    def in_history(self) -> list[Commit]:
        """Commits a fresh start would supersede (a writer resuming from "latest" refuses to)."""
        return [c for c in self.commits.values() if not (c.removed or self.superseded(c))]


BACKEND_FACTORY: Callable[[], Backend] | None = None


class StoreMachine(RuleBasedStateMachine):
    #: invariant checks run (one per step, plus one per example): reported by _run
    checks = 0
    examples = 0

    def __init__(self) -> None:
        super().__init__()
        StoreMachine.examples += 1
        assert BACKEND_FACTORY is not None
        self.inner = BACKEND_FACTORY()
        self.model = Model()
        self.fb = FaultyBackend(self.inner)
        self.writer = self._open_writer("latest")
        self.zombie: CheckpointStore | None = None
        self.next_step = 0
        #: junk planted under twins of real names (another script's digit): never read, never deleted
        self.planted: dict[str, bytes] = {}

    # -- helpers -----------------------------------------------------------
    def _open_writer(self, resume_from: object) -> CheckpointStore:
        self.fb = FaultyBackend(self.inner)  # a fresh process: no faults pending
        if resume_from == "latest" and self.model.expected_latest() is None and self.model.in_history():
            with pytest.raises(ResumeRefusedError):  # never a silent fresh start over the run's commits
                CheckpointStore.open(self.fb, RUN, identity=IDENT, retry=FAST, options=V2)
            resume_from = None  # the refusal's way out: the operator starts over deliberately
        w = CheckpointStore.open(self.fb, RUN, identity=IDENT, resume_from=resume_from, retry=FAST,  # type: ignore[arg-type]
                                 options=V2)
        assert w.attempt is not None
        self.model.attempts[w.attempt.number] = w.attempt.resumed_from
        for a in w.attempt.abandons:
            self.model.attempts.pop(a, None)
        if resume_from == "latest":
            exp = self.model.expected_latest()
            assert (w.resumed_from.save_id if w.resumed_from else None) == (exp.save_id if exp else None)
        return w

    def _record(self, ref, data: dict[str, bytes]) -> None:  # type: ignore[no-untyped-def]
        key = (ref.step, ref.attempt)
        assert key not in self.model.commits, "two commits acknowledged for one (step, attempt)"
        self.model.commits[key] = Commit(ref.step, ref.attempt, ref.save_id, data)

    def _landed(self, step: int, attempt: int, save_id: str, data: dict[str, bytes]) -> None:
        """After a crash: the commit record may have landed before the process died."""
        try:
            raw = self.inner.get(P.LATEST_LAYOUT.commit_key(RUN, step, attempt))
        except Exception:  # noqa: BLE001
            return
        rec = P.CommitRecord.decode(raw, "raw")
        if rec.save_id == save_id:
            self.model.commits[(step, attempt)] = Commit(step, attempt, save_id, data)

    def _reader(self) -> CheckpointStore:
        return CheckpointStore.open(self.inner, RUN, mode="r")

    # -- rules -------------------------------------------------------------
    sizes = st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=3)

    @rule(delta=st.integers(min_value=1, max_value=3), sizes=sizes)
    def save(self, delta: int, sizes: list[int]) -> None:
        step = self.next_step + delta
        data = {f"c{i}": os.urandom(n) for i, n in enumerate(sizes)}
        with self.writer.save(step) as s:
            for name, blob in data.items():
                s.put(name, blob)
        self._record(s.ref, data)
        self.next_step = step

    @rule(delta=st.integers(min_value=1, max_value=3), sizes=sizes, at=st.integers(min_value=1, max_value=12),
          kind=st.sampled_from(["crash", "io-error", "torn", "lost-ack"]))
    def faulty_save(self, delta: int, sizes: list[int], at: int, kind: str) -> None:
        step = self.next_step + delta
        data = {f"c{i}": os.urandom(n) for i, n in enumerate(sizes)}
        n = self.fb.count + at
        if kind == "crash":
            self.fb.crash_at(n)
        elif kind == "io-error":
            self.fb.fail(n, StoreUnavailableError("injected EIO"))
        elif kind == "torn":
            self.fb.torn(n, keep=7)
        else:
            self.fb.lose_ack(n)
        writer = self.writer
        w = writer.save(step)
        try:
            with w:
                for name, blob in data.items():
                    w.put(name, blob)
        except Crashed:
            self._landed(step, writer.attempt.number, w.save_id, data)  # type: ignore[union-attr]
            self.writer = self._open_writer("latest")  # the process died; a new one takes over
            self.next_step = max(self.next_step, step)
            return
        except (StoreUnavailableError, CommitUnknownError):
            # not acknowledged; the commit may still have landed (ground truth decides)
            self.fb.faults.clear()
            self._landed(step, writer.attempt.number, w.save_id, data)  # type: ignore[union-attr]
            self.next_step = max(self.next_step, step)
            return
        self.fb.faults.clear()
        self._record(w.ref, data)  # a lost ack on a write or the commit was settled by retry/read-back
        self.next_step = step

    @precondition(lambda self: any(not c.removed for c in self.model.commits.values()))
    @rule(data=st.data(), how=st.sampled_from(["flip", "truncate", "delete"]))
    def corrupt(self, data: st.DataObject, how: str) -> None:
        c = data.draw(st.sampled_from(sorted((c for c in self.model.commits.values() if not c.removed),
                                             key=lambda c: (c.step, c.attempt))))
        name = data.draw(st.sampled_from(sorted(c.data)))
        key = P.component_key(RUN, c.save_id, name)
        blob = c.data[name]
        if how == "delete":
            self.inner.delete(key)
            c.bad_size.add(name)
        elif how == "truncate":
            if not blob:
                return
            self.inner.put(key, [blob[:-1]])
            c.bad_size.add(name)
        else:
            if not blob:
                return
            b = bytearray(blob)
            b[len(b) // 2] ^= 0x10
            self.inner.put(key, [bytes(b)])  # the original with one flipped bit, at its recorded size
            c.bad_size.discard(name)
        c.corrupted = True

    @precondition(lambda self: bool(self.model.commits))
    @rule(data=st.data(), what=st.sampled_from(["commit", "attempt", "save"]),
          digit=st.characters(categories=("Nd", "No"), exclude_characters="0123456789"))
    def plant_twin(self, data: st.DataObject, what: str, digit: str) -> None:
        """A twin of a real name, one digit respelled in another script, holding
        junk: it must replace nothing (PROTOCOL.md §1, one spelling per name)."""
        c = data.draw(st.sampled_from(sorted(self.model.commits.values(), key=lambda c: (c.step, c.attempt))))
        key = {
            "commit": P.LATEST_LAYOUT.commit_key(RUN, c.step, c.attempt),
            "attempt": P.attempt_key(RUN, c.attempt),
            "save": P.component_key(RUN, c.save_id, sorted(c.data)[0]),
        }[what]
        # digits of the key but the save ID's random part (the draw must not depend on chance)
        shape = key.replace(c.save_id, c.save_id[:-12] + "x" * 12)
        digits = [i for i, ch in enumerate(shape) if ch.isdigit() and i > len(RUN)]
        at = data.draw(st.sampled_from(digits))
        twin = key[:at] + digit + key[at + 1 :]
        self.inner.put(twin, [b"twin"])
        self.planted[twin] = b"twin"

    @precondition(lambda self: any(not (c.removed or c.torn) for c in self.model.commits.values()))
    @rule(data=st.data(), how=st.sampled_from(["torn", "empty"]))
    def tear_commit_record(self, data: st.DataObject, how: str) -> None:
        """Bit rot on the commit record itself: its save is no longer selectable,
        and gc keeps it (THREATS.md §4.3)."""
        c = data.draw(st.sampled_from(sorted((c for c in self.model.commits.values() if not (c.removed or c.torn)),
                                             key=lambda c: (c.step, c.attempt))))
        key = P.LATEST_LAYOUT.commit_key(RUN, c.step, c.attempt)
        rec = self.inner.get(key)
        self.inner.put(key, [rec[: len(rec) // 2] if how == "torn" else b""])
        c.torn = c.corrupted = True

    @rule()
    def second_writer_same_step(self) -> None:
        step = self.next_step + 1
        a, b = self.writer.save(step), self.writer.save(step)
        a.put("x", b"a")
        b.put("x", b"b")
        ref = a.commit()
        with pytest.raises(CommitConflictError):
            b.commit()
        self._record(ref, {"x": b"a"})
        self.next_step = step

    @precondition(lambda self: bool(self.model.selectable()))
    @rule(data=st.data())
    def new_attempt_from_older_step(self, data: st.DataObject) -> None:
        target = data.draw(st.sampled_from(self.model.selectable()))
        self.zombie = self.writer
        self.writer = self._open_writer(target.step)
        self.next_step = target.step

    @precondition(lambda self: self.zombie is not None)
    @rule(delta=st.integers(min_value=-2, max_value=3))
    def zombie_saves(self, delta: int) -> None:
        assert self.zombie is not None and self.zombie.attempt is not None
        step = max(0, self.next_step + delta)
        z = self.zombie.attempt.number
        if (step, z) in self.model.commits:
            return
        data = {"z": os.urandom(10)}
        fenced = any(b > z and (r is None or r < step) for b, r in self.model.attempts.items())
        try:
            with self.zombie.save(step) as s:
                s.put("z", data["z"])
        except SupersededError as exc:
            assert fenced and not exc.committed
            return
        except CommitConflictError:
            return
        assert not fenced, "a fenced zombie was told it committed"
        self._record(s.ref, data)

    @rule(keep=st.integers(min_value=1, max_value=3))
    def gc(self, keep: int) -> None:
        before = self.model.expected_latest()
        self.writer.gc(keep_last=keep, grace_seconds=3600)
        selectable = self.model.selectable()
        keep_ids = {c.save_id for c in selectable}
        for c in self.model.valid():
            if c.save_id not in keep_ids:
                c.removed = True  # a lower attempt of a step committed again
        for i, c in enumerate(selectable):
            if i >= keep:
                c.removed = True
        for c in self.model.commits.values():
            if self.model.superseded(c) and not c.torn:  # a torn record's save is kept, whatever it was
                c.removed = True
        # gc hashes newest first only until `keep` saves verified; older ones get the size check
        # (PROTOCOL §4.5), so a flipped byte behind the kept saves looks complete and is deleted
        if len(selectable) >= keep:
            edge = (selectable[keep - 1].step, selectable[keep - 1].attempt)
            for c in self.model.commits.values():
                if c.corrupted and not c.bad_size and not c.torn and (c.step, c.attempt) < edge:
                    c.removed = True
        after = self.model.expected_latest()
        assert (before.save_id if before else None) == (after.save_id if after else None)

    @rule()
    def reopen_writer(self) -> None:
        self.zombie = self.writer
        self.writer = self._open_writer("latest")
        exp = self.model.expected_latest()
        self.next_step = max(self.next_step, exp.step if exp else 0)

    # -- invariants ----------------------------------------------------------
    @invariant()
    def selection_matches_model(self) -> None:
        StoreMachine.checks += 1
        r = self._reader()
        sel = r.latest_complete(deep=True, explain=True)
        exp = self.model.expected_latest()
        got = sel.latest
        assert (got.save_id if got else None) == (exp.save_id if exp else None), (
            f"selected {got and (got.step, got.attempt)}, model says {exp and (exp.step, exp.attempt)}; "
            f"skipped {[s.to_json() for s in sel.skipped]}\n{self.fb.format_trace()[-3000:]}"
        )
        if got is not None:
            for name, blob in exp.data.items():  # type: ignore[union-attr]
                assert r.read(got, name) == blob
        for s in sel.skipped:  # the reasons are true
            c = self.model.commits.get((s.step, s.attempt))
            if s.reason is SkipReason.SUPERSEDED:
                assert c is not None and self.model.superseded(c)
            elif s.reason in (SkipReason.MISSING_COMPONENT, SkipReason.SIZE_MISMATCH, SkipReason.HASH_MISMATCH):
                assert c is not None and c.corrupted
            elif s.reason is SkipReason.NO_COMMIT:  # no commit record names this save
                assert s.save_id not in {c.save_id for c in self.model.commits.values()}

    @invariant()
    def nothing_planted_or_torn_is_deleted(self) -> None:
        for key, data in self.planted.items():
            assert self.inner.get(key) == data, f"planted twin {key!r} was changed or deleted"
        for c in self.model.commits.values():
            if c.torn:
                for name in sorted(set(c.data) - c.bad_size):
                    self.inner.size(P.component_key(RUN, c.save_id, name))  # NotFoundError: gc deleted it

    @invariant()
    def acknowledged_commits_stay_selectable(self) -> None:
        infos = self._reader().list_saves(deep=True)
        committed = {(i.step, i.attempt) for i in infos if i.state is SaveState.COMMITTED}
        for c in self.model.selectable():
            assert (c.step, c.attempt) in committed, f"acknowledged commit {(c.step, c.attempt)} not selectable"
        steps = [s for s, _ in committed]
        assert len(steps) == len(set(steps)), "two selectable saves for one step"


StoreMachine.TestCase.settings = settings(deadline=None, suppress_health_check=list(HealthCheck))


def _run(factory: Callable[[], Backend], examples: int | None = None, steps: int | None = None) -> None:
    global BACKEND_FACTORY
    BACKEND_FACTORY = factory
    current = settings()
    kw = {"deadline": None, "suppress_health_check": list(HealthCheck)}
    if examples is not None and current.max_examples > examples:
        kw["max_examples"] = examples
    if steps is not None and current.stateful_step_count > steps:
        kw["stateful_step_count"] = steps
    StoreMachine.checks = StoreMachine.examples = 0
    try:
        run_state_machine_as_test(StoreMachine, settings=settings(current, **kw))
    finally:
        BACKEND_FACTORY = None
        steps = StoreMachine.checks - StoreMachine.examples
        print(f"\nstate machine: {steps} steps in {StoreMachine.examples} examples")


@pytest.mark.backends("memory")
def test_state_machine_memory(backend_kind) -> None:  # type: ignore[no-untyped-def]
    _run(MemoryBackend)


@pytest.mark.backends("local")
def test_state_machine_local(backend_kind, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _run(lambda: LocalBackend(tempfile.mkdtemp(dir=tmp_path)))


@pytest.mark.backends("seaweedfs", "moto", "fakegcs")
def test_state_machine_object_stores(backend_kind, object_servers) -> None:  # type: ignore[no-untyped-def]
    _run(lambda: object_servers.backend(backend_kind, f"sm-{uuid.uuid4().hex[:10]}"), examples=6, steps=12)
