"""The first async save's host buffers are allocated off the training loop
(issue 23 item 2): ``HostBuffers.prepare_for`` allocates and touches a buffer
for every tensor the objects hold, in a background thread, and the save's copy
then lands in those buffers with the live values."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from ckptstore.torch import Checkpointer
from ckptstore.torch.codec import flatten
from ckptstore.torch.state import HostBuffers

IDENT = {"data_digest": "d", "code_digest": "c", "optimizer_revision": "r", "feature_contract": "f"}


def _objects() -> dict[str, torch.nn.Module | torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def test_prepared_buffers_are_the_ones_the_copy_fills() -> None:
    objs = _objects()
    bufs = HostBuffers()
    th = bufs.prepare_for(objs)
    assert th is not None
    th.join(30)
    assert bufs.prepare_for(objs) is None  # everything has a buffer: nothing left to allocate
    tensors = flatten(objs["model"].state_dict()).tensors
    key = sorted(tensors)[0]
    first = bufs.copy("model", key, tensors[key])
    assert torch.equal(first, tensors[key])
    assert bufs.copy("model", key, tensors[key]).data_ptr() == first.data_ptr()  # reused, not reallocated


def test_a_buffer_of_another_shape_is_replaced_by_the_copy() -> None:
    bufs = HostBuffers()
    th = bufs.prepare_for({"x": {"t": torch.zeros(4)}})
    assert th is not None
    th.join(30)
    out = bufs.copy("x", "t", torch.arange(6.0))
    assert torch.equal(out, torch.arange(6.0))


def test_an_async_checkpointer_saves_the_live_values_after_resume(tmp_path: Path) -> None:
    objs = _objects()
    with Checkpointer.open(tmp_path, "run", IDENT, objs, handle_signals=False) as ck:
        assert ck.resume() == 0  # buffers prepared in the background here
        ck.save(1)
        ck.wait()
    live = _objects()
    with torch.no_grad():
        live["model"].weight.add_(3.0)  # type: ignore[union-attr, operator]
    with Checkpointer.open(tmp_path, "run", IDENT, live, handle_signals=False) as ck:
        assert ck.resume() == 2
    assert torch.equal(live["model"].weight, objs["model"].weight)  # type: ignore[union-attr, arg-type]


def _state_bytes(objs: dict[str, torch.nn.Module | torch.optim.Optimizer]) -> int:
    return sum(t.numel() * t.element_size() for o in objs.values() for t in flatten(o.state_dict()).tensors.values()
               if t.numel())


def _until(fn: Callable[[], bool], seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not fn():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_on_a_fresh_run_the_first_step_end_prepares_the_optimizer_buffers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters())
    objs: dict[str, torch.nn.Module | torch.optim.Optimizer] = {"model": model, "optimizer": opt}
    with Checkpointer.open(tmp_path, "run", IDENT, objs, every_steps=10, handle_signals=False) as ck:
        assert ck.resume() == 0  # nothing to resume: Adam has no moments yet, only the model's buffers
        model_bytes = _state_bytes({"model": model})
        assert _until(lambda: ck.host_buffer_bytes == model_bytes)
        model(torch.randn(2, 64)).sum().backward()
        opt.step()  # the moments exist now
        assert not ck.step_end(0)  # not due: the moments' buffers are allocated in the background
        assert _until(lambda: ck.host_buffer_bytes >= _state_bytes(objs))
        ck.save(1)  # copies into them (only the small RNG-state tensors are left to the save itself)
        ck.wait()
    live = torch.nn.Linear(64, 32)
    live_opt = torch.optim.Adam(live.parameters())
    with Checkpointer.open(tmp_path, "run", IDENT, {"model": live, "optimizer": live_opt}, handle_signals=False) as ck:
        assert ck.resume() == 2
    assert torch.equal(live.weight, model.weight)
    assert torch.equal(live_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_a_fresh_run_prepares_the_buffers_at_construction_without_resume(tmp_path: Path) -> None:
    """Issue 32: no resume(), no step_end: the constructor of a Checkpointer on
    a fresh run (no resume point) starts the allocation, and the first save
    copies into those buffers."""
    objs = _objects()
    with Checkpointer.open(tmp_path, "run", IDENT, objs, handle_signals=False) as ck:
        assert _until(lambda: not ck.preparing_host_buffers)
        assert ck.host_buffer_bytes == _state_bytes(objs)  # every tensor of the state, once
        ck.save(1)
        ck.wait()
        assert ck.host_buffer_bytes >= _state_bytes(objs)
    live = _objects()
    with torch.no_grad():
        live["model"].weight.add_(3.0)  # type: ignore[union-attr, operator]
    with Checkpointer.open(tmp_path, "run", IDENT, live, handle_signals=False) as ck:
        # a resume point: nothing is allocated before resume(), so the restore's peak memory is not raised
        assert not ck.preparing_host_buffers
        assert ck.host_buffer_bytes == 0
        assert ck.resume() == 2
        assert _until(lambda: not ck.preparing_host_buffers)
        assert ck.host_buffer_bytes == _state_bytes(live)
    assert torch.equal(live["model"].weight, objs["model"].weight)  # type: ignore[union-attr, arg-type]


def test_resume_and_step_end_do_not_allocate_what_construction_is_preparing(tmp_path: Path) -> None:
    objs = _objects()
    with Checkpointer.open(tmp_path, "run", IDENT, objs, every_steps=10, handle_signals=False) as ck:
        assert ck.resume() == 0  # while the constructor's allocation may still run
        assert not ck.step_end(0)
        assert _until(lambda: not ck.preparing_host_buffers)
        assert ck.host_buffer_bytes == _state_bytes(objs)  # one buffer a tensor, not two


def test_a_copy_during_the_preparation_shares_the_work_and_never_allocates_twice() -> None:
    """Whatever the interleaving of the background allocation and a save's copy
    that starts at once: one buffer a tensor, each holding the live values,
    the ones later copies reuse."""
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(64, 1024) for i in range(16)}
    want = sum(t.numel() * t.element_size() for t in state.values())
    for _ in range(5):
        bufs = HostBuffers()
        th = bufs.prepare_for({"x": state})
        assert th is not None
        out = {k: bufs.copy("x", k, t) for k, t in state.items()}  # the save, from the front, right away
        th.join(30)
        assert not bufs.preparing
        assert bufs.nbytes == want
        for k, t in state.items():
            assert torch.equal(out[k], t)
            assert bufs.copy("x", k, t).data_ptr() == out[k].data_ptr()
