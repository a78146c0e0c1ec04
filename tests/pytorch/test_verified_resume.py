"""One-pass verified resume (issue 14 item 1).

``CheckpointStore.read_into`` reads a component straight into caller memory,
hashing while it reads; the torch adapter's restore reads every tensor
component that way and applies nothing until every component verified. These
tests hold it to the round-1 promise: a bit flip never becomes a resume point,
and a resume that meets one applies nothing from the corrupt save.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore, CorruptionError, InvalidInputError, OpenOptions
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.torch import Checkpointer
from ckptstore.torch.safetensors_io import MIN_VIEW_BYTES
from tests.helpers import IDENT
from tests.incremental.common import stored_at, stored_objects

backend_kinds = ["memory", "local", "seaweedfs", "moto", "fakegcs"]
#: two tests are about version 2's whole-component files: the chunked read of one file (RunIO), and a
#: flip in the second of two identical saves (on version 3 both saves share that piece; a damaged piece
#: on version 3: tests/incremental/test_format.py, test_damaged_pieces.py)
WHOLE_FILES = 2


def _raw_put(b: Backend, key: str, data: bytes) -> None:
    b.put(key, [data])


# ------------------------------------------------------------------ read_into


def test_read_into_fills_the_buffer_with_verified_bytes(backend: Backend) -> None:
    st = CheckpointStore.open(backend, "r", identity=IDENT)
    payload = np.random.default_rng(1).integers(0, 256, 3 * (1 << 20) + 5, dtype=np.uint8).tobytes()
    with st.save(1) as s:
        s.put("blob", payload)
    ref = s.ref
    assert ref is not None
    out = bytearray(len(payload))
    st.read_into(ref, "blob", out)
    assert bytes(out) == payload
    arr = np.empty(len(payload), dtype=np.uint8)
    st.read_into(ref, "blob", arr)  # any writable buffer: numpy, tensor.numpy()
    assert arr.tobytes() == payload


def test_read_into_refuses_bad_buffers(backend: Backend) -> None:
    st = CheckpointStore.open(backend, "r", identity=IDENT)
    with st.save(1) as s:
        s.put("blob", b"x" * 100)
    ref = s.ref
    assert ref is not None
    with pytest.raises(InvalidInputError, match="99 bytes"):
        st.read_into(ref, "blob", bytearray(99))
    with pytest.raises(InvalidInputError, match="read-only"):
        st.read_into(ref, "blob", b"x" * 100)
    with pytest.raises(InvalidInputError, match="writable contiguous buffer"):
        st.read_into(ref, "blob", [0] * 100)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda raw: raw[:10] + bytes([raw[10] ^ 1]) + raw[11:], "does not match its BLAKE3"),
        (lambda raw: raw[:-1], "has 2097151 bytes"),
        (lambda raw: raw + b"!", r"has 2097152\+ bytes"),
    ],
    ids=["flipped", "short", "grown"],
)
def test_read_into_refuses_damaged_components(backend: Backend, damage, match) -> None:  # type: ignore[no-untyped-def]
    st = CheckpointStore.open(backend, "r", identity=IDENT)
    payload = bytes(range(256)) * (2 * 4096)  # 2 MiB: more than one chunk boundary on small chunk sizes
    with st.save(1) as s:
        s.put("blob", payload)
    ref = s.ref
    assert ref is not None
    ((key, _, _),) = stored_objects("r", ref, "blob")  # the whole file (version 2), its one piece (3)
    _raw_put(backend, key, damage(payload))
    with pytest.raises(CorruptionError, match=match):
        st.read_into(ref, "blob", bytearray(len(payload)))


# ------------------------------------------------------------------ torch restore


def big() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Tensors above MIN_VIEW_BYTES, so the restore hands out views of its read buffers."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8))
    assert m[0].weight.numel() * 4 >= MIN_VIEW_BYTES
    return m, torch.optim.Adam(m.parameters(), lr=1e-3)


def train(m: torch.nn.Module, o: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        o.zero_grad()
        m(torch.randn(16, 512, generator=g)).pow(2).mean().backward()
        o.step()


@pytest.mark.backends("memory", "local", "moto")
def test_resume_with_view_tensors_continues_bit_exactly(backend: Backend) -> None:
    m, o = big()
    train(m, o, 3, seed=1)
    ck = Checkpointer(CheckpointStore.open(backend, "r", identity=IDENT), {"model": m, "optimizer": o},
                      async_save=False, handle_signals=False)
    ck.save(2)
    ck.close()
    train(m, o, 2, seed=2)  # the uninterrupted run

    m2, o2 = big()
    ck2 = Checkpointer(CheckpointStore.open(backend, "r", identity=IDENT, resume_verify="cheap"),
                       {"model": m2, "optimizer": o2}, async_save=False, handle_signals=False)
    assert ck2.resume() == 3
    train(m2, o2, 2, seed=2)
    ck2.close()
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    sa, sb = o.state_dict()["state"], o2.state_dict()["state"]
    for k in sa:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[k][name], sb[k][name]), (k, name)


@pytest.mark.backends("memory", "local", "moto")
def test_a_flip_in_a_later_component_applies_nothing_from_the_corrupt_save(backend: Backend) -> None:
    """Step 1's model component is intact and its optimizer component has one
    flipped bit (same size: the cheap selection cannot see it). The restore
    reads both, finds the flip, and falls back to step 0: the live model must
    hold step 0's weights, not step 1's (which verified on their own)."""
    m, o = big()
    st = CheckpointStore.open(backend, "r", identity=IDENT)
    ck = Checkpointer(st, {"model": m, "optimizer": o}, async_save=False, handle_signals=False)
    train(m, o, 1, seed=1)
    ck.save(0)
    at0 = [p.detach().clone() for p in m.parameters()]
    train(m, o, 1, seed=2)
    bad = ck.save(1)
    ck.close()
    assert bad is not None
    key, at = stored_at("r", bad, "optimizer.safetensors", bad.components["optimizer.safetensors"].size // 2)
    raw = bytearray(backend.get(key))
    raw[at] ^= 0x10
    _raw_put(backend, key, bytes(raw))

    st2 = CheckpointStore.open(backend, "r", identity=IDENT, resume_verify="cheap")
    assert st2.resumed_from is not None and st2.resumed_from.step == 1  # chosen by sizes
    m2, o2 = big()
    ck2 = Checkpointer(st2, {"model": m2, "optimizer": o2}, async_save=False, handle_signals=False)
    with pytest.warns(RuntimeWarning, match="step 1 is corrupt; resuming from step 0"):
        assert ck2.resume() == 1
    for a, p in zip(at0, m2.parameters(), strict=True):
        assert torch.equal(a, p)
    ev = [e for e in st2.events() if e["event"] == "resume-fallback"]
    assert len(ev) == 1 and "optimizer.safetensors" in ev[0]["payload"]["reasons"][0]
    ck2.close()
    # the corrupt save is out of the run's history from now on
    sel = CheckpointStore.open(backend, "r", mode="r").latest_complete(deep=True)
    assert sel is not None and sel.step == 0


@pytest.mark.backends("local")
def test_deep_open_never_selects_the_flipped_save(backend: Backend) -> None:
    """The default open (deep) still never makes a flipped save the resume point."""
    m, o = big()
    st = CheckpointStore.open(backend, "r", identity=IDENT, options=OpenOptions(protocol_version=WHOLE_FILES))
    ck = Checkpointer(st, {"model": m, "optimizer": o}, async_save=False, handle_signals=False)
    ck.save(0)
    bad = ck.save(1)
    ck.close()
    assert bad is not None
    key = P.component_key("r", bad.save_id, "model.safetensors")
    raw = bytearray(backend.get(key))
    raw[-3] ^= 0x01
    _raw_put(backend, key, bytes(raw))
    st2 = CheckpointStore.open(backend, "r", identity=IDENT)
    assert st2.resumed_from is not None and st2.resumed_from.step == 0


@pytest.mark.parametrize("damage", ["none", "flip-middle", "short", "grown"])
def test_chunked_concurrent_read_into_verifies_in_order(backend: Backend, damage: str) -> None:
    """Many chunks, read up to the backend's read_concurrency at a time (8 on
    object stores), hashed in order: intact bytes arrive intact, and any damage
    is refused."""
    st = CheckpointStore.open(backend, "r", identity=IDENT, options=OpenOptions(protocol_version=WHOLE_FILES))
    payload = np.random.default_rng(2).integers(0, 256, (1 << 20) + 17, dtype=np.uint8).tobytes()
    with st.save(1) as s:
        s.put("blob", payload)
    ref = s.ref
    assert ref is not None
    key = P.component_key("r", ref.save_id, "blob")
    bad = {
        "none": payload,
        "flip-middle": payload[:600_000] + bytes([payload[600_000] ^ 4]) + payload[600_001:],
        "short": payload[:-100],
        "grown": payload + b"x",
    }[damage]
    if damage != "none":
        _raw_put(backend, key, bad)
    out = bytearray(len(payload))
    io = st._io
    comp = ref.components["blob"]
    if damage == "none":
        io.read_verified_into(key, comp, "blob", memoryview(out), chunk=64 << 10)
        assert bytes(out) == payload
    else:
        with pytest.raises(CorruptionError):
            io.read_verified_into(key, comp, "blob", memoryview(out), chunk=64 << 10)
