"""Forged and planted files against the Lightning plug-in (issue 18 class 5,
``protocol_spec/THREATS.md`` §4.5), tried as someone with write access to the
checkpoint directory would: pointers that make a resumed run delete a file
outside the store, pointers whose inline state or named store carries
attacker weights, detached files loaded as checkpoints, malformed pointers.

Each test runs with the store on local disk, SeaweedFS and fake-gcs-server
(pointer files on the local disk, where Lightning's ``ModelCheckpoint`` puts them), snapshots
everything outside the store before and after, checks the error or warning
names the cause, and that the legitimate checkpoint still loads bit for bit.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import uuid
from pathlib import Path
from typing import Any

import blake3
import pytest

pytest.importorskip("lightning")

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from ckptstore import CorruptionError, RunIdentity
from ckptstore.core.record_auth import UnauthenticatedWarning
from ckptstore.errors import CkptStoreError, InvalidInputError
from ckptstore.integrations.lightning import (
    RemovalRefusedWarning,
    StoreCheckpointIO,
    read_pointer,
)
from ckptstore.integrations.lightning.files import DETACHED_MAGIC
from ckptstore.integrations.lightning.trust import pointer_cap
from ckptstore.protocol.auth import Keyring
from ckptstore.torch.codec import flatten, safetensors_stream, tree_to_json
from tests.fail_closed.test_planted_local import snapshot
from tests.integrations.test_lightning import LoggingModel

backend_kinds = ("local", "seaweedfs", "fakegcs")

IDENT = RunIdentity(data_digest="random-64", code_digest="boring-1", world_size=1)
KEYS = Keyring({"k1": b"\x11" * 32})
WEIGHTS = {"w": torch.arange(6.0), "b": torch.tensor([0.5, -2.0], dtype=torch.bfloat16)}
EVIL = {"w": torch.full((6,), 666.0), "b": torch.tensor([6.0, 6.0], dtype=torch.bfloat16)}


@pytest.fixture
def store_at(backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """The URL and storage options of this test's store."""
    if backend_kind == "local":
        return str(tmp_path / "store"), {}
    servers = request.getfixturevalue("object_servers")
    url, opts = servers.url_and_options(backend_kind, f"lh-{uuid.uuid4().hex[:12]}")
    return url, dict(opts)


def plugin(store_at: tuple[str, dict[str, Any]], **kw: Any) -> StoreCheckpointIO:
    url, opts = store_at
    return StoreCheckpointIO(url=url, run_id="run", identity=IDENT, storage_options=opts, **kw)


def legit(io: StoreCheckpointIO, ckpts: Path) -> dict[str, Any]:
    """best.ckpt and last.ckpt at step 4; last.ckpt carries its callback state inline."""
    ck = {"global_step": 4, "epoch": 0, "state_dict": dict(WEIGHTS), "callbacks": {"cb": {"score": 1}}}
    io.save_checkpoint(ck, ckpts / "best.ckpt")
    last = {**ck, "callbacks": {"cb": {"score": 2, "best": str(ckpts / "best.ckpt")}}}
    io.save_checkpoint(last, ckpts / "last.ckpt")
    assert set(read_pointer(ckpts / "last.ckpt")["inline"]) == {"callbacks"}
    return last


def assert_loads_bit_for_bit(io: StoreCheckpointIO, path: Path, expected: dict[str, Any]) -> None:
    got = io.load_checkpoint(path)
    assert got["callbacks"] == expected["callbacks"] and got["global_step"] == expected["global_step"]
    for k, t in expected["state_dict"].items():
        assert got["state_dict"][k].dtype == t.dtype and torch.equal(got["state_dict"][k], t)


def forge(path: Path, **changes: Any) -> None:
    """Rewrite the pointer at ``path`` as an attacker can: fields changed, the unkeyed inline digest redone."""
    doc = json.loads(path.read_text())
    doc.update(changes)
    doc["inline_digest"] = blake3.blake3(tree_to_json(doc["inline"])).hexdigest()
    path.write_text(json.dumps(doc))


def inline_entry(value: Any) -> dict[str, Any]:
    fl = flatten(value)
    blob = b"".join(bytes(c) for c in safetensors_stream(fl.tensors)[1]) if fl.tensors else None
    return {"tree": fl.tree, "tensors": base64.b64encode(blob).decode() if blob else None}


