"""PyTorch adapter: no-pickle state trees, exact resume, bad input, async saves."""

from __future__ import annotations

import math
import pickle
import random

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore, InvalidInputError
from ckptstore.backends.faults import FaultyBackend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.torch import (
    Checkpointer,
    CheckpointMismatchError,
    ResumableSampler,
    flatten,
    read_state,
    restore_state,
    save_state,
    unflatten,
)
from ckptstore.torch.codec import safetensors_stream
from tests.helpers import IDENT
from tests.incremental.common import stored_objects

backend_kinds = ["memory", "local"]


def tiny(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 3))
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    s = torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
    return m, o, s


def train_steps(m, o, s, n: int) -> None:  # type: ignore[no-untyped-def]
    for _ in range(n):
        o.zero_grad()
        x = torch.randn(5, 4)
        m(x).pow(2).mean().backward()
        o.step()
        s.step()


def test_codec_roundtrip_of_awkward_trees() -> None:
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    tree = {
        "ints": {0: {"step": torch.tensor(3.0)}, 1: {}},
        "tup": (1, 2.5, "x", None, True),
        "nan": float("nan"),
        "inf": -math.inf,
        "np": np.arange(5, dtype=np.uint32),
        "tied_a": t,
        "tied_b": t,
        "empty": torch.empty(0, 7),
        "dtype": torch.float16,
        "__dunder": 1,
        "nested": [[{"a": torch.ones(2, dtype=torch.bool)}]],
    }
    fl = flatten(tree)
    assert len(fl.tensors) == 5  # the tied tensor once
    from ckptstore.torch.codec import load_safetensors, tree_from_json, tree_to_json

    size, chunks = safetensors_stream({k: v.contiguous() for k, v in fl.tensors.items()})
    raw = b"".join(bytes(c) for c in chunks)
    assert len(raw) == size
    back = unflatten(tree_from_json(tree_to_json(fl.tree)), load_safetensors(raw))
    assert torch.equal(back["tied_a"], t) and back["tied_a"].dtype == torch.bfloat16
    assert back["tup"] == (1, 2.5, "x", None, True)
    assert math.isnan(back["nan"]) and back["inf"] == -math.inf
    assert isinstance(back["np"], np.ndarray) and back["np"].dtype == np.uint32
    assert back["ints"][0]["step"].item() == 3.0 and list(back["ints"]) == [0, 1]
    assert back["empty"].shape == (0, 7) and back["dtype"] is torch.float16 and back["__dunder"] == 1


def test_safetensors_stream_is_a_real_safetensors_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from safetensors import safe_open

    ts = {"w": torch.randn(3, 4), "b": torch.arange(3)}
    _, chunks = safetensors_stream(ts)
    p = tmp_path / "x.safetensors"
    p.write_bytes(b"".join(bytes(c) for c in chunks))
    with safe_open(str(p), framework="pt") as f:
        assert sorted(f.keys()) == ["b", "w"]
        assert torch.equal(f.get_tensor("w"), ts["w"])


@pytest.mark.parametrize("bad", [object(), {1.5: 2}, lambda: 1, {"a": [complex(1, 2)]}])
def test_unrepresentable_objects_refused_with_path(bad) -> None:  # type: ignore[no-untyped-def]
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    with pytest.raises(InvalidInputError, match=r"state\['progress'\]"):
        save_state(st, 1, {"progress": {"x": bad}})
    assert st.latest_complete() is None


def test_exact_resume_in_fresh_objects_without_pickle(backend, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    m, o, s = tiny()
    train_steps(m, o, s, 3)
    st = CheckpointStore.open(backend, "run", identity=IDENT)
    save_state(st, 3, {"model": m, "optimizer": o, "scheduler": s, "progress": {"epoch": 1, "batch": 7}})
    train_steps(m, o, s, 4)
    ref_params = [p.detach().clone() for p in m.parameters()]
    ref_opt = o.state_dict()

    def no_pickle(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("pickle used in the load path")

    monkeypatch.setattr(pickle, "loads", no_pickle)
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(torch, "load", no_pickle)
    m2, o2, s2 = tiny(seed=99)  # different init: everything must come from the save
    st2 = CheckpointStore.open(backend, "run", identity=IDENT)
    saved = restore_state(st2, st2.resumed_from, {"model": m2, "optimizer": o2, "scheduler": s2})
    assert saved["progress"] == {"epoch": 1, "batch": 7}
    assert s2.state_dict()["last_epoch"] == 3
    train_steps(m2, o2, s2, 4)
    for a, b in zip(ref_params, m2.parameters(), strict=True):
        assert torch.equal(a, b)
    for k, v in ref_opt["state"].items():
        for name, t in v.items():
            assert torch.equal(t, o2.state_dict()["state"][k][name])


def test_reset_optimizer_is_detectably_different(backend) -> None:  # type: ignore[no-untyped-def]
    """The comparison the continuation tests use must catch a silently reset optimizer."""
    m, o, s = tiny()
    train_steps(m, o, s, 3)
    st = CheckpointStore.open(backend, "run", identity=IDENT)
    save_state(st, 3, {"model": m, "optimizer": o, "scheduler": s})
    train_steps(m, o, s, 2)
    m2, o2, s2 = tiny(seed=5)
    st2 = CheckpointStore.open(backend, "run", identity=IDENT)
    restore_state(st2, st2.resumed_from, {"model": m2, "scheduler": s2})  # optimizer "forgotten"
    train_steps(m2, o2, s2, 2)
    assert not all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))


def test_rng_states_restored() -> None:
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    save_state(st, 1, {"x": {"a": 1}})
    expect = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    restore_state(st, st.latest_complete(), {})
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expect


