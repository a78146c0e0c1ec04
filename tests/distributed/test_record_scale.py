"""The record format at scale (issue 23 item 4), checked without the ranks:
a commit of 4,096 ranks x 8 components stays under the commit-record cap and
decodes back, the largest world size the format holds is what
docs/performance.md says, and a 100,000-component save is listed, selected
and deep-verified with work proportional to its components and bytes."""

from __future__ import annotations

import time

import blake3

from ckptstore import CheckpointStore
from ckptstore import protocol as P
from ckptstore.backends.faults import FaultyBackend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.protocol.records import MAX_COMMIT_RECORD, MAX_COMPONENTS

IDENT = {"data_digest": "d", "code_digest": "c", "optimizer_revision": "r", "feature_contract": "f"}
#: the eight components of one rank in a typical sharded save (long, realistic names)
PARTS = ("model.safetensors", "optimizer.safetensors", "scheduler.safetensors", "scaler.safetensors",
         "sampler.safetensors", "loader.safetensors", "rng.safetensors", "extra_state.safetensors")


def _ranked_commit(world: int) -> P.CommitRecord:
    digest = blake3.blake3(b"x").hexdigest()
    comps = {f"rank{r}/{p}": P.ComponentEntry(f"rank{r}/{p}", 123_456_789_012, digest)
             for r in range(world) for p in PARTS}
    ranks = {r: tuple(sorted(f"rank{r}/{p}" for p in PARTS)) for r in range(world)}
    return P.CommitRecord("run", 10**9, 99, P.new_save_id(10**9, 99), "w" * 32, "a" * 64, comps, 1.7e9,
                          {"format": "ckptstore.torch/1"}, ranks, world)


def test_a_commit_of_4096_ranks_by_8_components_fits_the_record_cap() -> None:
    rec = _ranked_commit(4096)
    data = rec.encode()
    assert len(data) < MAX_COMMIT_RECORD // 2  # half the cap spare at 4,096 ranks
    back = P.CommitRecord.decode(data, "x")
    assert back == rec and back.world_size == 4096 and len(back.components) == 4096 * 8


def test_the_largest_world_size_is_set_by_the_component_bound() -> None:
    # 8 components a rank: MAX_COMPONENTS allows 12,500 ranks, and their record still fits the byte cap
    largest = MAX_COMPONENTS // len(PARTS)
    assert largest == 12_500
    assert len(_ranked_commit(largest).encode()) < MAX_COMMIT_RECORD


def test_a_100000_component_save_costs_one_read_per_component_and_each_byte_once() -> None:
    inner = MemoryBackend()
    st = CheckpointStore.open(inner, "run", identity=IDENT)
    n, size = MAX_COMPONENTS, 7
    sid = st.new_save_id(1)
    entries = {}
    for i in range(n):  # staged as a coordinator's ranks would: objects written, then one publish
        data = i.to_bytes(size, "little")
        inner.put(P.component_key("run", sid, f"c{i}"), [data])
        entries[f"c{i}"] = P.ComponentEntry(f"c{i}", size, blake3.blake3(data).hexdigest())
    published = st.publish(1, sid, entries)
    traced = FaultyBackend(inner)
    reader = CheckpointStore.open(traced, "run", mode="r")
    t = time.perf_counter()
    ref = reader.latest_complete()  # selection: sizes from one listing, the record read once
    select_s = time.perf_counter() - t
    assert ref is not None and ref.save_id == published.save_id and len(ref.components) == n
    before = len(traced.trace)
    report = reader.verify(ref, deep=True)
    assert report.ok, report.problems[:3]
    reads = [e for e in traced.trace[before:] if e.op in ("get", "get_range", "readinto")
             and f"/{sid}/" in e.key]
    assert n <= len(reads) <= 2 * n, len(reads)  # one read each (+ at most one end probe), never a scan per read
    assert select_s < 60  # proportional, not quadratic: a quadratic selection of 100,000 would take hours
