"""The Hugging Face callback against planted files (issue 18 class 6; protocol_spec/THREATS.md §4.6).

Someone who can write into the Trainer's output directory plants symbolic links,
special files and other spellings of ``checkpoint-N``. Every test asserts that
nothing outside the output directory changed (a snapshot of the victim tree,
contents, modes and mtimes), that nothing from outside reached the store (every
stored object listed and read back), and that the legitimate checkpoint still
restores byte for byte. The checkpoint directories are written by hand (the
callback treats the Trainer's files as opaque bytes); tests/integrations/test_hf.py runs the
real Trainer. Runs on local disk and moto (the callback publishes to the store
it is given; the files side is the same for every backend).
"""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from ckptstore import CheckpointStore
from ckptstore import protocol as P
from ckptstore.errors import InvalidInputError
from ckptstore.integrations.hf import (
    DEFAULT_MAX_PUBLISH_BYTES,
    StoreCallback,
    publish_checkpoint_dir,
    restore_latest,
)
from tests.helpers import IDENT, settle_background_writes
from tests.workers.dist_launch import run_job

pytestmark = pytest.mark.backends("local", "moto")

RUN = "hf-hostile"
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- victim's key, never to be uploaded"
WORKER = str(Path(__file__).parents[1] / "workers" / "hf_worker.py")


