"""The Lightning CheckpointIO: real Trainer runs on the CPU, a local directory store."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import enum
import json
import os
import pathlib
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from ckptstore import CheckpointStore, CorruptionError, InvalidInputError, NotFoundError, RunIdentity
from ckptstore.integrations.lightning import (
    DOC_COMPONENT,
    AsyncStoreCheckpointIO,
    RemovalRefusedWarning,
    StoreCheckpointIO,
    read_pointer,
    write_pointer_for_latest,
)
from ckptstore.torch.codec import TypeRegistry
from tests.incremental.common import stored_at

IDENT = RunIdentity(data_digest="random-64", code_digest="boring-1", world_size=1)


class LoggingModel(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out: Any = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"])
        return out


def _trainer(root: Path, io: Any, callbacks: list[Any], **kw: Any) -> Trainer:
    args: dict[str, Any] = {
        "default_root_dir": root, "plugins": [io], "callbacks": callbacks, "limit_train_batches": 3, "limit_val_batches": 1,
        "max_epochs": 3, "enable_progress_bar": False, "enable_model_summary": False, "logger": False,
        "num_sanity_val_steps": 0,
    }
    args.update(kw)
    return Trainer(**args)


def _io(tmp_path: Path, run: str = "run") -> StoreCheckpointIO:
    return StoreCheckpointIO(url=str(tmp_path / "store"), run_id=run, identity=IDENT)


def _reader(tmp_path: Path, run: str = "run") -> CheckpointStore:
    return CheckpointStore.open(str(tmp_path / "store"), run, mode="r")


def test_fit_writes_pointers_one_save_per_step_and_topk_removal_keeps_bytes(tmp_path: Path) -> None:
    io = _io(tmp_path)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="step", mode="max", save_top_k=1,
                           save_last=True, filename="{epoch}-{step}")
    _trainer(tmp_path, io, [ckpt]).fit(LoggingModel())

    files = sorted(os.listdir(tmp_path / "ckpts"))
    assert "last.ckpt" in files and len(files) == 2  # top-1 + last; older top-k pointers removed
    saves = _reader(tmp_path).list_saves()
    assert sorted(s.step for s in saves) == [3, 6, 9]  # every epoch's save survives a pointer removal
    assert all(s.state.value == "committed" for s in saves)

    last = read_pointer(tmp_path / "ckpts" / "last.ckpt")
    assert last["step"] == 9
    # last.ckpt and the top-k file of step 9 (if it is the best) share the save; the big state is referenced
    assert "state_dict" not in last["inline"] and "optimizer_states" not in last["inline"]
    best = read_pointer(Path(ckpt.best_model_path))
    assert best["step"] == 9 and best["save_id"] == last["save_id"] and best["inline"] == {}
    assert files == ["epoch=2-step=9.ckpt", "last.ckpt"]

    loaded = io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
    assert loaded["global_step"] == 9 and loaded["epoch"] == 2
    assert set(loaded["state_dict"]) == {"layer.weight", "layer.bias"}
    assert isinstance(loaded["optimizer_states"][0]["state"], dict)
    cb = next(v for k, v in loaded["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert cb["last_model_path"] == str(tmp_path / "ckpts" / "last.ckpt")


def test_resume_from_last_continues_with_the_saved_weights(tmp_path: Path) -> None:
    io = _io(tmp_path)
    model = LoggingModel()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    _trainer(tmp_path, io, [ckpt], max_epochs=2).fit(model)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    seen: dict[str, torch.Tensor] = {}

    class Probe(LoggingModel):
        def on_train_start(self) -> None:
            seen.update({k: v.clone() for k, v in self.state_dict().items()})

    io2 = _io(tmp_path)  # a new process: a new attempt of the same run
    ckpt2 = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    trainer = _trainer(tmp_path, io2, [ckpt2], max_epochs=4)
    trainer.fit(Probe(), ckpt_path=str(tmp_path / "ckpts" / "last.ckpt"))
    assert all(torch.equal(seen[k], saved[k]) for k in saved)
    assert trainer.global_step == 12
    assert io2.store.resumed_from is not None and io2.store.resumed_from.step == 6
    assert read_pointer(tmp_path / "ckpts" / "last.ckpt")["step"] == 12


@pytest.mark.parametrize("plugin", ["sync", "async"])
def test_checkpoints_come_back_with_their_keys_in_insertion_order(tmp_path: Path, plugin: str) -> None:
    """Issue 24 item 3: ``zip(module.state_dict(), checkpoint["state_dict"])`` pairs the same keys, at the
    top level, in state dicts and in the inline state of a second save at the same step."""
    io: Any = _io(tmp_path) if plugin == "sync" else AsyncStoreCheckpointIO(_io(tmp_path))
    model = LoggingModel()
    trainer = _trainer(tmp_path, io, [], max_epochs=1, enable_checkpointing=False)
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    got = io.load_checkpoint(tmp_path / "a.ckpt")
    assert list(got["state_dict"]) == list(model.state_dict()) == ["layer.weight", "layer.bias"]
    assert list(got)[:4] == ["epoch", "global_step", "pytorch-lightning_version", "state_dict"]
    sd = {"z.weight": torch.ones(2), "z.bias": torch.zeros(1), "a.weight": torch.ones(3), "a.bias": torch.zeros(1)}
    ck = {"global_step": 99, "zeta": {"b": 1, "a": 2}, "state_dict": sd, "alpha": [1]}
    io.save_checkpoint(ck, tmp_path / "b.ckpt")
    ck2 = {**ck, "zeta": {"y": 1, "x": 2}}  # same step, other small state: carried inline in the pointer
    io.save_checkpoint(ck2, tmp_path / "c.ckpt")
    for path, want in ((tmp_path / "b.ckpt", ck), (tmp_path / "c.ckpt", ck2)):
        back = io.load_checkpoint(path)
        assert list(back) == list(want) and list(back["zeta"]) == list(want["zeta"])
        assert list(back["state_dict"]) == list(sd)
    assert "zeta" in read_pointer(tmp_path / "c.ckpt")["inline"]
    if plugin == "async":
        io.teardown()


def test_second_save_at_same_step_points_to_existing_save(tmp_path: Path) -> None:
    io = _io(tmp_path)
    model = LoggingModel()
    trainer = _trainer(tmp_path, io, [], max_epochs=1, enable_checkpointing=False)
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    trainer.save_checkpoint(tmp_path / "b.ckpt", weights_only=True)
    a, b = read_pointer(tmp_path / "a.ckpt"), read_pointer(tmp_path / "b.ckpt")
    assert a["save_id"] == b["save_id"] and a["manifest_digest"] == b["manifest_digest"]
    assert b["inline"] == {} and "optimizer_states" in a["keys"] and "optimizer_states" not in b["keys"]
    assert len(_reader(tmp_path).list_saves()) == 1
    wb = io.load_checkpoint(tmp_path / "b.ckpt")
    assert "optimizer_states" not in wb
    assert all(torch.equal(wb["state_dict"][k], v) for k, v in model.state_dict().items())

    # different weights at the same step: refused, nothing written
    with torch.no_grad():
        model.layer.weight.add_(1.0)
    with pytest.raises(InvalidInputError, match="already saved in this attempt with different content"):
        io.max_inline_bytes = 16
        trainer.save_checkpoint(tmp_path / "c.ckpt")
    assert not (tmp_path / "c.ckpt").exists()


def test_small_differences_at_same_step_are_carried_in_the_pointer(tmp_path: Path) -> None:
    io = _io(tmp_path)
    base = {"global_step": 5, "epoch": 0, "state_dict": {"w": torch.arange(6.0)}, "callbacks": {"score": torch.tensor(1.0)}}
    io.save_checkpoint(base, tmp_path / "x.ckpt")
    other = {**base, "callbacks": {"score": torch.tensor(2.0)}, "loops": {"n": 3}}
    io.save_checkpoint(other, tmp_path / "y.ckpt")
    y = read_pointer(tmp_path / "y.ckpt")
    assert set(y["inline"]) == {"callbacks", "loops"}
    got = io.load_checkpoint(tmp_path / "y.ckpt")
    assert got["callbacks"]["score"].item() == 2.0 and got["loops"] == {"n": 3}
    assert torch.equal(got["state_dict"]["w"], torch.arange(6.0))
    assert io.load_checkpoint(tmp_path / "x.ckpt")["callbacks"]["score"].item() == 1.0


def test_remove_checkpoint_removes_only_the_pointer(tmp_path: Path) -> None:
    io = _io(tmp_path)
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(3)}}, tmp_path / "p.ckpt")
    io.remove_checkpoint(tmp_path / "p.ckpt")
    io.remove_checkpoint(tmp_path / "p.ckpt")  # idempotent, like TorchCheckpointIO
    assert not (tmp_path / "p.ckpt").exists()
    ref = _reader(tmp_path).latest_complete(deep=True)
    assert ref is not None and ref.step == 1


def test_load_verifies_the_manifest_digest_and_the_bytes(tmp_path: Path) -> None:
    io = _io(tmp_path)
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.ones(4)}}, tmp_path / "p.ckpt")
    doc = json.loads((tmp_path / "p.ckpt").read_text())

    (tmp_path / "bad.ckpt").write_text(json.dumps({**doc, "manifest_digest": "0" * 64}))
    with pytest.raises(CorruptionError, match="manifest digest"):
        io.load_checkpoint(tmp_path / "bad.ckpt")
    (tmp_path / "bad2.ckpt").write_text(json.dumps({**doc, "inline": {"state_dict": {"tree": {}, "tensors": None}}}))
    with pytest.raises(CorruptionError, match="inline state"):
        io.load_checkpoint(tmp_path / "bad2.ckpt")
    (tmp_path / "bad3.ckpt").write_bytes(b"PK\x03\x04 a torch.save zip")
    with pytest.raises(CorruptionError, match="not a ckptstore pointer"):
        io.load_checkpoint(tmp_path / "bad3.ckpt")
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")

    # flip one byte of the tensor component in the store: refused while reading
    ref = _reader(tmp_path).latest_complete()
    assert ref is not None
    key, at = stored_at("run", ref, next(n for n in ref.components if n.endswith(".safetensors")), -1)  # file or piece
    comp = tmp_path / "store" / key
    data = bytearray(comp.read_bytes())
    data[at] ^= 0xFF
    comp.write_bytes(bytes(data))
    with pytest.raises(CorruptionError):
        StoreCheckpointIO(url=str(tmp_path / "store"), run_id="run", identity=IDENT).load_checkpoint(
            tmp_path / "p.ckpt"
        )


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclasses.dataclass
class Opt:
    lr: float
    betas: tuple[float, float] = (0.9, 0.99)


def test_hyperparameters_of_many_kinds_round_trip_and_unknown_objects_are_refused(tmp_path: Path) -> None:
    reg = TypeRegistry()
    reg.register(Mode)
    reg.register(Opt)
    reg.register_class(torch.optim.SGD)
    io = StoreCheckpointIO(url=str(tmp_path / "store"), run_id="run", identity=IDENT, registry=reg)
    hp = {
        "data": pathlib.Path("/data/x"), "tags": {"a", "b"}, "salt": b"\x00\x01", "when": dt.datetime(2026, 1, 1, 12),
        "device": torch.device("cpu"), "args": argparse.Namespace(lr=0.1, steps=3), "mode": Mode.SLOW,
        "opt": Opt(1e-3), "every": dt.timedelta(minutes=5), "ratio": float("inf"), "optimizer": torch.optim.SGD,
    }
    ck = {"global_step": 7, "hyper_parameters": hp, "state_dict": {"w": torch.zeros(2, dtype=torch.bfloat16)}}
    io.save_checkpoint(ck, tmp_path / "h.ckpt")
    got = io.load_checkpoint(tmp_path / "h.ckpt")
    assert got["hyper_parameters"] == hp
    assert {k: type(v) for k, v in got["hyper_parameters"].items()} == {k: type(v) for k, v in hp.items()}
    assert got["state_dict"]["w"].dtype == torch.bfloat16

    class Unknown:
        pass

    bad = {"global_step": 8, "hyper_parameters": {"nested": [1, {"obj": Unknown()}]}, "state_dict": {}}
    with pytest.raises(InvalidInputError, match=r"checkpoint\['hyper_parameters'\]\['nested'\]\[1\]\['obj'\]"):
        io.save_checkpoint(bad, tmp_path / "bad.ckpt")
    with pytest.raises(InvalidInputError, match="enum .*Color.* is not registered"):

        class Color(enum.Enum):
            RED = 1

        io.save_checkpoint({"global_step": 8, "c": Color.RED}, tmp_path / "bad.ckpt")
    with pytest.raises(InvalidInputError, match=r"checkpoint\['cls'\]: the class .*Adam is stored only when registered"):
        io.save_checkpoint({"global_step": 8, "cls": torch.optim.Adam}, tmp_path / "bad.ckpt")
    assert not (tmp_path / "bad.ckpt").exists()
    assert [s.step for s in _reader(tmp_path).list_saves()] == [7]


def test_async_variant_orders_removal_after_saves_and_loads_after_waiting(tmp_path: Path) -> None:
    io = AsyncStoreCheckpointIO(url=str(tmp_path / "store"), run_id="run", identity=IDENT)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="step", mode="max", save_top_k=1,
                           save_last=True, filename="{epoch}-{step}")
    model = LoggingModel()
    trainer = _trainer(tmp_path, io, [ckpt])
    trainer.fit(model)
    assert trainer.strategy.checkpoint_io is io
    io.wait()
    files = sorted(os.listdir(tmp_path / "ckpts"))
    assert len(files) == 2 and "last.ckpt" in files  # no orphan pointer from a removal overtaking its save
    got = io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
    assert all(torch.equal(got["state_dict"][k], v) for k, v in model.state_dict().items())
    assert sorted(s.step for s in _reader(tmp_path).list_saves()) == [3, 6, 9]


def test_async_variant_holds_no_thread_pool_when_idle_so_a_resumed_trainer_deep_copies(tmp_path: Path) -> None:
    import copy
    import pickle

    io = AsyncStoreCheckpointIO(url=str(tmp_path / "store"), run_id="run", identity=IDENT)
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(2)}}, tmp_path / "a.ckpt")
    io.wait()
    resumed = AsyncStoreCheckpointIO(url=str(tmp_path / "store"), run_id="run", identity=IDENT)
    assert resumed.load_checkpoint(tmp_path / "a.ckpt")["global_step"] == 1  # what a resume does
    for plug in (io, resumed):
        twin = copy.deepcopy(plug)  # raised "cannot pickle '_queue.SimpleQueue'" when a pool stayed after wait()
        assert isinstance(pickle.loads(pickle.dumps(plug)), AsyncStoreCheckpointIO)
        assert twin.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"].tolist() == [1.0, 1.0]
    resumed.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.full((2,), 2.0)}}, tmp_path / "b.ckpt")
    resumed.remove_checkpoint(tmp_path / "a.ckpt")  # queued behind the save
    resumed.wait()
    assert not (tmp_path / "a.ckpt").exists() and read_pointer(tmp_path / "b.ckpt")["step"] == 2
    copy.deepcopy(resumed)
    resumed.teardown()


class _SlowIO(StoreCheckpointIO):
    """Saves that take longer than a training step (a large model), and optionally fail."""

    fail_at: int | None = None

    def _save_pointed(self, checkpoint: dict[str, Any], step: int, path: Any) -> None:
        time.sleep(0.3)
        if step == self.fail_at:
            raise OSError(f"disk full at step {step}")
        super()._save_pointed(checkpoint, step, path)


def test_async_saves_slower_than_a_step_keep_every_version_modelcheckpoint_names(tmp_path: Path) -> None:
    """Issue 24 item 2: ModelCheckpoint picks ``same-v1.ckpt`` only if ``same.ckpt`` exists when it checks;
    a save still in flight must count as existing, or the next save takes its name and overwrites it
    (1 of 4 files survived before the path was reserved on the caller's thread)."""
    io = AsyncStoreCheckpointIO(_SlowIO(url=str(tmp_path / "store"), run_id="run", identity=IDENT))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="same", monitor="train_loss", save_top_k=-1,
                           every_n_train_steps=1)
    _trainer(tmp_path, io, [ckpt], max_steps=4, limit_val_batches=0).fit(LoggingModel())
    io.wait()
    files = sorted(os.listdir(tmp_path / "ckpts"))
    assert files == ["same-v1.ckpt", "same-v2.ckpt", "same-v3.ckpt", "same.ckpt"]
    steps = [io.load_checkpoint(tmp_path / "ckpts" / f)["global_step"] for f in ["same.ckpt", *files[:3]]]
    assert steps == [1, 2, 3, 4]
    io.teardown()