def outside(tmp_path: Path) -> Path:
    victim = tmp_path / "victim" / "file"
    victim.parent.mkdir()
    victim.write_bytes(b"precious: not a checkpoint of this plug-in")
    return victim


# ------------------------------------------------------------------ removal


def test_removal_keeps_every_file_the_plugin_did_not_write(
    tmp_path: Path, store_at: tuple[str, dict[str, Any]], backend_kind: str, object_servers: Any
) -> None:
    ckpts = tmp_path / "ckpts"
    io = plugin(store_at)
    expected = legit(io, ckpts)
    victim = outside(tmp_path)
    (ckpts / "link.ckpt").symlink_to(ckpts / "best.ckpt")
    (ckpts / "dirlink").symlink_to(ckpts)
    (ckpts / "model.ckpt").write_bytes(b"PK\x03\x04 a torch.save zip of someone else's")
    os.mkfifo(ckpts / "fifo.ckpt")
    (ckpts / "big.ckpt").write_bytes(b"{" + b" " * pointer_cap(io.max_inline_bytes))
    other = StoreCheckpointIO(url=str(tmp_path / "other"), run_id="run", identity=IDENT)
    other.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(1)}}, ckpts / "theirs.ckpt")
    cases = {
        str(ckpts / ".." / "victim" / "file"): "path contains '..'",
        "../victim/file": "path contains '..'",
        str(ckpts / "link.ckpt"): "symbolic link",
        str(ckpts / "dirlink" / "best.ckpt"): "'dirlink' is a symbolic link .*below the checkpoint directory",
        str(ckpts / "model.ckpt"): "not a ckptstore pointer file",
        str(ckpts / "fifo.ckpt"): "not a regular file",
        str(ckpts / "big.ckpt"): "more than the",
        str(ckpts / "theirs.ckpt"): "a pointer to run 'run' at .*other, not to this plug-in's run",
        str(victim): "below none of the directories this plug-in saved checkpoints into",
    }
    if backend_kind != "local":  # any object the job's credentials reach
        url, opts = store_at
        victim_url = f"{url}-victim/file"
        fs = io_fs(victim_url, opts)
        fs.pipe_file(victim_url, b"precious object")
        cases[victim_url] = "below none of the directories"
        cases[f"{url}/../victim/file"] = "path contains '..'"
    allowing = plugin(store_at, allow_other_stores=True)
    allowing.save_checkpoint({"w": torch.ones(1)}, ckpts / "handoff.ckpt")  # ckpts is its checkpoint directory too
    allowing.remove_checkpoint(ckpts / "handoff.ckpt")
    before = snapshot(tmp_path)
    for path, cause in cases.items():
        with pytest.warns(RemovalRefusedWarning, match=f"{path[:20]}.*not removed: .*{cause}"):
            io.remove_checkpoint(path)
    with pytest.warns(RemovalRefusedWarning, match="not to this plug-in's run"):
        allowing.remove_checkpoint(ckpts / "theirs.ckpt")  # reads, never removes
    assert snapshot(tmp_path) == before
    if backend_kind != "local":
        fs.invalidate_cache()
        assert fs.cat_file(victim_url) == b"precious object"

    io.remove_checkpoint(ckpts / "best.ckpt")  # its own pointer: removed, the save stays
    io.remove_checkpoint(ckpts / "missing.ckpt")  # nothing there: nothing to do
    del before["ckpts/best.ckpt"]
    before.pop("ckpts/dirlink/best.ckpt", None)
    after = snapshot(tmp_path)
    after.pop("ckpts/dirlink/best.ckpt", None)
    assert after == before
    assert_loads_bit_for_bit(io, ckpts / "last.ckpt", expected)


def io_fs(url: str, opts: dict[str, Any]) -> Any:
    from lightning.fabric.utilities.cloud_io import get_filesystem

    return get_filesystem(url, **opts)