def snapshot(top: Path) -> dict[str, tuple[str, int, int, bytes | str]]:
    """Every entry under ``top`` (links not followed): kind, mode, mtime, content or link target."""
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    out: dict[str, tuple[str, int, int, bytes | str]] = {}
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            p = Path(dirpath) / n
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[str(p.relative_to(top))] = ("link", 0, 0, os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[str(p.relative_to(top))] = ("file", stat.S_IMODE(st.st_mode), st.st_mtime_ns, p.read_bytes())
            else:
                out[str(p.relative_to(top))] = ("dir" if stat.S_ISDIR(st.st_mode) else "special",
                                                stat.S_IMODE(st.st_mode), st.st_mtime_ns, b"")
    return out


def victim(tmp_path: Path) -> Path:
    """Outside the output directory and the store: a private key and a project tree whose file names
    are the checkpoint's own (so a write through a link would land on them)."""
    v = tmp_path / "victim"
    (v / "project" / "sub").mkdir(parents=True)
    (v / "id_rsa").write_bytes(SECRET)
    for name in ("model.safetensors", "trainer_state.json", "optimizer.pt"):
        (v / "project" / name).write_bytes(SECRET + b" " + name.encode())
    (v / "project" / "sub" / "extra.bin").write_bytes(SECRET + b" extra")
    (v / "marker.json").write_bytes(SECRET + b" marker")
    return v


def checkpoint_files(step: int) -> dict[str, bytes]:
    return {
        "model.safetensors": os.urandom(3000) + bytes([step]),
        "trainer_state.json": f'{{"global_step": {step}}}'.encode(),
        "optimizer.pt": os.urandom(1000),
        "sub/extra.bin": os.urandom(100),
    }


def write_checkpoint(out: Path, step: int) -> dict[str, bytes]:
    files = checkpoint_files(step)
    for rel, data in files.items():
        p = out / f"checkpoint-{step}" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return files


def read_checkpoint(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def where(backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    if backend_kind == "local":
        return str(tmp_path / "store"), {}
    servers = request.getfixturevalue("object_servers")
    url, opts = servers.url_and_options(backend_kind, f"hf-{uuid.uuid4().hex[:8]}")
    return url, opts


def open_store(url: str, opts: dict[str, Any]) -> CheckpointStore:
    return CheckpointStore.open(url, RUN, identity=IDENT, storage_options=opts or None)


def stored_objects(url: str, opts: dict[str, Any]) -> dict[str, bytes]:
    """Every object the store holds for the run, read straight from the backend."""
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    store = CheckpointStore.open(url, RUN, mode="r", storage_options=opts or None)
    return {o.key: store.backend.get(o.key) for o in store.backend.list(P.run_prefix(RUN))}


def assert_nothing_outside_uploaded(url: str, opts: dict[str, Any]) -> None:
    objects = stored_objects(url, opts)
    assert objects, "the store should hold the legitimate save"
    leaked = [k for k, v in objects.items() if SECRET in v]
    assert not leaked, f"files from outside the output directory reached the store: {leaked}"


def save(cb: StoreCallback, out: Path, step: int) -> None:
    args = TrainingArguments(output_dir=str(out), report_to=[], use_cpu=True)
    cb.on_save(args, TrainerState(global_step=step), TrainerControl())


def plant(kind: str, d: Path, v: Path) -> str:
    """Plant ``kind`` inside checkpoint directory ``d``; the relative path of what was planted."""
    if kind == "file-link":
        (d / "id_rsa").symlink_to(v / "id_rsa")
        return "id_rsa"
    if kind == "dir-link":
        (d / "project").symlink_to(v / "project", target_is_directory=True)
        return "project"
    if kind == "nested-link":
        (d / "sub" / "key.pem").symlink_to(v / "id_rsa")
        return "sub/key.pem"
    if kind == "relative-link":
        (d / "sub" / "up").symlink_to(Path("..") / ".." / ".." / "victim", target_is_directory=True)
        return "sub/up"
    if kind == "fifo":
        os.mkfifo(d / "pipe")
        return "pipe"
    raise AssertionError(kind)


def published_step_2(
    backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> tuple[str, dict[str, Any], Path, Path, dict[str, bytes], StoreCallback]:
    """The common start: a store, a victim tree outside the output directory, and
    ``checkpoint-2`` written and published: (url, options, victim, out, its files, callback)."""
    url, opts = where(backend_kind, tmp_path, request)
    v = victim(tmp_path)
    out = tmp_path / "out"
    want = write_checkpoint(out, 2)
    cb = StoreCallback(lambda: open_store(url, opts))
    save(cb, out, 2)
    return url, opts, v, out, want, cb


@pytest.mark.parametrize("kind", ["file-link", "dir-link", "nested-link", "relative-link", "fifo"])
def test_a_link_or_special_file_inside_a_checkpoint_is_refused_and_nothing_outside_is_uploaded(
    backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest, kind: str
) -> None:
    url, opts, v, out, want, cb = published_step_2(backend_kind, tmp_path, request)
    write_checkpoint(out, 4)
    planted = plant(kind, out / "checkpoint-4", v)
    before = snapshot(v)

    with pytest.raises(InvalidInputError) as e:
        save(cb, out, 4)  # a FIFO would hang an open(): the walk refuses it from its lstat
    assert str(out / "checkpoint-4" / planted) in str(e.value)
    assert "never follows a link" in str(e.value)
    assert [r.step for r in cb.published] == [2]

    reader = CheckpointStore.open(url, RUN, mode="r", storage_options=opts or None)
    latest = reader.latest_complete(deep=True)
    assert latest is not None and latest.step == 2
    assert_nothing_outside_uploaded(url, opts)
    # the last good checkpoint restores; the refused directory is renamed aside with the link in it, not followed
    assert restore_latest(url, out, run_id=RUN, storage_options=opts or None) == str(out / "checkpoint-2")
    assert read_checkpoint(out / "checkpoint-2") == want
    aside = [n for n in os.listdir(out) if n.startswith("checkpoint-4.incomplete-")]
    assert len(aside) == 1 and os.path.lexists(out / aside[0] / planted)
    assert snapshot(v) == before


def test_a_linked_checkpoint_directory_is_refused(backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url, opts, v, out, _, cb = published_step_2(backend_kind, tmp_path, request)
    (out / "checkpoint-4").symlink_to(v / "project", target_is_directory=True)
    before = snapshot(v)
    with pytest.raises(InvalidInputError, match="symbolic link where a directory belongs") as e:
        save(cb, out, 4)
    assert str(out / "checkpoint-4") in str(e.value)
    with pytest.raises(InvalidInputError):
        publish_checkpoint_dir(cb.store, out / "checkpoint-4", 4)
    assert [r.step for r in cb.published] == [2]
    assert_nothing_outside_uploaded(url, opts)
    assert snapshot(v) == before


@pytest.mark.parametrize("kind", ["dir-is-link", "file-is-link", "sub-is-link"])
def test_restore_never_writes_through_a_link_at_the_checkpoint_path(
    backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest, kind: str
) -> None:
    url, opts, v, out, want, cb = published_step_2(backend_kind, tmp_path, request)
    d = out / "checkpoint-2"
    if kind == "dir-is-link":
        for p in sorted(d.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        d.rmdir()
        d.symlink_to(v / "project", target_is_directory=True)
    elif kind == "file-is-link":
        # a link to a victim file holding exactly the checkpoint's bytes: "matching" must not be read through it
        (v / "model-copy").write_bytes(want["model.safetensors"])
        (d / "model.safetensors").unlink()
        (d / "model.safetensors").symlink_to(v / "model-copy")
    else:
        for p in (d / "sub").iterdir():
            p.unlink()
        (d / "sub").rmdir()
        (d / "sub").symlink_to(v / "project" / "sub", target_is_directory=True)
    before = snapshot(v)

    assert restore_latest(cb.store, out) == str(d)
    assert not d.is_symlink() and read_checkpoint(d) == want
    for p in d.rglob("*"):
        assert not p.is_symlink()
    aside = [n for n in os.listdir(out) if n.startswith("checkpoint-2.incomplete-")]
    assert len(aside) == 1  # what was there is renamed aside as it was (a link stays a link), never deleted
    assert snapshot(v) == before


def test_only_the_canonical_spelling_is_a_checkpoint_directory(
    backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, opts, v, out, want, cb = published_step_2(backend_kind, tmp_path, request)
    # other spellings: Arabic-Indic digits, leading zeros, not a number; and a link under a canonical newer name
    odd = {"checkpoint-\u0663": 3, "checkpoint-01": 1, "checkpoint-02": 2, "checkpoint-0100": 100,
           "checkpoint-\u0663\u0660\u0660": 300, "checkpoint-x": None, "checkpoint-": None}
    for name in odd:
        (out / name).mkdir()
        (out / name / "trainer_state.json").write_bytes(SECRET)
    (out / "checkpoint-9").symlink_to(v / "project", target_is_directory=True)
    before = snapshot(v)

    for name, step in odd.items():
        with pytest.raises(InvalidInputError, match="must be named"):
            publish_checkpoint_dir(cb.store, out / name, step if step is not None else 5)
    assert_nothing_outside_uploaded(url, opts)
    assert [r.step for r in cb.published] == [2]

    (out / "checkpoint-2" / "optimizer.pt").write_bytes(b"damaged")  # so the restore writes the directory
    kept = {n: read_checkpoint(out / n) for n in odd}
    assert restore_latest(url, out, run_id=RUN, storage_options=opts or None) == str(out / "checkpoint-2")
    assert read_checkpoint(out / "checkpoint-2") == want
    names = os.listdir(out)
    # what the Trainer's own resume_from_checkpoint=True would have preferred (it reads any Unicode digits,
    # leading zeros too) is renamed aside with its contents; names it ignores or ranks lower stay where they are
    for name in ("checkpoint-\u0663", "checkpoint-02", "checkpoint-0100", "checkpoint-\u0663\u0660\u0660", "checkpoint-9"):
        assert name not in names
        (aside,) = [n for n in names if n.startswith(name + ".incomplete-")]
        if name in kept:
            assert read_checkpoint(out / aside) == kept[name]
        else:
            assert os.readlink(out / aside) == str(v / "project")
    for name in ("checkpoint-01", "checkpoint-x", "checkpoint-"):
        assert read_checkpoint(out / name) == kept[name]
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")  # type: ignore[no-untyped-call]
    assert snapshot(v) == before


def test_a_planted_sparse_file_is_refused_before_a_byte_is_uploaded(
    backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Issue 30 class 9: a 1 TiB sparse file (no disk used) planted in ``checkpoint-4`` is not streamed
    into the store: the sizes the listing saw are summed and checked against the cap before anything is
    read or a save is opened, so the refusal is immediate by construction (reading 1 TiB would not end
    within the test's lifetime); it names the file, its size, the cap and the option. Nothing is written
    to the store and the last published checkpoint still restores. First, the cap is the option's: one
    byte below a normal checkpoint refuses it the same way, the exact size publishes it."""
    url, opts, v, out, _, cb = published_step_2(backend_kind, tmp_path, request)
    want = write_checkpoint(out, 3)
    total = sum(len(b) for b in want.values())
    reader = CheckpointStore.open(url, RUN, mode="r", storage_options=opts or None)
    with pytest.raises(InvalidInputError, match=f"{total} bytes to publish, more than the cap of {total - 1} bytes"):
        save(StoreCallback(cb.store, max_bytes=total - 1), out, 3)
    assert [i.step for i in reader.list_saves() if i.state.value == "committed"] == [2]
    exact = StoreCallback(cb.store, max_bytes=total)
    save(exact, out, 3)
    assert [r.step for r in exact.published] == [3]
    with pytest.raises(InvalidInputError, match="a positive number of bytes"):
        StoreCallback(cb.store, max_bytes=0)

    write_checkpoint(out, 4)
    huge = out / "checkpoint-4" / "sub" / "planted.bin"
    huge.touch()
    os.truncate(huge, 1 << 40)
    assert huge.stat().st_size == 1 << 40
    objects = stored_objects(url, opts)
    before = snapshot(v)
    with pytest.raises(InvalidInputError) as e:
        save(cb, out, 4)
    msg = str(e.value)
    assert f"its largest file {huge} has {1 << 40} bytes" in msg
    assert f"more than the cap of {DEFAULT_MAX_PUBLISH_BYTES} bytes" in msg and "max_bytes=N" in msg
    assert "Nothing was published" in msg
    with pytest.raises(InvalidInputError, match="more than the cap"):
        publish_checkpoint_dir(cb.store, out / "checkpoint-4", 4)
    assert [r.step for r in cb.published] == [2]
    assert stored_objects(url, opts) == objects  # not one object written, not even a staged one
    latest = reader.latest_complete(deep=True)
    assert latest is not None and latest.step == 3
    (out / "checkpoint-3" / "optimizer.pt").write_bytes(b"damaged")  # so the restore writes the directory
    assert restore_latest(url, out, run_id=RUN, storage_options=opts or None) == str(out / "checkpoint-3")
    assert read_checkpoint(out / "checkpoint-3") == want
    assert snapshot(v) == before


def test_two_ranks_coordinate_over_the_process_group_never_through_a_file(
    backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A 2-rank gloo job (one job, to keep the suite fast): StoreCallback.on_save publishes checkpoint-2
    on rank 0; checkpoint-4 holds a link, so rank 0 refuses it and rank 1 learns it over the process group
    (SaveNotPublishedError), not later as a hang at the next collective. Then restore_latest into a fresh
    output directory where older releases wrote their marker file, a link to a victim file planted there:
    rank 0 restores, rank 1 gets the path in a uint8 tensor broadcast, nothing is written through the
    link; a failure on rank 0 (an unknown run) raises on both ranks."""
    url, opts = where(backend_kind, tmp_path, request)
    v = victim(tmp_path)
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    want = write_checkpoint(out, 2)
    write_checkpoint(out, 4)
    (out / "checkpoint-4" / "id_rsa").symlink_to(v / "id_rsa")
    fresh.mkdir()
    (fresh / ".ckptstore-restored.json").symlink_to(v / "marker.json")
    before = snapshot(v)

    ops = [{"op": "publish", "step": 2}, {"op": "publish", "step": 4},
           {"op": "restore", "out": str(fresh), "run": "no-such-run"}, {"op": "restore", "out": str(fresh), "run": RUN}]
    res = run_job(2, url, "ops", opts=opts, args={"out": str(out), "run": RUN, "identity": IDENT, "ops": ops},
                  worker=WORKER, timeout=300)
    assert all(r.returncode == 0 for r in res), [(r.rank, r.returncode, r.stderr[-2000:]) for r in res]
    got = [[r.results[f"op{i}"] for r in res] for i in range(len(ops))]
    assert got[0] == [{"ok": True, "published": [2]}, {"ok": True, "published": []}]
    assert (got[1][0]["ok"], got[1][0]["type"]) == (False, "InvalidInputError")
    assert str(out / "checkpoint-4" / "id_rsa") in got[1][0]["message"]
    assert (got[1][1]["ok"], got[1][1]["type"]) == (False, "SaveNotPublishedError")
    assert got[1][1]["message"].startswith("rank 0 could not publish checkpoint-4: InvalidInputError: ")
    assert [g["ok"] for g in got[2]] == [False, False]
    assert got[2][0]["type"] == got[2][1]["type"] == "NotFoundError"
    assert got[2][1]["message"].startswith(f"rank 0 could not restore into {fresh}: NotFoundError: ")
    assert got[3] == [{"ok": True, "path": str(fresh / "checkpoint-2")}] * 2

    reader = CheckpointStore.open(url, RUN, mode="r", storage_options=opts or None)
    assert [i.step for i in reader.list_saves() if i.state.value == "committed"] == [2]
    assert_nothing_outside_uploaded(url, opts)
    assert read_checkpoint(fresh / "checkpoint-2") == want
    assert sorted(os.listdir(fresh)) == [".ckptstore-restored.json", "checkpoint-2"]
    assert os.readlink(fresh / ".ckptstore-restored.json") == str(v / "marker.json")
    assert snapshot(v) == before