def test_a_reservation_goes_with_a_failed_save_and_a_left_one_holds_no_checkpoint(tmp_path: Path) -> None:
    inner = _SlowIO(url=str(tmp_path / "store"), run_id="run", identity=IDENT)
    inner.fail_at = 2
    io = AsyncStoreCheckpointIO(inner)
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.ones(2)}}, tmp_path / "a.ckpt")
    assert (tmp_path / "a.ckpt").exists()  # reserved at once, before the background save ran
    with pytest.raises(OSError, match="disk full"):
        io.wait()
    assert not (tmp_path / "a.ckpt").exists()  # the failed save took its reservation with it

    # another plug-in of this process loading a path whose save is still running waits for it
    inner.fail_at = None
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.full((2,), 3.0)}}, tmp_path / "c.ckpt")
    fresh = StoreCheckpointIO(url=str(tmp_path / "store"), run_id="run")
    assert fresh.load_checkpoint(tmp_path / "c.ckpt")["state_dict"]["w"].tolist() == [3.0, 3.0]

    # what a process killed mid-save leaves: a reservation; loading it names the fix, removal takes it
    assert inner.reserve(tmp_path / "b.ckpt", 5) and not inner.reserve(tmp_path / "b.ckpt", 6)
    with pytest.raises(NotFoundError, match="write_pointer_for_latest"):
        StoreCheckpointIO(url=str(tmp_path / "store"), run_id="run").load_checkpoint(tmp_path / "b.ckpt")
    other = StoreCheckpointIO(url=str(tmp_path / "store"), run_id="other", identity=IDENT)
    with pytest.warns(RemovalRefusedWarning, match="not a file this plug-in wrote"):
        other.remove_checkpoint(tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "b.ckpt")
    io.wait()  # the removal is queued behind the saves
    assert not (tmp_path / "b.ckpt").exists()
    io.teardown()


