"""Fail closed in the operator's tools (issue 18, classes 7, 9 and the CLI /
key-file parts of 10; protocol_spec/THREATS.md §4.7, §4.9, §4.10): ``sign``
vouches only for a history that is consistent, ledger events alone never make
a run promotable or spend its budget, a gc refusal is a failure on the
command line, and key files are opened like the secrets they are.

Objects are planted straight on the storage (``ckptstore.testing.raw``) on
memory, local disk and the object stores; the public API and the CLI (in
process, so ``memory://`` stores are shared) are checked alike."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, InvalidInputError
from ckptstore import protocol as P
from ckptstore.authn import ENV_KEYS, keyring_from_env, keyring_from_file
from ckptstore.backends.base import Backend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.cli import main as cli_main
from ckptstore.protocol.auth import Keyring
from ckptstore.registry import backend_from_url
from ckptstore.testing.raw import RawAccess

IDENT = {"data_digest": "d-1", "code_digest": "c-1"}
KEY_HEX = "5a" * 32
K1 = Keyring({"k1": bytes.fromhex(KEY_HEX)})
OPS_BACKENDS = pytest.mark.backends("memory", "local", "moto", "fakegcs")


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
    # an attempt record planted without the key: under require it fences nothing, and stops gc
    RawAccess(place.backend()).set(P.attempt_key("run", 2), P.AttemptRecord("run", 2, None, "evil", 1.0).encode())
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
