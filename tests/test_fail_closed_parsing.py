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


# ------------------------------------------------- torch restore: the claim is bounded before allocating


def _torch_objects(seed: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def _weights(objects: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in objects["model"].state_dict().items()}


def _same_bits(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )


def _two_torch_saves(store: CheckpointStore) -> tuple[dict[str, Any], P.CommitRecord]:
    from ckptstore.torch import save_state

    first = _torch_objects(1)
    save_state(store, 1, first)
    second = _torch_objects(2)
    ref2 = save_state(store, 2, second)
    return _weights(first), ref2.record


@pytest.mark.backends("memory", "local", "moto")
def test_a_terabyte_component_claim_is_refused_before_allocating_and_the_fallback_restores_the_previous_save(
    backend_factory: Callable[[], Backend],
) -> None:
    from ckptstore.torch import Checkpointer, read_state, restore_state
    from ckptstore.torch.restore import read_with_fallback

    store = CheckpointStore.open(backend_factory(), "run", identity=IDENT)
    good, rec2 = _two_torch_saves(store)
    _forge_sizes(backend_factory(), rec2, {"model.safetensors": TIB})  # a consistent record claiming 1 TiB

    b = backend_factory()
    counted = Counted(b, "get_range", "readinto")
    reader = CheckpointStore.open(b, "run", identity=IDENT, resume_verify="cheap")
    forged = reader.get_save(2)  # not verified: the claim reaches the restore
    key = P.component_key("run", forged.save_id, "model.safetensors")
    live = _torch_objects(3)
    with pytest.raises(CorruptionError, match=r"claims 1099511627776 bytes, more than the live 'model' can hold"):
        restore_state(reader, forged, live)
    assert not [c for calls in counted.calls.values() for c in calls if c[0] == key]  # refused before any read
    with pytest.raises(CorruptionError, match="model.safetensors"):  # no live objects: the allocation itself fails closed
        read_state(reader, forged)

    # the Checkpointer's fallback reads past it to the previous save, bit for bit
    with pytest.warns(RuntimeWarning, match="resume point step 2 is corrupt; resuming from step 1"):
        saved, ref = read_with_fallback(reader, forged, live)
    assert ref.step == 1 and _same_bits(saved.trees["model"], good)

    # and a Checkpointer resuming this run never loses step 1 (selection skips the claim by its size)
    again = CheckpointStore.open(backend_factory(), "run", identity=IDENT, resume_verify="cheap")
    objs = _torch_objects(4)
    ckpt = Checkpointer(again, objs, async_save=False, handle_signals=False)
    assert ckpt.resume() == 2
    assert _same_bits(_weights(objs), good)
    ckpt.close()


@pytest.mark.backends("local")
def test_checkpointer_falls_back_past_a_sparse_terabyte_component(
    backend_factory: Callable[[], Backend],
) -> None:
    """On a disk the listing can agree with the claim (a sparse 1 TiB file),
    so only the restore's bound stands between the claim and the allocator."""
    from ckptstore.backends.local import LocalBackend
    from ckptstore.torch import Checkpointer

    b = backend_factory()
    assert isinstance(b, LocalBackend)
    store = CheckpointStore.open(b, "run", identity=IDENT)
    good, rec2 = _two_torch_saves(store)
    path = f"{b.root}/{P.component_key('run', rec2.save_id, 'model.safetensors')}"
    with open(path, "r+b") as f:
        f.truncate(TIB)  # sparse: no disk space used
    _forge_sizes(b, rec2, {"model.safetensors": TIB})

    counted = Counted(b, "readinto")
    resumed = CheckpointStore.open(b, "run", identity=IDENT, resume_verify="cheap")
    assert resumed.resumed_from is not None and resumed.resumed_from.step == 2  # sizes agree: selected
    objs = _torch_objects(5)
    ckpt = Checkpointer(resumed, objs, async_save=False, handle_signals=False)
    with pytest.warns(RuntimeWarning, match="resume point step 2 is corrupt; resuming from step 1"):
        assert ckpt.resume() == 2
    assert _same_bits(_weights(objs), good)
    assert not [c for c in counted.calls["readinto"] if c[0].endswith("model.safetensors") and rec2.save_id in c[0]]
    assert resumed.resumed_from is not None and resumed.resumed_from.step == 1  # a new attempt resumes from step 1
    ckpt.close()