def test_forged_callback_state_never_makes_a_resumed_run_delete_a_file(
    tmp_path: Path, store_at: tuple[str, dict[str, Any]], backend_kind: str
) -> None:
    """The reviewed attack: last.ckpt's ModelCheckpoint state names ``ckpts/../victim/file`` (and, on an
    object store, an object of the bucket) as the previous best and last files; Lightning hands those to
    ``remove_checkpoint`` when the resumed run saves its own."""
    ckpts = tmp_path / "ckpts"

    def trainer(max_epochs: int) -> tuple[Trainer, StoreCheckpointIO]:
        io = plugin(store_at)
        cb = ModelCheckpoint(dirpath=ckpts, save_last=True)
        return Trainer(default_root_dir=tmp_path, plugins=[io], callbacks=[cb], limit_train_batches=2,
                       limit_val_batches=1, max_epochs=max_epochs, enable_progress_bar=False,
                       enable_model_summary=False, logger=False, num_sanity_val_steps=0), io

    t1, io1 = trainer(1)
    model = LoggingModel()
    t1.fit(model)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    victim = outside(tmp_path)
    traversal = str(ckpts) + "/../victim/file"
    remote = None
    if backend_kind != "local":
        remote = f"{store_at[0]}-victim/obj"
        io_fs(remote, store_at[1]).pipe_file(remote, b"precious object")

    last = ckpts / "last.ckpt"
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "last.ckpt").write_bytes(last.read_bytes())
    state = io1.load_checkpoint(last)["callbacks"]
    key = next(k for k in state if k.startswith("ModelCheckpoint"))
    state[key].update(best_model_path=remote or traversal, last_model_path=traversal,
                      kth_best_model_path=traversal, best_k_models={traversal: torch.tensor(0.0)})
    doc = json.loads(last.read_text())
    forge(last, inline={**doc["inline"], "callbacks": inline_entry(state)})
    before = snapshot(tmp_path / "victim")

    t2, io2 = trainer(2)
    with pytest.warns(RemovalRefusedWarning, match="not removed") as seen:
        t2.fit(LoggingModel(), ckpt_path=str(last))
    refused = " ".join(str(w.message) for w in seen if w.category is RemovalRefusedWarning)
    assert "path contains '..'" in refused and (remote is None or remote in refused)
    assert snapshot(tmp_path / "victim") == before and victim.read_bytes().startswith(b"precious")
    if remote is not None:
        fs = io_fs(remote, store_at[1])
        fs.invalidate_cache()
        assert fs.cat_file(remote) == b"precious object"
    # the saves are intact: step 2 still loads bit for bit through its own pointer, the resumed run saved step 4
    got = io2.load_checkpoint(tmp_path / "kept" / "last.ckpt")
    assert got["global_step"] == 2 and all(torch.equal(got["state_dict"][k], v) for k, v in saved.items())
    assert 4 in {read_pointer(p)["step"] for p in ckpts.glob("*.ckpt")}  # (last-v1.ckpt: the forged last_model_path)