def test_pointer_for_latest_recovers_a_lost_pointer(tmp_path: Path) -> None:
    io = _io(tmp_path)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    _trainer(tmp_path, io, [ckpt], max_epochs=2).fit(LoggingModel())
    for f in (tmp_path / "ckpts").iterdir():  # e.g. the process died between the commit and the pointer
        f.unlink()
    ref = write_pointer_for_latest(tmp_path / "resume.ckpt", str(tmp_path / "store"), "run")
    assert ref is not None and ref.step == 6
    got = StoreCheckpointIO(url=str(tmp_path / "store"), run_id="run", identity=IDENT).load_checkpoint(
        tmp_path / "resume.ckpt"
    )
    assert got["global_step"] == 6


def test_store_holds_no_pickle(tmp_path: Path) -> None:
    io = _io(tmp_path)
    _trainer(tmp_path, io, [ModelCheckpoint(dirpath=tmp_path / "ckpts")], max_epochs=1).fit(LoggingModel())
    store = _reader(tmp_path)
    ref = store.latest_complete()
    assert ref is not None
    assert {DOC_COMPONENT, "tensors/state_dict.safetensors"} <= set(ref.components)
    assert all(n == DOC_COMPONENT or n.endswith(".safetensors") for n in ref.components)
    for name in ref.components:
        head = store.read(ref, name)[:2]
        assert head != b"\x80\x04" and not head.startswith(b"PK")  # neither a pickle nor a torch.save zip


