"""torch.distributed.checkpoint through the store: DTensor save/load with
resharding (2->2, 2->1, 2->4), async_save, failures, and the JSON metadata."""

from __future__ import annotations

import json
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore import CheckpointStore, CorruptionError
from ckptstore.distributed.dcp import METADATA_COMPONENT, StoreReader, StoreWriter
from tests.conftest import selected_kinds
from tests.helpers import IDENT
from tests.incremental.common import stored_at
from tests.workers.dist_launch import RankResult, run_job

WORKER = str(Path(__file__).parents[1] / "workers" / "dcp_worker.py")


def where(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    if kind not in selected_kinds():
        pytest.skip(f"{kind} is not among CKPT_BACKENDS")
    if kind == "local":
        return str(tmp_path / "store"), {}
    url, opts = request.getfixturevalue("object_servers").url_and_options(kind, f"dcp-{uuid.uuid4().hex[:8]}")
    return url, opts


def results(res: list[RankResult], event: str) -> list[dict[str, Any]]:
    got = [r.results.get(event) for r in res]
    assert all(g is not None for g in got), [(r.rank, r.returncode, r.stderr[-2000:]) for r in res]
    return got  # type: ignore[return-value]


@pytest.mark.parametrize("kind", ["local", "moto"])
def test_dtensor_save_and_reshard(kind: str, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    url, opts = where(kind, tmp_path, request)
    res = run_job(2, url, "save", opts=opts, args={"step": 3, "threads": 2}, worker=WORKER)
    assert all(r["ok"] for r in results(res, "save"))
    assert all(r["ok"] for r in results(res, "async_save"))  # dcp.async_save published step 4
    store = CheckpointStore.open(url, "run", mode="r", storage_options=opts or None)
    ref = store.latest_complete(deep=True)
    assert ref is not None and ref.step == 4
    assert ref.record.ranks is not None and set(ref.record.ranks) == {0, 1}
    assert ref.record.world_size == 2
    assert all(n.endswith(".bin") or n == METADATA_COMPONENT for n in ref.components)
    assert len(ref.components) <= 2 * 2 + 1  # one component per rank and I/O thread, never one per tensor
    for world in (2, 1, 4) if kind == "local" else (1,):
        res = run_job(world, url, "load", opts=opts, args={"reshard": world != 2}, worker=WORKER)
        loads = results(res, "load")
        assert all(r["ok"] and r["step"] == 4 for r in loads), loads
        opens = results(res, "open")
        if world != 2:
            assert opens[0]["resharded"]["from_world_size"] == 2 and opens[0]["resharded"]["to_world_size"] == world
    if kind == "local":
        # without asking for resharding, another world size is refused on every rank
        res = run_job(1, url, "load", opts=opts, args={}, worker=WORKER)
        assert [o.get("type") for o in results(res, "open")] == ["IdentityMismatchError"]
        kinds = [e["payload"] for e in store.events() if e["event"] == "reshard"]
        assert sorted(k["to_world_size"] for k in kinds) == [1, 4]


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_failing_rank_publishes_nothing(how: str, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    url, opts = where("local", tmp_path, request)
    res = run_job(2, url, "save", opts=opts, args={"step": 1, "async": False}, worker=WORKER)
    assert all(r["ok"] for r in results(res, "save"))
    res = run_job(2, url, "fail", opts=opts, args={"step": 5, "fail_rank": 1, "how": how, "pg_timeout": 20},
                  worker=WORKER)
    out = res[0].results["save"]
    assert out["ok"] is False
    if how == "raise":
        both = results(res, "save")
        assert [b["type"] for b in both] == ["CheckpointException"] * 2
        assert "disk full on rank 1" in both[0]["message"] and "disk full on rank 1" in both[1]["message"]
    else:
        assert res[1].killed
    store = CheckpointStore.open(url, "run", mode="r")
    ref = store.latest_complete(deep=True)
    assert ref is not None and ref.step == 1


def _single(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore.open(str(tmp_path / "s"), "run", identity=IDENT)


def test_single_process_round_trip_and_metadata_is_json(tmp_path: Path) -> None:
    store = _single(tmp_path)
    lin = torch.nn.Linear(4, 3)
    sd = {"m": lin.state_dict(), "bf": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "empty": torch.empty(0, 2),
          "i": torch.tensor(7)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=StoreWriter(store, step=2), no_dist=True)
        ref = store.latest_complete(deep=True)
        assert ref is not None
        doc = json.loads(store.read(ref, METADATA_COMPONENT))  # JSON, not pickle
        assert doc["format"] == "ckptstore.dcp/1"
        assert all(len(i["blake3"]) == 64 for i in doc["items"])
        back = {"m": torch.nn.Linear(4, 3).state_dict(), "bf": torch.zeros(2, 3, dtype=torch.bfloat16),
                "empty": torch.empty(0, 2), "i": torch.tensor(0)}
        dcp.load(back, storage_reader=StoreReader(store), no_dist=True)
    for k in ("weight", "bias"):
        assert torch.equal(back["m"][k], sd["m"][k])
    assert torch.equal(back["bf"], sd["bf"]) and int(back["i"]) == 7


class _Custom:
    """A value outside torch's weights_only allow-list."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch


def test_pickled_items_refused_unless_allowed(tmp_path: Path) -> None:
    """Plain values load by default (tests/distributed/test_dcp_bytes.py); other objects need allow_pickle."""
    store = _single(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"t": torch.ones(2), "obj": _Custom(3)}, storage_writer=StoreWriter(store, step=1), no_dist=True)
        target: dict[str, Any] = {"t": torch.zeros(2), "obj": None}
        with pytest.raises(BaseException) as ei:  # DCP wraps it in CheckpointException (a BaseException)
            dcp.load(target, storage_reader=StoreReader(store), no_dist=True)
        assert "PickleRefusedError" in str(ei.value) and "allow_pickle=True" in str(ei.value)
        assert target["obj"] is None
        dcp.load(target, storage_reader=StoreReader(store, allow_pickle=True), no_dist=True)
    assert target["obj"].epoch == 3 and torch.equal(target["t"], torch.ones(2))


def test_reader_verifies_every_range(tmp_path: Path) -> None:
    store = _single(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.arange(100.0), "b": torch.arange(50.0)}, storage_writer=StoreWriter(store, step=1),
                 no_dist=True)
    ref = store.latest_complete()
    assert ref is not None
    doc = json.loads(store.read(ref, METADATA_COMPONENT))
    item = next(i for i in doc["items"] if i["index"]["fqn"] == "b")
    key, at = stored_at(store.run_id, ref, item["component"], item["offset"] + 3)  # its file; on version 3 a piece
    path = tmp_path / "s" / key
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40  # one bit flip inside item "b", size unchanged
    path.write_bytes(bytes(raw))
    target = {"a": torch.zeros(100), "b": torch.zeros(50)}
    with pytest.raises(BaseException) as ei, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=StoreReader(store), no_dist=True)
    assert "item b (bytes" in str(ei.value) and "does not match its BLAKE3 digest" in str(ei.value)
    assert CorruptionError.__name__ in str(ei.value)


def test_metadata_json_round_trip_and_strict_decoding() -> None:
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ckptstore.distributed.dcp.metadata import ItemInfo, decode_metadata, encode_metadata

    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([4, 2]),
                                       [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
                                        ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 2]))]),
            "o": BytesStorageMetadata(),
        },
        planner_data={"w": ("model", "w"), "o": ("opt", 0)},
        version="1.0.0",
    )
    items = {MetadataIndex("w", [0, 0]): ItemInfo("dcp/rank00000-0.bin", 0, 8, "cd" * 32, "bfloat16", (2, 2)),
             MetadataIndex("w", [2, 0]): ItemInfo("dcp/rank00001-0.bin", 8, 8, "ab" * 32, "bfloat16", (2, 2)),
             MetadataIndex("o"): ItemInfo("dcp/rank00000-0.bin", 8, 5, "ef" * 32)}  # every chunk has its item
    data = encode_metadata(md, items)
    back, back_items = decode_metadata(data, "here")
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.planner_data == {"w": ("model", "w"), "o": ("opt", 0)}  # tuples survive
    assert back_items == items
    hostile = data.replace(b'"bfloat16"', b'"os.system"', 1)
    with pytest.raises(CorruptionError, match="unknown dtype"):
        decode_metadata(hostile, "here")
    with pytest.raises(CorruptionError, match="not a ckptstore.dcp/1 document"):
        decode_metadata(b'{"format": "pickle"}', "here")
