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

from ckptstore import CheckpointStore, CorruptionError, OpenOptions, SaveState
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from tests.helpers import IDENT, RawAccess

TIB = 1 << 40
#: the tests that forge a component's size or bytes as one object under saves/ use version 2's layout
#: (version 3's lying piece lists: tests/incremental/test_format.py)
V2 = OpenOptions(protocol_version=2)


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
    store = CheckpointStore.open(backend_factory(), "run", identity=IDENT, options=V2)
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

    store = CheckpointStore.open(backend_factory(), "run", identity=IDENT, options=V2)
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
        saved, ref = read_with_fallback(reader, forged, objects=live)
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
    store = CheckpointStore.open(b, "run", identity=IDENT, options=V2)
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


# ------------------------------------------------- DCP metadata: strict, bounded, every field checked


def _dcp_doc() -> dict[str, Any]:
    """A genuine metadata document (two tensors, one of them in two chunks, one bytes entry)."""
    import json

    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ckptstore.distributed.dcp.metadata import ItemInfo, encode_metadata

    md = Metadata(state_dict_metadata={
        "w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]),
                                   [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
                                    ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3]))]),
        "b": TensorStorageMetadata(TensorProperties(dtype=torch.int64), torch.Size([5]),
                                   [ChunkStorageMetadata(torch.Size([0]), torch.Size([5]))]),
        "o": BytesStorageMetadata(),
    }, planner_data={"w": ("m", "w")}, version="1.0.0")
    items = {
        MetadataIndex("w", [0, 0]): ItemInfo("dcp/r0.bin", 0, 24, "a" * 64, "float32", (2, 3)),
        MetadataIndex("w", [2, 0]): ItemInfo("dcp/r0.bin", 24, 24, "b" * 64, "float32", (2, 3)),
        MetadataIndex("b", [0]): ItemInfo("dcp/r0.bin", 48, 40, "c" * 64, "int64", (5,)),
        MetadataIndex("o"): ItemInfo("dcp/r0.bin", 88, 7, "d" * 64),
    }
    doc: dict[str, Any] = json.loads(encode_metadata(md, items))
    return doc


def _item(doc: dict[str, Any], fqn: str) -> dict[str, Any]:
    return next(i for i in doc["items"] if i["index"]["fqn"] == fqn)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        *head, last = path.split(".")
        x: Any = doc
        for k in head:
            x = x[int(k)] if isinstance(x, list) else x[k]
        x[int(last) if isinstance(x, list) else last] = value
    return mutate


HOSTILE_METADATA: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("negative-size", _set("state_dict_metadata.w.size", [-4, 3]), r"state_dict_metadata\['w'\]\.size\[0\]"),
    ("negative-chunk", _set("state_dict_metadata.w.chunks.1.offsets", [-2, 0]), r"chunks\[1\]\.offsets\[0\]"),
    ("bool-size", _set("state_dict_metadata.b.size", [True]), r"state_dict_metadata\['b'\]\.size\[0\]"),
    ("chunk-rank", _set("state_dict_metadata.b.chunks.0.sizes", [5, 1]), r"2 entries for a tensor of 1 dimensions"),
    ("gap", _set("state_dict_metadata.w.size", [6, 3]), r"cover 12 of the tensor's 18 elements"),
    ("overlap", _set("state_dict_metadata.w.chunks.1.offsets", [1, 0]), r"overlaps another chunk"),
    ("outside", _set("state_dict_metadata.w.chunks.1.offsets", [3, 0]), r"spans \[3, 5\) of dimension 0"),
    ("no-item", lambda d: d["items"].remove(_item(d, "o")), r"have no stored item.*left unloaded"),
    ("stray-item", _set("items.0.index.fqn", "ghost"), r"belongs to no tensor chunk"),
    ("item-shape", lambda d: _item(d, "b").update(shape=[4], length=32), r"holds a int64 \[4\], the chunk is int64 \[5\]"),
    ("item-length", lambda d: _item(d, "b").update(length=41), r"41 bytes for a int64 tensor of shape \[5\]"),
    ("dtype", _set("state_dict_metadata.b.dtype", "os.system"), r"unknown dtype 'os.system'"),
    ("layout", _set("state_dict_metadata.b.layout", "jagged"), r"unknown layout"),
    ("type", _set("state_dict_metadata.o.type", "pickle"), r"unknown item type 'pickle'"),
    ("unknown-field", _set("state_dict_metadata.b.evil", 1), r"unknown \['evil'\]"),
    ("missing-field", lambda d: d["state_dict_metadata"]["b"].pop("requires_grad"), r"missing \['requires_grad'\]"),
    ("transform", lambda d: _item(d, "b").update(transforms=["zstd"]), r"not a NAME/VERSION descriptor"),
    ("digest", lambda d: _item(d, "b").update(blake3="zz"), r"blake3: expected 64 lowercase hex"),
    ("tuple-tag", _set("planner_data.w", {"__tuple__": 3}), r"planner_data\['w'\]: a tuple tag"),
]