def test_a_linked_directory_in_a_removal_path_is_never_followed(
    tmp_path: Path, store_at: tuple[str, dict[str, Any]], backend_kind: str
) -> None:
    """Issue 30 class 9, through a real ``Trainer`` resume: last.ckpt's forged ModelCheckpoint state names
    ``ckpts/linked/sub/best.ckpt`` as the previous best and last files, ``linked`` a link to a directory
    outside that holds a copy of one of the run's own pointers (lexically below ``dirpath``, so Lightning
    asks for its removal). Below its checkpoint directory the plug-in opens every component without
    following a link: the copy outside stays, and reading or saving through the link is refused too."""
    ckpts = tmp_path / "ckpts"

    def trainer(max_epochs: int) -> tuple[Trainer, StoreCheckpointIO]:
        io = plugin(store_at)
        cb = ModelCheckpoint(dirpath=ckpts, save_last=True)
        return Trainer(default_root_dir=tmp_path, plugins=[io], callbacks=[cb], limit_train_batches=2,
                       limit_val_batches=1, max_epochs=max_epochs, enable_progress_bar=False,
                       enable_model_summary=False, logger=False, num_sanity_val_steps=0), io

    t1, io1 = trainer(1)
    model = LoggingModel()
    t1.fit(model)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    last = ckpts / "last.ckpt"
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "sub").mkdir(parents=True)
    copy = elsewhere / "sub" / "best.ckpt"
    copy.write_bytes(last.read_bytes())  # a pointer of the run's own, outside the checkpoint directory
    (ckpts / "linked").symlink_to(elsewhere, target_is_directory=True)
    planted = str(ckpts / "linked" / "sub" / "best.ckpt")
    state = io1.load_checkpoint(last)["callbacks"]
    key = next(k for k in state if k.startswith("ModelCheckpoint"))
    state[key].update(best_model_path=planted, last_model_path=planted, kth_best_model_path=planted,
                      best_k_models={planted: torch.tensor(0.0)})
    doc = json.loads(last.read_text())
    forge(last, inline={**doc["inline"], "callbacks": inline_entry(state)})
    before = snapshot(elsewhere)

    t2, io2 = trainer(2)
    with pytest.warns(RemovalRefusedWarning, match="not removed") as seen:
        t2.fit(LoggingModel(), ckpt_path=str(last))
    refused = [str(w.message) for w in seen if w.category is RemovalRefusedWarning]
    assert refused and all(m.startswith(f"{planted}: not removed: 'linked' is a symbolic link") for m in refused)
    assert all(f"below the checkpoint directory {ckpts}" in m and "replace the link" in m for m in refused)
    assert snapshot(elsewhere) == before

    # reading and saving through the link: refused, naming the path and the fix; nothing is committed
    with pytest.raises(CorruptionError, match=f"{planted}: 'linked' is a symbolic link.*replace the link"):
        io2.load_checkpoint(planted)
    steps = {s.step for s in io2.store.list_saves()}
    with pytest.raises(InvalidInputError, match="evil.ckpt: 'linked' is a symbolic link.*replace the link"):
        io2.save_checkpoint({"global_step": 99, "state_dict": dict(EVIL)}, ckpts / "linked" / "sub" / "evil.ckpt")
    assert {s.step for s in io2.store.list_saves()} == steps and 99 not in steps
    assert snapshot(elsewhere) == before
    # the saves are intact: the copy (read where the operator names it) loads step 2 bit for bit
    got = io2.load_checkpoint(copy)
    assert got["global_step"] == 2 and all(torch.equal(got["state_dict"][k], v) for k, v in saved.items())
    assert 4 in {read_pointer(p)["step"] for p in ckpts.glob("*.ckpt")}


def test_a_pointer_outside_its_checkpoint_directories_is_never_removed(
    tmp_path: Path, store_at: tuple[str, dict[str, Any]], backend_kind: str
) -> None:
    """A pointer names its run, not where it was written: a copy of one of the run's own pointers
    outside the directories the plug-in saved into (another local directory, or another prefix of the
    bucket when the pointer files are on the object store too) is kept; a plug-in that saved nothing
    yet removes no pointer; its own pointer in its directory goes."""
    url, opts = store_at
    base = str(tmp_path) if backend_kind == "local" else url
    ck, elsewhere = f"{base}-ck", f"{base}-elsewhere"
    fs = io_fs(ck, opts)
    io = plugin(store_at)
    io.save_checkpoint({"global_step": 4, "epoch": 0, "state_dict": dict(WEIGHTS), "callbacks": {}}, f"{ck}/best.ckpt")
    pointer = fs.cat_file(f"{ck}/best.ckpt")
    fs.makedirs(elsewhere, exist_ok=True)
    fs.pipe_file(f"{elsewhere}/best.ckpt", pointer)
    for p in (io, plugin(store_at)):
        with pytest.warns(RemovalRefusedWarning, match="not removed: .*below none of the directories this plug-in "
                                                       "saved checkpoints into"):
            p.remove_checkpoint(f"{elsewhere}/best.ckpt")
    with pytest.warns(RemovalRefusedWarning, match=r"below none of the directories .*\(none yet\)"):
        plugin(store_at).remove_checkpoint(f"{ck}/best.ckpt")  # a fresh plug-in has saved nowhere yet
    fs.invalidate_cache()
    assert fs.cat_file(f"{elsewhere}/best.ckpt") == pointer and fs.cat_file(f"{ck}/best.ckpt") == pointer
    got = io.load_checkpoint(f"{elsewhere}/best.ckpt")  # still the run's save, read where it is named
    assert all(torch.equal(got["state_dict"][k], v) for k, v in WEIGHTS.items())
    io.remove_checkpoint(f"{ck}/best.ckpt")
    fs.invalidate_cache()
    assert not fs.exists(f"{ck}/best.ckpt") and fs.cat_file(f"{elsewhere}/best.ckpt") == pointer