def test_plugin_pickles_for_spawned_workers_and_refuses_an_open_store(tmp_path: Path) -> None:
    import pickle

    io = _io(tmp_path)
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(2)}}, tmp_path / "a.ckpt")
    worker = pickle.loads(pickle.dumps(io))  # what ddp_spawn does with the strategy's plug-ins
    worker.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.full((2,), 2.0)}}, tmp_path / "b.ckpt")
    assert read_pointer(tmp_path / "b.ckpt")["attempt"] == 2  # the worker opened the run itself
    assert io.load_checkpoint(tmp_path / "b.ckpt")["state_dict"]["w"].tolist() == [2.0, 2.0]

    with pytest.raises(TypeError, match="url=, run_id= and identity="):
        pickle.dumps(StoreCheckpointIO(CheckpointStore.open(str(tmp_path / "s2"), "r", identity=IDENT)))


def test_a_dict_without_global_step_is_written_detached_at_the_path(tmp_path: Path) -> None:
    # Lightning's spawn launcher hands the trained weights to the main process through the CheckpointIO
    io = _io(tmp_path)
    weights: dict[str, Any] = {"layer.weight": torch.randn(2, 3), "layer.bias": torch.zeros(2), "meta": {"n": 1}}
    io.save_checkpoint(weights, tmp_path / ".temp.ckpt")
    got = io.load_checkpoint(tmp_path / ".temp.ckpt")
    assert set(got) == set(weights) and got["meta"] == {"n": 1}
    assert torch.equal(got["layer.weight"], weights["layer.weight"])
    assert not (tmp_path / "store").exists()  # not a training checkpoint: the store is not even opened
    io.remove_checkpoint(tmp_path / ".temp.ckpt")
    assert not (tmp_path / ".temp.ckpt").exists()


