"""The record pack is a cache, never a source of truth (PROTOCOL.md §4.7.1,
THREATS.md §4.15): a planted, stale, foreign, oversize or garbage pack, or a
link in its place, changes no listing and no gc decision; it only costs (or
saves) record reads. On S3 a writer's pack saves the record reads of a cold
listing; on the other backends (no content digest in the listing) no pack is
read or written at all."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import FaultyBackend
from ckptstore.core import record_pack
from ckptstore.protocol import component_key
from tests.helpers import open_reader, open_writer, save

Row = tuple[str, int, int, str, str, int, int]


@pytest.fixture(autouse=True)
def _small_pack_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record_pack, "MIN_NEW_RECORDS", 1)  # a few saves are enough to write and read a pack


def rows(st: CheckpointStore) -> list[Row]:
    return [(i.save_id, i.step, i.attempt, i.state.value, i.detail, i.bytes, i.components) for i in st.list_saves()]


def cold(backend: Backend, run: str = "run") -> tuple[list[Row], int]:
    """The rows of a listing by a store that holds none of the run's records, and its record reads."""
    fb = FaultyBackend(backend)
    st = open_reader(fb, run)
    seen = len(fb.trace)
    got = rows(st)
    reads = sum(1 for e in fb.trace[seen:] if e.op.startswith("get") and f"{run}/commits/" in e.key)
    st.close()
    return got, reads


def history(backend: Backend, run: str = "run", n: int = 6) -> list[Row]:
    """A run of ``n`` saves (one damaged: a component removed), listed by its writer (which writes the pack)."""
    st = open_writer(backend, run)
    refs = [save(st, step, names=("model",), size=64) for step in range(1, n + 1)]
    backend.delete(component_key(run, refs[2].save_id, "model"))
    out = rows(st)
    st.close()
    return out


def truth(backend: Backend, run: str = "run") -> list[Row]:
    """The rows a full scan gives with no pack in the store."""
    backend.delete(record_pack.pack_key(run))
    return cold(backend, run)[0]


def test_a_writers_pack_saves_the_record_reads_of_a_cold_listing(backend_factory: Callable[[], Backend]) -> None:
    backend = backend_factory()
    listed = history(backend)
    got, reads = cold(backend)
    assert got == listed
    if backend.capabilities.version_is_md5:
        assert backend.exists(record_pack.pack_key("run"))
        assert reads == 0  # every record came from the pack, each proven by its listed ETag
        assert truth(backend) == listed
        assert cold(backend)[1] == len(listed)  # no pack: one read per record
    else:
        assert not backend.exists(record_pack.pack_key("run"))  # nothing could prove its entries: never written
        assert reads == len(listed)


def _plant(backend: Backend, records: dict[str, str], run: str = "run", top: dict[str, object] | None = None) -> None:
    body = {"kind": record_pack.PACK_KIND, "run_id": run, "records": records, **(top or {})}
    backend.put(record_pack.pack_key(run), [json.dumps(body).encode()])


def _pack_records(backend: Backend, run: str = "run") -> dict[str, str]:
    data = backend.get(record_pack.pack_key(run)) if backend.exists(record_pack.pack_key(run)) else b""
    return dict(json.loads(data)["records"]) if data else {}


def test_planted_pack_entries_change_nothing(backend_factory: Callable[[], Backend]) -> None:
    backend = backend_factory()
    history(backend)
    real = _pack_records(backend)
    listed = truth(backend)
    commits = sorted(k for k in backend.list_keys("run/commits/"))
    names = [k.rsplit("/", 1)[1] for k in commits]
    # a pack naming saves that do not exist (a newer step's name, with a well-formed record of it)
    fake_name = "999999999899.99999998-000000000100.00000001.json"
    forged = {fake_name: next(iter(real.values()), "{}")}
    # the same length, other bytes: an entry that claims another record under a real name
    forged_real = {n: text.replace('"step":', '"stsp":') for n, text in real.items()}
    for records in (
        forged,
        {**real, **forged},
        dict(list(real.items())[:2]),  # omits most records
        forged_real,
        {n: "" for n in names},
        {n: "x" * 10_000 for n in names},
    ):
        _plant(backend, records)
        assert cold(backend)[0] == listed
    for top in ({"run_id": "other"}, {"kind": "not-a-pack"}, {"records": list(real.values())}):
        _plant(backend, real, top=top)
        assert cold(backend)[0] == listed
    for garbage in (b"", b"\xff\xfe", b"[" * 100_000, b'{"records": {"a": 1e999}}', b"not json"):
        backend.put(record_pack.pack_key("run"), [garbage])
        assert cold(backend)[0] == listed


def test_a_foreign_runs_pack_and_an_oversize_pack_change_nothing(
    backend_factory: Callable[[], Backend], monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = backend_factory()
    history(backend, "run")
    history(backend, "other")
    listed = truth(backend, "run")
    other = backend.get(record_pack.pack_key("other")) if backend.exists(record_pack.pack_key("other")) else b"{}"
    backend.put(record_pack.pack_key("run"), [other])  # another run's pack copied over this run's
    assert cold(backend, "run")[0] == listed
    # a pack over the bound is never read in part (here: every pack is over it)
    st = open_writer(backend, "run")
    st.list_saves()
    st.close()
    monkeypatch.setattr(record_pack, "MAX_PACK_BYTES", 64)
    got, reads = cold(backend, "run")
    assert got == listed
    assert reads == len(listed)


def test_gc_decides_the_same_with_a_planted_pack(backend_factory: Callable[[], Backend]) -> None:
    backend = backend_factory()
    history(backend)
    listed = truth(backend)
    real = _pack_records(backend) or {"x": "{}"}
    fake = {k: v.replace('"size":64', '"size":99') for k, v in real.items()}  # claims other sizes: never proven
    _plant(backend, fake)
    st = open_writer(backend)
    plan = st.gc(keep_last=2, dry_run=True)
    st.close()
    backend.delete(record_pack.pack_key("run"))
    st = open_writer(backend)
    plan_without = st.gc(keep_last=2, dry_run=True)
    st.close()
    assert [(s, r) for s, r in plan.deleted_saves] == [(s, r) for s, r in plan_without.deleted_saves]
    assert sorted(a.key for a in plan.actions) == sorted(a.key for a in plan_without.actions)
    assert record_pack.pack_key("run") not in {a.key for a in plan.actions}
    assert cold(backend)[0] == listed


def test_a_link_in_place_of_the_pack_is_never_followed(tmp_path: object) -> None:
    """On a local disk no pack is read or written; a link planted where it would lie changes nothing and
    stays (gc deletes only what it proved is a save's)."""
    from ckptstore.backends.local import LocalBackend

    root = os.path.join(str(tmp_path), "store")
    backend = LocalBackend(root)
    history(backend)
    secret = os.path.join(str(tmp_path), "secret.json")
    with open(secret, "w") as f:
        f.write('{"kind": "commit-pack", "run_id": "run", "records": {}}')
    os.makedirs(os.path.join(root, "run", "index"), exist_ok=True)
    link = os.path.join(root, "run", "index", "commits.json")
    os.symlink(secret, link)
    listed = cold(backend)[0]
    st = open_writer(backend)
    assert rows(st) == listed
    st.gc(keep_last=1)
    st.close()
    assert os.path.islink(link) and os.path.exists(secret)
