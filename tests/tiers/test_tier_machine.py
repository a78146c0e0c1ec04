"""A Hypothesis state machine over two tiers: saves, durable outages, a
corrupted / truncated / removed local copy, a wiped local disk and restarts
(new writers), on a real local tier and a real durable directory; and the
same on a version-3 run (pieces) with a gc of the durable tier among the rules.

Invariants: selection never returns a save that is not complete and verified
in the tier it is read from (every byte read back equals what was written
for that step), and no save acknowledged durable is ever lost."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from ckptstore import CheckpointStore
from ckptstore.backends.faults import FaultyBackend, transient
from ckptstore.backends.local import LocalBackend
from ckptstore.core.collector import GcReport
from ckptstore.core.intents import MAX_INTENT_BYTES
from ckptstore.errors import LocalTierRefusedError
from ckptstore.protocol import AttemptRecord, attempt_key, component_key
from ckptstore.protocol.layout import intents_prefix, pieces_prefix
from ckptstore.protocol.pieces import PACK_BYTES
from ckptstore.protocol.records import IntentRecord
from ckptstore.retry import RetryPolicy
from tests.helpers import settle_background_writes
from tests.incremental.common import GRACE, LONG, Clock, long_timing

IDENT = {"m": "machine"}
FAST = RetryPolicy(attempts=2, base_delay=0.001, max_delay=0.01)
#: TwoTiers damages version 2's whole-component files in the local tier (TwoTiersWithPieces: version 3's pieces)
WHOLE_FILES = 2


def payload(step: int, attempt: int) -> bytes:
    return bytes((step * 31 + attempt * 7 + i) % 253 for i in range(600))



def damage(f: Path, how: str) -> None:
    """Damage one local file: one bit flipped, its last 3 bytes cut, or removed."""
    if how == "flip":
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0x40
        f.write_bytes(bytes(b))
    elif how == "truncate":
        f.write_bytes(f.read_bytes()[:-3])
    else:
        f.unlink()

class TwoTiers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tier-sm-"))
        self.down = threading.Event()
        self.local = self.dir / "nvme"
        self.step = 0
        self.acked: dict[str, int] = {}  # save ID -> step, acknowledged durable
        self.written: dict[str, bytes] = {}  # save ID -> bytes of component "a"
        self.store = self._open()

    def _durable(self) -> FaultyBackend:
        down = self.down
        return FaultyBackend(LocalBackend(self.dir / "durable")).fail(
            None, transient(), persistent=True,
            when=lambda op, key: down.is_set() and "/events/" not in key and op in ("put", "create"))

    def _open(self) -> CheckpointStore:
        s = CheckpointStore.open(self._durable(), "run", identity=IDENT, local_tier=self.local, retry=FAST,
                                 max_replication_lag=3, local_keep=3, close_flush_seconds=0.05, protocol_version=WHOLE_FILES)
        self.step = (s.resumed_from.step + 1) if s.resumed_from is not None else 0
        return s

    @rule()
    def save(self) -> None:
        att = self.store.attempt.number  # type: ignore[union-attr]
        data = payload(self.step, att)
        with self.store.save(self.step) as w:
            w.put("a", data)
        self.written[w.save_id] = data
        self.step += 1

    @rule()
    def flush(self) -> None:
        if self.store.flush(0 if self.down.is_set() else 20):
            for i in self.store.list_saves():
                if i.ref is not None and i.ref.tier in ("durable", "both"):
                    self.acked[i.save_id] = i.step

    @rule()
    def toggle_durable(self) -> None:
        if self.down.is_set():
            self.down.clear()
        else:
            self.down.set()

    @rule(how=st.sampled_from(["flip", "truncate", "remove"]))
    def damage_newest_local(self, how: str) -> None:
        saves = self.local / "run" / "saves"
        if not saves.exists():
            return
        ids = sorted(p.name for p in saves.iterdir())
        if not ids:
            return
        f = self.local / component_key("run", ids[-1], "a")
        if not f.exists():
            return
        damage(f, how)

    @rule()
    def wipe_local(self) -> None:
        self.store.close()
        shutil.rmtree(self.local, ignore_errors=True)
        self.down.clear()
        self.store = self._open()

    @precondition(lambda self: True)
    @rule()
    def restart(self) -> None:
        self.store.close()
        self.down.clear()
        self.store = self._open()

    @invariant()
    def selection_reads_back_verified(self) -> None:
        ref = self.store.latest_complete()
        if ref is None:
            return
        try:
            got = self.store.read(ref, "a")
        except Exception:  # noqa: BLE001 - a local-only copy damaged after selection: never bad bytes
            return
        assert got == self.written.get(ref.save_id, got)
        assert got == self.expected(ref.step, ref.attempt)

    def expected(self, step: int, attempt: int) -> bytes:
        """The bytes component ``a`` of a save of ``step`` by ``attempt`` holds."""
        return payload(step, attempt)

    @invariant()
    def nothing_acknowledged_durable_is_lost(self) -> None:
        r = CheckpointStore.open(LocalBackend(self.dir / "durable"), "run", mode="r")
        have = {i.save_id for i in r.list_saves() if i.state.value in ("committed", "superseded")}
        assert set(self.acked) <= have, set(self.acked) - have

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def test_two_tier_state_machine() -> None:
    run_state_machine_as_test(TwoTiers, settings=settings(max_examples=8, stateful_step_count=12, deadline=None))


FROZEN = bytes(range(256)) * (PACK_BYTES // 256)  # one shared piece every save reuses


class TwoTiersWithPieces(TwoTiers):
    """The same machine on a version-3 run (pieces), with a gc of the durable
    tier among the rules: damage hits a local piece, and on top of the
    invariants above every save acknowledged durable that gc did not delete
    on purpose deep-verifies in the durable tier (gc never took a piece it needs).

    Time is the rule ``time_passes``, not the wall clock: the writers' intents
    live LONG (no save or replication runs out of protection however slowly
    the machine runs), and the durable gc judges by a clock fixed where every
    piece and intent there when time last passed is older than its grace and
    lifetime, and everything written since is young (it stays so: that clock
    does not run)."""

    def __init__(self) -> None:
        #: the durable gc's clock: the real one until time first passes
        self.gc_clock = Clock()
        self.last_gc: GcReport | None = None
        super().__init__()

    def _open(self) -> CheckpointStore:
        s = CheckpointStore.open(self._durable(), "run", identity=IDENT, local_tier=self.local, retry=FAST,
                                 max_replication_lag=3, local_keep=3, close_flush_seconds=0.05,
                                 protocol_version=3, piece_timing=long_timing())
        self.step = (s.resumed_from.step + 1) if s.resumed_from is not None else 0
        return s

    @rule()
    def save(self) -> None:
        att = self.store.attempt.number  # type: ignore[union-attr]
        data = payload(self.step, att)
        with self.store.save(self.step) as w:
            w.put("a", [memoryview(FROZEN), memoryview(data)])
        self.written[w.save_id] = FROZEN + data
        self.step += 1

    @rule(how=st.sampled_from(["flip", "truncate", "remove"]), pick=st.integers(0, 50))
    def damage_newest_local(self, how: str, pick: int) -> None:  # type: ignore[override]
        files = sorted((self.local / "run" / "pieces").glob("*/*"))
        if not files:
            return
        f = files[pick % len(files)]
        damage(f, how)

    @rule()
    def time_passes(self) -> None:
        """An hour passes for the durable gc, while no replication is in flight (it would be judged by a
        clock an hour ahead of its writer's): what the durable tier holds now is old to every later gc."""
        if self.down.is_set() or not self.store.flush(20):
            return
        listed = LocalBackend(self.dir / "durable").list(pieces_prefix("run"))
        boundary = max([o.mtime for o in listed] + [time.time()])
        # a lower bound only: what is written from now on is dated later than the boundary (local mtimes
        # are exact to well under this; intents are dated by the writers' real clock)
        time.sleep(0.05)
        self.gc_clock = Clock(fixed=boundary + LONG + 0.01)

    @rule()
    def gc_durable(self) -> None:
        report = CheckpointStore.open(LocalBackend(self.dir / "durable"), "run",
                                      piece_timing=long_timing(self.gc_clock)).gc(
            keep_last=1, grace_seconds=GRACE, deep=False)
        self.last_gc = report
        for sid, _ in report.deleted_saves:
            self.acked.pop(sid, None)

    @rule(shape=st.sampled_from(["future", "junk", "huge"]))
    def gc_durable_with_a_planted_intent(self, shape: str) -> None:
        """A planted save intent (dated 50 years ahead, not JSON, or more bytes than gc reads) refuses
        the durable sweep with its reason; the operator removes it again."""
        durable = LocalBackend(self.dir / "durable")
        key = intents_prefix("run") + "00000001-0000000000ff.json"
        now = self.gc_clock()
        data = {"future": IntentRecord("run", 1, now + 50 * 365 * 86400, now + 50 * 365 * 86400 + 1,
                                       (("000000000000-00000001-0123456789ab", "0" * 64),), version=3).encode(),
                "junk": b"not an intent", "huge": b"x" * (MAX_INTENT_BYTES + 1)}[shape]
        durable.put(key, [data])
        try:
            report = CheckpointStore.open(durable, "run", piece_timing=long_timing(self.gc_clock)).gc(
                keep_last=1, grace_seconds=GRACE, deep=False)
            assert report.pieces_refused is not None and report.pieces_freed == 0, report
            for sid, _ in report.deleted_saves:
                self.acked.pop(sid, None)
        finally:
            durable.delete(key)

    def expected(self, step: int, attempt: int) -> bytes:
        return FROZEN + payload(step, attempt)

    @invariant()
    def acknowledged_durable_saves_verify(self) -> None:
        r = CheckpointStore.open(LocalBackend(self.dir / "durable"), "run", mode="r")
        for sid, step in sorted(self.acked.items()):
            info = next((i for i in r.list_saves() if i.save_id == sid), None)
            assert info is not None and info.ref is not None, (sid, step)
            assert not r.verify(info.ref, deep=True).problems, (sid, step)


def test_two_tier_state_machine_with_pieces() -> None:
    run_state_machine_as_test(TwoTiersWithPieces,
                              settings=settings(max_examples=8, stateful_step_count=12, deadline=None))


class TwoTiersPlanted(TwoTiers):
    """The machine above with hostile objects planted in the tier root
    (issue 30, THREATS.md §4.12): a link at the run's folder (to the durable
    run's folder or to a user's folder), a ``.quarantine`` link with a foreign
    run record that forces a quarantine, the tier root pointing at the durable
    store itself, and a local attempt record the durable tier never had. Each
    refused open must be a ``LocalTierRefusedError`` that changed nothing; on
    top of the invariants above, nothing outside the tier and the store ever
    changes and every save acknowledged durable still reads back bit for bit."""

    def __init__(self) -> None:
        super().__init__()
        self.outside = self.dir / "outside"
        (self.outside / "run").mkdir(parents=True)
        (self.outside / "run" / "notes.txt").write_bytes(b"a user's file")
        settle_background_writes()  # a version-3 save's next intent lands after the save returned
        self.outside_before = _tree(self.outside)
        self.planted_attempt = 40

    def _refused(self, tier: Path) -> None:
        """An open on ``tier`` is refused and changes nothing in the durable store."""
        settle_background_writes()  # a version-3 save's next intent lands after the save returned
        before = _tree(self.dir / "durable")
        try:
            s = CheckpointStore.open(self._durable(), "run", identity=IDENT, local_tier=tier, retry=FAST)
        except LocalTierRefusedError as exc:
            assert "remove" in str(exc) or "choose another local_tier" in str(exc).lower(), str(exc)
        else:
            s.close()
            raise AssertionError(f"an open of the planted tier {tier} was not refused")
        assert _tree(self.dir / "durable") == before

    @rule(to=st.sampled_from(["durable", "outside"]))
    def plant_run_folder_link(self, to: str) -> None:
        self.store.close()
        self.down.clear()
        run, aside = self.local / "run", self.local / "run.aside"
        had = run.is_dir()
        if had:
            run.rename(aside)
        self.local.mkdir(parents=True, exist_ok=True)
        run.symlink_to(self.dir / "durable" / "run" if to == "durable" else self.outside / "run")
        self._refused(self.local)
        run.unlink()
        if had:
            aside.rename(run)
        self.store = self._open()

    @rule()
    def point_the_tier_at_the_durable_store(self) -> None:
        self.store.close()  # its replicator no longer writes to the durable store while it is compared
        self.down.clear()
        self._refused(self.dir / "durable")
        self._refused(self.dir / "durable" / "run")
        self.store = self._open()

    @rule()
    def plant_quarantine_link(self) -> None:
        self.store.close()
        self.down.clear()
        q = self.local / ".quarantine"
        if q.is_dir() and not q.is_symlink():
            q.rename(self.local / f".quarantine-old-{time.time_ns()}")  # a unique name: the rule may run again
        (self.local / "run").mkdir(parents=True, exist_ok=True)
        rr = self.local / "run" / "RUN.json"
        if rr.exists():
            rr.unlink()
        rr.write_bytes(b'{"another":"run"}')
        q.symlink_to(self.outside)
        settle_background_writes()  # a version-3 save's next intent lands after the save returned
        before = _tree(self.local)
        self._refused(self.local)
        assert _tree(self.local) == before  # nothing moved
        q.unlink()
        self.store = self._open()  # now set aside into a real .quarantine
        assert (self.local / ".quarantine").is_dir() and not (self.local / ".quarantine").is_symlink()

    @rule()
    def plant_local_attempt(self) -> None:
        p = self.local / attempt_key("run", self.planted_attempt)
        if not p.parent.is_dir() or p.exists():
            return
        p.write_bytes(AttemptRecord("run", self.planted_attempt, 0, "e" * 32, 1.0, (), "elsewhere").encode())
        self.planted_attempt += 1

    @invariant()
    def nothing_outside_changed(self) -> None:
        assert _tree(self.outside) == self.outside_before

    @invariant()
    def acknowledged_durable_saves_read_back(self) -> None:
        r = CheckpointStore.open(LocalBackend(self.dir / "durable"), "run", mode="r")
        by_id = {i.save_id: i for i in r.list_saves()}
        for sid, step in sorted(self.acked.items()):
            info = by_id.get(sid)
            assert info is not None and info.ref is not None, (sid, step)
            assert r.read(info.ref, "a") == self.written[sid], (sid, step)


def _tree(top: Path) -> dict[str, bytes | str]:
    """Every entry under ``top``, links not followed: a file's bytes, a link's target, a folder."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            p = Path(dirpath) / n
            out[str(p.relative_to(top))] = (os.readlink(p) if p.is_symlink() else "dir" if p.is_dir()
                                            else p.read_bytes())
    return out


def test_two_tier_state_machine_with_planted_links() -> None:
    run_state_machine_as_test(TwoTiersPlanted, settings=settings(max_examples=8, stateful_step_count=12,
                                                                 deadline=None))

def test_a_truncated_local_piece_is_written_again_and_saving_goes_on() -> None:
    """Issue 34's seed of the pieces machine, kept as a fixed example: a local
    piece the next save would reuse is truncated; that save and the next are
    acknowledged (the piece is written again under the new save, reported),
    and a restarted writer resumes bit for bit."""
    m = TwoTiersWithPieces()
    try:
        m.save()
        m.flush()
        shared = sorted((m.local / "run" / "pieces").glob("*/*"), key=lambda f: f.stat().st_size)[-1]
        damage(shared, "truncate")  # the FROZEN piece every save reuses
        m.save()
        assert any("written again" in line for line in m.store.damaged_pieces)
        m.save()
        m.flush()
        m.selection_reads_back_verified()
        m.nothing_acknowledged_durable_is_lost()
        m.acknowledged_durable_saves_verify()
        m.restart()
        ref = m.store.resumed_from
        assert ref is not None and ref.step == 2
        assert m.store.read(ref, "a") == m.expected(2, ref.attempt)
        m.save()
        m.selection_reads_back_verified()
    finally:
        m.teardown()


def test_after_time_passes_the_durable_gc_sweeps_old_pieces_beside_a_replication() -> None:
    """A fixed example of the pieces machine: two saves made durable, time
    passes, a third save is replicated while the durable gc runs: the pieces
    only the deleted older saves named go, and every save acknowledged durable
    still deep-verifies (the third's new pieces, written after time passed, are
    young to that gc)."""
    m = TwoTiersWithPieces()
    try:
        for _ in range(2):
            m.save()
            m.flush()
        m.time_passes()
        m.save()
        m.gc_durable()  # beside the third save's replication
        m.flush()
        assert m.last_gc is not None and m.last_gc.pieces_refused is None and m.last_gc.pieces_freed >= 1
        m.gc_durable()
        m.selection_reads_back_verified()
        m.nothing_acknowledged_durable_is_lost()
        m.acknowledged_durable_saves_verify()
    finally:
        m.teardown()
