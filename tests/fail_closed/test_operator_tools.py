"""Fail closed in the operator's tools (issue 18, classes 7, 9 and the CLI /
key-file parts of 10; protocol_spec/THREATS.md §4.7, §4.9, §4.10): ``sign``
vouches only for a history that is consistent, ledger events alone never make
a run promotable or spend its budget, a gc refusal is a failure on the
command line, and key files are opened like the secrets they are.

Objects are planted straight on the storage (``tests.helpers.RawAccess``) on
memory, local disk and the object stores; the public API and the CLI (in
process, so ``memory://`` stores are shared) are checked alike."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, InvalidInputError
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.backends.schemes import backend_from_url
from ckptstore.cli.commands import main as cli_main
from ckptstore.core.record_auth import ENV_KEYS, keyring_from_env, keyring_from_file, sidecar_key
from ckptstore.core.signing import attempt_refusal
from ckptstore.ops.budget import Budget
from ckptstore.ops.events import CLOCK_SKEW_S, validate_events
from ckptstore.ops.report import build_record
from ckptstore.protocol.auth import Keyring
from tests.helpers import IDENT, RawAccess, settle_background_writes

KEY_HEX = "5a" * 32
K1 = Keyring({"k1": bytes.fromhex(KEY_HEX)})
OPS_BACKENDS = pytest.mark.backends("memory", "local", "moto", "fakegcs")
#: signing runs under auth_policy="warn": the unsigned records it reads are expected
pytestmark = pytest.mark.filterwarnings("ignore::ckptstore.core.record_auth.UnauthenticatedWarning")


@dataclass
class Place:
    """One fresh store location, reachable by the API (``backend()``) and the CLI (``url`` + ``cli_opts``)."""

    url: str
    opts: dict[str, Any] = field(default_factory=dict)
    mem: MemoryBackend | None = None

    def backend(self) -> Backend:
        if self.mem is not None:
            return self.mem
        return backend_from_url(self.url, storage_options=self.opts)

    @property
    def cli_opts(self) -> list[str]:
        return [x for k, v in self.opts.items() if isinstance(v, str) for x in ("-o", f"{k}={v}")]


@pytest.fixture
def place(backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[Place]:
    if backend_kind == "memory":
        name = f"ops-{uuid.uuid4().hex[:8]}"
        mem = backend_from_url(f"memory://{name}")
        assert isinstance(mem, MemoryBackend)
        yield Place(f"memory://{name}", mem=mem)
    elif backend_kind == "local":
        yield Place(str(tmp_path / "store"))
    else:
        servers = request.getfixturevalue("object_servers")
        url, opts = servers.url_and_options(backend_kind, f"ops-{uuid.uuid4().hex[:12]}")
        if backend_kind == "moto":
            monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # client_kwargs cannot travel as -o
        if backend_kind == "fakegcs":
            for k, v in servers.server(backend_kind).env().items():
                monkeypatch.setenv(k, v)
        yield Place(url, opts)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli_main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _plant_event(raw: RawAccess, ev: P.EventRecord) -> None:
    """A ledger entry as a writer without the key plants it: well named, canonically encoded."""
    raw.set(P.events_prefix("run") + P.event_name(int(ev.at * 1e6), ev.event), ev.encode())


def _manifest(st: CheckpointStore) -> str:
    ref = st.latest_complete()
    assert ref is not None
    return ref.manifest_digest


def _save(st: CheckpointStore, step: int) -> P.CommitRecord:
    with st.save(step) as s:
        s.put("model", f"weights@{step}".encode())
    assert s.ref is not None
    return s.ref.record


# -- §4.10: the CLI's gc refusal --------------------------------------------------------------------------------


@OPS_BACKENDS
def test_cli_gc_refusal_is_printed_with_its_reason_and_exits_1(
    place: Place, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_KEYS, f"k1:{KEY_HEX}")
    st = CheckpointStore.open(place.backend(), "run", identity=IDENT, auth_policy="require", keyring=K1)
    for step in (1, 2, 3):
        _save(st, step)
    st.close()  # a version-3 writer writes its intent in the background: before the listing below
    # an attempt record planted without the key: under require it fences nothing, and stops gc
    RawAccess(place.backend()).set(P.attempt_key("run", 2), P.AttemptRecord("run", 2, None, "evil", 1.0).encode())
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = sorted(o.key for o in place.backend().list("run/"))
    # the public API says why
    rep = CheckpointStore.open(place.backend(), "run", mode="r", auth_policy="require", keyring=K1).gc(
        keep_last=1, grace_seconds=0)
    assert rep.refused and "attempt record 2" in rep.refused and not rep.actions
    # the CLI prints it and fails
    for extra in ([], ["--apply"], ["--json"]):
        rc, out, err = cli(capsys, "gc", place.url, "run", *place.cli_opts, "--auth-policy", "require",
                           "--keep-last", "1", "--grace", "0", *extra)
        assert rc == 1, (out, err)
        assert "attempt record 2" in out and ("gc refused" in out or '"refused"' in out), out
        assert KEY_HEX not in out + err
    assert sorted(o.key for o in place.backend().list("run/")) == before  # nothing deleted
    rc, out, _ = cli(capsys, "latest", place.url, "run", *place.cli_opts, "--auth-policy", "require", "--deep")
    assert rc == 0 and "latest complete: step 3" in out
    # without a refusal gc still succeeds (exit 0)
    RawAccess(place.backend()).delete(P.attempt_key("run", 2))
    rc, out, err = cli(capsys, "gc", place.url, "run", *place.cli_opts, "--auth-policy", "require", "--keep-last", "1",
                       "--grace", "0", "--apply")
    assert rc == 0 and "gc refused" not in out, (out, err)
    assert CheckpointStore.open(place.backend(), "run", mode="r", auth_policy="require",
                                keyring=K1).latest_complete(deep=True).step == 3  # type: ignore[union-attr]


# -- §4.10: key files -----------------------------------------------------------------------------------------


def _key_file(path: Path, doc: str, mode: int = 0o600) -> Path:
    path.write_text(doc)
    os.chmod(path, mode)
    return path


GOOD_DOC = json.dumps({"active": "k1", "keys": {"k1": KEY_HEX}})


def _refused(capsys: pytest.CaptureFixture[str], store: Path, kf: Path, *needles: str) -> None:
    """The API and the CLI both refuse the key file, naming it and the cause, never showing the key."""
    with pytest.raises(InvalidInputError) as ei:
        keyring_from_file(kf)
    msg = str(ei.value)
    assert str(kf) in msg and all(n in msg for n in needles), msg
    assert KEY_HEX not in msg and KEY_HEX.upper() not in msg
    rc, out, err = cli(capsys, "latest", str(store), "run", "--auth-policy", "require", "--auth-key-file", str(kf))
    assert rc == 2 and str(kf) in err and all(n in err for n in needles), err
    assert KEY_HEX not in out + err and len(err.strip().splitlines()) == 1


def test_key_file_links_foreign_owners_and_open_modes_are_refused(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    _save(CheckpointStore.open(str(store), "run", identity=IDENT, auth_policy="warn", keyring=K1), 1)
    good = _key_file(tmp_path / "good.json", GOOD_DOC)
    assert keyring_from_file(good).key_ids == ["k1"]
    rc, out, _ = cli(capsys, "latest", str(store), "run", "--auth-policy", "require", "--auth-key-file", str(good))
    assert rc == 0 and "latest complete: step 1" in out
    # a symbolic link to a perfectly private key file: refused, never followed
    link = tmp_path / "link.json"
    link.symlink_to(good)
    _refused(capsys, store, link, "symbolic link")
    # a key file owned by someone else (a planted one the attacker controls)
    foreign = _key_file(tmp_path / "foreign.json", GOOD_DOC)
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)
    else:  # not root: a file of another user, which cannot be chowned here
        foreign = Path("/etc/passwd")
        assert os.stat(foreign).st_uid != os.geteuid()
    _refused(capsys, store, foreign, "owned by uid")
    # group- or world-readable: refused as before (one rule for every permission bit)
    for mode in (0o640, 0o604, 0o660):
        _refused(capsys, store, _key_file(tmp_path / f"open-{mode:o}.json", GOOD_DOC, mode), "owner only")
    # not a regular file: a FIFO is refused without blocking the open
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo, 0o600)
    _refused(capsys, store, fifo, "not a regular file")
    # oversized: refused, not cut short
    _refused(capsys, store, _key_file(tmp_path / "big.json", GOOD_DOC + " " * (1 << 16)), "larger than")


def test_key_material_never_appears_in_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "store"
    _save(CheckpointStore.open(str(store), "run", identity=IDENT), 1)
    broken = {
        "id and key swapped, key too short": json.dumps({"keys": {KEY_HEX: "00"}}),
        "key not hex": json.dumps({"keys": {"k1": "zz" + KEY_HEX}}),
        "key is not a string": json.dumps({"keys": {"k1": [KEY_HEX]}}),
        "active names a key": json.dumps({"active": KEY_HEX, "keys": {"k1": KEY_HEX}}),
        "not JSON": json.dumps({"keys": {"k1": KEY_HEX}})[:-1],
        "ID with a bad character": json.dumps({"keys": {"k1 " + KEY_HEX: KEY_HEX}}),
    }
    for i, (case, doc) in enumerate(broken.items()):
        kf = _key_file(tmp_path / f"bad-{i}.json", doc)
        with pytest.raises(InvalidInputError) as ei:
            keyring_from_file(kf)
        assert str(kf) in str(ei.value) and KEY_HEX not in str(ei.value), (case, str(ei.value))
        rc, out, err = cli(capsys, "sign", str(store), "run", "--auth-key-file", str(kf))
        assert rc == 2 and str(kf) in err and KEY_HEX not in out + err, (case, err)
    # the environment variable, with ID and key swapped or the key mistyped
    for spec in (f"{KEY_HEX}:k1", f"k1:{KEY_HEX}zz", f"{KEY_HEX}:00"):
        monkeypatch.setenv(ENV_KEYS, spec)
        with pytest.raises(InvalidInputError) as ei:
            keyring_from_env()
        assert KEY_HEX not in str(ei.value), str(ei.value)
        rc, out, err = cli(capsys, "latest", str(store), "run", "--auth-policy", "require")
        assert rc == 2 and ENV_KEYS in err and KEY_HEX not in out + err, err


# -- §4.7: signing vouches only for a consistent history ----------------------------------------------------------


def _require(place: Place) -> CheckpointStore:
    return CheckpointStore.open(place.backend(), "run", mode="r", auth_policy="require", keyring=K1)


@OPS_BACKENDS
def test_sign_refuses_a_planted_fresh_start_and_the_last_good_save_stays_selectable(
    place: Place, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    st = CheckpointStore.open(place.backend(), "run", identity=IDENT)  # written before any key existed
    recs = {step: _save(st, step) for step in (1, 2, 3)}
    st.record_event("progress", {"step": 3})
    raw = RawAccess(place.backend())
    # a planted "restarted from scratch" (would supersede every save), a torn attempt record,
    # an event of the planted attempt, and a junk sidecar where commit 2's tag would go
    raw.set(P.attempt_key("run", 2), P.AttemptRecord("run", 2, None, "evil", 2.0).encode())
    raw.set(P.attempt_key("run", 9), b'{"torn')
    _plant_event(raw, P.EventRecord("finished", time.time(), 2, {"steps": 4}))
    commit2 = P.LATEST_LAYOUT.commit_key("run", 2, 1)
    raw.set(sidecar_key(commit2), b"junk sidecar")
    kf = _key_file(tmp_path / "keys.json", GOOD_DOC)

    rep = CheckpointStore.open(place.backend(), "run", mode="r", auth_policy="warn", keyring=K1).sign()
    assert "supersede" in rep.refused[P.attempt_key("run", 2)] and "step(s) 3, 2, 1" in rep.refused[P.attempt_key("run", 2)]
    assert P.attempt_key("run", 9) in rep.refused  # reported, skipped
    assert "remove that object" in rep.refused[commit2] and sidecar_key(commit2) in rep.refused[commit2]
    assert any("names attempt 2" in why for why in rep.refused.values())  # the planted attempt's event
    assert {P.attempt_key("run", 1), P.LATEST_LAYOUT.commit_key("run", 3, 1),
            P.LATEST_LAYOUT.commit_key("run", 1, 1)} <= set(rep.signed)
    # without a key, signing is refused outright (not reported record by record)
    with pytest.raises(InvalidInputError, match="signing needs a key"):
        CheckpointStore.open(place.backend(), "run", mode="r", auth_policy="warn", keyring=Keyring({})).sign()
    # the CLI reports the same refusals (and signs nothing twice)
    rc, out, err = cli(capsys, "sign", place.url, "run", *place.cli_opts, "--auth-key-file", str(kf))
    assert rc == 0 and "signed 0 record(s)" in out and "attempts/00000002.json" in out and "supersede" in out, (out, err)

    # the last good save is still the one selected under require, and restores bit for bit
    sel = _require(place).latest_complete(deep=True, explain=True)
    assert sel.latest is not None and (sel.latest.step, sel.latest.attempt) == (3, 1)
    assert _require(place).read(sel.latest, "model") == b"weights@3"
    assert sel.latest.save_id == recs[3].save_id
    rc, out, _ = cli(capsys, "latest", place.url, "run", *place.cli_opts, "--auth-policy", "require",
                     "--auth-key-file", str(kf), "--deep")
    assert rc == 0 and "latest complete: step 3" in out, out
    # a writer under require resumes from it, never from scratch
    w = CheckpointStore.open(place.backend(), "run", identity=IDENT, auth_policy="require", keyring=K1)
    assert w.resumed_from is not None and w.resumed_from.step == 3
    # the way out the refusal names: remove the junk sidecar, sign again
    raw.delete(sidecar_key(commit2))
    rep = CheckpointStore.open(place.backend(), "run", mode="r", auth_policy="warn", keyring=K1).sign()
    assert commit2 in rep.signed


@OPS_BACKENDS
def test_sign_still_signs_a_genuine_history_with_a_rollback(place: Place) -> None:
    st = CheckpointStore.open(place.backend(), "run", identity=IDENT)
    for step in (1, 2, 3):
        _save(st, step)
    st2 = CheckpointStore.open(place.backend(), "run", identity=IDENT, resume_from=1)  # an operator's rollback
    _save(st2, 2)
    rep = CheckpointStore.open(place.backend(), "run", mode="r", auth_policy="warn", keyring=K1).sign()
    assert rep.refused == {}, rep.refused
    sel = _require(place).latest_complete(deep=True, explain=True)
    assert sel.latest is not None and (sel.latest.step, sel.latest.attempt) == (2, 2)
    assert _require(place).read(sel.latest, "model") == b"weights@2"
    # and a fresh run with no save yet: its first attempt started from scratch, consistently
    fresh = CheckpointStore.open(place.backend(), "fresh", identity=IDENT)
    rep = CheckpointStore.open(place.backend(), "fresh", mode="r", auth_policy="warn", keyring=K1).sign()
    assert fresh.attempt is not None and rep.refused == {} and P.attempt_key("fresh", 1) in rep.signed


def test_attempt_refusal_rules() -> None:
    def att(n: int, r: int | None, abandons: tuple[int, ...] = ()) -> P.AttemptRecord:
        return P.AttemptRecord("run", n, r, "w", 1.0, abandons)

    verified = [(1, 1), (2, 1), (3, 1)]
    a1 = att(1, None)
    assert attempt_refusal(a1, verified, {}) is None  # the first attempt: nothing earlier
    assert attempt_refusal(att(2, 3), verified, {1: a1}) is None  # resumed from a verified save
    assert attempt_refusal(att(2, 1), verified, {1: a1}) is None  # a rollback to a verified save
    why = attempt_refusal(att(2, None), verified, {1: a1})
    assert why is not None and "from scratch" in why and "3, 2, 1" in why
    why = attempt_refusal(att(2, 7), [(1, 1), (8, 1)], {1: a1})  # names a step that is no save
    assert why is not None and "step 7" in why and "step(s) 8" in why
    # harmless: the resume point is gone (gc), but nothing it would supersede still stands
    assert attempt_refusal(att(2, 5), [(1, 1), (2, 1), (3, 1)], {1: a1}) is None
    assert attempt_refusal(att(2, 5), [(1, 1), (6, 1)], {1: a1, 3: att(3, 1)}) is None  # 6 superseded by 3
    # un-abandoning an accepted attempt is never harmless
    why = attempt_refusal(att(4, 9, abandons=(3,)), [(1, 1), (6, 1)], {1: a1, 3: att(3, 1)})
    assert why is not None and "abandons" in why


# -- §4.9: events that decide promotion and the budget --------------------------------------------------------------


def _finished_run(st: CheckpointStore, steps: int) -> P.CommitRecord:
    for step in range(steps):
        st.record_event("progress", {"step": step})
    rec = _save(st, steps - 1)
    st.record_event("finished", {"steps": steps, "final_manifest_digest": _manifest(st)})
    return rec


@OPS_BACKENDS
def test_finished_without_planned_steps_is_unconfirmed_never_eligible(
    place: Place, capsys: pytest.CaptureFixture[str]
) -> None:
    # a run that stopped at step 2: a "finished" event planted for it names the right attempt and manifest,
    # which is all a forger needs; without a planned length no record can contradict it
    st = CheckpointStore.open(place.backend(), "run", identity=IDENT)
    for step in range(3):
        st.record_event("progress", {"step": step})
    _save(st, 2)
    assert st.attempt is not None
    _plant_event(RawAccess(place.backend()), P.EventRecord(
        "finished", time.time(), st.attempt.number, {"steps": 3, "final_manifest_digest": _manifest(st)}))
    report = build_record(CheckpointStore.open(place.backend(), "run", mode="r"))
    assert report["promotion"]["eligible"] is False and report["promotion"]["status"] == "unconfirmed"
    assert report["promotion"]["artifact_manifest_digest"] is None
    assert any("planned_steps" in r for r in report["promotion"]["reasons"])
    rc, out, err = cli(capsys, "report", place.url, "run", *place.cli_opts)
    assert rc == 0 and "PROMOTION ELIGIBLE" in out and "NO (unconfirmed)" in out, (out, err)
    rc, out, _ = cli(capsys, "report", place.url, "run", *place.cli_opts, "--json")
    assert rc == 0 and json.loads(out)["promotion"]["status"] == "unconfirmed"


@OPS_BACKENDS
def test_a_finish_is_confirmed_by_a_plan_or_by_signed_events(place: Place) -> None:
    # the planned length confirms it (the records must agree with the plan)
    st = CheckpointStore.open(place.backend(), "planned", identity={**IDENT, "planned_steps": 3})
    _finished_run(st, 3)
    report = build_record(CheckpointStore.open(place.backend(), "planned", mode="r"))
    assert report["promotion"]["eligible"] and report["promotion"]["status"] == "eligible", report["promotion"]
    # under require only key holders' events count: a signed finish confirms it without a plan,
    signed = CheckpointStore.open(place.backend(), "signed", identity=IDENT, auth_policy="require", keyring=K1)
    _finished_run(signed, 3)
    reader = CheckpointStore.open(place.backend(), "signed", mode="r", auth_policy="require", keyring=K1)
    assert build_record(reader)["promotion"]["status"] == "eligible"
    # while a planted one is dropped before it is even considered
    unsigned = CheckpointStore.open(place.backend(), "forged", identity=IDENT, auth_policy="require", keyring=K1)
    for step in range(3):
        unsigned.record_event("progress", {"step": step})
    _save(unsigned, 2)
    assert unsigned.attempt is not None
    RawAccess(place.backend()).set(
        P.events_prefix("forged") + P.event_name(int(time.time() * 1e6), "finished"),
        P.EventRecord("finished", time.time(), unsigned.attempt.number,
                      {"steps": 3, "final_manifest_digest": _manifest(unsigned)}).encode())
    reader = CheckpointStore.open(place.backend(), "forged", mode="r", auth_policy="require", keyring=K1)
    report = build_record(reader)
    assert not report["promotion"]["eligible"] and report["promotion"]["status"] == "not-eligible"


@OPS_BACKENDS
def test_progress_claims_are_bounded_by_wall_clock_time(place: Place, capsys: pytest.CaptureFixture[str]) -> None:
    st = CheckpointStore.open(place.backend(), "run", identity=IDENT)  # no planned length
    for step in range(4):
        st.record_event("progress", {"step": step})
    _save(st, 3)
    assert st.attempt is not None
    n, registered = st.attempt.number, st.attempt.created_at
    budget = Budget(limit_gpu_hours=23.0, gpu_hours_per_step=0.1, min_step_seconds=1.0)
    clean = build_record(CheckpointStore.open(place.backend(), "run", mode="r"), budget)
    assert clean["executed_steps"] == 4
    raw, now = RawAccess(place.backend()), time.time()
    forged = [
        P.EventRecord("progress", now, n, {"step": 10**9}),  # a billion steps since the attempt registered
        P.EventRecord("progress", now, n, {"step": 5000}),  # fewer, still faster than one step per second
        P.EventRecord("progress", now + 7200, n, {"step": 9}),  # from the future
        P.EventRecord("progress", registered - 7200, n, {"step": 2}),  # before its attempt registered
        P.EventRecord("budget-exhausted", now, n, {"spent_gpu_hours": 500.0, "limit_gpu_hours": 23.0}),
    ]
    for ev in forged:
        _plant_event(raw, ev)
    report = build_record(CheckpointStore.open(place.backend(), "run", mode="r"), budget)
    assert report["executed_steps"] == 4 and report["spent_gpu_hours"] == clean["spent_gpu_hours"]
    assert not report["budget_stopped"]
    reasons = [r["reason"] for r in report["rejected_events"]]
    assert sum("since attempt" in r for r in reasons) == 2, reasons
    assert any("in the future" in r for r in reasons) and any("before attempt" in r for r in reasons)
    assert any("accounting shows" in r for r in reasons)
    # the default pace (a physical floor of 1 ms a step) still refuses the billion (not the 5,000: THREATS §4.9)
    report = build_record(CheckpointStore.open(place.backend(), "run", mode="r"), Budget())
    assert report["executed_steps"] == 5001
    assert any("progress step 1000000000" in r["reason"] for r in report["rejected_events"])
    # the CLI applies the same bound
    rc, out, err = cli(capsys, "report", place.url, "run", *place.cli_opts, "--json", "--min-step-seconds", "1")
    assert rc == 0, err
    assert json.loads(out)["spent_gpu_hours"] == clean["spent_gpu_hours"]
    # and so does the trainer's budget check (what it passes to plan_resume)
    reader = CheckpointStore.open(place.backend(), "run", mode="r")
    ledger = validate_events(reader.events(), reader.attempts(), identity=IDENT, min_step_seconds=1.0)
    assert max(e["payload"]["step"] for e in ledger.accepted if e["event"] == "progress") == 3


def test_the_wall_clock_rule() -> None:
    att = [{"attempt": 1, "resumed_from": None, "created_at": 1000.0},
           {"attempt": 2, "resumed_from": 99, "created_at": 5000.0}]

    def verdict(at: float, attempt: int | None, step: int | None, kind: str = "progress") -> str | None:
        payload = {} if step is None else {"step": step}
        led = validate_events([{"event": kind, "at": at, "attempt": attempt, "payload": payload}], att,
                              now=6000.0, min_step_seconds=0.5)
        return led.rejected[0].reason if led.rejected else None

    skew = CLOCK_SKEW_S
    assert verdict(1000.0, 1, int(skew / 0.5) - 1) is None  # the skew allowance at the very start
    assert verdict(1000.0, 1, int(skew / 0.5)) is not None  # one more step than it allows
    assert verdict(1100.0, 1, int((100 + skew) / 0.5) - 1) is None
    assert "steps in the 100 s" in (verdict(1100.0, 1, int((100 + skew) / 0.5)) or "")
    assert verdict(5100.0, 2, 99 + int((100 + skew) / 0.5)) is None  # counted from the resume point
    assert verdict(5100.0, 2, 99 + int((100 + skew) / 0.5) + 1) is not None
    assert "future" in (verdict(6000.0 + skew + 1, 1, 5) or "")
    assert verdict(6000.0 + skew - 1, 1, 5) is None
    assert "before attempt 1 registered" in (verdict(1000.0 - skew - 1, 1, 5) or "")
    assert "future" in (verdict(6000.0 + skew + 1, None, None, "budget-exhausted") or "")
    assert verdict(10.0, None, None, "budget-exhausted") is None  # an operator's note has no attempt to bound it
    with pytest.raises(InvalidInputError):
        validate_events([], att, min_step_seconds=0.0)