def test_omegaconf_hyperparameters_round_trip(tmp_path: Path) -> None:
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"lr": 0.1, "name": "${model}", "model": "gpt", "sizes": [1, 2], "todo": "???"})
    omegaconf.OmegaConf.set_struct(cfg, True)
    io = _io(tmp_path)
    io.save_checkpoint({"global_step": 3, "hyper_parameters": cfg, "hparams_type": type(cfg),
                        "state_dict": {"w": torch.ones(1)}}, tmp_path / "o.ckpt")
    loaded = io.load_checkpoint(tmp_path / "o.ckpt")
    assert loaded["hparams_type"] is omegaconf.DictConfig  # Lightning stores the class itself
    got = loaded["hyper_parameters"]
    assert isinstance(got, omegaconf.DictConfig) and omegaconf.OmegaConf.is_struct(got)
    assert got.name == "gpt" and omegaconf.OmegaConf.is_missing(got, "todo")  # interpolation and ??? kept
    assert omegaconf.OmegaConf.to_container(got) == omegaconf.OmegaConf.to_container(cfg)

    @dataclasses.dataclass
    class Structured:
        lr: float = 0.1

    with pytest.raises(InvalidInputError, match="structured OmegaConf config"):
        io.save_checkpoint({"global_step": 4, "hyper_parameters": omegaconf.OmegaConf.structured(Structured)},
                           tmp_path / "s.ckpt")


