"""The Hugging Face Trainer plug-in: a tiny GPT-2 built from a config (no downloads), CPU only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from ckptstore import CheckpointStore, RunIdentity
from ckptstore.integrations.hf import StoreCallback, restore_latest
from tests.incremental.common import stored_at

IDENT = RunIdentity(data_digest="tokens-32", code_digest="gpt2-tiny", world_size=1)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 32, (32, 8), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)  # type: ignore[no-untyped-call]
    return GPT2LMHeadModel(cfg)  # type: ignore[no-untyped-call]


def _trainer(out: Path, max_steps: int, callbacks: list[Any]) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out), max_steps=max_steps, save_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
        report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no", seed=0, dataloader_num_workers=0,
        save_strategy="steps",
    )
    trainer: Trainer = Trainer(model=_model(), args=args, train_dataset=Tokens(), callbacks=callbacks)
    return trainer


def _store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore.open(str(tmp_path / "store"), "hf-run", identity=IDENT)


class DieBeforePublishing(TrainerCallback):
    """Stands in for a kill at step ``at``: the Trainer wrote checkpoint-N, nothing after it ran."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if state.global_step == self.at:
            raise KeyboardInterrupt("killed")


def test_each_checkpoint_dir_is_published_as_one_save(tmp_path: Path) -> None:
    cb = StoreCallback(lambda: _store(tmp_path))
    _trainer(tmp_path / "out", 6, [cb]).train()
    assert [r.step for r in cb.published] == [2, 4, 6]
    reader = CheckpointStore.open(str(tmp_path / "store"), "hf-run", mode="r")
    ref = reader.latest_complete(deep=True)
    assert ref is not None and ref.step == 6
    on_disk = sorted(p.relative_to(tmp_path / "out" / "checkpoint-6").as_posix()
                     for p in (tmp_path / "out" / "checkpoint-6").rglob("*") if p.is_file())
    assert sorted(n.removeprefix("files/") for n in ref.components) == on_disk
    assert {"model.safetensors", "trainer_state.json", "optimizer.pt"} <= set(on_disk)
    assert reader.read(ref, "files/trainer_state.json") == (tmp_path / "out" / "checkpoint-6" / "trainer_state.json").read_bytes()


def test_partial_newest_dir_is_set_aside_and_resume_continues_like_an_uninterrupted_run(tmp_path: Path) -> None:
    # the reference: 8 steps without interruption
    ref_trainer = _trainer(tmp_path / "ref", 8, [])
    ref_trainer.train()
    assert ref_trainer.model is not None
    want = {k: v.clone() for k, v in ref_trainer.model.state_dict().items()}

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _trainer(out, 8, [DieBeforePublishing(at=6), StoreCallback(_store(tmp_path))]).train()
    # checkpoint-6 was written but never published; make it partial as a kill mid-write would
    (out / "checkpoint-6" / "optimizer.pt").unlink()
    with open(out / "checkpoint-6" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    # and damage the older one on disk too: the store's copy is what counts
    (out / "checkpoint-4" / "rng_state.pth").write_bytes(b"garbage")

    path = restore_latest(str(tmp_path / "store"), out, run_id="hf-run")
    assert path == str(out / "checkpoint-4")
    names = sorted(os.listdir(out))
    assert "checkpoint-6" not in names and any(n.startswith("checkpoint-6.incomplete-") for n in names)
    assert any(n.startswith("checkpoint-4.incomplete-") for n in names)  # the damaged copy, kept aside
    assert (out / "checkpoint-4" / "rng_state.pth").read_bytes() != b"garbage"

    # the Trainer's own choice now finds the restored one
    from transformers.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(str(out)) == path  # type: ignore[no-untyped-call]

    resumed = _trainer(out, 8, [StoreCallback(_store(tmp_path))])
    resumed.train(resume_from_checkpoint=path)
    assert resumed.state.global_step == 8
    assert resumed.model is not None
    got = resumed.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), "resumed run diverged from the uninterrupted one"
    latest = CheckpointStore.open(str(tmp_path / "store"), "hf-run", mode="r").latest_complete()
    assert latest is not None and latest.step == 8


