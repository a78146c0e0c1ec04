"""The restore's scatter read (issue 32 item 2): a component read straight
into one buffer per tensor, hashed as it is read, handed out only after its
digest matched.

``CheckpointStore.read_into`` with a list of buffers fills them in order as
one; the torch restore shapes the tensors from a header it read before the
verified read and trusts that header only once the verified bytes repeat it.
A damaged save is never applied to the live objects: the restore raises or
falls back, and the live tensors keep their values.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore, CorruptionError, InvalidInputError, OpenOptions
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.core.hashing import SMALL_SEGMENT, Scatter
from ckptstore.torch import Checkpointer
from ckptstore.torch.tensor_read import read_tensors
from tests.helpers import IDENT
from tests.incremental.common import stored_at

SIZES = [3, 0, SMALL_SEGMENT + 7, 1, 100, 2 * SMALL_SEGMENT, 5, SMALL_SEGMENT - 1, 64]
#: test_scatter_read_into_fills_every_buffer_or_refuses damages and reads (RunIO) version 2's whole-component
#: file; version 3's pieces: test_scatter_read_of_a_pieced_component
WHOLE_FILES = 2


def _blob(n: int, seed: int = 1) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _buffers(sizes: list[int]) -> list[bytearray]:
    return [bytearray(n) for n in sizes]


def test_spans_tile_the_buffer_and_keep_large_segments_alone() -> None:
    views = [memoryview(b) for b in _buffers(SIZES)]
    sc = Scatter(views)
    for chunk in (64 << 10, SMALL_SEGMENT, 8 << 20):
        spans = sc.spans(chunk)
        assert spans[0][0] == 0 and spans[-1][1] == len(sc) == sum(SIZES)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert all(end - start <= chunk for start, end in spans)
        for start, end in spans:  # a span either lies in one large segment or holds small ones only
            segs = sc.segments(start, end)
            assert len(segs) == 1 or all(len(v) < min(SMALL_SEGMENT, chunk) for v in segs)
    one = Scatter([memoryview(bytearray(10 * 1024))])
    assert one.spans(4096) == [(0, 4096), (4096, 8192), (8192, 10240)]  # one view: the plain grid


@pytest.mark.parametrize("damage", ["none", "flip-small", "flip-large", "short", "grown"])
@pytest.mark.backends("memory", "local", "moto")
def test_scatter_read_into_fills_every_buffer_or_refuses(backend: Backend, damage: str) -> None:
    st = CheckpointStore.open(backend, "r", identity=IDENT, options=OpenOptions(protocol_version=WHOLE_FILES))
    payload = _blob(sum(SIZES))
    with st.save(1) as s:
        s.put("blob", payload)
    ref = s.ref
    assert ref is not None
    key = P.component_key("r", ref.save_id, "blob")
    at = {"flip-small": 2, "flip-large": SIZES[0] + SMALL_SEGMENT // 2}.get(damage)
    bad = {"short": payload[:-10], "grown": payload + b"x"}.get(damage)
    if at is not None:
        bad = payload[:at] + bytes([payload[at] ^ 1]) + payload[at + 1 :]
    if bad is not None:
        backend.put(key, [bad])
    bufs = _buffers(SIZES)
    if damage == "none":
        st.read_into(ref, "blob", bufs)
        assert b"".join(bufs) == payload
        io = st._io  # the I/O floor with a small chunk: many spans, in flight at once on object stores
        bufs = _buffers(SIZES)
        io.read_verified_into(key, ref.components["blob"], "blob", Scatter([memoryview(b) for b in bufs]), chunk=64 << 10)
        assert b"".join(bufs) == payload
    else:
        with pytest.raises(CorruptionError):
            st.read_into(ref, "blob", bufs)


def test_scatter_read_into_refuses_bad_lists(tmp_path: Any) -> None:
    st = CheckpointStore.open(tmp_path, "r", identity=IDENT)
    with st.save(1) as s:
        s.put("blob", b"x" * 100)
    ref = s.ref
    assert ref is not None
    with pytest.raises(InvalidInputError, match="2 buffers of 99 bytes"):
        st.read_into(ref, "blob", [bytearray(50), bytearray(49)])
    with pytest.raises(InvalidInputError, match="read-only"):
        st.read_into(ref, "blob", [bytearray(50), b"x" * 50])


def test_scatter_read_of_a_pieced_component(tmp_path: Any) -> None:
    """Version 3: pieces and tensors cut at different places; small pieces
    span several buffers, large buffers span several pieces."""
    from ckptstore.protocol.layout import piece_key
    from ckptstore.protocol.pieces import PIECE_BYTES

    st = CheckpointStore.open(tmp_path, "r", identity=IDENT, protocol_version=3)
    sizes = [40, PIECE_BYTES + 3, 7, 300_000, 5, PIECE_BYTES // 2]
    payload = _blob(sum(sizes), seed=3)
    with st.save(1) as s:
        s.put("blob", payload)
    ref = s.ref
    assert ref is not None and ref.components["blob"].pieces
    bufs = _buffers(sizes)
    st.read_into(ref, "blob", bufs)
    assert b"".join(bufs) == payload
    piece = ref.components["blob"].pieces[0]
    key = piece_key("r", piece.holder, piece.digest)
    raw = bytearray(tmp_path.joinpath(key).read_bytes())
    raw[1] ^= 1
    tmp_path.joinpath(key).write_bytes(bytes(raw))
    with pytest.raises(CorruptionError):
        st.read_into(ref, "blob", _buffers(sizes))


# ------------------------------------------------------------------ the torch restore


def _objects(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(600, 700), torch.nn.LayerNorm(700), torch.nn.Linear(700, 3))
    m.register_buffer("flags", torch.tensor([True, False, True]))
    m.half_w = torch.nn.Parameter(torch.randn(3, dtype=torch.float16))  # an odd-sized tensor before others
    return {"model": m, "optimizer": torch.optim.Adam(m.parameters(), lr=1e-3)}


def _step(objs: dict[str, Any]) -> None:
    m, o = objs["model"], objs["optimizer"]
    o.zero_grad()
    (m(torch.randn(4, 600)).sum() + m.half_w.float().sum()).backward()
    o.step()


def _snapshot(objs: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in objs["model"].state_dict().items()}
    for i, st in objs["optimizer"].state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in st.items()})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("version", [2, 3])
def test_restore_is_bit_exact_through_the_scatter_read(tmp_path: Any, version: int) -> None:
    objs = _objects(1)
    _step(objs)
    st = CheckpointStore.open(tmp_path, "r", identity=IDENT, protocol_version=version)
    with Checkpointer(st, objs, async_save=False, handle_signals=False) as ck:
        ck.save(1)
    want = _snapshot(objs)
    live = _objects(2)
    _step(live)
    with Checkpointer.open(tmp_path, "r", IDENT, live, async_save=False, handle_signals=False) as ck:
        assert ck.resume() == 2
    assert _same(_snapshot(live), want)
    for t in _snapshot(live).values():  # each tensor its own memory, aligned: nothing shares a read buffer
        assert t.storage_offset() == 0



def test_the_restore_allocates_its_tensors_on_the_calling_thread(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor a restore hands out is allocated on the thread that called
    it, not in the read pool: glibc's per-thread arenas reuse the memory the
    caller freed only for that thread's allocations (a pool-allocated restore
    paid page faults for every byte: 137 against 104 ms for 240 MiB in a fresh
    process). The reads themselves still run in the pool."""
    import threading

    from ckptstore.torch import tensor_read

    objs = _objects(1)
    _step(objs)
    st = CheckpointStore.open(tmp_path, "r", identity=IDENT)
    with Checkpointer(st, objs, async_save=False, handle_signals=False) as ck:
        ck.save(1)
    ref = st.latest_complete()
    assert ref is not None
    real_empty, real_read_into = torch.empty, st.read_into
    allocated: list[str] = []
    read: list[str] = []

    def empty(*a: Any, **k: Any) -> torch.Tensor:
        allocated.append(threading.current_thread().name)
        return real_empty(*a, **k)

    def read_into(*a: Any, **k: Any) -> None:
        read.append(threading.current_thread().name)
        real_read_into(*a, **k)

    monkeypatch.setattr(tensor_read.torch, "empty", empty)
    monkeypatch.setattr(st, "read_into", read_into)
    comps = {name: f"{name}.safetensors" for name in ("model", "optimizer", "rng")}
    got = read_tensors(st, ref, comps)
    assert set(got) == set(comps) and all(got.values())
    me = threading.current_thread().name
    assert allocated and set(allocated) == {me}
    assert len(read) == len(comps) and all(n.startswith("ckptstore-read") for n in read)