class WithHparams(LoggingModel):
    def __init__(self, note: str = "x", scale: float = 1.0) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_load_module_builds_the_module_from_a_pointer(tmp_path: Path) -> None:
    from ckptstore.integrations.lightning import load_module

    model = WithHparams(note="hello", scale=2.5)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    _trainer(tmp_path, _io(tmp_path), [ckpt], max_epochs=1).fit(model)
    last = tmp_path / "ckpts" / "last.ckpt"
    got = load_module(WithHparams, last, url=str(tmp_path / "store"), run_id="run")
    assert isinstance(got, WithHparams) and got.hparams["note"] == "hello" and got.hparams["scale"] == 2.5
    assert all(torch.equal(got.state_dict()[k], v) for k, v in model.state_dict().items())
    assert load_module(WithHparams, last, allow_other_stores=True, note="override").hparams["note"] == "override"
    with pytest.raises(CorruptionError, match="refusing to read another store .* allow_other_stores=True"):
        load_module(WithHparams, last)  # a pointer names its store: which one to trust is the caller's to say

    reader = StoreCheckpointIO(url=str(tmp_path / "store"), run_id="run")  # no identity: loads only
    assert reader.load_checkpoint(last)["global_step"] == 3
    with pytest.raises(InvalidInputError, match="for loading only"):
        reader.save_checkpoint({"global_step": 9}, tmp_path / "x.ckpt")