def test_model_shape_mismatch_is_refused(backend) -> None:  # type: ignore[no-untyped-def]
    m, o, s = tiny()
    st = CheckpointStore.open(backend, "run", identity=IDENT)
    save_state(st, 1, {"model": m, "optimizer": o})
    other = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(CheckpointMismatchError, match="shape"):
        restore_state(st, st.latest_complete(), {"model": other})
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))  # nothing loaded


def test_dtype_mismatch_is_refused() -> None:
    m, _, _ = tiny()
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    save_state(st, 1, {"model": m})
    m16 = tiny()[0].to(torch.float64)
    with pytest.raises(CheckpointMismatchError, match="dtype"):
        restore_state(st, st.latest_complete(), {"model": m16})


def test_missing_optimizer_state_is_refused() -> None:
    m, o, _ = tiny()
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    save_state(st, 1, {"model": m})
    with pytest.raises(CheckpointMismatchError, match="optimizer"):
        restore_state(st, st.latest_complete(), {"model": m, "optimizer": o})


def test_missing_component_falls_back_to_older_complete_save(backend) -> None:  # type: ignore[no-untyped-def]
    m, o, s = tiny()
    st = CheckpointStore.open(backend, "run", identity=IDENT)
    save_state(st, 1, {"model": m, "optimizer": o})
    train_steps(m, o, s, 1)
    ref2 = save_state(st, 2, {"model": m, "optimizer": o})
    for key, _, _ in stored_objects("run", ref2, "optimizer.safetensors"):  # its file; on version 3 its pieces
        if ref2.save_id in key:  # written by this save (not a piece step 1 holds)
            backend.delete(key)
    st2 = CheckpointStore.open(backend, "run", identity=IDENT)
    assert st2.resumed_from.step == 1  # the policy: newest complete save


def test_grad_accumulation_save_refused_unless_grads_saved(backend) -> None:  # type: ignore[no-untyped-def]
    m, o, s = tiny()
    st = CheckpointStore.open(backend, "run", identity=IDENT)
    ck = Checkpointer(st, {"model": m, "optimizer": o}, async_save=False, handle_signals=False)
    m(torch.randn(2, 4)).sum().backward()
    with pytest.raises(InvalidInputError, match="accumulation"):
        ck.save(0, accumulating=True)
    grads = [p.grad.clone() for p in m.parameters()]
    ck.save(0, accumulating=True, include_grads=True)
    ck.close()
    m2, o2, _ = tiny(seed=3)
    ck2 = Checkpointer(CheckpointStore.open(backend, "run", identity=IDENT), {"model": m2, "optimizer": o2},
                       async_save=False, handle_signals=False)
    assert ck2.resume() == 1
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, m2.parameters(), strict=True))
    ck2.close()


def test_async_save_error_surfaces_at_next_call_and_close() -> None:
    fb = FaultyBackend(MemoryBackend())
    st = CheckpointStore.open(fb, "run", identity=IDENT)
    m, o, _ = tiny()
    ck = Checkpointer(st, {"model": m, "optimizer": o}, every_steps=1, handle_signals=False)
    from ckptstore import StoreUnavailableError

    fb.fail(None, StoreUnavailableError("disk on fire"), persistent=True, when=lambda op, k: op == "put")
    ck.step_end(0)  # schedules the save; the failure happens in the background
    with pytest.raises(StoreUnavailableError, match="disk on fire"):
        ck.wait()
    ck.step_end(1)
    with pytest.raises(StoreUnavailableError):
        ck.close()


def test_async_save_snapshot_is_isolated_from_training() -> None:
    st = CheckpointStore.open(FaultyBackend(MemoryBackend()).slow(None, 0.2, when=lambda op, k: op == "create"),
                              "run", identity=IDENT)
    m, o, s = tiny()
    ck = Checkpointer(st, {"model": m}, every_steps=1, handle_signals=False)
    snap = [p.detach().clone() for p in m.parameters()]
    ck.step_end(0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # training continues while the save is written
    ck.close()
    saved = read_state(st, st.latest_complete())
    assert torch.equal(saved["model"]["0.weight"], snap[0])


def test_resumable_sampler_order_and_position() -> None:
    a = ResumableSampler(10, seed=4)
    it = iter(a)
    first = [next(it) for _ in range(4)]
    state = a.state_dict()
    rest = list(it)
    b = ResumableSampler(10, seed=4)
    b.load_state_dict(state)
    assert list(b) == rest and sorted(first + rest) == list(range(10))
    assert b.epoch == 1 and list(b)[:3] == a.order(1)[:3]
    with pytest.raises(InvalidInputError, match="seed"):
        ResumableSampler(10, seed=5).load_state_dict(state)


def test_torchdata_stateful_dataloader_is_supported() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(20))
    dl = StatefulDataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1))
    it = iter(dl)
    [next(it) for _ in range(2)]
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    save_state(st, 2, {"loader": dl})
    rest = [b.tolist() for b in it]
    dl2 = StatefulDataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1))
    restore_state(st, st.latest_complete(), {"loader": dl2})
    assert [b.tolist() for b in dl2] == rest


def test_grad_scaler_and_scheduler_state_roundtrip() -> None:
    m, o, s = tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    scaler.scale(torch.ones(1))  # materialize the scale
    scaler.update(512.0)
    train_steps(m, o, s, 3)
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    save_state(st, 3, {"scaler": scaler, "scheduler": s, "optimizer": o, "model": m})
    m2, o2, s2 = tiny(seed=8)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=7)
    restore_state(st, st.latest_complete(), {"scaler": scaler2, "scheduler": s2, "optimizer": o2, "model": m2})
    assert scaler2.state_dict() == scaler.state_dict()
    assert s2.state_dict() == s.state_dict()