# ------------------------------------------------------------------ what a load returns


def test_inline_state_needs_the_run_key_under_require(tmp_path: Path, store_at: tuple[str, dict[str, Any]]) -> None:
    ckpts = tmp_path / "ckpts"
    io = plugin(store_at, auth_policy="require", keyring=KEYS)
    expected = legit(io, ckpts)
    assert "auth" in read_pointer(ckpts / "last.ckpt")  # its pointers are tagged with the run's key
    assert_loads_bit_for_bit(io, ckpts / "last.ckpt", expected)

    good = (ckpts / "last.ckpt").read_bytes()
    evil = {"state_dict": inline_entry(EVIL)}
    for name, drop_tag in (("tagless.ckpt", True), ("badtag.ckpt", False)):
        p = ckpts / name
        p.write_bytes(good)
        doc = json.loads(good)
        if drop_tag:
            doc.pop("auth")
        p.write_text(json.dumps(doc))
        forge(p, inline={**doc["inline"], **evil})
    before = snapshot(tmp_path)
    for name, cause in (("tagless.ckpt", "no tag"), ("badtag.ckpt", "bad tag")):
        with pytest.raises(CorruptionError, match=f"{name}: the pointer carries state .*state_dict.* not authenticated .*{cause}"):
            io.load_checkpoint(ckpts / name)
        with pytest.raises(CorruptionError, match="not authenticated"):  # a fresh process: same answer
            plugin(store_at, auth_policy="require", keyring=KEYS).load_checkpoint(ckpts / name)
    # warn: used, and said so
    with pytest.warns(UnauthenticatedWarning, match="tagless.ckpt: inline state .*state_dict.* used although"):
        got = plugin(store_at, auth_policy="warn", keyring=KEYS).load_checkpoint(ckpts / "tagless.ckpt")
    assert torch.equal(got["state_dict"]["w"], EVIL["w"])  # what "warn" means
    assert snapshot(tmp_path) == before
    assert_loads_bit_for_bit(io, ckpts / "last.ckpt", expected)


def test_a_pointer_to_an_unauthenticated_commit_of_its_own_run_is_refused_under_require(
    tmp_path: Path, store_at: tuple[str, dict[str, Any]]
) -> None:
    ckpts = tmp_path / "ckpts"
    io = plugin(store_at, auth_policy="require", keyring=KEYS)
    expected = legit(io, ckpts)
    # a writer without the key (auth off) commits the attacker's weights into the same run, and points to them
    plugin(store_at).save_checkpoint({"global_step": 9, "state_dict": dict(EVIL)}, ckpts / "evil.ckpt")
    assert read_pointer(ckpts / "evil.ckpt")["run_id"] == "run" and "auth" not in read_pointer(ckpts / "evil.ckpt")
    before = snapshot(tmp_path)
    for p in (io, plugin(store_at, auth_policy="require", keyring=KEYS)):
        with pytest.raises(CorruptionError, match="evil.ckpt: the commit of step 9 attempt 2 is refused under "
                                                  "auth_policy='require': .*no tag"):
            p.load_checkpoint(ckpts / "evil.ckpt")
    assert snapshot(tmp_path) == before
    assert_loads_bit_for_bit(io, ckpts / "last.ckpt", expected)