def test_async_variant_refuses_on_the_callers_thread_and_reports_background_errors(tmp_path: Path) -> None:
    io = AsyncStoreCheckpointIO(url=str(tmp_path / "store"), run_id="run", identity=IDENT)
    with pytest.raises(InvalidInputError, match=r"checkpoint\['hyper_parameters'\]\['f'\]"):
        io.save_checkpoint({"global_step": 1, "hyper_parameters": {"f": object()}}, tmp_path / "a.ckpt")
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(2)}}, tmp_path / "a.ckpt")
    # a background failure (here: the pointer's directory cannot be created) surfaces at the next wait
    (tmp_path / "file").write_text("not a directory")
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.ones(2)}}, tmp_path / "file" / "b.ckpt")
    with pytest.raises(InvalidInputError, match="file/b.ckpt: 'file' is a symbolic link or not a directory"):
        io.wait()
    io.wait()  # reported once
    assert io.load_checkpoint(tmp_path / "a.ckpt")["global_step"] == 1
    io.teardown()


# ------------------------------------------------------------------ multi-rank (issue 24 item 1)


def test_two_rank_ddp_spawn_job_saves_and_resumes_with_both_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real 2-rank CPU jobs (ddp_spawn, gloo on 127.0.0.1): rank 0 saves (the store is opened as the single
    writer of the job), every rank resumes through the pointer, the trained weights come back to the main
    process through the plug-in's hand-off file. StoreCheckpointIO saves; AsyncStoreCheckpointIO resumes from
    it and saves; StoreCheckpointIO resumes from that and saves."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    handoff = tmp_path / "tmp"  # where the spawn launcher's tempfile.mkdtemp() puts its hand-off file
    handoff.mkdir()
    monkeypatch.setenv("TMPDIR", str(handoff))
    monkeypatch.setattr(tempfile, "tempdir", str(handoff))
    ident = RunIdentity(data_digest="random-64", code_digest="boring-1", world_size=2)
    last = tmp_path / "ckpts" / "last.ckpt"

    def run(plugin: Any, max_epochs: int, resume: bool) -> LoggingModel:
        io = plugin(url=str(tmp_path / "store"), run_id="run", identity=ident)
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True, save_top_k=1, monitor="step", mode="max")
        trainer = _trainer(tmp_path, io, [ckpt], max_epochs=max_epochs, strategy="ddp_spawn", accelerator="cpu",
                           devices=2, limit_train_batches=2)
        model = LoggingModel()
        trainer.fit(model, ckpt_path=str(last) if resume else None)
        return model

    def check(model: LoggingModel, step: int, attempts: int) -> None:
        store = _reader(tmp_path)
        assert sorted(s.step for s in store.list_saves()) == list(range(2, step + 1, 2))
        recs = store.attempts()
        assert [a.number for a in recs] == list(range(1, attempts + 1))  # rank 0 alone registered each job
        assert recs[-1].resumed_from == (step - 2 if attempts > 1 else None)
        got = StoreCheckpointIO(url=str(tmp_path / "store"), run_id="run").load_checkpoint(last)
        assert got["global_step"] == step
        # the weights the spawn launcher handed back to the main process are the ones saved last
        assert all(torch.equal(got["state_dict"][k], v) for k, v in model.state_dict().items())
        assert sorted(os.listdir(tmp_path / "ckpts")) == [f"epoch={step // 2 - 1}-step={step}.ckpt", "last.ckpt"]
        assert [p.name for p in handoff.rglob("*") if not p.is_dir()] == []  # the hand-off file was removed
        assert len(list(handoff.iterdir())) == attempts  # ... and there was one per job

    check(run(StoreCheckpointIO, 1, False), 2, 1)
    check(run(AsyncStoreCheckpointIO, 2, True), 4, 2)
    check(run(StoreCheckpointIO, 3, True), 6, 3)


