"""Packing what changes (PROTOCOL.md §9.2): after a probe save has seen which
buffers of a component changed, the saves that follow pack those buffers into
large pieces (fewer files, each byte hashed once) and keep cutting the others
alone, so that what did not change is still skipped. A prediction only moves
cut points: every save reads back exactly, whatever changed."""

from __future__ import annotations

import os

import pytest

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.core import pieces as core_pieces
from ckptstore.protocol.pieces import CHANGING_PIECE_BYTES, PACK_BYTES
from tests.incremental.common import open_store

MiB = 1 << 20
#: a component of six tensors of 1.5 MiB after a small header: one piece each when cut alone
SIZES = [4096] + [3 * MiB // 2] * 6


class Run:
    """One writer's saves of a component whose changing buffers the test chooses per step."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.stable = {i: bytes([i + 7]) * n for i, n in enumerate(SIZES)}
        self.step = 0

    def save(self, changing: set[int]) -> tuple[int, int, bytes]:
        """(pieces the save wrote, bytes it wrote, the component's bytes)."""
        self.step += 1
        bufs = [os.urandom(n) if i in changing else self.stable[i] for i, n in enumerate(SIZES)]
        with self.store.save(self.step) as s:
            s.put("model", [memoryview(b) for b in bufs])
        ref = s.ref
        assert ref is not None
        data = b"".join(bufs)
        assert self.store.read(ref, "model") == data  # every save reads back exactly
        pieces = ref.components["model"].pieces or ()
        written = [p for p in pieces if p.holder == ref.save_id]
        return len(written), ref.record.bytes_written(), data


@pytest.mark.backends("memory", "local", "seaweedfs")
def test_changing_buffers_are_packed_after_a_probe_and_stable_ones_still_skipped(backend: Backend) -> None:
    run = Run(open_store(backend))
    changing = {2, 3, 4, 5}  # four neighbours change every save; the header and tensors 1 and 6 never do
    first = run.save(changing)
    probe = run.save(changing)  # informed probe: learns which buffers changed
    assert first[0] == len(SIZES)  # a run's first save: one piece per buffer (the header's alone: a large tensor follows)
    assert probe[0] == len(changing)  # one piece per changed tensor, the rest skipped
    packed = run.save(changing)
    # the four changing tensors (6 MiB) in one piece; nothing else written
    assert packed[0] == 1 and packed[1] == len(changing) * SIZES[1]
    again = run.save(changing)
    assert again[0] == 1 and again[1] == packed[1]
    assert run.store.verify(run.store.latest_complete(), deep=True).ok  # type: ignore[arg-type]


@pytest.mark.backends("memory", "local")
def test_a_packed_buffer_that_stops_changing_is_found_again_at_the_next_probe(backend: Backend,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_pieces, "PROBE_EVERY", 3)
    run = Run(open_store(backend))
    for _ in range(3):  # a probe that teaches nothing (nothing known), one that learns {1, 2}, one packed
        run.save({1, 2})
    # buffer 2 stops changing: until the probes it is still packed with buffer 1 (bytes, not a wrong restore)
    n, written, _ = run.save({1})
    assert n == 1 and written == 2 * SIZES[1]
    # the first probe gives buffer 2 a piece of its own again (it had none: it was packed) ...
    n, written, _ = run.save({1})
    assert n == 2 and written == 2 * SIZES[1]
    # ... the second finds it unchanged, and from then on only buffer 1 is written
    n, written, _ = run.save({1})
    assert n == 1 and written == SIZES[1]
    n, written, _ = run.save({1})
    assert n == 1 and written == SIZES[1]


@pytest.mark.backends("memory", "local")
def test_a_buffer_that_starts_changing_gets_its_own_piece_until_the_probe(backend: Backend,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_pieces, "PROBE_EVERY", 3)
    run = Run(open_store(backend))
    for _ in range(3):
        run.save({1})
    n, written, _ = run.save({1, 4})  # 4 was stable: cut alone, written alone, next to 1's packed piece
    assert n == 2 and written == 2 * SIZES[1]
    for _ in range(2):  # the two probes: each alone
        n, written, _ = run.save({1, 4})
        assert n == 2 and written == 2 * SIZES[1]
    n, written, _ = run.save({1, 3, 4})  # 1 and 4 packed (not neighbours: one piece each), 3 alone
    assert n == 3 and written == 3 * SIZES[1]


@pytest.mark.backends("memory", "local")
def test_another_layout_is_cut_alone_and_reads_back(backend: Backend) -> None:
    store = open_store(backend)
    run = Run(store)
    for _ in range(3):
        run.save({1, 2, 3})
    bufs = [os.urandom(n) for n in [10, 5 * MiB, 3 * MiB]]  # another layout: the prediction is dropped
    with store.save(99) as s:
        s.put("model", [memoryview(b) for b in bufs])
    ref = s.ref
    assert ref is not None and store.read(ref, "model") == b"".join(bufs)


@pytest.mark.backends("memory", "local")
def test_a_restarted_writer_probes_before_it_packs(backend: Backend) -> None:
    store = open_store(backend)
    run = Run(store)
    for _ in range(3):
        run.save({1, 2})
    store.close()
    again = Run(open_store(backend))
    again.step = run.step
    again.stable = run.stable
    # the resume point's record may be packed: two probes (each alone), then packed
    for _ in range(2):
        n, written, _ = again.save({1, 2})
        assert n == 2 and written == 2 * SIZES[1]
    n, written, _ = again.save({1, 2})
    assert n == 1 and written == 2 * SIZES[1]


def test_a_large_changing_run_is_cut_at_the_packed_piece_size() -> None:
    from ckptstore.protocol.pieces import cut_planned

    bufs = [memoryview(bytes(n)) for n in [100, CHANGING_PIECE_BYTES + 5, 3, 2 * PACK_BYTES]]
    got = list(cut_planned(bufs, {1, 2}))
    sizes = [sum(len(v) for v in views) for views, _ in got]
    assert sizes == [100, CHANGING_PIECE_BYTES, 8, 2 * PACK_BYTES]  # 5 + 3 bytes of the run, then a stable buffer
    assert [sorted(i) for _, i in got] == [[0], [1], [1, 2], [3]]
    assert all(isinstance(v, memoryview) for views, _ in got for v in views)


def test_a_full_fine_tuning_checkpointer_save_writes_few_pieces_and_resumes_exactly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every tensor changes every step (Adam on every layer): after the probes
    the model's and the optimizer's tensors are written in a few large pieces,
    not one per tensor, and the run resumes bit-exact from such a save."""
    import torch

    from ckptstore import OpenOptions
    from ckptstore.torch import Checkpointer
    from tests.incremental.common import IDENT, RUN, long_timing

    def objects(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 8 x (1 MiB + 2 KiB)
        return m, torch.optim.Adam(m.parameters(), lr=1e-3)

    def step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
        o.zero_grad()
        m(torch.randn(4, 512)).pow(2).mean().backward()
        o.step()

    opts = OpenOptions(protocol_version=3, pieces=long_timing())
    m, o = objects(0)
    store = CheckpointStore.open(tmp_path, RUN, identity=IDENT, options=opts)
    ck = Checkpointer(store, {"model": m, "optimizer": o}, async_save=False, handle_signals=False)
    counts = []
    for s in range(1, 5):
        step(m, o)
        ref = ck.save(s)
        assert ref is not None
        counts.append(sum(p.holder == ref.save_id for c in ref.record.components.values() for p in c.pieces or ()))
    want = {k: v.clone() for k, v in m.state_dict().items()}
    want_opt = [t.clone() for st in o.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    ck.close()
    store.close()
    assert counts[1] >= 3 * 8  # a probe: a piece per weight and per moment of a weight (the biases packed)
    assert counts[2] <= 4 and counts[3] <= 4, counts  # packed: the model's tensors, the optimizer's, rng, state
    m2, o2 = objects(1)
    with Checkpointer.open(tmp_path, RUN, IDENT, {"model": m2, "optimizer": o2}, async_save=False,
                           handle_signals=False, options=opts) as ck2:
        assert ck2.resume() == 5
    assert all(torch.equal(want[k], v) for k, v in m2.state_dict().items())
    got_opt = [t for st in o2.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    assert len(got_opt) == len(want_opt) and all(torch.equal(a, b) for a, b in zip(want_opt, got_opt, strict=True))
