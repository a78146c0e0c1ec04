"""How the replicator copies a save (docs/tiers.md "Replication"): every
component uploaded once, a corrupt local copy never replicated, and with
``early_replication`` each component (version 2) or each new piece (version
3) copied as soon as its local write returned, the durable commit still
after the local one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import FaultyBackend
from ckptstore.protocol import component_key
from ckptstore.protocol.layout import piece_key
from tests.tiers.test_tiers import durable_steps, local_file, open_tiered, payload, save

#: test_each_component_is_uploaded_once_and_the_durable_copy_verifies counts version 2's whole-component
#: uploads (version 3's early uploads of its own pieces: the test after it; its uploads of lacking pieces:
#: tests/tiers/test_pieces.py)
WHOLE_COMPONENTS_VERSION = 2


def component_puts(durable: FaultyBackend, save_id: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in durable.trace:
        if t.op == "put" and t.outcome == "ok" and f"/{save_id}/" in t.key:
            out[t.key] = out.get(t.key, 0) + 1
    return out


@pytest.mark.parametrize("early", [False, True])
def test_each_component_is_uploaded_once_and_the_durable_copy_verifies(
        backend_factory: Callable[[], Backend], tmp_path: Path, early: bool) -> None:
    durable = FaultyBackend(backend_factory())
    s = open_tiered(durable, tmp_path / "nvme", early_replication=early, protocol_version=WHOLE_COMPONENTS_VERSION)
    for step in range(3):
        save(s, step)
        assert s.flush(30)
    ref = s.latest_complete()
    assert ref is not None and ref.tier == "both"
    s.close()
    puts = component_puts(durable, ref.save_id)
    assert puts == {component_key("run", ref.save_id, n): 1 for n in ("a", "b/c")}
    r = CheckpointStore.open(backend_factory(), "run", mode="r")
    dref = r.latest_complete(deep=True)
    assert dref is not None and dref.manifest_digest == ref.manifest_digest
    assert r.read(dref, "a") == payload(2) and r.read(dref, "b/c") == payload(2)[::-1]


@pytest.mark.parametrize("version", [2, 3])
def test_early_replication_uploads_a_saves_new_bytes_before_its_local_commit_once(
        backend_factory: Callable[[], Backend], tmp_path: Path, version: int) -> None:
    """``early_replication`` on either version: the bytes a save writes (a
    whole component on version 2; the new pieces under its own ID on version
    3) start to upload while the save is still open (decided by an event the
    upload sets, inside the ``with`` block), each lands once, and what a
    version-3 save reuses from the save before is not uploaded again; the
    durable copy verifies deep and holds the bytes."""
    durable = FaultyBackend(backend_factory())
    watched: list[str] = []
    began = threading.Event()

    def upload_began(op: str, key: str) -> bool:
        if op == "put" and any(f"/{sid}/" in key for sid in watched):
            began.set()
        return False  # a probe, never a fault

    durable.slow(None, 0.0, when=upload_began)
    s = open_tiered(durable, tmp_path / "nvme", early_replication=True, protocol_version=version)
    assert s.run_record["protocol_version"] == version
    save(s, 1)
    assert s.flush(30)
    first = s.latest_complete()
    assert first is not None
    with s.save(2) as w:
        watched.append(w.save_id)
        w.put("b/c", payload(2)[::-1])  # new bytes
        assert began.wait(60), "no upload of the save's bytes began before its local commit"
        w.put("a", payload(1))  # the same bytes as save 1's "a": a reused piece on version 3
    assert s.flush(30)
    ref = s.latest_complete()
    assert ref is not None and ref.step == 2 and ref.tier == "both"
    s.close()
    puts: dict[str, int] = {}
    for t in durable.trace:
        if t.op == "put" and t.outcome == "ok":
            puts[t.key] = puts.get(t.key, 0) + 1
    mine = {k: n for k, n in puts.items() if f"/{ref.save_id}/" in k}
    assert mine and set(mine.values()) == {1}, puts  # each of its own objects uploaded once
    if version == 3:
        reused = first.components["a"].pieces
        assert reused and ref.components["a"].pieces == reused
        assert puts[piece_key("run", reused[0].holder, reused[0].digest)] == 1  # by save 1 alone
        assert all("/pieces/" in k for k in mine)
    r = CheckpointStore.open(backend_factory(), "run", mode="r")
    dref = r.latest_complete(deep=True)
    assert dref is not None and dref.manifest_digest == ref.manifest_digest
    assert r.read(dref, "a") == payload(1) and r.read(dref, "b/c") == payload(2)[::-1]


@pytest.mark.parametrize("version", [2, 3])
def test_an_aborted_save_with_early_replication_commits_nothing_durable(
        backend_factory: Callable[[], Backend], tmp_path: Path, version: int) -> None:
    s = open_tiered(backend_factory(), tmp_path / "nvme", early_replication=True, protocol_version=version)
    save(s, 1)
    assert s.flush(30)
    with pytest.raises(RuntimeError), s.save(2) as w:
        w.put("a", payload(2))  # copied to the durable tier at once
        raise RuntimeError("the training step failed mid-save")
    save(s, 3)
    assert s.flush(30)
    s.close()
    assert durable_steps(backend_factory()) == [1, 3]


def test_a_local_copy_corrupted_before_replication_is_never_replicated(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    """The replicator verifies every byte it reads from the local tier: a bit
    flip between the local commit and the upload stops that save's
    replication (``local-copy-bad``), the corrupt bytes never land and
    nothing of it is committed durably."""
    durable = backend_factory()
    s = open_tiered(durable, tmp_path / "nvme", replicate_every=2)
    save(s, 0)  # replicated
    assert s.flush(30)
    save(s, 1)  # skipped by replicate_every: flipped, then forced into replication
    ref = s.latest_complete()
    assert ref is not None and ref.step == 1 and ref.tier == "local"
    f = local_file(tmp_path / "nvme", ref, "a")
    b = bytearray(f.read_bytes())
    b[7] ^= 1
    f.write_bytes(bytes(b))
    assert not s.make_durable(30)
    st = s.replication_status()
    assert st is not None and (1, "local-copy-bad") in st.skipped
    s.close()
    assert durable_steps(backend_factory()) == [0]
    r = CheckpointStore.open(backend_factory(), "run", mode="r")
    # the corrupt component never landed (the good one may have: uncommitted, gc removes it)
    assert f.relative_to(tmp_path / "nvme").as_posix() not in r.backend.list_keys("run/")


def test_a_local_piece_damaged_before_its_early_upload_never_lands(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    """THREATS.md §4.12, early uploads: a version-3 piece flipped in the local
    tier after its local write and before its early upload read it (the
    upload held at its start by an event) never lands in the durable tier;
    the replication skips the save as ``local-copy-bad`` and commits nothing
    of it durably; the save before it stays the durable one."""
    durable = FaultyBackend(backend_factory())
    watched: list[str] = []
    held, release = threading.Event(), threading.Event()

    def gate(op: str, key: str) -> bool:
        if op == "put" and any(f"/{sid}/" in key for sid in watched):
            held.set()
            release.wait(120)
        return False  # a gate, never a fault

    durable.slow(None, 0.0, when=gate)
    s = open_tiered(durable, tmp_path / "nvme", early_replication=True)
    assert s.run_record["protocol_version"] == 3
    save(s, 1)
    assert s.flush(30)
    with s.save(2) as w:
        watched.append(w.save_id)
        entry = w.put("b/c", payload(2)[::-1])
        assert held.wait(60), "the early upload never began"
        assert entry.pieces
        f = tmp_path / "nvme" / piece_key("run", entry.pieces[0].holder, entry.pieces[0].digest)
        b = bytearray(f.read_bytes())
        b[7] ^= 1
        f.write_bytes(bytes(b))
        release.set()
        w.put("a", payload(2))
    s.flush(30)
    st = s.replication_status()
    assert st is not None and (2, "local-copy-bad") in st.skipped, st
    s.close()
    assert durable_steps(backend_factory()) == [1]
    r = CheckpointStore.open(backend_factory(), "run", mode="r")
    assert f.relative_to(tmp_path / "nvme").as_posix() not in r.backend.list_keys("run/")


def test_replicate_every_counts_from_each_open(backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    """docs/tiers.md: the first save handed to replication after an open is made
    durable, then every K-th; after a restart from a save only the local tier
    holds, that save is the first (replicated whatever K is)."""
    s = open_tiered(backend_factory(), tmp_path / "nvme", replicate_every=3)
    for step in range(1, 6):
        save(s, step)
    assert s.flush(30)
    s.close()
    assert durable_steps(backend_factory()) == [1, 4]  # 5 stays local only
    s = open_tiered(backend_factory(), tmp_path / "nvme", replicate_every=3)
    ref = s.latest_complete()
    assert ref is not None and ref.step == 5 and ref.tier == "local"
    for step in range(6, 10):
        save(s, step)
    assert s.flush(30)
    s.close()
    assert durable_steps(backend_factory()) == [1, 4, 5, 8]
    s = open_tiered(backend_factory(), tmp_path / "nvme", replicate_every=3)
    save(s, 10)  # the resume point (9) is local only again: 9 first, then 12
    for step in (11, 12):
        save(s, step)
    assert s.flush(30)
    s.close()
    assert durable_steps(backend_factory()) == [1, 4, 5, 8, 9, 12]