def test_a_pointer_naming_another_store_or_run_is_refused(tmp_path: Path, store_at: tuple[str, dict[str, Any]]) -> None:
    ckpts = tmp_path / "ckpts"
    io = plugin(store_at, auth_policy="require", keyring=KEYS)
    expected = legit(io, ckpts)
    # the attacker's own store and run, with their weights, and a well-formed pointer to it
    evil = StoreCheckpointIO(url=str(tmp_path / "evil"), run_id="run", identity=IDENT)
    evil.save_checkpoint({"global_step": 9, "state_dict": dict(EVIL)}, ckpts / "evil.ckpt")
    other_run = StoreCheckpointIO(url=store_at[0], run_id="other", identity=IDENT, storage_options=store_at[1],
                                  auth_policy="require", keyring=KEYS)
    other_run.save_checkpoint({"global_step": 9, "state_dict": dict(EVIL)}, ckpts / "other-run.ckpt")
    before = snapshot(tmp_path)
    for name in ("evil.ckpt", "other-run.ckpt"):
        for p in (io, plugin(store_at), plugin(store_at, auth_policy="require", keyring=KEYS)):
            with pytest.raises(CorruptionError, match=f"{name}: the pointer names run .* not this plug-in's .*"
                                                      "refusing to read another store .*allow_other_stores=True"):
                p.load_checkpoint(ckpts / name)
    with pytest.raises(CorruptionError, match="refusing to read another store"):
        StoreCheckpointIO().load_checkpoint(ckpts / "evil.ckpt")  # a load-only plug-in trusts no store by default
    # allowed: the other store is opened with the plug-in's own policy and key, so an unauthenticated run is refused
    allowing = plugin(store_at, auth_policy="require", keyring=KEYS, allow_other_stores=True)
    with pytest.raises(CkptStoreError, match="(?i)authenticat"):
        allowing.load_checkpoint(ckpts / "evil.ckpt")
    assert allowing.load_checkpoint(ckpts / "other-run.ckpt")["global_step"] == 9  # same key: its own data
    assert snapshot(tmp_path) == before
    assert_loads_bit_for_bit(io, ckpts / "last.ckpt", expected)


def test_detached_files_load_only_in_the_plugin_that_wrote_them(
    tmp_path: Path, store_at: tuple[str, dict[str, Any]]
) -> None:
    ckpts = tmp_path / "ckpts"
    io = plugin(store_at, auth_policy="require", keyring=KEYS)
    expected = legit(io, ckpts)
    io.save_checkpoint({"layer.weight": WEIGHTS["w"]}, tmp_path / "handoff.ckpt")  # no global_step: detached
    assert (tmp_path / "handoff.ckpt").read_bytes().startswith(DETACHED_MAGIC)
    spawned = pickle.loads(pickle.dumps(io))  # what ddp_spawn sends to its workers
    assert torch.equal(spawned.load_checkpoint(tmp_path / "handoff.ckpt")["layer.weight"], WEIGHTS["w"])

    # the attacker's detached file (written by their own plug-in) claiming to be a training checkpoint
    StoreCheckpointIO().save_checkpoint({"global_step": "4", "state_dict": dict(EVIL)}, ckpts / "forged.ckpt")
    raw = (tmp_path / "handoff.ckpt").read_bytes()
    (ckpts / "flipped.ckpt").write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))  # ours, one bit flipped
    (ckpts / "short.ckpt").write_bytes(raw[: len(DETACHED_MAGIC) + 2])
    # the previous format: a safetensors file whose metadata said "detached"
    meta = {"format": "ckptstore.lightning-detached/1", "doc": '{"keys":["global_step"],"trees":{"global_step":4}}'}
    (ckpts / "v1.ckpt").write_bytes(b"".join(bytes(c) for c in safetensors_stream({"x": torch.ones(1)}, meta)[1]))
    before = snapshot(tmp_path)
    cases = {"forged.ckpt": "not written by this plug-in", "flipped.ckpt": "truncated or altered",
             "short.ckpt": "not a detached file", "v1.ckpt": "not a ckptstore pointer file"}
    for name, cause in cases.items():
        with pytest.raises(CorruptionError, match=f"{name}: .*{cause}"):
            io.load_checkpoint(ckpts / name)
        with pytest.raises(CorruptionError, match="not written by this plug-in|not a detached|not a ckptstore"):
            plugin(store_at).load_checkpoint(ckpts / name)
    for name in ("forged.ckpt", "short.ckpt", "v1.ckpt"):
        with pytest.warns(RemovalRefusedWarning, match="not a file this plug-in wrote"):
            io.remove_checkpoint(ckpts / name)
    with pytest.raises(CorruptionError, match="not written by this plug-in"):
        plugin(store_at).load_checkpoint(tmp_path / "handoff.ckpt")  # another plug-in (another job)
    assert snapshot(tmp_path) == before
    io.remove_checkpoint(tmp_path / "handoff.ckpt")  # its own: removed
    assert not (tmp_path / "handoff.ckpt").exists()
    assert_loads_bit_for_bit(io, ckpts / "last.ckpt", expected)