@pytest.mark.parametrize("mutate,match", [(m, r) for _, m, r in HOSTILE_METADATA],
                         ids=[n for n, _, _ in HOSTILE_METADATA])
def test_hostile_dcp_metadata_fields_are_corruption_naming_the_field(
    mutate: Callable[[dict[str, Any]], None], match: str,
) -> None:
    import json

    from ckptstore.distributed.dcp.metadata import decode_metadata

    doc = _dcp_doc()
    decode_metadata(json.dumps(doc).encode(), "genuine")  # the unmutated document decodes
    mutate(doc)
    with pytest.raises(CorruptionError, match=match):
        decode_metadata(json.dumps(doc).encode(), "here")


@pytest.mark.parametrize("data,match", [
    (b'{"format":"ckptstore.dcp/1","planner_data":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "not valid JSON|deeper"),
    (b'{"format":"ckptstore.dcp/1","format":"ckptstore.dcp/1"}', "duplicate key"),
    (b'{"format":"ckptstore.dcp/1","planner_data":NaN}', "not valid JSON"),
    (b'{"format":"ckptstore.dcp/1","version":1' + b"0" * 5000 + b"}", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[]", "not a ckptstore.dcp/1 document"),
])
def test_dcp_metadata_is_decoded_by_the_strict_bounded_decoder(data: bytes, match: str) -> None:
    from ckptstore.distributed.dcp.metadata import decode_metadata

    with pytest.raises(CorruptionError, match=match):
        decode_metadata(data, "here")


def test_chunk_layouts_of_real_shardings_tile() -> None:
    """Row, column and grid shardings, uneven shards and empty tensors are accepted; a missing cell is not."""
    from ckptstore.distributed.dcp.metadata import MAX_TILING_CELLS, check_tiling

    check_tiling("rows", (10, 4), [((0, 0), (3, 4)), ((3, 0), (3, 4)), ((6, 0), (4, 4))])
    check_tiling("cols", (4, 4096), [((0, i * 4), (4, 4)) for i in range(1024)])
    check_tiling("grid", (6, 6), [((r, c), (2, 3)) for r in (0, 2, 4) for c in (0, 3)])
    check_tiling("scalar", (), [((), ())])
    check_tiling("empty", (0, 5), [((0, 0), (0, 5))])
    hole = [((r, c), (2, 3)) for r in (0, 2, 4) for c in (0, 3)][:-1] + [((4, 3), (1, 3))]
    with pytest.raises(Exception, match="cover 33 of the tensor's 36 elements"):
        check_tiling("hole", (6, 6), hole)
    with pytest.raises(Exception, match="overlaps another chunk"):  # 36 elements counted, one cell twice
        check_tiling("twice", (6, 6), [*hole, ((3, 3), (1, 3))])
    assert MAX_TILING_CELLS >= 1 << 20


def _zlib_extension(bomb: bytes | None = None) -> Any:
    """A real stream transform (zlib; zstandard is not installed here) whose
    writer, with ``bomb``, stores that stream instead of the data (a hostile
    writer: the record then digests the bomb, so only the reader's bound stops it)."""
    import io
    import zlib

    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class Zlib(StreamTransformExtension):
        @staticmethod
        def registry_name() -> str:
            return "test.zlib"

        @staticmethod
        def from_descriptor(version: str) -> Zlib:
            if version != "1":
                raise ValueError(f"unknown version {version}")
            return Zlib()

        def get_descriptor(self) -> str:
            return "test.zlib/1"

        def transform_to(self, output: Any) -> Any:
            class Writer(io.RawIOBase):
                def __init__(self) -> None:
                    self.c = zlib.compressobj(9)

                def writable(self) -> bool:
                    return True

                def write(self, b: Any) -> int:
                    if bomb is None:
                        output.write(self.c.compress(bytes(b)))
                    return len(memoryview(b))

                def close(self) -> None:
                    if not self.closed:
                        output.write(self.c.flush() if bomb is None else bomb)
                        output.close()
                    super().close()

            return Writer()

        def transform_from(self, input: Any) -> Any:
            class Reader(io.RawIOBase):
                def __init__(self) -> None:
                    self.d = zlib.decompressobj()

                def readable(self) -> bool:
                    return True

                def readinto(self, b: Any) -> int:
                    while True:
                        data = self.d.unconsumed_tail or input.read(1 << 16)
                        if not data:
                            return 0
                        out = self.d.decompress(data, len(b))
                        if out:
                            b[: len(out)] = out
                            return len(out)

            return Reader()

    return Zlib()


def _zlib_bomb(size: int) -> bytes:
    """A zlib stream of ``size`` zero bytes (about a thousandth of that stored)."""
    import zlib

    c = zlib.compressobj(9)
    block = bytes(1 << 20)
    return b"".join(c.compress(block) for _ in range(size >> 20)) + c.flush()


def _dcp_save(store: CheckpointStore, step: int, seed: int, extensions: Any = None) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from ckptstore.distributed.dcp import StoreWriter

    g = torch.Generator().manual_seed(seed)
    sd = {"t": torch.randn(1000, generator=g), "w": torch.randn(4, 3, generator=g)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=StoreWriter(store, step=step, _extensions=extensions), no_dist=True)
    return sd


def _dcp_load(store: CheckpointStore, step: int, registry: Any = None) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from ckptstore.distributed.dcp import StoreReader

    target = {"t": torch.zeros(1000), "w": torch.zeros(4, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=StoreReader(store, store.get_save(step), _extension_registry=registry),
                 no_dist=True)
    return target


def _forge_metadata(backend: Backend, store: CheckpointStore, step: int, data: bytes) -> None:
    """Replace a save's DCP metadata, with a commit record that digests the new bytes."""
    import blake3

    from ckptstore.distributed.dcp import METADATA_COMPONENT

    rec = store.get_save(step).record
    RawAccess(backend).set(P.component_key("run", rec.save_id, METADATA_COMPONENT), data)
    comps = dict(rec.components)
    comps[METADATA_COMPONENT] = dataclasses.replace(comps[METADATA_COMPONENT], size=len(data),
                                                    blake3=blake3.blake3(data).hexdigest())
    forged = dataclasses.replace(rec, components=comps, stored_digest="", body_digest="")
    RawAccess(backend).set(P.LATEST_LAYOUT.commit_key("run", rec.step, rec.attempt), forged.encode())


def _mutated_metadata(store: CheckpointStore, step: int, mutate: Callable[[dict[str, Any]], None]) -> bytes:
    import json

    from ckptstore.distributed.dcp import METADATA_COMPONENT

    doc = json.loads(store.read(store.get_save(step), METADATA_COMPONENT))
    mutate(doc)
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _shrink_chunk(doc: dict[str, Any]) -> None:
    doc["state_dict_metadata"]["t"]["size"] = [2000]  # one chunk of 1000 left: half the tensor never loaded


def _drop_item(doc: dict[str, Any]) -> None:
    doc["items"] = [i for i in doc["items"] if i["index"]["fqn"] != "w"]


def _overlap(doc: dict[str, Any]) -> None:
    t = doc["state_dict_metadata"]["t"]
    t["chunks"] = [{"offsets": [0], "sizes": [600]}, {"offsets": [400], "sizes": [400]}]


STORE_CASES: list[tuple[str, Callable[[dict[str, Any]], None] | bytes, str]] = [
    ("deep", b'{"format":"ckptstore.dcp/1","planner_data":' + b"[" * 50_000 + b"]" * 50_000 + b"}", "not valid JSON|deeper"),
    ("negative", lambda d: d["state_dict_metadata"]["w"].update(size=[-4, 3]), r"\['w'\]\.size\[0\]"),
    ("gap", _shrink_chunk, r"\['t'\]\.chunks: cover 1000 of the tensor's 2000 elements"),
    ("overlap", _overlap, r"\['t'\]\.chunks\[1\]: overlaps another chunk"),
    ("unloaded", _drop_item, r"\['w'\]: 1 chunk\(s\) have no stored item"),
    ("outside", lambda d: d["items"][0].update(offset=1 << 40), r"lie outside"),
]


@pytest.mark.backends("memory", "local", "moto")
@pytest.mark.parametrize("case", [c for c, _, _ in STORE_CASES])
def test_planted_dcp_metadata_fails_closed_and_the_previous_save_loads_bit_for_bit(
    case: str, backend_factory: Callable[[], Backend],
) -> None:
    import torch

    _, mutation, match = next(c for c in STORE_CASES if c[0] == case)
    store = CheckpointStore.open(backend_factory(), "run", identity=IDENT, options=V2)
    first = _dcp_save(store, 1, seed=1)
    _dcp_save(store, 2, seed=2)
    data = mutation if isinstance(mutation, bytes) else _mutated_metadata(store, 2, mutation)
    _forge_metadata(backend_factory(), store, 2, data)

    import re

    from ckptstore.distributed.dcp import StoreReader

    reader = CheckpointStore.open(backend_factory(), "run", mode="r")
    with pytest.raises(CorruptionError, match=match):  # the reader's own answer
        StoreReader(reader, reader.get_save(2)).read_metadata()
    with pytest.raises(BaseException) as ei:  # DCP folds it into its own exception, message kept
        _dcp_load(reader, 2)
    assert re.search(match, str(ei.value)), str(ei.value)[:2000]
    back = _dcp_load(reader, 1)
    assert all(torch.equal(back[k].view(torch.int32), first[k].view(torch.int32)) for k in first)


@pytest.mark.backends("memory", "local", "moto")
def test_dcp_stream_transforms_are_known_and_bounded_by_the_declared_size(
    backend_factory: Callable[[], Backend],
) -> None:
    import tracemalloc

    import torch
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    registry = ExtensionRegistry()
    registry.register(type(_zlib_extension()))
    store = CheckpointStore.open(backend_factory(), "run", identity=IDENT)
    first = _dcp_save(store, 1, seed=1, extensions=[_zlib_extension()])
    back = _dcp_load(store, 1, registry)  # a genuine transform round-trips
    assert all(torch.equal(back[k], first[k]) for k in first)

    # a transform this reader does not know: refused when the metadata is read, naming the field
    from ckptstore.distributed.dcp import StoreReader

    with pytest.raises(CorruptionError, match=r"\.transforms: \['test.zlib/1'\] cannot be undone"):
        StoreReader(store, store.get_save(1)).read_metadata()
    with pytest.raises(BaseException) as ei:
        _dcp_load(store, 1)
    assert ".transforms: ['test.zlib/1'] cannot be undone" in str(ei.value)

    # a stream that inflates past its declared size (256 MiB for a 4,000-byte tensor): bounded
    bomb = _zlib_bomb(256 << 20)
    _dcp_save(store, 2, seed=2, extensions=[_zlib_extension(bomb)])
    tracemalloc.start()
    try:
        with pytest.raises(BaseException) as ei:
            _dcp_load(store, 2, registry)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "CorruptionError" in str(ei.value) and "holds more than the" in str(ei.value), str(ei.value)[:2000]
    assert peak < 64 << 20, peak
    back = _dcp_load(store, 1, registry)
    assert all(torch.equal(back[k], first[k]) for k in first)


@pytest.mark.backends("local")
def test_the_cli_reports_a_huge_claim_and_keeps_the_last_good_save(
    backend_factory: Callable[[], Backend], capsys: pytest.CaptureFixture[str],
) -> None:
    from ckptstore.backends.local import LocalBackend
    from ckptstore.cli.commands import main as cli_main

    b = backend_factory()
    assert isinstance(b, LocalBackend)
    store = CheckpointStore.open(b, "run", identity=IDENT)
    _save(store, 1, b"good weights")
    _forge_sizes(b, _save(store, 2, b"x" * 100), {"model": TIB})
    capsys.readouterr()
    assert cli_main(["verify", b.root, "run", "--step", "2"]) == 1
    out = capsys.readouterr()
    assert "1099511627776" in out.out + out.err and "Traceback" not in out.err
    assert cli_main(["latest", b.root, "run", "--deep", "--json"]) == 0
    assert '"step": 1' in capsys.readouterr().out
    assert cli_main(["ls", b.root, "run"]) == 0
