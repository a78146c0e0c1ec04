"""Fail closed, issue 30 class 1 (THREATS.md §4.13): one byte of ``RUN.json``
must not decide which commit names count.

Someone with write access to the storage (no key, no code on the host)
edits ``"protocol_version"`` in a run's ``RUN.json``. Planted straight on
memory, the local disk and moto (S3), under ``auth_policy`` off and warn, for
version-1, -2 and -3 runs; then the public API and the command line run, and
each test asserts what must hold: the refusal names the mismatch and the fix;
nothing in or outside the store changed (no attempt registered, nothing
deleted, by ``gc`` default, dry run or ``--apply``); once the run record is
restored every real save is listed and restorable bit for bit. A commit name
of another version's naming inside a consistent run is history: its save is
kept, the real saves are still selected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, OpenOptions, RunRecordMismatchError, SaveState
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.memory import named_memory_backend
from ckptstore.cli.commands import main as cli_main
from tests.helpers import IDENT, RawAccess, settle_background_writes

RUN = "run"
V2 = OpenOptions(protocol_version=2)  # a record stamped 3 (the newest version) is another version only in an older run
KINDS = pytest.mark.backends("memory", "local", "moto")
pytestmark = pytest.mark.filterwarnings("ignore::ckptstore.UnauthenticatedWarning")


@dataclass
class Env:
    """One fresh store location, for the API (``backend()``) and the command line (``url``, ``-o``)."""

    backend: Callable[[], Backend]
    url: str
    options: list[str]
    outside: Path | None = None

    def cli(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = cli_main([args[0], self.url, RUN, *args[1:], *self.options])
        out = capsys.readouterr()
        assert "Traceback" not in out.err + out.out, out.err
        return rc, out.out, out.err


@pytest.fixture
def env(backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Env]:
    if backend_kind == "memory":
        name = f"rr-{uuid.uuid4().hex[:10]}"
        yield Env(lambda: named_memory_backend(name), f"memory://{name}", [])
        return
    if backend_kind == "local":
        root = tmp_path / "store"
        (tmp_path / "beside.txt").write_bytes(b"not the store's")
        yield Env(lambda: LocalBackend(root), str(root), [], outside=tmp_path)
        return
    servers = request.getfixturevalue("object_servers")
    prefix = f"rr-{uuid.uuid4().hex[:12]}"
    url, opts = servers.url_and_options(backend_kind, prefix)
    made: list[Backend] = []

    def factory() -> Backend:
        b = servers.backend(backend_kind, prefix)
        made.append(b)
        return b

    yield Env(factory, url, [x for k, v in opts.items() if isinstance(v, str) for x in ("-o", f"{k}={v}")])
    for b in made:
        b.close()


def snapshot(env: Env) -> dict[str, str]:
    """Every object of the store and every file beside it, with a digest of its bytes."""
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    b = env.backend()
    raw = RawAccess(b)
    out = {o.key: hashlib.sha256(raw.get(o.key) or b"").hexdigest() for o in b.list("")}
    if env.outside is not None:
        for dirpath, _dirs, files in os.walk(env.outside):
            if "store" not in Path(dirpath).relative_to(env.outside).parts:
                out.update({f"outside:{f}": hashlib.sha256(Path(dirpath, f).read_bytes()).hexdigest() for f in files})
    return out


def save(st: CheckpointStore, step: int) -> dict[str, bytes]:
    payload = {"model": f"weights@{step}".encode() * 40, "optim/state": os.urandom(64) + bytes([step])}
    with st.save(step) as s:
        for name, data in payload.items():
            s.put(name, data)
    return payload


def edit_run_record(env: Env, version: int) -> bytes:
    """Rewrite RUN.json's protocol_version as a person with write access would; the original bytes."""
    raw = RawAccess(env.backend())
    original = raw.get(f"{RUN}/RUN.json")
    assert original is not None
    rec = json.loads(original)
    rec["protocol_version"] = version
    raw.set(f"{RUN}/RUN.json", json.dumps(rec, sort_keys=True, separators=(",", ":")).encode())
    return original


def assert_every_save_restorable(env: Env, saved: dict[int, dict[str, bytes]], policy: str) -> None:
    r = CheckpointStore.open(env.backend(), RUN, mode="r", auth_policy=policy)
    infos = [i for i in r.list_saves(grace_seconds=0) if i.state is SaveState.COMMITTED]
    assert [i.step for i in infos] == sorted(saved, reverse=True)
    for info in infos:
        assert info.ref is not None
        assert {n: r.read(info.ref, n) for n in saved[info.step]} == saved[info.step]  # bit for bit
    latest = r.latest_complete(deep=True)
    assert latest is not None and latest.step == max(saved)


# (created, edited): the edit that hides the history (version 2 or 3 read as 1, 1 read as 2)
# and the ones the names cannot tell (2 and 3 share their naming; the records' own versions can)
# (one policy is enough for the version-1 run: the rule does not depend on it)
EDITS = [(c, e, p) for c, e in [(2, 1), (3, 1), (3, 2), (2, 3)] for p in ("off", "warn")] + [(1, 2, "off")]