def test_malformed_pointers_are_refused_with_their_cause(tmp_path: Path, store_at: tuple[str, dict[str, Any]]) -> None:
    ckpts = tmp_path / "ckpts"
    io = plugin(store_at, max_inline_bytes=1 << 12)
    expected = legit(io, ckpts)
    good = (ckpts / "last.ckpt").read_text()
    doc = json.loads(good)
    cap = pointer_cap(io.max_inline_bytes)
    planted: dict[str, tuple[str | bytes | None, str]] = {
        "big.ckpt": (good[:-1] + " " * cap + "}", f"more than the {cap} bytes"),
        "dup.ckpt": ('{"step": 0, ' + good.lstrip()[1:], "duplicate key 'step'"),
        "unknown.ckpt": (json.dumps({**doc, "extra": 1}), "unknown fields \\['extra'\\]"),
        "missing.ckpt": (json.dumps({k: v for k, v in doc.items() if k != "save_id"}), "lacks fields \\['save_id'\\]"),
        "strstep.ckpt": (json.dumps({**doc, "step": "4"}), "mangles field step"),
        "boolstep.ckpt": (json.dumps({**doc, "attempt": True}), "mangles field attempt"),
        "dupkeys.ckpt": (json.dumps({**doc, "keys": doc["keys"] + doc["keys"][:1]}), "mangles field keys"),
        "deep.ckpt": ('{"a":' * 100 + "1" + "}" * 100, "nested deeper than"),
        "nan.ckpt": (good.replace('"step":4', '"step":NaN'), "NaN is not allowed"),
        "digest.ckpt": (json.dumps({**doc, "inline_digest": "0" * 64}), "does not match its digest"),
        "zip.ckpt": (b"PK\x03\x04", "not a ckptstore pointer file"),
        "link.ckpt": (None, "symbolic link"),
        "fifo.ckpt": (None, "not a regular file"),
    }
    for name, (data, _) in planted.items():
        if isinstance(data, str):
            (ckpts / name).write_text(data)
        elif isinstance(data, bytes):
            (ckpts / name).write_bytes(data)
    badb64 = {**doc, "inline": {"callbacks": {"tree": {}, "tensors": "!!not base64!!"}}}
    badb64["inline_digest"] = blake3.blake3(tree_to_json(badb64["inline"])).hexdigest()
    (ckpts / "b64.ckpt").write_text(json.dumps(badb64))
    planted["b64.ckpt"] = (None, "not base64")
    (ckpts / "link.ckpt").symlink_to(ckpts / "last.ckpt")
    os.mkfifo(ckpts / "fifo.ckpt")
    before = snapshot(tmp_path)
    for name, (_, cause) in planted.items():
        with pytest.raises(CorruptionError, match=f"{name}: .*{cause}"):
            io.load_checkpoint(ckpts / name)
        with pytest.raises(CorruptionError, match=cause):
            read_pointer(ckpts / name, max_bytes=cap)
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(ckpts / "absent.ckpt")
    assert snapshot(tmp_path) == before
    assert_loads_bit_for_bit(io, ckpts / "last.ckpt", expected)


def test_pointers_at_the_inline_bound_stay_under_the_read_cap(tmp_path: Path, store_at: tuple[str, dict[str, Any]]) -> None:
    """The cap refuses only what the plug-in would never write: inline state at its bound (non-ASCII
    names, many small values, tensors) loads."""
    io = plugin(store_at, max_inline_bytes=1 << 14)
    base = {"global_step": 1, "state_dict": dict(WEIGHTS), "callbacks": {}}
    io.save_checkpoint(base, tmp_path / "a.ckpt")
    cb = {"ü" * 40 + str(i): [i, -i, 0.5] for i in range(100)}
    big = {**base, "callbacks": {"cb": cb, "t": torch.arange(1500, dtype=torch.int16)}}
    io.save_checkpoint(big, tmp_path / "b.ckpt")
    size = (tmp_path / "b.ckpt").stat().st_size
    assert io.max_inline_bytes * 3 // 4 < size < pointer_cap(io.max_inline_bytes)
    got = io.load_checkpoint(tmp_path / "b.ckpt")
    assert got["callbacks"]["cb"] == cb and torch.equal(got["callbacks"]["t"], big["callbacks"]["t"])
