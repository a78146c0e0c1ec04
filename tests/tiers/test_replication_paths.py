"""How the replicator copies a save (docs/tiers.md "Replication"): every
component uploaded once, a corrupt local copy never replicated, and with
``early_replication`` each component copied as soon as its local write
returned, the durable commit still after the local one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import FaultyBackend
from ckptstore.protocol import component_key
from tests.tiers.test_tiers import durable_steps, local_file, open_tiered, payload, save

#: test_each_component_is_uploaded_once_and_the_durable_copy_verifies counts version 2's whole-component
#: uploads (early_replication is version 2 only; version 3's uploads of lacking pieces: tests/tiers/test_pieces.py)
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


def test_an_aborted_save_with_early_replication_commits_nothing_durable(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    s = open_tiered(backend_factory(), tmp_path / "nvme", early_replication=True)
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
