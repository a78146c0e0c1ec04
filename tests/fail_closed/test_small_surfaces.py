"""Fail closed, issue 30 class 10 (b, c; THREATS.md §4.14): ``status --prom``
into a directory that is not there is one line naming the flag and the fix,
before any store is read; listing a run twice under ``warn`` or ``require``
reads no auth sidecar the second time, and a replaced sidecar is read again.
(Class 10a, the promotion check, is in tests/ops/test_promote.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ckptstore import CheckpointStore, SaveState, UnauthenticatedWarning
from ckptstore.backends.base import Backend
from ckptstore.cli.commands import main as cli_main
from ckptstore.protocol.auth import Keyring
from tests.fail_closed.test_parsing import Counted
from tests.helpers import IDENT, RawAccess, settle_background_writes

K1 = Keyring({"k1": b"\x01" * 32})
SIDECARS = "run/auth/commits/"


# ------------------------------------------------------- (b) status --prom


@pytest.mark.parametrize("where", ["missing-dir", "is-a-dir", "parent-is-a-file", "not-prom"])
def test_status_prom_into_a_place_it_cannot_write_is_one_line_before_any_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    store = tmp_path / "store"
    st = CheckpointStore.open(str(store), "run", identity=IDENT)
    with st.save(1) as s:
        s.put("model", b"w")
    st.close()  # a version-3 writer writes its intent in the background: before the listing below
    (tmp_path / "file").write_bytes(b"x")
    (tmp_path / "d.prom").mkdir()
    target = {"missing-dir": tmp_path / "nope" / "deeper" / "m.prom", "is-a-dir": tmp_path / "d.prom",
              "parent-is-a-file": tmp_path / "file" / "m.prom", "not-prom": tmp_path / "m.txt"}[where]
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    capsys.readouterr()
    rc = cli_main(["status", str(store), "run", "--prom", str(target)])
    out = capsys.readouterr()
    assert rc == 2, out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "--prom" in lines[0] and str(target) in lines[0], out.err
    assert "FileNotFoundError" not in out.err and "Errno" not in out.err and "Traceback" not in out.err
    assert out.out == ""  # refused before any store was read or printed
    hint = {"missing-dir": "does not exist; create it first", "is-a-dir": "is a directory; name a file in it",
            "parent-is-a-file": "is not a directory", "not-prom": "must end in .prom"}[where]
    assert hint in lines[0], lines[0]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing created
    (tmp_path / "nope").mkdir()
    ok = tmp_path / "nope" / "m.prom"
    assert cli_main(["status", str(store), "run", "--prom", str(ok)]) == 0 and "ckptstore_" in ok.read_text()


# ---------------------------------------------- (c) sidecars read once per listing entry


@pytest.mark.backends("memory", "local", "moto")
@pytest.mark.filterwarnings("ignore::ckptstore.UnauthenticatedWarning")
def test_listing_twice_reads_each_auth_sidecar_at_most_once(backend_factory: Callable[[], Backend]) -> None:
    st = CheckpointStore.open(backend_factory(), "run", identity=IDENT)
    for step in range(1, 41):
        with st.save(step) as s:
            s.put("model", b"w%d" % step)
    st.close()
    b = backend_factory()
    counted = Counted(b, "get_range")  # a bounded read of a small record is one ranged read

    def sidecar_reads() -> int:
        n = sum(1 for args in counted.calls["get_range"] if str(args[0]).startswith(SIDECARS))
        counted.calls["get_range"].clear()
        return n

    # warn, with a key, no sidecar anywhere: the listing of auth/commits/ shows none, so none is read
    r = CheckpointStore.open(b, "run", mode="r", auth_policy="warn", keyring=K1)
    sidecar_reads()
    with pytest.warns(UnauthenticatedWarning):
        assert len(r.list_saves()) == 40
    assert sidecar_reads() == 0  # was 40 a listing (81 for two listings with the attempt record's)
    r.list_saves()
    assert sidecar_reads() == 0

    # signed after the fact: every commit has a sidecar; the first listing reads each once, the next none
    signer = CheckpointStore.open(b, "run", mode="r", auth_policy="warn", keyring=K1)
    assert len(signer.sign().signed) >= 40
    req = CheckpointStore.open(b, "run", mode="r", auth_policy="require", keyring=K1)
    sidecar_reads()
    infos = req.list_saves()
    assert [i.state for i in infos] == [SaveState.COMMITTED] * 40  # authenticated through their sidecars
    assert sidecar_reads() == 40
    assert [i.state for i in req.list_saves()] == [SaveState.COMMITTED] * 40
    assert sidecar_reads() == 0

    # a sidecar replaced (another size: another listing entry) is read again and judged again
    victim = next(o.key for o in b.list(SIDECARS, flat=True))
    RawAccess(b).set(victim, b'{"junk": true}')
    states = [i.state for i in req.list_saves()]
    assert states.count(SaveState.CORRUPT) == 1 and states.count(SaveState.COMMITTED) == 39, states
    assert sidecar_reads() == 1