def test_save_last_link_reads_and_removes_only_sibling_links_to_its_own_pointers(tmp_path: Path) -> None:
    """``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a link to the newest top-k file of
    the same directory and asks the plug-in to remove the previous link: a sibling link to one of the
    plug-in's own pointers is read and removed (the link, never its target); any other link is not."""
    ckpts = tmp_path / "ckpts"
    io = _io(tmp_path)
    model = LoggingModel()
    ckpt = ModelCheckpoint(dirpath=ckpts, monitor="step", mode="max", save_top_k=1, save_last="link",
                           filename="{epoch}-{step}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RemovalRefusedWarning)
        _trainer(tmp_path, io, [ckpt], max_epochs=3).fit(model)
    assert sorted(os.listdir(ckpts)) == ["epoch=2-step=9.ckpt", "last.ckpt"]  # no stale links pile up
    assert os.readlink(ckpts / "last.ckpt") == "epoch=2-step=9.ckpt"
    loaded = io.load_checkpoint(ckpts / "last.ckpt")
    assert loaded["global_step"] == 9
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in model.state_dict().items())

    io2 = _io(tmp_path)  # resume through the link, in a new attempt
    ckpt2 = ModelCheckpoint(dirpath=ckpts, monitor="step", mode="max", save_top_k=1, save_last="link",
                            filename="{epoch}-{step}")
    trainer = _trainer(tmp_path, io2, [ckpt2], max_epochs=4)
    trainer.fit(LoggingModel(), ckpt_path=str(ckpts / "last.ckpt"))
    assert io2.store.resumed_from is not None and io2.store.resumed_from.step == 9
    assert trainer.global_step == 12 and os.readlink(ckpts / "last.ckpt") == "epoch=3-step=12.ckpt"

    # links the plug-in must neither read through nor remove
    other = StoreCheckpointIO(url=str(tmp_path / "other"), run_id="run", identity=IDENT)
    other.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(1)}}, ckpts / "theirs.ckpt")
    (ckpts / "sub").mkdir()
    (ckpts / "sub" / "x.ckpt").write_bytes((ckpts / "epoch=3-step=12.ckpt").read_bytes())
    (ckpts / "to-theirs.ckpt").symlink_to("theirs.ckpt")
    (ckpts / "to-sub.ckpt").symlink_to("sub/x.ckpt")
    (ckpts / "to-abs.ckpt").symlink_to(ckpts / "epoch=3-step=12.ckpt")
    (ckpts / "chain.ckpt").symlink_to("last.ckpt")
    (ckpts / "dangling.ckpt").symlink_to("gone.ckpt")
    for name, cause in {"to-theirs.ckpt": "link to 'theirs.ckpt', which is .*not to this plug-in's run",
                        "to-sub.ckpt": "symbolic link", "to-abs.ckpt": "symbolic link",
                        "chain.ckpt": "symbolic link", "dangling.ckpt": "'gone.ckpt', which is not there"}.items():
        with pytest.warns(RemovalRefusedWarning, match=cause):
            io2.remove_checkpoint(ckpts / name)
        assert (ckpts / name).is_symlink()
    for name in ("to-sub.ckpt", "to-abs.ckpt", "chain.ckpt"):
        with pytest.raises(CorruptionError, match="symbolic link"):
            io2.load_checkpoint(ckpts / name)
    with pytest.raises(CorruptionError, match="to-theirs.ckpt: the pointer names run 'run' at .*other"):
        io2.load_checkpoint(ckpts / "to-theirs.ckpt")  # followed one hop, then judged like any pointer
    io2.remove_checkpoint(ckpts / "last.ckpt")
    assert not (ckpts / "last.ckpt").exists() and (ckpts / "epoch=3-step=12.ckpt").is_file()
