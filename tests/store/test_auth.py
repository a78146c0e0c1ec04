"""Authenticated records (optional): a writer without the key cannot get a
record acted on under auth_policy="require" (PROTOCOL.md §2.5, THREATS.md)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptstore import CheckpointStore, CorruptionError, InvalidInputError, OpenOptions, SkipReason
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.cli.commands import main as cli_main
from ckptstore.core.record_auth import UnauthenticatedWarning, keyring_from_file
from ckptstore.protocol.auth import Keyring, compute_tag, run_key
from tests.helpers import IDENT, RawAccess

K1 = Keyring({"k1": b"\x01" * 32})
K2 = Keyring({"k1": b"\x01" * 32, "k2": b"\x02" * 32}, active="k2")
AUTH_BACKENDS = pytest.mark.backends("memory", "local", "moto")
# these tests plant into version 2's layout: whole components under saves/ (version 3's planted pieces:
# tests/incremental, tests/fail_closed/test_peer_pieces.py)
V2 = OpenOptions(protocol_version=2)


def _open(factory: Callable[[], Backend], policy: str = "require", keyring: Keyring | None = K1, **kw: object) -> CheckpointStore:
    return CheckpointStore.open(factory(), "run", identity=IDENT, auth_policy=policy, keyring=keyring, **kw)  # type: ignore[arg-type]


def _reader(factory: Callable[[], Backend], policy: str = "require", keyring: Keyring | None = K1) -> CheckpointStore:
    return CheckpointStore.open(factory(), "run", mode="r", auth_policy=policy, keyring=keyring)


def _save(st: CheckpointStore, step: int, data: bytes | None = None) -> P.CommitRecord:
    with st.save(step) as s:
        s.put("model", data or f"w{step}".encode())
    assert s.ref is not None
    return s.ref.record


def _plant_forged_commit(factory: Callable[[], Backend], step: int, attempt: int, identity_digest: str) -> str:
    """What a writer with storage access but no key can do: a well-formed save."""
    raw = RawAccess(factory())
    sid = P.new_save_id(step, attempt)
    payload = b"attacker weights"
    raw.set(P.component_key("run", sid, "model"), payload)
    rec = P.CommitRecord("run", step, attempt, sid, "evil", identity_digest,
                         {"model": P.ComponentEntry("model", len(payload), P.digest_bytes(payload))}, 1.0)
    raw.set(P.LATEST_LAYOUT.commit_key("run", step, attempt), rec.encode())
    return sid


def test_records_carry_tags_and_verify() -> None:
    from ckptstore.backends.memory import MemoryBackend

    mem = MemoryBackend()
    st = _open(lambda: mem)
    rec = _save(st, 1)
    assert rec.auth is not None and rec.auth.key_id == "k1"
    stored = json.loads(RawAccess(mem).get(P.LATEST_LAYOUT.commit_key("run", 1, 1)) or b"{}")
    assert stored["auth"]["key_id"] == "k1" and len(stored["auth"]["tag"]) == 64
    assert _reader(lambda: mem).latest_complete(deep=True) is not None


def test_require_without_a_key_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTSTORE_AUTH_KEYS", raising=False)
    with pytest.raises(InvalidInputError, match="needs a key"):
        CheckpointStore.open("memory://x", "run", identity=IDENT, auth_policy="require")


@AUTH_BACKENDS
def test_forged_newer_commit_is_selected_without_auth_and_skipped_with_it(backend_factory: Callable[[], Backend]) -> None:
    st = _open(backend_factory)
    good = _save(st, 1)
    _plant_forged_commit(backend_factory, 50, st.attempt.number if st.attempt else 1, st.identity_digest)
    # the threat, shown: without authentication the forgery wins
    plain = CheckpointStore.open(backend_factory(), "run", mode="r")
    assert plain.latest_complete() is not None and plain.latest_complete().step == 50  # type: ignore[union-attr]
    sel = _reader(backend_factory).latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.save_id == good.save_id
    assert sel.skipped[0].step == 50 and sel.skipped[0].reason is SkipReason.UNAUTHENTICATED
    # a writer under require resumes from the authentic save
    assert _open(backend_factory).resumed_from.step == 1  # type: ignore[union-attr]


def test_forged_attempt_record_fences_nothing_and_stops_gc() -> None:
    from ckptstore.backends.memory import MemoryBackend

    mem = MemoryBackend()
    st = _open(lambda: mem)
    for s in (1, 2, 3):
        _save(st, s)
    forged = P.AttemptRecord("run", 2, None, "evil", 1.0)  # "restarted from scratch": would supersede all
    RawAccess(mem).set(P.attempt_key("run", 2), forged.encode())
    assert CheckpointStore.open(mem, "run", mode="r").latest_complete() is None  # unauthenticated view: hidden
    sel = _reader(lambda: mem).latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.step == 3
    assert any("attempt record 2" in n and "no tag" in n for n in sel.notes)
    rep = _open(lambda: mem).gc(keep_last=1, grace_seconds=0)
    assert rep.refused and not rep.actions


def test_wrong_key_unknown_key_and_kind_confusion() -> None:
    from ckptstore.backends.memory import MemoryBackend

    mem = MemoryBackend()
    st = _open(lambda: mem)
    rec = _save(st, 1)
    other = Keyring({"k1": b"\x09" * 32})  # same ID, different key: bad tag
    with pytest.raises(CorruptionError, match="bad tag"):
        _reader(lambda: mem, keyring=other)
    unknown = Keyring({"zz": b"\x03" * 32})
    with pytest.raises(CorruptionError, match="unknown key"):
        _reader(lambda: mem, keyring=unknown)
    # a commit's tag never verifies as an event's (domain separation)
    k = run_key(b"\x01" * 32, "run")
    assert compute_tag(k, "commit", rec.unsigned_digest()) != compute_tag(k, "event", rec.unsigned_digest())


def test_key_rotation_old_saves_still_verify() -> None:
    from ckptstore.backends.memory import MemoryBackend

    mem = MemoryBackend()
    _save(_open(lambda: mem, keyring=K1), 1)
    st2 = _open(lambda: mem, keyring=K2)
    rec2 = _save(st2, 2)
    assert rec2.auth is not None and rec2.auth.key_id == "k2"
    r = _reader(lambda: mem, keyring=K2)
    assert [i.step for i in r.list_saves() if i.state.value == "committed"] == [2, 1]


def test_warn_uses_unauthenticated_records_with_a_warning() -> None:
    from ckptstore.backends.memory import MemoryBackend

    mem = MemoryBackend()
    _save(CheckpointStore.open(mem, "run", identity=IDENT), 1)  # written with no key
    with pytest.warns(UnauthenticatedWarning):
        assert _reader(lambda: mem, policy="warn").latest_complete() is not None


def test_sign_an_existing_run_after_rehashing(tmp_path: Path) -> None:
    from ckptstore.backends.local import LocalBackend

    b = LocalBackend(str(tmp_path))
    st = CheckpointStore.open(b, "run", identity=IDENT, options=V2)
    for s in (1, 2):
        _save(st, s)
    bad = _save(st, 3)
    RawAccess(b).set(P.component_key("run", bad.save_id, "model"), b"w9")  # same size, different bytes
    st.record_event("note", {"x": 1})
    with pytest.raises(CorruptionError):
        _reader(lambda: b)  # the run record is not authenticated yet
    rep = CheckpointStore.open(b, "run", mode="r", auth_policy="warn", keyring=K1).sign()
    assert P.LATEST_LAYOUT.commit_key("run", 3, 1) in rep.refused and P.LATEST_LAYOUT.commit_key("run", 2, 1) in rep.signed
    r = _reader(lambda: b)
    sel = r.latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.step == 2
    assert sel.skipped[0].reason is SkipReason.UNAUTHENTICATED
    assert [e["event"] for e in r.events()] == ["note"]


def test_key_file_must_be_private_and_cli_uses_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kf = tmp_path / "keys.json"
    kf.write_text(json.dumps({"active": "k1", "keys": {"k1": "01" * 32}}))
    os.chmod(kf, 0o644)
    with pytest.raises(InvalidInputError, match="owner only"):
        keyring_from_file(kf)
    os.chmod(kf, 0o600)
    assert keyring_from_file(kf).key_ids == ["k1"]
    store = tmp_path / "store"
    st = CheckpointStore.open(str(store), "run", identity=IDENT)
    _save(st, 1)
    assert cli_main(["latest", str(store), "run", "--auth-policy", "require", "--auth-key-file", str(kf)]) == 1
    assert cli_main(["sign", str(store), "run", "--auth-key-file", str(kf)]) == 0
    assert cli_main(["latest", str(store), "run", "--auth-policy", "require", "--auth-key-file", str(kf)]) == 0
    out = capsys.readouterr()
    assert "01" * 32 not in out.out + out.err  # key material is never printed
