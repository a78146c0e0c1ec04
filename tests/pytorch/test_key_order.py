"""Key order of state dicts is kept on every path (issue 24, item 3): what comes back lists its keys in
the order they were inserted, as ``torch.save``/``torch.load`` would give them."""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore, CorruptionError
from ckptstore.backends.memory import MemoryBackend
from ckptstore.torch import Checkpointer, flatten, read_state, save_state, unflatten
from ckptstore.torch.codec import load_safetensors, safetensors_stream, tree_from_json, tree_to_json
from ckptstore.torch.state import STATE_COMPONENT

IDENT = {"data_digest": "d", "code_digest": "c", "optimizer_revision": "adam-r3", "feature_contract": "f"}
SAVED = ["z.weight", "z.bias", "a.weight", "a.bias"]  # the example: not sorted


class ZA(torch.nn.Module):
    """Parameters registered in an unsorted order (``z`` before ``a``)."""

    def __init__(self) -> None:
        super().__init__()
        self.z = torch.nn.Linear(3, 2)
        self.a = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.a(self.z(x))
        return out


def _keys(x: object) -> list[object]:
    assert isinstance(x, dict)
    return list(x)


def test_codec_keeps_insertion_order_through_its_json_bytes() -> None:
    sd = OrderedDict((k, torch.full((2,), float(i))) for i, k in enumerate(SAVED))
    tree = {"state_dict": sd, "b": 1, "a": {"y": 2, "x": 3}, 3: "int key", "sorted": {"a": 1, "b": 2}}
    fl = flatten(tree)
    doc = tree_from_json(tree_to_json(fl.tree))  # the bytes a save stores: objects with sorted keys
    tensors = load_safetensors(b"".join(bytes(c) for c in safetensors_stream(fl.tensors)[1]))
    back = unflatten(doc, tensors)
    assert _keys(back) == ["state_dict", "b", "a", 3, "sorted"]
    assert _keys(back["state_dict"]) == SAVED
    assert _keys(back["a"]) == ["y", "x"]
    assert all(torch.equal(back["state_dict"][k], sd[k]) for k in SAVED)
    assert dict(fl.tree["__map"])["sorted"] == {"a": 1, "b": 2}  # a dict already in sorted order stays an object


def test_safetensors_files_list_tensors_in_the_dict_order() -> None:
    ts = {k: torch.arange(3, dtype=torch.float32) + i for i, k in enumerate(SAVED)}
    raw = b"".join(bytes(c) for c in safetensors_stream(ts)[1])
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    assert list(header) == SAVED
    assert [header[k]["data_offsets"][0] for k in SAVED] == [0, 12, 24, 36]
    assert list(load_safetensors(raw)) == SAVED


def test_saved_state_comes_back_in_insertion_order_at_every_level() -> None:
    st = CheckpointStore.open(MemoryBackend(), "r", identity=IDENT)
    m = ZA()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    ref = save_state(st, 1, {"model": m, "progress": {"epoch": 1, "batch": 2}, "optimizer": opt})
    got = read_state(st, ref)
    assert _keys(got)[:3] == ["model", "progress", "optimizer"]
    assert _keys(got["model"]) == list(m.state_dict()) == SAVED
    assert _keys(got["progress"]) == ["epoch", "batch"]
    assert _keys(got["optimizer"]) == list(opt.state_dict())
    assert _keys(got["optimizer"]["state"]) == list(opt.state_dict()["state"])
    for a, b in zip(got["model"].items(), m.state_dict().items(), strict=True):  # what Lightning's tests do
        assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_checkpointer_saves_in_order_and_resumes_from_it(tmp_path: Path) -> None:
    m = ZA()
    store = CheckpointStore.open(str(tmp_path / "s"), "r", identity=IDENT)
    ck = Checkpointer(store, {"model": m, "progress": {"step": 1}}, async_save=False, handle_signals=False)
    ck.save(1)
    ref = store.latest_complete()
    assert ref is not None
    got = read_state(store, ref)
    assert _keys(got)[:2] == ["model", "progress"] and _keys(got["model"]) == SAVED
    ck.close()
    fresh = ZA()
    again = CheckpointStore.open(str(tmp_path / "s"), "r", identity=IDENT)
    ck2 = Checkpointer(again, {"model": fresh, "progress": {"step": 0}}, async_save=False, handle_signals=False)
    assert ck2.resume() == 2
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), m.state_dict().values(), strict=True))
    ck2.close()


def test_an_order_field_that_does_not_list_the_entries_is_corruption() -> None:
    be = MemoryBackend()
    st = CheckpointStore.open(be, "r", identity=IDENT)
    ref = save_state(st, 1, {"b": {"x": 1}, "a": {"y": 2}})
    doc = tree_from_json(st.read(ref, STATE_COMPONENT))
    assert doc["order"][:2] == ["b", "a"]
    doc["order"] = ["a", "a", *doc["order"][2:]]
    with st.save(2, expect=[STATE_COMPONENT]) as s:
        doc["step"] = 2
        s.put(STATE_COMPONENT, tree_to_json(doc))
    assert s.ref is not None
    with pytest.raises(CorruptionError, match="field order"):
        read_state(st, s.ref)
