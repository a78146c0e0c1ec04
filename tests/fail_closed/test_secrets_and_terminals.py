"""Secrets and terminals (protocol_spec/THREATS.md): escape sequences planted
in names on the storage, passwords in URLs, ``-o`` typos, forged ledger events,
one-line errors, and storage options kept off the drill's command lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, OpenOptions
from ckptstore.backends.local import LocalBackend
from ckptstore.cli import commands as cli
from ckptstore.ops.budget import Budget
from ckptstore.ops.drill.proc import run_trainer
from ckptstore.ops.events import planned_steps, validate_events
from ckptstore.ops.report import build_record, render_table
from ckptstore.protocol import canonical_json
from ckptstore.util.redact import redact_options, redact_text, redact_url, secret_values
from ckptstore.util.terminal import escape, escape_lines, sanitize
from tests.helpers import IDENT

PLANNED = {**IDENT, "planned_steps": 10}
CLI_TIMEOUT = 120
EVIL = "\x1b]0;pwned\x07\x1b[2J\x1b[31m\u202eexe.txt\u2066\x9b\nlatest complete: step 999"
RAW_CONTROL = ("\x1b", "\x07", "\u202e", "\u2066", "\x9b")
V2 = OpenOptions(protocol_version=2)  # the evil save folder is planted under saves/, version 2's layout


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptstore.cli", *args], check=False, capture_output=True, text=True,
        timeout=CLI_TIMEOUT, env={**os.environ, **(env or {})}, errors="surrogateescape",
    )


def assert_clean(text: str) -> None:
    for ch in RAW_CONTROL:
        assert ch not in text, (ch, text)
    assert not any(line.startswith("latest complete: step 999") for line in text.splitlines())


def assert_one_line_error(p: subprocess.CompletedProcess[str]) -> None:
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptstore: "), p.stderr
    assert "Traceback" not in p.stderr


# -- terminal escaping --------------------------------------------------------------------------------------------


def test_escape_makes_every_dangerous_character_visible() -> None:
    out = escape(EVIL)
    assert_clean(out)
    assert "\n" not in out and out.isprintable()
    assert "\\x1b]0;pwned\\x07" in out and "\\u202e" in out and "\\u2066" in out and "\\x9b" in out
    assert escape("a\\b") == "a\\\\b"  # an escape in the output is never ambiguous
    assert escape("\udcff") == "\\udcff"  # undecodable file-name bytes: printable, and print() cannot fail
    assert escape("zürich-日本-ok") == "zürich-日本-ok"
    assert escape_lines("line one\nline \x1b[2J two") == "line one\nline \\x1b[2J two"
    assert sanitize({"k\x1b": ["v\u202e", 3]}) == {"k\\x1b": ["v\\u202e", 3]}


def _plant_evil_save(root: Path) -> None:
    st = CheckpointStore.open(root, "run", identity=IDENT, options=V2)
    with st.save(1) as s:
        s.put("model", b"weights")
    evil = root / "run" / "saves" / EVIL
    evil.mkdir()
    (evil / "model").write_bytes(b"x")
    attempt = json.loads((root / "run" / "attempts" / "00000001.json").read_text())
    attempt.update(attempt=2, host=EVIL, resumed_from=1, writer_id="f" * 32)
    (root / "run" / "attempts" / "00000002.json").write_bytes(canonical_json(attempt))


@pytest.mark.parametrize("command", [["ls"], ["ls", "--deep"], ["latest"], ["gc", "--grace", "0"], ["inspect"],
                                     ["report"]])
def test_planted_names_reach_the_terminal_escaped(tmp_path: Path, command: list[str]) -> None:
    root = tmp_path / "store"
    _plant_evil_save(root)
    p = run_cli(command[0], str(root), "run", *command[1:])
    assert_clean(p.stdout + p.stderr)
    assert p.returncode in (0, 1), p.stderr
    if "pwned" in p.stdout:  # a junk save name may be listed (or ignored by the catalog): then only escaped
        assert "\\x1b]0;pwned\\x07" in p.stdout, p.stdout
    if command[0] == "inspect":  # the host of an attempt record is free text from the store
        assert "on \\x1b]0;pwned" in p.stdout
    pj = run_cli(command[0], str(root), "run", *command[1:], "--json")
    assert_clean(pj.stdout)
    json.loads(pj.stdout)


# -- redaction ----------------------------------------------------------------------------------------------------


def test_redact_url_and_text() -> None:
    assert redact_url("https://alice:hunter2pass@s3.example:9000/b?x=1") == "https://alice:***@s3.example:9000/b?x=1"
    assert redact_url("https://h/o?X-Amz-Signature=abcd&X-Amz-Date=1") == "https://h/o?X-Amz-Signature=***&X-Amz-Date=1"
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"
    assert "hunter2pass" not in redact_url("http://u:hunter2pass@[::1:bad/x")
    text = "cannot reach http://u:hunter2pass@127.0.0.1:9 (key 'topsecretvalue' refused)"
    red = redact_text(text, ["topsecretvalue"])
    assert "hunter2pass" not in red and "topsecretvalue" not in red and "http://u:***@127.0.0.1:9" in red
    opts: dict[str, Any] = {"key": "AKIAEXAMPLE", "secret": "topsecretvalue", "endpoint_url": "http://u:pw12@h",
                            "client_kwargs": {"aws_session_token": "tok-123456"}, "anon": False}
    found = secret_values(opts, environ={"AWS_SECRET_ACCESS_KEY": "envsecret99"})
    assert {"AKIAEXAMPLE", "topsecretvalue", "tok-123456", "envsecret99"} <= set(found)
    shown = json.dumps(redact_options(opts))
    assert "topsecretvalue" not in shown and "tok-123456" not in shown and "pw12" not in shown


def test_password_in_endpoint_url_is_never_printed(tmp_path: Path) -> None:
    # port 9 on loopback: nothing listens, the endpoint probe fails at once
    p = run_cli("ls", "s3://bucket/prefix", "run", "-o", "endpoint_url=http://alice:hunter2pass@127.0.0.1:9",
                "-o", "key=AKIAEXAMPLEKEY", "-o", "secret=topsecretvalue", env={"AWS_EC2_METADATA_DISABLED": "true"})
    assert_one_line_error(p)
    for secret in ("hunter2pass", "topsecretvalue", "AKIAEXAMPLEKEY"):
        assert secret not in p.stdout + p.stderr


def test_password_in_environment_endpoint_is_redacted() -> None:
    p = run_cli("ls", "s3://bucket/prefix", "run",
                env={"AWS_ENDPOINT_URL": "http://alice:hunter2pass@127.0.0.1:9", "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY",
                     "AWS_SECRET_ACCESS_KEY": "envsecretvalue", "AWS_EC2_METADATA_DISABLED": "true"})
    assert_one_line_error(p)
    assert "hunter2pass" not in p.stderr and "envsecretvalue" not in p.stderr
    assert "***" in p.stderr


def test_mistyped_storage_option_echoes_the_key_only(tmp_path: Path) -> None:
    p = run_cli("ls", str(tmp_path / "s"), "run", "-o", "topsecretvalue")  # '=' forgotten
    assert_one_line_error(p)
    assert p.returncode == 2 and "topsecretvalue" not in p.stderr
    p = run_cli("ls", str(tmp_path / "s"), "run", "-o", "secert_key=topsecretvalue")  # unknown key
    assert_one_line_error(p)
    assert "secert_key" in p.stderr and "topsecretvalue" not in p.stderr
    p = run_cli("ls", str(tmp_path / "s"), "run", "-o", "bad key!=topsecretvalue")
    assert_one_line_error(p)
    assert "topsecretvalue" not in p.stderr


# -- one-line errors ---------------------------------------------------------------------------------------------


def test_any_failure_is_one_line_and_debug_shows_the_traceback(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    def boom(args: Any) -> int:
        raise RuntimeError("unexpected\nsecond line from http://alice:hunter2pass@host/x")

    monkeypatch.setattr(cli, "cmd_ls", boom)
    assert cli.main(["ls", "/nowhere", "run"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "internal error: RuntimeError" in err and "--debug" in err
    assert "hunter2pass" not in err
    assert cli.main(["ls", "/nowhere", "run", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "hunter2pass" not in err


def test_missing_run_usage_errors_and_unwritable_svg_are_one_line(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("ls", str(tmp_path / "nothing"), "run"))
    assert_one_line_error(run_cli("ls"))
    assert_one_line_error(run_cli("ls", str(tmp_path), "run", "--grace", "soon"))
    p = run_cli("--debug", "ls", str(tmp_path / "nothing"), "run")
    assert p.returncode == 1 and "Traceback" in p.stderr
    st = CheckpointStore.open(tmp_path / "s", "run", identity=IDENT)
    with st.save(0) as s:
        s.put("m", b"x")
    assert_one_line_error(run_cli("report", str(tmp_path / "s"), "run", "--svg", str(tmp_path / "no" / "dir" / "x.svg")))


# -- forged ledger events ----------------------------------------------------------------------------------------


def _raw_event(b: LocalBackend, n: int, obj: Any) -> None:
    """Plant a ledger entry as an attacker would: a well-named, canonically encoded object."""
    b.create(f"run/events/{n:020d}-progress-{n:08x}.json", canonical_json(obj))


def _unfinished_run(root: Path, identity: dict[str, Any]) -> CheckpointStore:
    st = CheckpointStore.open(root, "run", identity=identity)
    for step in range(4):
        st.record_event("progress", {"step": step})
    with st.save(3) as s:
        s.put("m", b"weights@3")
    st.record_event("save", {"step": 3, "seconds": 0.01, "bytes": 9})
    return st


def test_malformed_events_never_crash_report_and_are_listed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _unfinished_run(root, IDENT)
    clean = build_record(CheckpointStore.open(root, "run", mode="r"))
    b = LocalBackend(root, create_root=False)
    # envelope junk: refused by the ledger's strict decoding (the core), never reaches the report
    envelope: list[Any] = [
        {"protocol_version": 1, "kind": "event", "event": "progress", "at": "now", "attempt": 1, "payload": {"step": 2}},
        {"protocol_version": 1, "kind": "event", "event": "progress", "at": 1.0, "attempt": "1", "payload": {"step": 5}},
        {"protocol_version": 1, "kind": "event", "event": "progress", "at": 1.0, "attempt": 1, "payload": [1, 2]},
        {"protocol_version": 1, "kind": "event", "event": EVIL, "at": 1.0, "attempt": 1, "payload": {}},
        {"protocol_version": 1, "kind": "event", "event": "progress", "at": 1.0, "attempt": True, "payload": {"step": 1}},
        ["not", "an", "object"],
    ]
    # payload junk: well-formed envelopes whose claims the report must not count
    payload = [
        {"protocol_version": 1, "kind": "event", "event": "progress", "at": 1.0, "attempt": 1, "payload": {"step": "x"}},
        {"protocol_version": 1, "kind": "event", "event": "progress", "at": 1.0, "attempt": 1, "payload": {}},
        {"protocol_version": 1, "kind": "event", "event": "progress", "at": 1.0, "attempt": 99, "payload": {"step": 9}},
        {"protocol_version": 1, "kind": "event", "event": "progress", "at": 1.0, "attempt": 1,
         "payload": {"step": 10**15}},
        {"protocol_version": 1, "kind": "event", "event": "first-step", "at": 1.0, "attempt": 1,
         "payload": {"seconds": "fast"}},
        {"protocol_version": 1, "kind": "event", "event": "save", "at": 1.0, "attempt": 1,
         "payload": {"step": 3, "seconds": -1.0, "bytes": "many"}},
        {"protocol_version": 1, "kind": "event", "event": "finished", "at": 2.0, "attempt": 1,
         "payload": {"steps": True, "final_manifest_digest": 5}},
        {"protocol_version": 1, "kind": "event", "event": "resume", "at": 2.0, "attempt": 1,
         "payload": {"resumed_from": 3}},
    ]
    for i, obj in enumerate(envelope + payload):
        _raw_event(b, i + 1, obj)
    rec = build_record(CheckpointStore.open(root, "run", mode="r"))
    assert rec["spent_gpu_hours"] == clean["spent_gpu_hours"]
    assert rec["executed_steps"] == clean["executed_steps"] == 4
    assert len(rec["rejected_events"]) == len(payload), rec["rejected_events"]
    text = render_table(sanitize(rec))
    assert "ledger events rejected" in text
    assert_clean(text)
    p = run_cli("report", str(root), "run")
    assert p.returncode == 0, p.stderr
    assert_clean(p.stdout)
    assert "PROMOTION ELIGIBLE" in p.stdout and "NO" in p.stdout


@pytest.mark.parametrize("identity", [IDENT, PLANNED], ids=["no-plan", "planned"])
def test_forged_finished_event_never_makes_an_unfinished_run_eligible(tmp_path: Path, identity: dict[str, Any]) -> None:
    root = tmp_path / "store"
    st = _unfinished_run(root, identity)
    latest = st.latest_complete()
    assert latest is not None
    # the attacker's best forgeries: wrong attempt; right attempt but not the newest; plan contradicted
    forger = CheckpointStore.open(root, "run", mode="r")
    forger.record_event("finished", {"steps": 4, "final_manifest_digest": latest.manifest_digest})  # attempt None
    rec = build_record(CheckpointStore.open(root, "run", mode="r"))
    assert not rec["promotion"]["eligible"]
    assert any(r["event"] == "finished" for r in rec["rejected_events"])
    # a later attempt registers (a restart): a finished claim by attempt 1 is no longer the newest attempt's
    st2 = CheckpointStore.open(root, "run", identity=identity)
    st.record_event("finished", {"steps": 4, "final_manifest_digest": latest.manifest_digest})
    rec = build_record(CheckpointStore.open(root, "run", mode="r"))
    assert not rec["promotion"]["eligible"]
    # a claim from the newest attempt that names a save committed by another attempt
    st2.record_event("finished", {"steps": 4, "final_manifest_digest": latest.manifest_digest})
    rec = build_record(CheckpointStore.open(root, "run", mode="r"))
    assert not rec["promotion"]["eligible"]
    if planned_steps(identity) is not None:
        # the newest attempt commits step 3 itself and claims to be finished at 4 of 10 planned steps
        with st2.save(3) as s:
            s.put("m", b"weights@3")
        ref = st2.latest_complete()
        assert ref is not None and ref.attempt == st2.attempt.number  # type: ignore[union-attr]
        st2.record_event("finished", {"steps": 4, "final_manifest_digest": ref.manifest_digest})
        rec = build_record(CheckpointStore.open(root, "run", mode="r"))
        assert not rec["promotion"]["eligible"]
        assert any("plans 10" in r["reason"] for r in rec["rejected_events"])


def test_a_genuine_finish_is_still_eligible(tmp_path: Path) -> None:
    st = CheckpointStore.open(tmp_path / "s", "run", identity=PLANNED)
    for step in range(10):
        st.record_event("progress", {"step": step})
    with st.save(9) as s:
        s.put("m", b"final")
    ref = st.latest_complete()
    assert ref is not None
    st.record_event("finished", {"steps": 10, "final_manifest_digest": ref.manifest_digest})
    rec = build_record(CheckpointStore.open(tmp_path / "s", "run", mode="r"))
    assert rec["promotion"]["eligible"] and rec["rejected_events"] == []


def test_forged_events_never_make_the_budget_look_spent(tmp_path: Path) -> None:
    root = tmp_path / "store"
    st = _unfinished_run(root, PLANNED)
    budget = Budget(limit_gpu_hours=23.0, gpu_hours_per_step=0.1)
    clean = build_record(CheckpointStore.open(root, "run", mode="r"), budget)
    forger = CheckpointStore.open(root, "run", mode="r")
    forger.record_event("budget-exhausted", {"spent_gpu_hours": 23.0, "limit_gpu_hours": 23.0})
    st.record_event("budget-exhausted", {"step": 3, "spent_gpu_hours": 99.0, "limit_gpu_hours": 23.0})
    st.record_event("progress", {"step": 10**9})  # far beyond the planned 10 steps
    st.record_event("progress", {"step": -5})  # before the attempt's start
    rec = build_record(CheckpointStore.open(root, "run", mode="r"), budget)
    assert not rec["budget_stopped"]
    assert rec["spent_gpu_hours"] == clean["spent_gpu_hours"] < budget.limit_gpu_hours
    assert rec["budget_remaining_gpu_hours"] == clean["budget_remaining_gpu_hours"]
    reasons = " ".join(r["reason"] for r in rec["rejected_events"])
    assert "planned 10 steps" in reasons and "accounting shows" in reasons
    # the same validation guards the trainer's budget check: no forged event stops a run
    ledger = validate_events(forger.events(), forger.attempts(), identity=PLANNED)
    assert all(e["payload"].get("step") != 10**9 for e in ledger.accepted)


def test_a_real_budget_stop_is_confirmed(tmp_path: Path) -> None:
    st = CheckpointStore.open(tmp_path / "s", "run", identity=IDENT)
    for step in range(10):
        st.record_event("progress", {"step": step})
    st.record_event("budget-exhausted", {"step": 9, "spent_gpu_hours": 1.0, "limit_gpu_hours": 1.0})
    rec = build_record(CheckpointStore.open(tmp_path / "s", "run", mode="r"), Budget(1.0, 0.1, 0.25))
    assert rec["budget_stopped"] and rec["rejected_events"] == []


# -- the drill's child processes --------------------------------------------------------------------------------


def test_storage_options_reach_the_child_through_a_pipe_not_argv(tmp_path: Path) -> None:
    probe = (
        "import json, sys\n"
        "from ckptstore.ops.drill.proc import OPTIONS_FD_FLAG, read_options_fd\n"
        "cmdline = open('/proc/self/cmdline', 'rb').read().decode()\n"
        "fd = int(sys.argv[sys.argv.index(OPTIONS_FD_FLAG) + 1])\n"
        "print('CMDLINE', json.dumps(cmdline))\n"
        "print('OPTIONS', json.dumps(read_options_fd(fd), sort_keys=True))\n"
    )
    opts = {"key": "AKIAEXAMPLEKEY", "secret": "topsecretvalue", "client_kwargs": {"region_name": "us-east-1"}}
    r = run_trainer([sys.executable, "-c", probe], storage_options=opts, timeout=60)
    assert r.returncode == 0, r.lines
    cmdline = json.loads((r.first("CMDLINE ") or "")[len("CMDLINE "):])
    assert "topsecretvalue" not in cmdline and "AKIAEXAMPLEKEY" not in cmdline
    assert json.loads((r.first("OPTIONS ") or "")[len("OPTIONS "):]) == opts


def test_drill_argv_carries_no_storage_options(tmp_path: Path) -> None:
    from ckptstore.ops.drill.drill import Drill, DrillConfig

    d = Drill(DrillConfig(store=str(tmp_path / "s"), out_dir=str(tmp_path / "o"),
                          storage_options={"secret": "topsecretvalue"}), log=lambda *_: None)
    d.interval = 5
    assert not any("topsecretvalue" in a for a in d._args())


@pytest.mark.slow
def test_the_trainer_receives_its_storage_options_through_the_pipe(tmp_path: Path) -> None:
    """End to end: the options (here the local store's modes) take effect in the
    child although they never appear on its command line."""
    import stat

    from ckptstore.ops.drill.proc import trainer_cmd

    old = os.umask(0o022)
    try:
        r = run_trainer(trainer_cmd(str(tmp_path / "s"), "r", "--steps", "3", "--save-every", "2", "--sync"),
                        storage_options={"file_mode": "0o640", "dir_mode": "0o750"}, timeout=300)
    finally:
        os.umask(old)
    assert r.returncode == 0, r.lines[-20:]
    modes = set()
    for dirpath, dirs, files in os.walk(tmp_path / "s" / "r"):
        modes |= {("f", stat.S_IMODE(os.lstat(os.path.join(dirpath, f)).st_mode)) for f in files}
        modes |= {("d", stat.S_IMODE(os.lstat(os.path.join(dirpath, d)).st_mode)) for d in dirs}
    assert modes == {("f", 0o640), ("d", 0o750)}


def test_the_drills_console_escapes_and_redacts(capsys: pytest.CaptureFixture[str]) -> None:
    from ckptstore.ops.drill.drill import _terminal_log

    # one line of a child's output (the parent reads them line by line)
    _terminal_log("      REFUSED CorruptionError: http://u:hunter2pass@h/x: " + EVIL.split("\n")[0])
    out = capsys.readouterr().out
    assert_clean(out)
    assert "hunter2pass" not in out and "\\x1b]0;pwned" in out


def test_auth_warnings_are_escaped_lines_and_keys_never_printed(tmp_path: Path) -> None:
    st = CheckpointStore.open(tmp_path / "s", "run", identity=IDENT)  # written without a key: unauthenticated
    with st.save(1) as s:
        s.put("m", b"x")
    hexkey = "ab" * 32
    env = {"CKPTSTORE_AUTH_KEYS": f"k1:{hexkey}"}
    p = run_cli("ls", str(tmp_path / "s"), "run", "--auth-policy", "warn", env=env)
    assert p.returncode == 0, p.stderr
    warned = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert warned and all(ln.startswith("ckptstore: warning: ") for ln in warned), p.stderr
    assert hexkey not in p.stdout + p.stderr
    assert secret_values(environ=env) and hexkey in secret_values(environ=env)
    assert redact_text(f"boom {hexkey}", secret_values(environ=env)) == "boom ***"