def _flip(path: Any, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x20
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("where", ["header", "data"])
def test_a_damaged_only_save_raises_and_leaves_the_live_tensors_untouched(tmp_path: Any, where: str) -> None:
    """No older save to fall back to: the restore raises CorruptionError and
    no live tensor changed (a flip in the header, which shapes the read, or
    in the data, found only by the digest)."""
    objs = _objects(1)
    st = CheckpointStore.open(tmp_path, "r", identity=IDENT)
    with Checkpointer(st, objs, async_save=False, handle_signals=False) as ck:
        ref = ck.save(1)
    assert ref is not None
    key, at = stored_at("r", ref, "model.safetensors", 20 if where == "header" else -7)  # a piece on version 3
    _flip(tmp_path / key, at)
    live = _objects(2)
    _step(live)
    before = _snapshot(live)
    st2 = CheckpointStore.open(tmp_path, "r", identity=IDENT, resume_verify="cheap")
    with pytest.raises(CorruptionError), Checkpointer(st2, live, async_save=False, handle_signals=False) as ck:
        ck.resume()
    assert _same(_snapshot(live), before)


class _HeaderLies:
    """A store whose unverified header read returns other bytes than the
    component holds (a tier's damaged copy, a file rewritten between the two
    reads): the verified bytes must decide."""

    def __init__(self, real: CheckpointStore, header: bytes) -> None:
        self.real, self.header = real, header

    def component(self, ref: Any, name: str) -> Any:
        return self.real.component(ref, name)

    def read_into(self, ref: Any, name: str, out: Any) -> None:
        self.real.read_into(ref, name, out)

    def read_range(self, ref: Any, name: str, start: int, end: int) -> bytes:
        return self.header[start:end]


def _header_of(real: bytes, swap: bool) -> bytes:
    """``real``'s header, with the shapes of its first two entries swapped (a valid, different layout)."""
    n = struct.unpack("<Q", real[:8])[0]
    h = json.loads(real[8 : 8 + n])
    if swap:
        a, b = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])[:2]
        h[a]["shape"], h[b]["shape"] = h[b]["shape"], h[a]["shape"]
    hb = json.dumps(h).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    return struct.pack("<Q", len(hb)) + hb


@pytest.mark.parametrize("lie", ["other-layout", "garbage", "too-long"])
def test_the_verified_header_decides_the_tensors(tmp_path: Any, lie: str) -> None:
    torch.manual_seed(0)
    tensors = {"a": torch.randn(6, 4), "b": torch.randn(4, 6), "c": torch.arange(5)}
    st = CheckpointStore.open(tmp_path, "r", identity=IDENT)
    from ckptstore.torch.safetensors_io import safetensors_stream

    _n, chunks = safetensors_stream(tensors)
    with st.save(1) as s:
        s.put("e.safetensors", list(chunks))
    ref = s.ref
    assert ref is not None
    real = st.read(ref, "e.safetensors")
    header = {"other-layout": _header_of(real, swap=True), "garbage": b"\xff" * 64,
              "too-long": struct.pack("<Q", 1 << 40)}[lie]
    got = read_tensors(_HeaderLies(st, header), ref, {"e": "e.safetensors"})["e"]  # type: ignore[arg-type]
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], tensors[k]) and got[k].shape == tensors[k].shape for k in tensors)
