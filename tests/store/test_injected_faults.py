"""Faults the round-1 suite did not inject, each judged by a raw invariant check
(``ckptstore.testing.invariants``) rather than through ``latest_complete()``,
which by design skips a commit whose bytes are missing:

* a put acknowledged but not there (dropped, or stored short): the inventory
  check before the commit must catch it, so no commit names missing bytes;
* a crash at every backend operation of ``gc``: the commit record goes first,
  so no crash leaves a commit pointing at deleted components;
* real processes racing to open one run for writing: distinct attempt numbers
  (create-if-absent, never a plain put) and fencing that holds.

Each of these turns red when its rule is broken in the core; the mutation
check (``tests/mutations/run.py``) proves it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckptstore import CheckpointStore, OpenOptions, SaveAbortedError
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import Crashed, FaultyBackend
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.retry import RetryPolicy
from ckptstore.testing.invariants import (
    assert_invariant_1,
    commits_of_step,
    raw_attempts,
    raw_commits,
    save_objects,
)
from tests.helpers import IDENT

FAST = RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.005)
NAMES = ("model", "optim", "extra/rng")
# these tests fault, damage or count version 2's whole components under saves/ (version 3's pieces:
# tests/incremental, tests/fail_closed/test_peer_pieces.py)
V2 = OpenOptions(protocol_version=2)


def blob(step: int, name: str, size: int = 2500) -> bytes:
    seed = f"<{step}/{name}>".encode()
    return (seed * (size // len(seed) + 1))[:size]


def do_save(store: CheckpointStore, step: int, names: tuple[str, ...] = NAMES) -> None:
    with store.save(step) as s:
        for n in names:
            s.put(n, blob(step, n))


def check_selected(backend: Backend, step: int, context: str = "") -> None:
    reader = CheckpointStore.open(backend, "run", mode="r")
    latest = reader.latest_complete(deep=True)
    assert latest is not None and latest.step == step, f"{context}: selected {latest and latest.step}, want {step}"
    for n in latest.components:
        assert reader.read(latest, n) == blob(step, n), context


@pytest.fixture
def new_backend(backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[[], Backend]]:
    """Each call: a backend on a new, empty location (same kind as the test's)."""
    made: list[Backend] = []
    tag = uuid.uuid4().hex[:8]

    def make() -> Backend:
        i = len(made)
        b: Backend
        if backend_kind == "memory":
            b = MemoryBackend(f"m{i}")
        elif backend_kind == "local":
            b = LocalBackend(tmp_path / f"store{i}")
        else:
            b = request.getfixturevalue("object_servers").backend(backend_kind, f"inv-{tag}-{i}")
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


# ------------------------------------------------ acknowledged, but not there


@pytest.mark.parametrize("fault", ["dropped", "short"])
@pytest.mark.parametrize("which", [0, 2])
def test_acknowledged_put_that_is_not_there_is_never_committed(
    backend: Backend, fault: str, which: int
) -> None:
    """A put that returned normally but left no object (or fewer bytes): the
    read-after-write inventory must refuse the commit. Judged raw: no commit
    record of the step exists, and no commit anywhere lacks its bytes."""
    fb = FaultyBackend(backend)
    st = CheckpointStore.open(fb, "run", identity=IDENT, retry=FAST, options=V2)
    do_save(st, 1)
    target = f"/{NAMES[which]}"

    def is_target(op: str, key: str) -> bool:
        return op == "put" and key.endswith(target) and "-" in key

    if fault == "dropped":
        fb.drop_put(when=is_target)
    else:
        fb.short_put(missing=7, when=is_target)
    with pytest.raises(SaveAbortedError, match="did not land intact"):
        do_save(st, 2)
    assert any("ACKED" in t.outcome for t in fb.trace), fb.format_trace()
    assert_invariant_1(backend, "run", f"{fault} put of {NAMES[which]}\n{fb.format_trace()}")
    assert commits_of_step(backend, "run", 2) == [], "a save with a missing component was committed"
    check_selected(backend, 1, fault)
    # the aborted save's components were removed by the writer
    assert [sid for sid in save_objects(backend, "run") if sid.startswith("000000000002-")] == []


# ------------------------------------------------------- gc, crash everywhere


def build_gc_scenario(backend: Backend) -> None:
    """Committed, superseded, re-committed and partial saves, so one gc deletes
    every kind: attempt 1 saves 1, 2, 3; attempt 2 resumes from 2 (step 3 of
    attempt 1 is superseded), saves 3 and 4; a save of 5 dies before its commit."""
    a1 = CheckpointStore.open(backend, "run", identity=IDENT, retry=FAST, options=V2)
    for s in (1, 2, 3):
        do_save(a1, s)
    a2 = CheckpointStore.open(backend, "run", identity=IDENT, resume_from=2, retry=FAST)
    for s in (3, 4):
        do_save(a2, s)
    fb = FaultyBackend(backend)
    a3 = CheckpointStore.open(fb, "run", identity=IDENT, resume_from=4, retry=FAST)
    fb.crash_when(lambda op, key: op == "create" and "/commits/" in key)
    with pytest.raises(Crashed):
        do_save(a3, 5)


def copy_store(src: Backend, dst: Backend) -> None:
    for o in src.list(""):
        dst.put(o.key, [src.get(o.key)])


def check_after_gc_crash(backend: Backend, context: str) -> None:
    assert_invariant_1(backend, "run", context)
    check_selected(backend, 4, context)


@pytest.mark.backends("memory", "local", "moto", "fakegcs")  # SeaweedFS: minutes per run on this scenario
def test_crash_at_every_operation_of_gc(backend_kind: str, new_backend: Callable[[], Backend]) -> None:
    template = new_backend()
    build_gc_scenario(template)
    assert_invariant_1(template, "run", "scenario")
    # count gc's operations on a copy
    probe_inner = new_backend()
    copy_store(template, probe_inner)
    probe = FaultyBackend(probe_inner)
    st = CheckpointStore.open(probe, "run", mode="r", retry=FAST)
    start = probe.count
    rep = st.gc(keep_last=1, grace_seconds=0)
    n_ops = probe.count - start
    ops = probe.trace[-n_ops:]
    deletes = [t.n - start for t in ops if t.op == "delete"]
    assert len(deletes) >= 10, probe.format_trace()  # 4 commits + their components + a partial save
    assert any(a.key.endswith(".json") for a in rep.actions)
    check_after_gc_crash(probe_inner, "complete gc")
    # every operation on memory and local disk. On object stores (each point
    # costs a copy of the store): the first read, the first two deletes (the
    # window between a commit record and its components), the middle and the
    # last delete, and after the end
    if backend_kind in ("memory", "local"):
        points = list(range(1, n_ops + 2))
    else:
        points = sorted({1, deletes[0], deletes[1], deletes[len(deletes) // 2], deletes[-1], n_ops + 1})
    for n in points:
        inner = new_backend()
        copy_store(template, inner)
        fb = FaultyBackend(inner)
        st = CheckpointStore.open(fb, "run", mode="r", retry=FAST)
        fb.crash_at(fb.count + n)
        try:
            st.gc(keep_last=1, grace_seconds=0)
        except Crashed:
            pass
        context = f"gc crashed at its operation {n} of {n_ops}\n{fb.format_trace()}"
        check_after_gc_crash(inner, context)
        # recovery: the next gc finishes the job
        CheckpointStore.open(inner, "run", mode="r", retry=FAST).gc(keep_last=1, grace_seconds=0)
        check_after_gc_crash(inner, "after the recovering gc; " + context)
        left = [(c.step, c.attempt) for c in raw_commits(inner, "run")]
        assert left == [(4, 2)], context
        assert len(save_objects(inner, "run")) == 1, context


# ------------------------------------------------------ processes racing open

RACER = str(Path(__file__).parents[1] / "workers" / "race_opener.py")
N_RACERS = 4


def _wait(paths: list[Path], procs: list[subprocess.Popen[str]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            out = dead[0].communicate()[0]
            raise AssertionError(f"a racer exited early ({dead[0].returncode}):\n{out}")
        assert time.monotonic() < deadline, f"racers did not reach {paths[0].name} in {timeout}s"
        time.sleep(0.01)


@pytest.mark.backends("local", "fakegcs")  # one object store keeps the default suite short
def test_processes_racing_to_open_get_distinct_attempts_and_fencing_holds(
    backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend_kind == "local":
        url, opts = str(tmp_path / "store"), {}
    else:
        url, opts = request.getfixturevalue("object_servers").url_and_options(
            backend_kind, f"race-{uuid.uuid4().hex[:8]}"
        )
    from ckptstore.backends.schemes import backend_from_url

    backend = backend_from_url(url, storage_options=opts or None)
    run = "run"
    first = CheckpointStore.open(backend, run, identity={"data_digest": "race", "code_digest": "race"})
    with first.save(1) as s:
        s.put("model", b"step one" * 100)
    sync = tmp_path / "sync"
    sync.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    procs = [
        subprocess.Popen([sys.executable, RACER, url, run, json.dumps(opts), str(sync), str(i), "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for i in range(N_RACERS)
    ]
    try:
        _wait([sync / f"ready-{i}" for i in range(N_RACERS)], procs, 120)
        (sync / "go").touch()
        _wait([sync / f"opened-{i}" for i in range(N_RACERS)], procs, 120)
        (sync / "save").touch()
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    opened: dict[str, dict[str, object]] = {}
    outcome: dict[str, dict[str, object]] = {}
    for out in outs:
        for line in out.splitlines():
            if line.startswith("OPENED "):
                rec = json.loads(line[7:])
                opened[str(rec["index"])] = rec
            elif line.startswith("OUTCOME "):
                rec = json.loads(line[8:])
                outcome[str(rec["index"])] = rec
    assert len(opened) == N_RACERS and len(outcome) == N_RACERS, "\n".join(outs)
    numbers = sorted(int(str(r["attempt"])) for r in opened.values())
    assert len(set(numbers)) == N_RACERS, f"two processes own one attempt number: {numbers}"
    # each process's number is backed by its own record (nobody overwrote it)
    records = raw_attempts(backend, run)
    for r in opened.values():
        assert records[int(str(r["attempt"]))]["writer_id"] == r["writer_id"], (r, records)
    # fencing: all resumed from step 1, so only the newest attempt may commit step 2
    top = max(opened.values(), key=lambda r: int(str(r["attempt"])))
    for i, res in outcome.items():
        if i == top["index"]:
            assert res["result"] == "ack", (res, outs)
        else:
            assert res == {"index": i, "result": "superseded", "committed": False}, (res, outs)
    commits = [(c.step, c.attempt) for c in commits_of_step(backend, run, 2)]
    assert commits == [(2, int(str(top["attempt"])))], commits
    assert_invariant_1(backend, run, "after the open race")
    latest = CheckpointStore.open(backend, run, mode="r").latest_complete(deep=True)
    assert latest is not None and (latest.step, latest.attempt) == (2, top["attempt"])


# ------------------------------------------------ a newer attempt mid-commit


class RegisterDuringCommit(FaultyBackend):
    """Runs ``hook`` once, just before the first commit record is created: a
    replacement process registers while this writer is past its pre-commit fence."""

    hook: Callable[[], None] | None = None

    def create(self, key: str, data: bytes) -> bool:
        hook, self.hook = self.hook, None
        if hook is not None and "/commits/" in key:
            hook()
        elif hook is not None:
            self.hook = hook
        return super().create(key, data)


def test_attempt_registered_during_the_commit_fences_it(backend: Backend) -> None:
    """The post-commit fence (PROTOCOL §4.3 step 7): the record landed, but a
    newer attempt resumed from before its step, so the save is never
    acknowledged and never selected; the newer attempt commits the step again."""
    from ckptstore import SupersededError

    rb = RegisterDuringCommit(backend)
    old = CheckpointStore.open(rb, "run", identity=IDENT, retry=FAST)
    do_save(old, 1)
    newer: list[CheckpointStore] = []
    rb.hook = lambda: newer.append(CheckpointStore.open(backend, "run", identity=IDENT, retry=FAST))
    with pytest.raises(SupersededError) as ei:
        do_save(old, 2)
    assert ei.value.committed, "the record landed: the error must say so"
    assert [c.attempt for c in commits_of_step(backend, "run", 2)] == [1]
    assert_invariant_1(backend, "run", "fenced commit")
    check_selected(backend, 1, "a fenced commit was selected")
    do_save(newer[0], 2)
    check_selected(backend, 2, "the newer attempt's commit")
    assert_invariant_1(backend, "run", "after the newer commit")


def test_cheap_selection_skips_a_component_of_the_wrong_size(backend: Backend) -> None:
    """The default (cheap) selection compares sizes from the listing; a
    component that lost its tail at rest is skipped without reading a byte."""
    st = CheckpointStore.open(backend, "run", identity=IDENT, retry=FAST, options=V2)
    do_save(st, 1)
    do_save(st, 2)
    reader = CheckpointStore.open(backend, "run", mode="r")
    newest = reader.latest_complete()
    assert newest is not None and newest.step == 2
    key = f"run/saves/{newest.save_id}/optim"
    backend.put(key, [backend.get(key)[:-5]])
    sel = reader.latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.step == 1
    assert sel.skipped[0].reason.value == "size-mismatch", sel.skipped
