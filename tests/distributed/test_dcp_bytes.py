"""DCP without pickle (issue 24, item 5): non-tensor values saved by DCP's unchanged default planner
(``torch.save`` into BYTE_IO items) load with the reader as constructed by default when torch's restricted
``weights_only`` unpickler accepts them; any other object is refused with the fix named, and runs nothing.

The first two tests are the blob and bytes cases of PyTorch's own file-system suite
(``test_read_write_tensor_and_blob``, ``test_save_load_bytes``; tests/peer/PROVENANCE.md), written again
here so that they run where the upstream file is absent."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore import CheckpointStore
from ckptstore.distributed.dcp import StoreReader, StoreWriter
from ckptstore.distributed.dcp.compat import PathStoreReader, PathStoreWriter

IDENT = {"data_digest": "d", "code_digest": "c"}


class BlobState:
    """A Stateful holding bytes, as in PyTorch's suite."""

    def __init__(self, value: bytes) -> None:
        self.state: dict[str, Any] = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlobState) and self.state == other.state


class Opaque:
    """Not on torch's weights_only allow-list."""

    def __init__(self, n: int) -> None:
        self.n = n


class Planted:
    """Unpickling it in full would create a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own warnings about no process group
        yield


@pytest.mark.parametrize("thread_count", [1, 2])
def test_tensors_and_a_blob_round_trip_through_an_extension_with_the_default_reader(
    tmp_path: Path, thread_count: int
) -> None:
    from torch.testing._internal.distributed.checkpoint_utils import Rot13Example, get_test_extension_registry

    torch.manual_seed(0)
    sd: dict[str, Any] = dict(torch.nn.Linear(5, 5).state_dict())
    sd["test_blob"] = BlobState(b"SomeBlobForTesting")
    dcp.save(sd, storage_writer=PathStoreWriter(tmp_path, thread_count=thread_count, _extensions=[Rot13Example()]),
             no_dist=True)
    torch.manual_seed(1)
    back: dict[str, Any] = dict(torch.nn.Linear(5, 5).state_dict())
    back["test_blob"] = BlobState(b"")
    dcp.load(back, storage_reader=PathStoreReader(tmp_path, _extension_registry=get_test_extension_registry()),
             no_dist=True)
    assert back["test_blob"] == sd["test_blob"]
    assert all(torch.equal(back[k], sd[k]) for k in ("weight", "bias"))


@pytest.mark.parametrize("thread_count", [1, 2])
def test_plain_values_round_trip_with_the_default_reader(tmp_path: Path, thread_count: int) -> None:
    dcp.save({"bytes0": [1], "bytes1": "string"}, storage_writer=PathStoreWriter(tmp_path, thread_count=thread_count),
             no_dist=True)
    back: dict[str, Any] = {"bytes0": [2], "bytes1": "other"}
    dcp.load(back, storage_reader=PathStoreReader(tmp_path), no_dist=True)
    assert back == {"bytes0": [1], "bytes1": "string"}


def test_containers_numbers_and_tensors_inside_values_load_without_allow_pickle(tmp_path: Path) -> None:
    store = CheckpointStore.open(str(tmp_path / "s"), "r", identity=IDENT)
    pair = (torch.arange(3), torch.ones(2, dtype=torch.bfloat16))  # a tuple is one BYTE_IO value: tensors inside
    value = {"epoch": 3, "lr": 0.5, "name": "x", "none": None, "flags": (True, False), "raw": b"\x00\xff",
             "nested": {"ids": [1, 2, 3]}, "pair": pair}
    dcp.save({"t": torch.ones(2), "obj": value, "size": torch.Size([2, 3])},
             storage_writer=StoreWriter(store, step=1), no_dist=True)
    back: dict[str, Any] = {"t": torch.zeros(2), "size": None, "obj": {
        "epoch": 0, "lr": 0.0, "name": "", "none": 1, "flags": (), "raw": b"", "nested": {"ids": []}, "pair": ()}}
    dcp.load(back, storage_reader=StoreReader(store), no_dist=True)
    assert torch.equal(back["t"], torch.ones(2)) and back["size"] == torch.Size([2, 3])
    got = back["obj"]
    assert {k: v for k, v in got.items() if k != "pair"} == {k: v for k, v in value.items() if k != "pair"}
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got["pair"], pair, strict=True))


def test_other_objects_are_refused_naming_the_fix_and_load_with_allow_pickle(tmp_path: Path) -> None:
    store = CheckpointStore.open(str(tmp_path / "s"), "r", identity=IDENT)
    dcp.save({"t": torch.ones(2), "obj": Opaque(7)}, storage_writer=StoreWriter(store, step=1), no_dist=True)
    target: dict[str, Any] = {"t": torch.zeros(2), "obj": None}
    with pytest.raises(BaseException) as ei:  # DCP wraps the reader's error in its CheckpointException
        dcp.load(target, storage_reader=StoreReader(store), no_dist=True)
    msg = str(ei.value)
    assert "PickleRefusedError" in msg and "weights_only" in msg and "allow_pickle=True" in msg
    assert "add_safe_globals" in msg and "Opaque" in msg
    assert target["obj"] is None
    dcp.load(target, storage_reader=StoreReader(store, allow_pickle=True), no_dist=True)
    assert isinstance(target["obj"], Opaque) and target["obj"].n == 7


def test_an_allow_listed_class_loads_without_allow_pickle(tmp_path: Path) -> None:
    store = CheckpointStore.open(str(tmp_path / "s"), "r", identity=IDENT)
    dcp.save({"obj": Opaque(5)}, storage_writer=StoreWriter(store, step=1), no_dist=True)
    target: dict[str, Any] = {"obj": None}
    with torch.serialization.safe_globals([Opaque]):
        dcp.load(target, storage_reader=StoreReader(store), no_dist=True)
    assert isinstance(target["obj"], Opaque) and target["obj"].n == 5


def test_a_planted_pickle_runs_nothing_under_the_default_reader(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    store = CheckpointStore.open(str(tmp_path / "s"), "r", identity=IDENT)
    dcp.save({"obj": Planted(marker)}, storage_writer=StoreWriter(store, step=1), no_dist=True)
    assert not marker.exists()
    with pytest.raises(BaseException, match="PickleRefusedError"):
        dcp.load({"obj": None}, storage_reader=StoreReader(store), no_dist=True)
    assert not marker.exists()
