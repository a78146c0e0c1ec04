"""The combinations table of docs/combinations.md, one process: every cell of
{one tier, two tiers} x {protocol version 2, 3} x {auth off, warn, require}
on the local disk, SeaweedFS and fake-gcs-server runs the same life of a run
through the public API and asserts what a user relies on:

save three steps -> the process dies without close() (replication flushed
first in a two-tier cell, so the durable copy exists) -> the newest save is
damaged in every tier that holds it -> a fresh writer resumes from the save
before it (the corrupt-save fallback) and reads it back bit for bit -> it
saves again and replicates -> gc keeps the newest and removes the rest
(the damaged save is superseded: the new attempt forked before it) -> a reader reads the newest bit for bit;
under ``require`` a reader without the keyring is refused, naming the key.

The many-rank cells are in tests/distributed/test_ranks_compose.py; the
DCP cells in tests/distributed/test_dcp.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, CkptStoreError, Keyring, SaveRef, SaveState
from ckptstore.backends.base import Backend

pytestmark = pytest.mark.backends("local", "seaweedfs", "fakegcs")

IDENT = {"model": "tiny", "data": "snap-1"}
RING = Keyring({"k1": b"c" * 32})


def payload(step: int, name: str) -> bytes:
    # distinct per step and name (version 3: each packed into one piece)
    seed = (step * 31 + len(name)) % 251
    return bytes((seed + i) % 251 for i in range(40_000)) + name.encode() * 100


def save(store: CheckpointStore, step: int) -> SaveRef:
    with store.save(step) as w:
        for name in ("model", "optim"):
            w.put(name, payload(step, name))
    ref = store.latest_complete()
    assert ref is not None and ref.step == step
    return ref


def read_back(store: CheckpointStore, ref: SaveRef) -> None:
    for name in ("model", "optim"):
        assert store.read(ref, name) == payload(ref.step, name), (ref.step, name)


def damage(backend: Backend, local: Path | None, save_id: str) -> int:
    """Flip a byte in every data object the save holds (components or pieces), in both tiers."""
    hit = 0
    for key in backend.list_keys("run/"):
        if save_id in key and "/commits/" not in key and not key.endswith(".json"):
            data = bytearray(backend.get(key))
            data[len(data) // 2] ^= 0x01
            backend.put(key, [bytes(data)])
            hit += 1
    if local is not None:
        for f in (local / "run").rglob("*"):
            if f.is_file() and save_id in str(f) and "commits" not in f.parts and f.suffix != ".json":
                data = bytearray(f.read_bytes())
                data[len(data) // 2] ^= 0x01
                f.write_bytes(bytes(data))
                hit += 1
    return hit


@pytest.mark.parametrize("auth", ["off", "warn", "require"])
@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("tiers", ["one", "two"])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_run_lives_through_kill_damage_fallback_and_gc(
        backend_factory: Callable[[], Backend], tmp_path: Path, tiers: str, version: int, auth: str) -> None:
    local = tmp_path / "nvme" if tiers == "two" else None
    opts: dict[str, Any] = {"protocol_version": version, "auth_policy": auth,
                            "keyring": RING if auth != "off" else None, "local_tier": local}
    durable = backend_factory()

    first = CheckpointStore.open(durable, "run", identity=IDENT, **opts)
    refs = [save(first, step) for step in (1, 2, 3)]
    if local is not None:
        assert first.flush(60) and first.is_durable(refs[-1])
    del first  # killed: no close()

    assert damage(durable, local, refs[-1].save_id) >= (4 if local is not None else 2)
    second = CheckpointStore.open(durable, "run", identity=IDENT, **opts)
    assert second.resumed_from is not None and second.resumed_from.step == 2  # the damaged step 3 was skipped
    read_back(second, second.resumed_from)
    ref4 = save(second, 4)
    if local is not None:
        assert second.flush(60) and second.is_durable(ref4)

    report = second.gc(keep_last=1, grace_seconds=0)
    assert report.refused is None, report.refused
    if local is not None:  # gc is per tier: the local tier keeps local_keep=2 until its own gc
        local_report = second.gc_local(keep_last=1, grace_seconds=0)
        assert local_report.refused is None, local_report.refused
    # the damaged step 3 lies in the history attempt 2 forked off (superseded): removed, as 1 and 2 are
    # (version 3: with their pieces, at once: their commits were read, PROTOCOL.md §9.5 step 5)
    committed = {i.step: i.state for i in second.list_saves() if i.state in (SaveState.COMMITTED, SaveState.CORRUPT)}
    assert committed == {4: SaveState.COMMITTED}
    second.close()

    reader = CheckpointStore.open(durable, "run", mode="r", auth_policy=auth, keyring=opts["keyring"])
    newest = reader.latest_complete(deep=True)
    assert newest is not None and newest.step == 4
    read_back(reader, newest)
    if auth == "require":
        with pytest.raises(CkptStoreError, match="(?i)key"):
            CheckpointStore.open(durable, "run", mode="r", auth_policy="require", keyring=Keyring({}))


@pytest.mark.backends("local")
@pytest.mark.parametrize(("opts", "message"), [
    ({"rank": 0, "early_replication": True}, "early_replication is for one process"),
    ({"keep": 0}, "must be at least 1"),
    ({"join_attempt": 1}, "local_tier with join_attempt needs the rank's tier"),
    ({"peer_copies": 1}, "peer_copies is for many ranks"),
    ({"peer_copies": -1}, "peer_copies must be >= 0"),
], ids=["ranks-early", "keep-0", "join-no-rank", "one-process-peers", "peers-negative"])
def test_each_refused_combination_names_its_fix_before_anything_is_written(
        backend: Backend, tmp_path: Path, opts: dict[str, Any], message: str) -> None:
    from ckptstore import OpenOptions, TierOptions

    opts = dict(opts)
    version, join = opts.pop("protocol_version", None), opts.pop("join_attempt", None)
    o = OpenOptions(protocol_version=version, tiers=TierOptions(tmp_path / "nvme", **opts))
    with pytest.raises(CkptStoreError, match=message):
        CheckpointStore(backend, "run", o, identity=IDENT, join_attempt=join)
    assert backend.list_keys("") == []
    assert not (tmp_path / "nvme").exists()


@pytest.mark.backends("local")
def test_the_dcp_writer_on_a_tiered_rank_store_is_refused_with_the_fix(backend: Backend, tmp_path: Path) -> None:
    # docs/combinations.md: DCP publishes on the coordinator alone, so a tiered job of many ranks cannot use it
    pytest.importorskip("torch.distributed.checkpoint")
    from ckptstore import OpenOptions, TierOptions
    from ckptstore.distributed.dcp import StoreWriter

    o = OpenOptions(single_writer=True, tiers=TierOptions(tmp_path / "nvme", rank=0, peers={}))
    with CheckpointStore.open(backend, "run", identity=IDENT, options=o) as store:
        with pytest.raises(CkptStoreError, match="Checkpointer\\(RankStore\\(run\\)\\)"):
            StoreWriter(store)
        assert store.list_saves() == []
    with CheckpointStore.open(backend, "run", identity=IDENT, options=OpenOptions(
            tiers=TierOptions(tmp_path / "nvme2"))) as one:
        StoreWriter(one)  # one process with two tiers: DCP's writer works (the coordinator is the whole job)
