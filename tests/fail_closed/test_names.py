"""Fail closed on names and torn records (issue 18, classes 1, 3 and two parts
of 10; THREATS.md §4.1, §4.3, §4.10).

Objects are planted straight on the storage (``RawAccess``) on memory, local
disk and the object-store servers; then the public API and the command line
(``gc --apply``, ``ls``, ``latest``) run, and each test asserts what must
hold: the last good save is still selected and restorable bit for bit, the
planted objects and everything outside the store are untouched, no foreign
exception escapes, and an error names its cause.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, CorruptionError, OpenOptions, SaveState, StoreUnavailableError
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.memory import named_memory_backend
from ckptstore.cli.commands import main as cli_main
from ckptstore.protocol.records import AttemptRecord
from tests.helpers import IDENT, RawAccess, settle_background_writes

RUN = "run"
#: the tests that read or plant whole components under saves/ (payload_of) use version 2's layout
#: (version 3's planted pieces: tests/incremental, tests/fail_closed/test_peer_pieces.py)
V2 = OpenOptions(protocol_version=2)

#: other scripts' digits that ``\d`` matches and ``int()`` reads as 0-9
DIGIT_SETS = {
    "arabic-indic": "٠١٢٣٤٥٦٧٨٩",
    "fullwidth": "０１２３４５６７８９",
    "devanagari": "०१२३४५६७८९",
    "math-bold": "".join(chr(0x1D7CE + i) for i in range(10)),
}


def respell(name: str, digits: str, *, first_only: bool = False) -> str:
    """``name`` with its ASCII digits (or only the first one) in another script."""
    out, done = [], False
    for ch in name:
        if ch.isascii() and ch.isdigit() and not (first_only and done):
            out.append(digits[int(ch)])
            done = True
        else:
            out.append(ch)
    return "".join(out)


@dataclass
class Env:
    """One fresh store location, reachable by the API (``backend()``) and by
    the command line (``url`` plus ``-o`` options)."""

    kind: str
    backend: Callable[[], Backend]
    url: str
    options: list[str]
    #: local disk: the directory that holds the store and a victim tree beside it
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
        name = f"fc-{uuid.uuid4().hex[:10]}"
        yield Env(backend_kind, lambda: named_memory_backend(name), f"memory://{name}", [])
        return
    if backend_kind == "local":
        root = tmp_path / "store"
        victim = tmp_path / "victim"
        victim.mkdir()
        (victim / "keep.txt").write_bytes(b"not the store's")
        (victim / "saves").mkdir()
        (victim / "saves" / "model").write_bytes(b"also not the store's")
        yield Env(backend_kind, lambda: LocalBackend(root), str(root), [], outside=tmp_path)
        return
    servers = request.getfixturevalue("object_servers")
    prefix = f"fc-{uuid.uuid4().hex[:12]}"
    url, opts = servers.url_and_options(backend_kind, prefix)
    made: list[Backend] = []

    def factory() -> Backend:
        b = servers.backend(backend_kind, prefix)
        made.append(b)
        return b

    flat = [x for k, v in opts.items() if isinstance(v, str) for x in ("-o", f"{k}={v}")]
    yield Env(backend_kind, factory, url, flat)
    for b in made:
        b.close()


def tree(root: Path | None, skip: str = "store") -> dict[str, str]:
    """Every file under ``root`` but the store itself, with a digest of its bytes."""
    if root is None:
        return {}
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel == skip or rel.startswith(skip + os.sep):
            continue
        for f in files:
            out[os.path.join(rel, f)] = hashlib.sha256(Path(dirpath, f).read_bytes()).hexdigest()
    return out


def writer(env: Env, **kw: Any) -> CheckpointStore:
    return CheckpointStore.open(env.backend(), RUN, identity=IDENT, **kw)


def reader(env: Env) -> CheckpointStore:
    return CheckpointStore.open(env.backend(), RUN, mode="r")


def save(st: CheckpointStore, step: int) -> P.SaveRef:
    with st.save(step) as s:
        s.put("model", f"weights@{step}".encode() * 50)
        s.put("optim/state", os.urandom(64) + bytes([step]))
    assert s.ref is not None
    return s.ref


def assert_restorable(env: Env, good: P.SaveRef, payload: dict[str, bytes]) -> None:
    """``good`` is what a resume selects, and reads back bit for bit."""
    r = reader(env)
    got = r.latest_complete(deep=True)
    assert got is not None and got.save_id == good.save_id, got
    for name, blob in payload.items():
        assert r.read(got, name) == blob
    w = writer(env)  # a writer resuming from "latest" picks it too
    assert w.resumed_from is not None and w.resumed_from.save_id == good.save_id


def payload_of(env: Env, ref: P.SaveRef) -> dict[str, bytes]:
    raw = RawAccess(env.backend())
    out = {}
    for name in ref.components:
        data = raw.get(P.component_key(RUN, ref.save_id, name))
        assert data is not None
        out[name] = data
    return out


NAME_KINDS = pytest.mark.backends("memory", "local", "seaweedfs", "fakegcs")


# ------------------------------------------------------ class 1: one spelling


@NAME_KINDS
@pytest.mark.parametrize("version", [1, 2])
def test_twins_of_real_names_replace_nothing_and_gc_keeps_every_save(
    env: Env, capsys: pytest.CaptureFixture[str], version: int
) -> None:
    st = writer(env, protocol_version=version)
    old = save(st, 1)
    good = save(st, 2)
    payload = payload_of(env, good)
    layout = P.layout_of(version)
    raw = RawAccess(env.backend())
    # twins of the real names, each another spelling of the same numbers (in
    # every digit set at once), with junk bytes
    name2 = layout.commit_name(2, 1)
    planted: dict[str, bytes] = {}
    for d in DIGIT_SETS.values():
        planted |= {
            f"{RUN}/commits/{respell(name2, d)}": b"junk twin",
            f"{RUN}/commits/{respell(name2, d, first_only=True)}": b"{}",
            f"{RUN}/attempts/{respell('00000001.json', d)}": b"junk attempt twin",
            f"{RUN}/attempts/{respell('00000009.json', d)}": b"junk attempt twin",
            f"{RUN}/saves/{respell(good.save_id, d)}/model": b"junk save twin",
            f"{RUN}/saves/{respell(old.save_id, d, first_only=True)}/model": b"junk save twin",
            f"{RUN}/events/{respell('00000000000000000001', d)}-x-0123abcd.json": b"junk event twin",
        }
    for key, data in planted.items():
        raw.set(key, data)
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = tree(env.outside)

    sel = reader(env).latest_complete(deep=True, explain=True)
    assert sel.latest is not None and sel.latest.save_id == good.save_id
    # junk is skipped and reported: the twins under attempts/ (and, on a v1 run, whose whole
    # commits/ listing is read, under commits/; a v2 selection stops paging at its choice) in the notes
    if version == 1:
        assert any("under commits/ are not commit records" in n for n in sel.notes), sel.notes
    assert any("8 name(s) under attempts/ are not attempt records" in n for n in sel.notes), sel.notes
    infos = reader(env).list_saves(deep=True, grace_seconds=0)
    assert [(i.step, i.state) for i in infos] == [(2, SaveState.COMMITTED), (1, SaveState.COMMITTED)]
    rep = reader(env).gc(keep_last=1, grace_seconds=0, dry_run=True)
    assert rep.refused is None  # a twin of an attempt record is not an unreadable attempt record
    assert [s for s, _ in rep.deleted_saves] == [old.save_id]
    assert {k for k in planted if "/saves/" in k} <= set(rep.ignored)

    rc, out, _ = env.cli(capsys, "ls", "--grace", "0")
    assert rc == 0 and good.save_id in out and "partial" not in out
    rc, out, _ = env.cli(capsys, "latest", "--deep")
    assert rc == 0 and f"step 2 (attempt 1, save {good.save_id}" in out
    rc, out, _ = env.cli(capsys, "gc", "--apply", "--grace", "0", "--keep-last", "1")
    assert rc == 0 and "deleted 1 save(s)" in out, out

    assert_restorable(env, good, payload)
    for key, data in planted.items():  # not ckptstore's: never deleted, never rewritten
        assert RawAccess(env.backend()).get(key) == data, key
    assert RawAccess(env.backend()).get(P.component_key(RUN, old.save_id, "model")) is None
    assert tree(env.outside) == before
    # a new writer counts only real attempt numbers: the twins of 1 and 9 take none
    real = max(a.number for a in reader(env).attempts())
    assert real < 9 and writer(env).attempt.number == real + 1  # type: ignore[union-attr]


@pytest.mark.backends("memory", "local")
def test_a_commit_name_with_a_trailing_newline_is_not_the_commit(env: Env) -> None:
    st = writer(env, options=V2)
    save(st, 1)
    good = save(st, 2)
    RawAccess(env.backend()).set(P.LATEST_LAYOUT.commit_key(RUN, 2, 1) + "\n", b"junk")
    payload = payload_of(env, good)
    reader(env).gc(keep_last=1, grace_seconds=0)
    assert_restorable(env, good, payload)


def test_parsers_accept_only_the_canonical_spelling() -> None:
    sid = P.new_save_id(12, 3)
    ev = P.event_name(1_700_000_000_000_000, "resume")
    cases: list[tuple[Callable[[str], object], str]] = [
        (P.parse_save_id, sid),
        (P.parse_attempt_name, "00000003.json"),
        (P.parse_event_name, ev),
        (P.LAYOUT_V1.parse_commit_name, P.LAYOUT_V1.commit_name(12, 3)),
        (P.LAYOUT_V2.parse_commit_name, P.LAYOUT_V2.commit_name(12, 3)),
    ]
    for parse, name in cases:
        assert parse(name) is not None, name
        for d in DIGIT_SETS.values():
            assert parse(respell(name, d)) is None
            assert parse(respell(name, d, first_only=True)) is None
        for bad in (name + "\n", " " + name, name.upper() if name != name.upper() else name + "x",
                    name.replace("0", "\u00b2", 1), "/" + name):
            assert parse(bad) is None, repr(bad)
    # listings are keyed by the canonical key: a sub-folder's name or a twin is not the record
    assert P.attempt_of_key(RUN, f"{RUN}/attempts/00000003.json") == 3
    assert P.attempt_of_key(RUN, f"{RUN}/attempts/x/00000003.json") is None
    assert P.attempt_of_key(RUN, f"{RUN}/attempts/{respell('00000003.json', DIGIT_SETS['fullwidth'])}") is None
    key = P.LAYOUT_V2.commit_key(RUN, 12, 3)
    assert P.LAYOUT_V2.commit_of_key(RUN, key) == (12, 3)
    assert P.LAYOUT_V2.commit_of_key(RUN, key.replace("/commits/", "/commits/sub/")) is None
    assert P.LAYOUT_V2.commit_of_key("other", key) is None
    assert not P.is_component_name("model\n") and not P.is_component_name("a/b\n/c")


# ------------------------------------- class 3: a torn record keeps its save


def _tear(data: bytes, how: str, save_id: str) -> bytes:
    if how == "torn":
        return data[: len(data) // 2]
    if how == "empty":
        return b""
    if how == "bitflip":  # one bit of the step in the record's save_id: '0' -> '4'
        b = bytearray(data)
        b[data.index(b'"save_id":"') + len(b'"save_id":"')] ^= 0x04
        return bytes(b)
    assert how == "other-save-id"  # a readable record that names a save that is not there
    last = save_id[-1]
    return data.replace(save_id.encode(), (save_id[:-1] + ("0" if last != "0" else "1")).encode())


@pytest.mark.backends("memory", "local", "seaweedfs", "fakegcs")
@pytest.mark.parametrize("how", ["torn", "empty", "bitflip", "other-save-id"])
def test_unreadable_commit_record_keeps_its_save_through_gc(
    env: Env, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    st = writer(env, options=V2)
    save(st, 1)
    good = save(st, 2)
    hurt = save(st, 3)
    payload, hurt_payload = payload_of(env, good), payload_of(env, hurt)
    raw = RawAccess(env.backend())
    ckey = P.LATEST_LAYOUT.commit_key(RUN, 3, 1)
    record = raw.get(ckey)
    assert record is not None
    raw.set(ckey, _tear(record, how, hurt.save_id))
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = tree(env.outside)

    infos = {i.save_id: i for i in reader(env).list_saves(grace_seconds=0)}
    assert infos[hurt.save_id].state is SaveState.CORRUPT, infos[hurt.save_id]
    assert "commit record of step 3, attempt 1 exists" in infos[hurt.save_id].detail
    rep = reader(env).gc(keep_last=1, grace_seconds=0, dry_run=True)
    assert hurt.save_id in rep.kept and hurt.save_id not in {s for s, _ in rep.deleted_saves}
    rc, out, _ = env.cli(capsys, "ls", "--grace", "0")
    assert rc == 0 and "corrupt" in out and hurt.save_id in out
    rc, out, _ = env.cli(capsys, "latest")
    assert rc == 0 and f"save {good.save_id}" in out and "step 3" in out  # the skip says why
    assert "no-commit" not in out  # its commit record exists: never reported as uncommitted
    rc, out, _ = env.cli(capsys, "gc", "--apply", "--grace", "0", "--keep-last", "1")
    assert rc == 0, out

    assert_restorable(env, good, payload)
    assert payload_of(env, hurt) == hurt_payload  # every byte of the save behind the torn record
    assert RawAccess(env.backend()).get(ckey) == _tear(record, how, hurt.save_id)  # evidence kept too
    assert tree(env.outside) == before


@pytest.mark.backends("memory", "local", "seaweedfs")
def test_the_only_save_behind_a_torn_record_survives_gc(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    st = writer(env, options=V2)
    only = save(st, 5)
    data = payload_of(env, only)
    raw = RawAccess(env.backend())
    ckey = P.LATEST_LAYOUT.commit_key(RUN, 5, 1)
    raw.set(ckey, (raw.get(ckey) or b"")[:10])
    rc, _, _ = env.cli(capsys, "gc", "--apply", "--grace", "0")
    assert rc == 0
    reader(env).gc(keep_last=1, grace_seconds=0)
    assert reader(env).latest_complete() is None
    assert payload_of(env, only) == data
    # the operator repairs the record: the save is selectable again, bit for bit
    raw.set(ckey, only.record.encode())
    assert_restorable(env, only, data)


# ------------------------------------- class 10: foreign keys, junk attempts


@pytest.mark.backends("memory", "local", "seaweedfs", "moto", "fakegcs")
def test_names_that_are_not_component_names_are_left_alone_by_gc(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    st = writer(env, options=V2)
    old = save(st, 1)
    good = save(st, 2)
    payload = payload_of(env, good)
    raw = RawAccess(env.backend())
    names = [".hidden", "-dash", "with space"]
    if env.kind in ("memory", "moto", "fakegcs"):  # stores that hold a '..' segment as a plain key
        names += ["../../victim", "..", "x/../../y"]
    planted = {}
    for sid in (old.save_id, good.save_id):
        for n in names:
            planted[f"{RUN}/saves/{sid}/{n}"] = b"planted " + n.encode()
    if env.kind in ("memory", "moto", "fakegcs"):
        planted[f"{RUN}/saves/../outside"] = b"planted"
    planted[f"{RUN}/saves/not-a-save-id/model"] = b"planted"
    for k, v in planted.items():
        raw.set(k, v)
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = tree(env.outside)

    rep = reader(env).gc(keep_last=1, grace_seconds=0, dry_run=True)
    assert [s for s, _ in rep.deleted_saves] == [old.save_id]
    assert all(a.key not in planted for a in rep.actions)
    assert sorted(planted) == sorted(rep.ignored)
    rc, out, _ = env.cli(capsys, "gc", "--apply", "--grace", "0", "--keep-last", "1")
    assert rc == 0, out
    assert "deleted 1 save(s)" in out and f"left alone {len(planted)} key(s)" in out
    rc, out, _ = env.cli(capsys, "gc", "--json", "--grace", "0", "--keep-last", "1")
    assert rc == 0 and sorted(json.loads(out)["ignored"]) == sorted(planted)
    for cmd in (["ls"], ["latest"]):
        rc, _, _ = env.cli(capsys, *cmd)
        assert rc == 0

    assert_restorable(env, good, payload)
    for k, v in planted.items():
        assert RawAccess(env.backend()).get(k) == v, k
    assert RawAccess(env.backend()).get(P.component_key(RUN, old.save_id, "model")) is None
    assert tree(env.outside) == before


@pytest.mark.backends("memory", "local", "seaweedfs", "fakegcs")
@pytest.mark.parametrize("junk", ["garbage", "forged"])
def test_a_junk_top_attempt_record_is_named_in_the_writers_error(
    env: Env, capsys: pytest.CaptureFixture[str], junk: str
) -> None:
    st = writer(env, options=V2)
    save(st, 1)
    good = save(st, 2)
    payload = payload_of(env, good)
    key = P.attempt_key(RUN, P.MAX_ATTEMPT)
    data = b"\x00 not json" if junk == "garbage" else AttemptRecord(RUN, P.MAX_ATTEMPT, 2, "planted", 1.0).encode()
    raw = RawAccess(env.backend())
    raw.set(key, data)

    with pytest.raises(StoreUnavailableError) as err:
        writer(env)
    msg = str(err.value)
    assert f"{key}" in msg and "remove it" in msg and "exhausted" in msg, msg
    assert ("not a usable attempt record" in msg) if junk == "garbage" else ("'planted'" in msg)
    assert "The next highest attempt is 1" in msg
    r = reader(env).latest_complete(deep=True)  # readers are not locked out
    assert r is not None and r.save_id == good.save_id
    rc, out, _ = env.cli(capsys, "latest")
    assert rc == 0 and good.save_id in out
    # the way out the error names: remove the file, and writers resume from the last good save
    raw.delete(key)
    assert_restorable(env, good, payload)


@pytest.mark.parametrize("rank", ["\u00b2", "١", "０", "01", "+1", " 1"])
def test_rank_numbers_in_a_commit_record_have_one_spelling(rank: str) -> None:
    sid = P.new_save_id(7, 1)
    rec = P.CommitRecord(
        RUN, 7, 1, sid, "w" * 32, "a" * 64, {"m": P.ComponentEntry("m", 3, "b" * 64)}, 1.5e9, {}, {0: ("m",)}, 1
    )
    raw = rec.to_record()
    raw["ranks"] = {rank: ["m"]}
    data = json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    with pytest.raises(CorruptionError, match="ranks"):  # never a ValueError from int()
        P.CommitRecord.decode(data, "planted", run_id=RUN, step=7, attempt=1)
    assert P.CommitRecord.decode(rec.encode(), "real", run_id=RUN, step=7, attempt=1).ranks == {0: ("m",)}