@KINDS
@pytest.mark.parametrize(("created", "edited", "policy"), EDITS, ids=[f"v{c}-as-v{e}-{p}" for c, e, p in EDITS])
def test_a_run_record_edited_to_another_version_is_refused_and_deletes_nothing(
    env: Env, capsys: pytest.CaptureFixture[str], created: int, edited: int, policy: str
) -> None:
    st = CheckpointStore.open(env.backend(), RUN, identity=IDENT, protocol_version=created, auth_policy=policy)
    saved = {s: save(st, s) for s in (1, 2, 3)}
    st.close()  # a version-3 writer's intent is written in the background
    original = edit_run_record(env, edited)
    before = snapshot(env)

    def refused(fn: Callable[[], Any]) -> str:
        with pytest.raises(RunRecordMismatchError) as ei:
            fn()
        msg = str(ei.value)
        assert f"says protocol_version {edited}" in msg, msg  # the mismatch ...
        assert f"set its protocol_version back to {created}" in msg, msg  # ... and the fix
        assert "Nothing was selected, registered or deleted" in msg
        return msg

    def reader() -> CheckpointStore:
        return CheckpointStore.open(env.backend(), RUN, mode="r", auth_policy=policy)

    refused(lambda: reader().latest_complete())
    refused(lambda: reader().latest_complete(deep=True, explain=True))
    refused(lambda: reader().list_saves(grace_seconds=0))
    refused(lambda: reader().gc())  # default: the grace period, keep_last=2
    refused(lambda: reader().gc(dry_run=True, grace_seconds=0))
    refused(lambda: reader().gc(keep_last=1, grace_seconds=0))
    refused(lambda: CheckpointStore.open(env.backend(), RUN, identity=IDENT, auth_policy=policy))  # resume "latest"
    flags = ["--auth-policy", policy]
    for args in (["ls", "--grace", "0"], ["latest"], ["gc"], ["gc", "--apply", "--grace", "0", "--keep-last", "1"]):
        rc, out, err = env.cli(capsys, *args, *flags)
        assert rc == 1 and "RunRecordMismatchError" in err and f"back to {created}" in err, (args, out, err)
    assert snapshot(env) == before  # no attempt registered, no event, nothing deleted, nothing beside the store

    RawAccess(env.backend()).set(f"{RUN}/RUN.json", original)  # the fix the message names
    assert_every_save_restorable(env, saved, policy)
    w = CheckpointStore.open(env.backend(), RUN, identity=IDENT, auth_policy=policy)
    assert w.resumed_from is not None and w.resumed_from.step == 3


@KINDS
@pytest.mark.parametrize("naming", [1, 2])
def test_a_commit_name_of_the_other_naming_is_history_its_save_is_kept(
    env: Env, capsys: pytest.CaptureFixture[str], naming: int
) -> None:
    """A consistent run of the other naming with one
    planted commit name of ``naming``'s pattern and a save folder of its step and
    attempt: the real saves are still selected; gc keeps the planted folder
    (it is not "uncommitted and older than the grace period")."""
    version = 2 if naming == 1 else 1
    st = CheckpointStore.open(env.backend(), RUN, identity=IDENT, protocol_version=version)
    saved = {s: save(st, s) for s in (1, 2)}
    st.close()
    raw = RawAccess(env.backend())
    other = P.LAYOUT_V1 if naming == 1 else P.LAYOUT_V2
    sid = f"{7:012d}-00000001-{7:012x}"
    planted = {other.commit_key(RUN, 7, 1): b'{"not": "a record"}', P.component_key(RUN, sid, "model"): b"bytes"}
    for k, v in planted.items():
        raw.set(k, v)
    before = snapshot(env)

    sel = CheckpointStore.open(env.backend(), RUN, mode="r").latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.step == 2
    assert any("another protocol version's commit naming" in n for n in sel.notes), sel.notes
    infos = {i.save_id: i for i in CheckpointStore.open(env.backend(), RUN, mode="r").list_saves(grace_seconds=0)}
    assert infos[sid].state is SaveState.CORRUPT and "kept as history" in infos[sid].detail, infos[sid]
    rep = CheckpointStore.open(env.backend(), RUN, mode="r").gc(keep_last=2, grace_seconds=0, dry_run=True)
    assert sid in rep.kept and not rep.deleted_saves
    rc, out, err = env.cli(capsys, "gc", "--apply", "--grace", "0")
    assert rc == 0, (out, err)
    assert snapshot(env) == before  # nothing deleted: both real saves are the newest two, the planted ones history
    assert_every_save_restorable(env, saved, "off")


@KINDS
def test_a_record_stamped_with_another_version_is_skipped_not_a_refusal(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """One planted record of the run's own naming that states another version
    (the newest): never selected, its save kept, the older real save selected."""
    st = CheckpointStore.open(env.backend(), RUN, identity=IDENT, options=V2)
    saved = {s: save(st, s) for s in (1, 2)}
    st.close()
    hurt = st.latest_complete()
    assert hurt is not None and hurt.step == 2
    key = P.LATEST_LAYOUT.commit_key(RUN, 2, 1)
    forged = dataclasses.replace(hurt.record, version=3, stored_digest="", body_digest="")
    RawAccess(env.backend()).set(key, forged.encode())
    before = snapshot(env)
    r = CheckpointStore.open(env.backend(), RUN, mode="r")
    sel = r.latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.step == 1
    assert "states protocol_version 3, the run record 2" in sel.skipped[0].detail, sel.skipped
    assert {i.step: i.state for i in r.list_saves(grace_seconds=0)} == {2: SaveState.CORRUPT, 1: SaveState.COMMITTED}
    rc, out, err = env.cli(capsys, "gc", "--apply", "--grace", "0", "--keep-last", "1")
    assert rc == 0, (out, err)
    assert snapshot(env) == before
    RawAccess(env.backend()).set(key, hurt.record.encode())
    assert_every_save_restorable(env, saved, "off")