def test_restore_skips_a_save_whose_bytes_rotted_and_keeps_a_matching_dir(tmp_path: Path) -> None:
    cb = StoreCallback(_store(tmp_path))
    _trainer(tmp_path / "out", 4, [cb]).train()
    out = tmp_path / "out"
    mtime = (out / "checkpoint-4" / "model.safetensors").stat().st_mtime_ns
    assert restore_latest(cb.store, out) == str(out / "checkpoint-4")
    assert (out / "checkpoint-4" / "model.safetensors").stat().st_mtime_ns == mtime  # matching: left alone

    # flip a byte of step 4's model in the store: the copy fails verification, step 2 is restored
    step4 = cb.published[-1]
    name = next(n for n in step4.components if n.endswith("/model.safetensors"))
    key, at = stored_at("hf-run", step4, name, step4.components[name].size // 2)  # its file; on version 3 a piece
    comp = tmp_path / "store" / key
    data = bytearray(comp.read_bytes())
    data[at] ^= 0x01
    comp.write_bytes(bytes(data))
    (out / "checkpoint-4").rename(out / "gone-4")
    (out / "checkpoint-2").rename(out / "gone-2")
    assert restore_latest(str(tmp_path / "store"), out, run_id="hf-run") == str(out / "checkpoint-2")
    assert not (out / "checkpoint-4").exists()
    assert not [n for n in os.listdir(out) if n.startswith(".checkpoint-")]  # no temp dir left behind


def test_restore_on_an_empty_run_returns_none(tmp_path: Path) -> None:
    _store(tmp_path)
    assert restore_latest(str(tmp_path / "store"), tmp_path / "out", run_id="hf-run") is None


def test_process_group_path_barriers_and_broadcast(tmp_path: Path) -> None:
    """With torch.distributed initialized (a one-process gloo group here), the callback goes through its
    barrier and broadcast, and rank 0's restore sends its path over the group: no marker file is written
    (two ranks: tests/fail_closed/test_hf_planted.py)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        cb = StoreCallback(lambda: _store(tmp_path))
        _trainer(tmp_path / "out", 4, [cb]).train()
        assert [r.step for r in cb.published] == [2, 4]
        path = restore_latest(str(tmp_path / "store"), tmp_path / "out", run_id="hf-run")
        assert path == str(tmp_path / "out" / "checkpoint-4")
        assert not [n for n in os.listdir(tmp_path / "out") if not n.startswith("checkpoint-")]
    finally:
        dist.destroy_process_group()


def test_restore_step_restores_that_step_and_leaves_newer_dirs(tmp_path: Path) -> None:
    from ckptstore.integrations.hf import restore_step

    _trainer(tmp_path / "out", 4, [StoreCallback(_store(tmp_path))]).train()
    out = tmp_path / "out"
    (out / "checkpoint-2").rename(tmp_path / "moved")
    assert restore_step(str(tmp_path / "store"), out, 2, run_id="hf-run") == str(out / "checkpoint-2")
    assert (out / "checkpoint-2" / "trainer_state.json").read_bytes() == (tmp_path / "moved" / "trainer_state.json").read_bytes()
    assert (out / "checkpoint-4").is_dir()  # an explicit step does not set newer directories aside
    assert restore_step(str(tmp_path / "store"), out, 3, run_id="hf-run") is None


def test_restored_checkpoint_files_are_the_trainers_bytes_so_key_order_is_kept(tmp_path: Path) -> None:
    """Issue 24 item 3 on the HF path: the plug-in stores the Trainer's files byte for byte, so the tensor
    and key order of model.safetensors and optimizer.pt is the Trainer's own after a restore."""
    from safetensors import safe_open

    _trainer(tmp_path / "out", 2, [StoreCallback(_store(tmp_path))]).train()
    path = restore_latest(str(tmp_path / "store"), tmp_path / "fresh", run_id="hf-run")
    assert path == str(tmp_path / "fresh" / "checkpoint-2")
    src = tmp_path / "out" / "checkpoint-2"
    for f in src.rglob("*"):
        if f.is_file():
            assert (Path(path) / f.relative_to(src)).read_bytes() == f.read_bytes(), f.name
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as st:  # type: ignore[no-untyped-call]
        assert set(st.keys()) <= set(_model().state_dict())
