"""The fast path is the easy path (issue 19 item 4, issue 23 item 1).

``Checkpointer.open(url, run_id, identity, objects)`` opens the store and
builds the Checkpointer in one call; its resume reads every byte of the save
once, verified while read, and a save whose bytes are corrupt is never
applied (the older intact one is resumed, recorded). The read buffers are
fresh memory the restored tensors live in.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore, InvalidInputError
from ckptstore.backends.faults import FaultyBackend
from ckptstore.backends.local import LocalBackend
from ckptstore.torch import Checkpointer
from ckptstore.torch.tensor_read import HEAD_GUESS, fresh_buffer
from tests.incremental.common import stored_at, stored_objects

IDENT = {"data_digest": "d", "code_digest": "c", "optimizer_revision": "r", "feature_contract": "f"}


def _objects(seed: int) -> dict[str, torch.nn.Module | torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def _weights(objects: dict[str, torch.nn.Module | torch.optim.Optimizer]) -> torch.Tensor:
    model = objects["model"]
    assert isinstance(model, torch.nn.Module)
    return model.weight.detach().clone()


def test_open_resumes_where_the_last_save_left_off(tmp_path: Path) -> None:
    first = _objects(1)
    with Checkpointer.open(tmp_path, "run", IDENT, first, async_save=False, handle_signals=False) as ck:
        assert ck.resume() == 0
        ck.save(4)
    saved = _weights(first)
    live = _objects(2)
    assert not torch.equal(_weights(live), saved)
    with Checkpointer.open(tmp_path, "run", IDENT, live, async_save=False, handle_signals=False) as ck:
        assert ck.store.resumed_from is not None and ck.store.resumed_from.step == 4
        assert ck.resume() == 5
    assert torch.equal(_weights(live), saved)


def test_open_reads_every_byte_once(tmp_path: Path) -> None:
    with Checkpointer.open(tmp_path, "run", IDENT, _objects(1), async_save=False, handle_signals=False) as ck:
        ref = ck.save(3)
    assert ref is not None
    ((key, _, _),) = stored_objects("run", ref, "model.safetensors")  # its file; on version 3 its one piece

    def reads_of_model(trace_owner: FaultyBackend) -> int:
        return sum(1 for t in trace_owner.trace if t.key == key and t.op in ("get_range", "get"))

    def bytes_of_model(trace_owner: FaultyBackend) -> int:
        return sum(int(t.outcome.split()[1].removesuffix("B")) for t in trace_owner.trace
                   if t.key == key and t.op == "get_range")

    one = FaultyBackend(LocalBackend(str(tmp_path)))
    store = CheckpointStore.open(one, "run")
    store.read_into(ref, "model.safetensors", bytearray(ref.components["model.safetensors"].size))
    one_read, one_bytes = reads_of_model(one), bytes_of_model(one)
    assert one_read >= 1

    fast = FaultyBackend(LocalBackend(str(tmp_path)))
    with Checkpointer.open(fast, "run", IDENT, _objects(2), async_save=False, handle_signals=False) as ck:
        assert ck.resume() == 4
    # the open checked sizes; the resume read (and hashed) every byte once, after one bounded read of the
    # header that shapes the tensors the component is read into (tensor_read's scatter read)
    assert reads_of_model(fast) == one_read + 1
    assert one_bytes < bytes_of_model(fast) <= one_bytes + HEAD_GUESS

    deep = FaultyBackend(LocalBackend(str(tmp_path)))
    store = CheckpointStore.open(deep, "run", identity=IDENT)  # the store's own default: re-hash at open
    with Checkpointer(store, _objects(2), async_save=False, handle_signals=False) as ck:
        assert ck.resume() == 4
    assert reads_of_model(deep) > one_read


def test_open_never_applies_a_corrupt_save(tmp_path: Path) -> None:
    objs = _objects(1)
    with Checkpointer.open(tmp_path, "run", IDENT, objs, async_save=False, handle_signals=False) as ck:
        ck.save(1)
        good = _weights(objs)
        model = objs["model"]
        assert isinstance(model, torch.nn.Module)
        with torch.no_grad():
            model.weight.add_(1.0)
        bad_ref = ck.save(2)
    assert bad_ref is not None
    backend = FaultyBackend(LocalBackend(str(tmp_path)))
    key, at = stored_at("run", bad_ref, "model.safetensors", -5)  # its file; on version 3 the piece of that byte
    backend.flip_at_rest(key, offset=at)
    live = _objects(3)
    with pytest.warns(RuntimeWarning, match="corrupt"), \
            Checkpointer.open(backend, "run", IDENT, live, async_save=False, handle_signals=False) as ck:
        assert ck.store.resumed_from is not None and ck.store.resumed_from.step == 2  # sizes only at open
        assert ck.resume() == 2  # the bit flip was found while reading: step 1 resumed instead
    assert torch.equal(_weights(live), good)


def test_open_passes_checkpointer_choices_and_refuses_bad_ones(tmp_path: Path) -> None:
    with Checkpointer.open(tmp_path, "run", IDENT, _objects(1), every_steps=3, keep_last=2,
                           handle_signals=False) as ck:
        assert (ck.every_steps, ck.keep_last, ck.async_save) == (3, 2, True)
    with pytest.raises(InvalidInputError, match="every_steps must be positive"):
        Checkpointer.open(tmp_path, "run", IDENT, _objects(1), every_steps=0)
    with pytest.raises(TypeError):
        Checkpointer.open(tmp_path, "run", IDENT, _objects(1), every_step=3)


def test_the_class_says_what_it_promises() -> None:
    doc = Checkpointer.__doc__ or ""
    for promise in ("Nothing unverified is applied", "saved whole or not at all", "Training waits only for the copy",
                    "Preemption"):
        assert promise in doc


@pytest.mark.parametrize("size", [0, 1, 4097, (4 << 20) + 5])
def test_fresh_buffer_is_writable_memory_of_the_size_asked(size: int) -> None:
    buf = fresh_buffer(size)
    assert buf.dtype == torch.uint8 and buf.numel() == size and buf.is_contiguous()
    if size:
        buf[-1] = 7
        view = buf[8 * (size >= 16):].view(torch.uint8)
        del buf  # the memory lives as long as a view of it does
        assert int(view[-1]) == 7
