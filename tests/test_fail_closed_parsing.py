"""Fail closed, class 8 (THREATS.md §4.8): parsing and allocation on the
restore paths are bounded by what the store can prove, never by a claim.

Hostile objects are planted with RawAccess (bypassing the backend) on
memory, local disk and real object-store servers (moto, fake-gcs-server);
requests and bytes are counted by wrapping the real backend's own methods
(no mock: every call still reaches the server)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from ckptstore import CheckpointStore, CorruptionError, SaveState
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.testing.raw import RawAccess

IDENT = {"data_digest": "d-1", "code_digest": "c-1"}
TIB = 1 << 40


class Counted:
    """Counts the calls of some of a real backend's methods (and the bytes
    they returned), by wrapping them on the instance; ``before`` runs ahead
    of each call (a racing writer, for instance)."""

    def __init__(self, backend: Backend, *names: str,
                 before: Callable[[str, tuple[Any, ...]], None] | None = None) -> None:
        self.calls: dict[str, list[tuple[Any, ...]]] = {n: [] for n in names}
        self.returned: dict[str, int] = dict.fromkeys(names, 0)
        for name in names:
            self._wrap(backend, name, before)

    def _wrap(self, backend: Backend, name: str, before: Callable[[str, tuple[Any, ...]], None] | None) -> None:
        inner = getattr(backend, name)

        def counted(*args: Any, **kw: Any) -> Any:
            if before is not None:
                before(name, args)
            self.calls[name].append(args)
            out = inner(*args, **kw)
            if isinstance(out, (bytes, bytearray)):
                self.returned[name] += len(out)
            elif isinstance(out, int):
                self.returned[name] += out
            elif isinstance(out, list):
                self.returned[name] += sum(len(x) for x in out if x is not None)
            return out

        setattr(backend, name, counted)


def _save(store: CheckpointStore, step: int, payload: bytes) -> P.CommitRecord:
    with store.save(step) as s:
        s.put("model", payload)
    assert s.ref is not None
    return s.ref.record


def _forge_sizes(backend: Backend, rec: P.CommitRecord, sizes: dict[str, int]) -> None:
    """Rewrite a commit record in place, consistent but for the sizes it claims."""
    comps = {n: dataclasses.replace(c, size=sizes.get(n, c.size)) for n, c in rec.components.items()}
    forged = dataclasses.replace(rec, components=comps, stored_digest="", body_digest="")
    RawAccess(backend).set(P.LATEST_LAYOUT.commit_key(rec.run_id, rec.step, rec.attempt), forged.encode())


# ------------------------------------------------- a huge size claim, short object


@pytest.mark.backends("memory", "local", "moto", "fakegcs", "moto-obstore")
def test_a_huge_size_claim_costs_one_request_past_the_real_end(backend_factory: Callable[[], Backend]) -> None:
    store = CheckpointStore.open(backend_factory(), "run", identity=IDENT)
    good = b"good weights " * 1000
    _save(store, 1, good)
    forged = _save(store, 2, b"x" * 100)
    _forge_sizes(backend_factory(), forged, {"model": TIB})  # a 1 TB claim for a 100-byte object

    b = backend_factory()
    counted = Counted(b, "get_range", "readinto")
    reader = CheckpointStore.open(b, "run", mode="r")
    with pytest.raises(CorruptionError, match=r"has 100 bytes, the commit record says 1099511627776"):
        reader.read(reader.get_save(2), "model")
    key = P.component_key("run", forged.save_id, "model")
    ranged = [c for c in counted.calls["get_range"] if c[0] == key]
    assert len(ranged) == 1, ranged  # the first block came back short: not 131,072 ranged requests

    # the verified read into caller memory stops at the first short block too
    for calls in counted.calls.values():
        calls.clear()
    claim = 256 << 20  # 32 chunks; the object holds 100 bytes
    _forge_sizes(backend_factory(), forged, {"model": claim})
    reader = CheckpointStore.open(b, "run", mode="r")
    with pytest.raises(CorruptionError, match="has 100 bytes"):
        reader.read_into(reader.get_save(2), "model", bytearray(claim))
    reads = [c for name in ("readinto", "get_range") for c in counted.calls[name] if c[0] == key]
    assert 1 <= len(reads) <= 16, reads  # at most one window of concurrent reads, not one per chunk

    # the claim costs that save, never the last good one
    latest = reader.latest_complete(deep=True)
    assert latest is not None and latest.step == 1
    assert reader.read(latest, "model") == good


# ------------------------------------------------- batched record reads


@pytest.mark.backends("memory", "local", "moto", "fakegcs")
def test_records_that_grew_after_listing_cost_their_listed_size_in_a_batch(
    backend_factory: Callable[[], Backend],
) -> None:
    store = CheckpointStore.open(backend_factory(), "run", identity=IDENT)
    good = b"good weights"
    _save(store, 0, good)
    grown = [_save(store, step, f"w{step}".encode()) for step in range(1, 9)]
    keys = {P.LATEST_LAYOUT.commit_key("run", r.step, r.attempt): r for r in grown}
    raw = RawAccess(backend_factory())
    listed = {k: len(raw.get(k) or b"") for k in keys}
    growth = 256 << 10

    def grow(name: str, args: tuple[Any, ...]) -> None:
        if name == "get_many":  # between the listing and the batched read, the records grow
            for k in args[0]:
                if k in keys:
                    raw.set(k, (raw.get(k) or b"") + b" " * growth)

    b = backend_factory()
    counted = Counted(b, "get_many", before=grow)
    reader = CheckpointStore.open(b, "run", mode="r")
    saves = {i.step: i for i in reader.list_saves()}
    assert counted.calls["get_many"], "the records were not read in a batch"
    batch_keys = [k for call in counted.calls["get_many"] for k in call[0]]
    assert set(keys) <= set(batch_keys)
    # each record read up to its listed size + 1, not up to the 16 MiB record cap
    assert counted.returned["get_many"] <= sum(listed.values()) + len(batch_keys) + 4096
    assert saves[0].state is SaveState.COMMITTED and saves[0].ref is not None
    for r in grown:
        assert saves[r.step].ref is None  # a record that changed is never trusted
    latest = reader.latest_complete()
    assert latest is not None and latest.step == 0 and reader.read(latest, "model") == good
