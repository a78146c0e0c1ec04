"""Hostile objects planted among a version-3 run's pieces (protocol_spec/THREATS.md §4,
PROTOCOL.md §9): the counterparts of the version-2 tests in this folder, which plant whole
components under ``saves/<sid>/<component>`` (test_planted_local.py, test_selection.py,
test_parsing.py, test_secrets_and_terminals.py). A version-3 save's bytes are pieces under
``pieces/<holder save id>/<blake3>``, named by ``[holder, digest, size]`` in its commit record.

Every test plants straight on the storage (a link, a FIFO, a hard link, other bytes, a forged
record, a key with control characters), runs the public API and the command line, and asserts
what must hold: what is refused or ignored and why; that nothing outside the store changed
(where a link points outside, the outside file holds the very bytes of the piece it replaces,
so a backend that followed it would read a piece that verifies); that nothing hangs; and that
the last good save is still selected and restores bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import blake3
import pytest

from ckptstore import CheckpointStore, CorruptionError, OpenOptions
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.memory import named_memory_backend
from ckptstore.cli.commands import main as cli_main
from ckptstore.errors import ResumeRefusedError, StoreUnavailableError
from ckptstore.protocol.layout import piece_key, pieces_prefix
from ckptstore.protocol.records import PieceRef, pieces_digest
from ckptstore.protocol.selection import SaveRef, SkipReason
from tests.fail_closed.test_parsing import TIB, Counted, _same_bits, _torch_objects, _two_torch_saves, _weights
from tests.fail_closed.test_planted_local import (
    assert_one_line_error,
    cli,
    outside_dir,
    replace_with_link,
    snapshot,
)
from tests.fail_closed.test_secrets_and_terminals import EVIL, assert_clean
from tests.fail_closed.test_selection import Where, changed, objects, where
from tests.fail_closed.test_selection import two_saves as two_saves_at
from tests.helpers import IDENT, RawAccess, settle_background_writes
from tests.incremental.common import LONG, Clock, long_timing

__all__ = ["where"]  # the fixture of test_selection.py, used here as it is there

RUN = "run"
V3 = OpenOptions(protocol_version=3)
T = TypeVar("T")


# -- helpers --------------------------------------------------------------------------------------------------------


def two_saves(root: Path | Backend, options: OpenOptions = V3) -> tuple[CheckpointStore, SaveRef, SaveRef]:
    """A version-3 run with two saves of two one-piece components each; the writer (still open)
    and both saves. Every piece of a save is its own (nothing shared between the two)."""
    st = CheckpointStore.open(root, RUN, identity=IDENT, options=options)
    refs = []
    for step in (1, 2):
        with st.save(step) as s:
            s.put("model", f"weights-{step}".encode())
            s.put("optimizer", f"adam-{step}".encode())
        assert s.ref is not None
        refs.append(s.ref)
    old, new = refs
    assert new.record.version == 3 and all(c.pieces for c in new.record.components.values())
    assert not set(old.record.piece_refs()) & set(new.record.piece_refs())
    return st, old, new


def only_piece(ref: SaveRef, name: str) -> PieceRef:
    comp = ref.record.components[name]
    assert comp.pieces is not None and len(comp.pieces) == 1
    return comp.pieces[0]


def piece_path(root: Path, p: PieceRef) -> Path:
    return root.joinpath(*piece_key(RUN, p.holder, p.digest).split("/"))


def payload(ref: SaveRef) -> dict[str, bytes]:
    return {"model": f"weights-{ref.step}".encode(), "optimizer": f"adam-{ref.step}".encode()}


def assert_selected_and_whole(root: Path | Backend, ref: SaveRef, *, data: dict[str, bytes] | None = None) -> None:
    """A fresh reader selects ``ref`` after re-hashing every byte, and reads it back bit for bit."""
    reader = CheckpointStore.open(root, RUN, mode="r")
    latest = reader.latest_complete(deep=True)
    assert latest is not None and latest.save_id == ref.save_id, (latest, ref.save_id)
    want = payload(ref) if data is None else data
    assert {n: reader.read(latest, n) for n in want} == want
    assert reader.verify(latest).ok


def settle(store: CheckpointStore) -> None:
    """Wait for the intent the writer writes in the background after each commit."""
    pieces = store._place.pieces  # noqa: SLF001 - a snapshot taken while it is written would race it
    assert pieces is not None
    pieces.settle()


def within(seconds: float, fn: Callable[[], T]) -> T:
    """``fn()`` in a thread that must finish within ``seconds``: a read that blocks on a FIFO
    or streams /dev/zero fails the test instead of hanging it."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box.append((False, exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} did not finish in {seconds}s (blocked on a special file?)"
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def aged_gc(root: Path | Backend, *, keep_last: int = 1) -> Any:
    """A gc whose clock is past every intent's lifetime and every piece's grace: the most a gc
    may sweep (a killed writer's intent has expired and been removed)."""
    reader = CheckpointStore.open(root, RUN, mode="r", options=OpenOptions(pieces=long_timing(Clock(offset=LONG + 2))))
    return reader.gc(keep_last=keep_last, grace_seconds=LONG)


# -- links under pieces/: gc never deletes outside the store, nothing outside is read as a piece ---------------------


def test_gc_with_a_linked_holder_folder_deletes_nothing_outside(tmp_path: Path) -> None:
    """``pieces/<old save id>`` replaced by a link to a folder outside the store that holds
    files named like that save's pieces, with their very bytes, and a file named like a piece
    no commit names, long untouched: followed, the link would make the first a save that
    verifies and the second a piece of a settled holder that gc sweeps at any age."""
    root = tmp_path / "store"
    out = outside_dir(tmp_path)
    st, old, new = two_saves(root)
    st.close()  # its intent landed and was removed
    for name in ("model", "optimizer"):
        pc = only_piece(old, name)
        (out / pc.digest).write_bytes(piece_path(root, pc).read_bytes())
    stale = out / blake3.blake3(b"precious").hexdigest()
    stale.write_bytes(b"precious")
    os.utime(stale, (1e9, 1e9))
    holder = root / RUN / "pieces" / old.save_id
    replace_with_link(holder, out)
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = snapshot(out)

    reader = CheckpointStore.open(root, RUN, mode="r")
    with pytest.raises(CorruptionError, match="missing"):  # the copies outside would verify: not read
        reader.read(reader.get_save(1), "model")
    assert not reader.verify(reader.get_save(1)).ok
    assert not LocalBackend(root, create_root=False).list(pieces_prefix(RUN) + old.save_id + "/")

    for dry_run in (True, False):
        rep = reader.gc(keep_last=1, grace_seconds=0, dry_run=dry_run)
        assert not [a.key for a in rep.actions if old.save_id in a.key and "/pieces/" in a.key]
        assert snapshot(out) == before
    p = cli("gc", str(root), RUN, "--apply", "--keep-last", "1", "--grace", "0")
    assert snapshot(out) == before, p.stdout + p.stderr
    if p.returncode != 0:
        assert_one_line_error(p)
    assert holder.is_symlink() and Path(os.readlink(holder)) == out  # the planted link itself stays
    assert_selected_and_whole(root, new)


def link_pieces_outside(root: Path, ref: SaveRef, out: Path) -> None:
    """Replace the one piece of ``ref``'s model and optimizer by a link to a copy of its very bytes in ``out``."""
    for name in ("model", "optimizer"):
        pc = only_piece(ref, name)
        (out / name).write_bytes(piece_path(root, pc).read_bytes())
        replace_with_link(piece_path(root, pc), out / name)


def test_links_in_place_of_an_older_saves_pieces_are_not_read_nor_followed_by_gc(tmp_path: Path) -> None:
    root = tmp_path / "store"
    out = outside_dir(tmp_path)
    st, old, new = two_saves(root)
    st.close()
    link_pieces_outside(root, old, out)
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = snapshot(out)

    reader = CheckpointStore.open(root, RUN, mode="r")
    for name in ("model", "optimizer"):
        with pytest.raises(CorruptionError, match="missing"):
            reader.read(old, name)
    assert not reader.verify(old).ok
    kept = reader.gc(keep_last=2, grace_seconds=0)  # both saves kept: the links are merely not pieces
    assert not [a for a in kept.actions if "/pieces/" in a.key]
    assert snapshot(out) == before

    reader.gc(keep_last=1, grace_seconds=0)
    p = cli("gc", str(root), RUN, "--apply", "--keep-last", "1", "--grace", "0")
    assert snapshot(out) == before, p.stdout + p.stderr
    if p.returncode != 0:
        assert_one_line_error(p)
    assert (out / "model").read_bytes() == b"weights-1" and not (out / "model").is_symlink()
    assert_selected_and_whole(root, new)


def test_links_in_place_of_the_newest_saves_pieces_make_it_corrupt_not_outside_bytes(tmp_path: Path) -> None:
    root = tmp_path / "store"
    out = outside_dir(tmp_path)
    st, old, new = two_saves(root)
    st.close()
    link_pieces_outside(root, new, out)
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = snapshot(out)

    reader = CheckpointStore.open(root, RUN, mode="r")
    sel = reader.latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.save_id == old.save_id
    assert [(s.save_id, s.reason) for s in sel.skipped] == [(new.save_id, SkipReason.MISSING_COMPONENT)]
    with pytest.raises(CorruptionError, match="missing"):
        reader.read(new, "model")
    assert_selected_and_whole(root, old)
    writer = CheckpointStore.open(root, RUN, identity=IDENT)  # resumes from the last good save
    assert writer.resumed_from is not None and writer.resumed_from.save_id == old.save_id
    writer.close()
    p = cli("gc", str(root), RUN, "--apply", "--keep-last", "1", "--grace", "0")
    assert p.returncode == 0, p.stderr
    assert snapshot(out) == before
    assert_selected_and_whole(root, old)


def test_a_live_writer_never_reuses_pieces_behind_a_linked_holder_folder(tmp_path: Path) -> None:
    """The holder of the pieces a live writer is about to reuse (the bytes that did not change)
    is replaced by a link to a copy of itself outside the store: the next save does not rely on
    what lies behind the link; it writes those pieces again under its own ID, and is whole."""
    root = tmp_path / "store"
    out = outside_dir(tmp_path)
    st = CheckpointStore.open(root, RUN, identity=IDENT, options=V3)
    with st.save(1) as s:
        s.put("model", b"frozen weights" * 100)
        s.put("optimizer", b"adam-1")
    assert s.ref is not None
    first = s.ref
    settle(st)
    holder = root / RUN / "pieces" / first.save_id
    shutil.copytree(holder, out / "copy")
    replace_with_link(holder, out / "copy")
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = snapshot(out)

    with st.save(2) as s:
        s.put("model", b"frozen weights" * 100)  # unchanged: its piece would be reused
        s.put("optimizer", b"adam-2")
    assert s.ref is not None
    second = s.ref
    settle(st)
    assert {h for h, _ in second.record.piece_refs()} == {second.save_id}, second.record.piece_refs()
    assert only_piece(second, "model").digest == only_piece(first, "model").digest  # the same bytes, written again
    assert snapshot(out) == before
    assert holder.is_symlink()
    st.close()
    assert_selected_and_whole(root, second, data={"model": b"frozen weights" * 100, "optimizer": b"adam-2"})


# -- a linked pieces folder: a writer never writes through it ---------------------------------------------------


def test_a_linked_pieces_folder_is_refused_by_writers_and_nothing_lands_outside(tmp_path: Path) -> None:
    """``<run>/pieces`` replaced by a link to a copy of itself outside the store (a plausible
    pieces folder: followed, every save would verify)."""
    root = tmp_path / "store"
    out = outside_dir(tmp_path)
    st, old, new = two_saves(root)
    settle(st)  # the intent written after the last commit landed
    shutil.copytree(root / RUN / "pieces", out / "pieces")
    replace_with_link(root / RUN / "pieces", out / "pieces")
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = snapshot(out)

    # the open writer's next save
    with pytest.raises(StoreUnavailableError, match="symbolic link"), st.save(3) as s:
        s.put("model", b"secret weights that must not land outside")
    assert snapshot(out) == before

    # a reader finds no piece: nothing selected, both saves skipped as missing their pieces
    sel = CheckpointStore.open(root, RUN, mode="r").latest_complete(explain=True)
    assert sel.latest is None
    assert {(s.save_id, s.reason) for s in sel.skipped} == {
        (old.save_id, SkipReason.MISSING_COMPONENT), (new.save_id, SkipReason.MISSING_COMPONENT)}

    # a fresh writer resuming from "latest" refuses (never a fresh start over the history), registers nothing
    with pytest.raises(ResumeRefusedError, match="none can be selected") as err:
        CheckpointStore.open(root, RUN, identity=IDENT)
    assert "missing-component" in str(err.value)
    assert [a.number for a in CheckpointStore.open(root, RUN, mode="r").attempts()] == [1]

    # a deliberate fresh start registers, but its save does not write through the link
    fresh = CheckpointStore.open(root, RUN, identity=IDENT, resume_from=None)
    with pytest.raises(StoreUnavailableError, match="symbolic link"), fresh.save(3) as s:
        s.put("model", b"secret weights that must not land outside")
    assert snapshot(out) == before
    p = cli("gc", str(root), RUN, "--apply", "--keep-last", "1", "--grace", "0")
    assert snapshot(out) == before, p.stdout + p.stderr
    assert (root / RUN / "pieces").is_symlink()


# -- special files in place of a piece: never read, never a hang ----------------------------------------------------


@pytest.mark.parametrize("plant", ["fifo", "dev-zero"])
def test_a_special_file_in_place_of_a_newest_piece_is_skipped_without_hanging(tmp_path: Path, plant: str) -> None:
    root = tmp_path / "store"
    st, old, new = two_saves(root)
    st.close()
    path = piece_path(root, only_piece(new, "model"))
    if plant == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:
        replace_with_link(path, Path("/dev/zero"))

    reader = CheckpointStore.open(root, RUN, mode="r")
    latest = within(60, lambda: reader.latest_complete(deep=True))
    assert latest is not None and latest.save_id == old.save_id
    sel = within(60, lambda: reader.latest_complete(explain=True))
    assert [(s.save_id, s.reason) for s in sel.skipped] == [(new.save_id, SkipReason.MISSING_COMPONENT)]
    with pytest.raises(CorruptionError):
        within(60, lambda: reader.read(reader.get_save(2), "model"))
    assert not within(60, lambda: reader.verify(new)).ok

    p = cli("latest", str(root), RUN, "--deep", "--json")
    assert p.returncode == 0, p.stderr
    assert f'"save_id": "{old.save_id}"' in p.stdout and "missing-component" in p.stdout
    p = cli("verify", str(root), RUN, "--step", "2")
    assert p.returncode == 1 and "missing" in p.stdout, p.stdout + p.stderr
    p = cli("ls", str(root), RUN, "--deep")
    assert p.returncode == 0, p.stderr
    p = cli("gc", str(root), RUN, "--apply", "--keep-last", "1", "--grace", "0")
    assert p.returncode == 0, p.stderr
    assert_selected_and_whole(root, old)


# -- a partial save's piece folder holding links ------------------------------------------------------------------


@pytest.mark.parametrize("intent", ["live", "expired"])
def test_gc_of_a_partial_saves_piece_folder_holding_links_keeps_everything_outside(tmp_path: Path, intent: str) -> None:
    """A killed writer's save 3: a piece of its own, no commit. Planted in its piece folder: a
    link to a folder outside, a link named like a digest to an outside file, and a hard link
    named like a digest to another outside file. ``live``: the writer's intent still lives (a
    gc of grace 0 judges no uncommitted piece); ``expired``: a gc at a clock past the intent's
    life and the grace sweeps the save's own pieces, and still nothing outside."""
    root = tmp_path / "store"
    out = outside_dir(tmp_path)
    st = CheckpointStore.open(root, RUN, identity=IDENT, options=OpenOptions(pieces=long_timing()))
    for step in (1, 2):
        with st.save(step) as s:
            s.put("model", f"weights-{step}".encode())
            s.put("optimizer", f"adam-{step}".encode())
    assert s.ref is not None
    newest = s.ref
    w = st.save(3)  # the process dies here: a piece, no commit, its intent left behind
    w.put("model", b"weights-3")
    settle(st)
    partial = root / RUN / "pieces" / next(
        p.name for p in (root / RUN / "pieces").iterdir() if p.name.startswith("000000000003-"))
    regular = sorted(x.name for x in partial.iterdir())
    assert regular == [blake3.blake3(b"weights-3").hexdigest()]
    (partial / "escape").symlink_to(out)
    (partial / blake3.blake3(b"optimizer").hexdigest()).symlink_to(out / "optimizer")
    hard = partial / blake3.blake3(b"keep").hexdigest()
    os.link(out / "keep.txt", hard)
    if intent == "expired":  # the killed save's last write is long past (older than any grace)
        for entry in [*regular, hard.name]:
            os.utime(partial / entry, (time.time() - 2 * LONG, time.time() - 2 * LONG))
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = snapshot(out)

    if intent == "live":
        rep = CheckpointStore.open(root, RUN, mode="r").gc(keep_last=1, grace_seconds=0)
        assert rep.pieces_refused is None
        assert not [a for a in rep.actions if a.key.startswith(pieces_prefix(RUN) + partial.name + "/")]
        p = cli("gc", str(root), RUN, "--apply", "--keep-last", "1", "--grace", "0")
        assert p.returncode == 0, p.stderr
        assert sorted(x.name for x in partial.iterdir()) == sorted([*regular, "escape", hard.name,
                                                                   blake3.blake3(b"optimizer").hexdigest()])
    else:
        rep = aged_gc(root)
        assert rep.pieces_refused is None and rep.intents_expired
        assert not any((partial / r).exists() for r in regular)  # the killed save's own piece was swept
        assert (partial / "escape").is_symlink() and (partial / blake3.blake3(b"optimizer").hexdigest()).is_symlink()
        p = cli("gc", str(root), RUN, "--apply", "--keep-last", "1", "--grace", "0")
        assert p.returncode == 0, p.stderr
    assert snapshot(out) == before
    assert (out / "keep.txt").read_text() == "do not touch"
    assert (out / "optimizer").read_bytes() == b"precious optimizer file"
    assert_selected_and_whole(root, newest)


# -- rotten pieces everywhere: a writer never resumes from nothing (THREATS.md §4.2) ------------------------------


@pytest.mark.backends("memory", "local", "seaweedfs")
@pytest.mark.parametrize("rot", ["size-mismatch", "hash-mismatch"])
def test_a_writer_never_resumes_from_nothing_over_pieces_it_cannot_use(where: Where, rot: str) -> None:
    _st, ids = two_saves_at(where, options=V3)
    reader = where.open(mode="r")
    refs = [reader.get_save(step) for step in ids]
    assert all(r.record.version == 3 and r.record.components["model"].pieces for r in refs)
    raw = RawAccess(where.backend)
    rotted = set()
    for ref in refs:  # every piece of the run loses its bytes (bit rot, a botched copy)
        for holder, digest in ref.record.piece_refs():
            key = piece_key(RUN, holder, digest)
            data = raw.get(key)
            assert data is not None
            raw.set(key, b"rotten" if rot == "size-mismatch" else bytes([data[0] ^ 1]) + data[1:])
            rotted.add(key)
    assert rotted
    before, outside = objects(where.backend), objects(where.outside)
    with pytest.raises(ResumeRefusedError) as err:
        where.open(identity=IDENT)
    msg = str(err.value)
    assert "2 commit record(s) in its history and none can be selected" in msg
    assert rot in msg and "resume_from=None" in msg and "ckptstore ls" in msg
    assert [a.number for a in where.open(mode="r").attempts()] == [1]  # nothing registered
    events = where.open(mode="r").events()
    assert events[-1]["event"] == "resume-refused" and "none can be selected" in events[-1]["payload"]["error"]
    ch = changed(before, objects(where.backend))
    assert ch and all("/events/" in k for k in ch)  # not a piece written again, nothing deleted
    assert objects(where.outside) == outside
    # explicit: a deliberate fresh start is the operator's choice
    fresh = where.open(identity=IDENT, resume_from=None)
    assert fresh.attempt is not None and fresh.attempt.resumed_from is None
    with fresh.save(1) as s:
        s.put("model", b"a new beginning")
    back = where.open(mode="r")
    latest = back.latest_complete(deep=True)
    assert latest is not None and latest.attempt == 2 and back.read(latest, "model") == b"a new beginning"
    fresh.close()


# -- a commit record that claims a terabyte piece (THREATS.md §4.8) ----------------------------------------------


def forge_piece_sizes(backend: Backend, rec: P.CommitRecord, sizes: dict[str, int]) -> P.CommitRecord:
    """Rewrite a commit record in place claiming ``sizes`` (its last piece grows), consistent but
    for the claim: the component's size is the pieces' sum and its blake3 the digest of the forged
    piece list, so the record decodes."""
    comps = {}
    for n, c in rec.components.items():
        if n in sizes:
            assert c.pieces is not None
            ps = list(c.pieces)
            ps[-1] = dataclasses.replace(ps[-1], size=sizes[n] - sum(p.size for p in ps[:-1]))
            c = dataclasses.replace(c, size=sizes[n], pieces=tuple(ps), blake3=pieces_digest(ps))
        comps[n] = c
    forged = dataclasses.replace(rec, components=comps, stored_digest="", body_digest="")
    data = forged.encode()
    key = P.LATEST_LAYOUT.commit_key(rec.run_id, rec.step, rec.attempt)
    RawAccess(backend).set(key, data)
    back = P.CommitRecord.decode(data, key)  # the forgery is a readable record, not junk
    assert back.components[next(iter(sizes))].size == sizes[next(iter(sizes))]
    return back


@pytest.mark.backends("memory", "local", "moto", "fakegcs", "moto-obstore")
def test_a_terabyte_piece_claim_costs_one_request_past_the_real_end(backend_factory: Callable[[], Backend]) -> None:
    store = CheckpointStore.open(backend_factory(), RUN, identity=IDENT, options=V3)
    good = b"good weights " * 1000
    with store.save(1) as s:
        s.put("model", good)
    with store.save(2) as s:
        s.put("model", b"x" * 100)
    assert s.ref is not None
    store.close()
    forged = forge_piece_sizes(backend_factory(), s.ref.record, {"model": TIB})  # 1 TiB for a 100-byte piece
    (piece,) = forged.components["model"].pieces or ()
    key = piece_key(RUN, piece.holder, piece.digest)

    b = backend_factory()
    counted = Counted(b, "get_range", "readinto")
    reader = CheckpointStore.open(b, RUN, mode="r")
    with pytest.raises(CorruptionError, match=r"has 100 bytes, the commit record says 1099511627776"):
        reader.read(reader.get_save(2), "model")
    reads = [c for name in counted.calls for c in counted.calls[name] if c[0] == key]
    assert len(reads) == 1, reads  # the first block came back short: not 131,072 ranged requests

    for calls in counted.calls.values():
        calls.clear()
    claim = 256 << 20  # 32 chunks; the piece holds 100 bytes
    forge_piece_sizes(backend_factory(), s.ref.record, {"model": claim})
    reader = CheckpointStore.open(b, RUN, mode="r")
    with pytest.raises(CorruptionError, match="has 100 bytes"):
        reader.read_into(reader.get_save(2), "model", bytearray(claim))
    reads = [c for name in counted.calls for c in counted.calls[name] if c[0] == key]
    assert 1 <= len(reads) <= 16, reads  # at most one window of concurrent reads, not one per chunk

    latest = reader.latest_complete(deep=True)  # the claim costs that save, never the last good one
    assert latest is not None and latest.step == 1 and reader.read(latest, "model") == good
    sel = reader.latest_complete(explain=True)
    assert [s.reason for s in sel.skipped] == [SkipReason.SIZE_MISMATCH]


@pytest.mark.backends("memory", "local", "moto")
def test_a_terabyte_piece_claim_is_refused_before_the_restore_reads_and_falls_back(
    backend_factory: Callable[[], Backend],
) -> None:
    from ckptstore.torch import Checkpointer, read_state, restore_state
    from ckptstore.torch.restore import read_with_fallback

    store = CheckpointStore.open(backend_factory(), RUN, identity=IDENT, options=V3)
    good, rec2 = _two_torch_saves(store)
    store.close()
    forge_piece_sizes(backend_factory(), rec2, {"model.safetensors": TIB})

    b = backend_factory()
    counted = Counted(b, "get_range", "readinto")
    reader = CheckpointStore.open(b, RUN, identity=IDENT, options=dataclasses.replace(V3, resume_verify="cheap"))
    forged = reader.get_save(2)  # not verified: the claim reaches the restore
    keys = {piece_key(RUN, p.holder, p.digest) for p in forged.record.components["model.safetensors"].pieces or ()}
    assert keys
    live = _torch_objects(3)
    with pytest.raises(CorruptionError, match=r"claims 1099511627776 bytes, more than the live 'model' can hold"):
        restore_state(reader, forged, live)
    assert not [c for calls in counted.calls.values() for c in calls if c[0] in keys]  # refused before any read
    with pytest.raises(CorruptionError, match="model.safetensors"):  # no live objects: the allocation fails closed
        read_state(reader, forged)

    with pytest.warns(RuntimeWarning, match="resume point step 2 is corrupt; resuming from step 1"):
        saved, ref = read_with_fallback(reader, forged, objects=live)
    assert ref.step == 1 and _same_bits(saved.trees["model"], good)

    again = CheckpointStore.open(backend_factory(), RUN, identity=IDENT,
                                 options=dataclasses.replace(V3, resume_verify="cheap"))
    objs = _torch_objects(4)
    ckpt = Checkpointer(again, objs, async_save=False, handle_signals=False)
    assert ckpt.resume() == 2  # selection skipped the claim by its size: step 1 restored
    assert _same_bits(_weights(objs), good)
    ckpt.close()


def test_the_checkpointer_falls_back_past_a_sparse_terabyte_piece(tmp_path: Path) -> None:
    """On a disk the listing can agree with the claim (a sparse piece of the claimed size), so
    only the restore's bound stands between the claim and the allocator."""
    from ckptstore.torch import Checkpointer

    b = LocalBackend(tmp_path / "store")
    store = CheckpointStore.open(b, RUN, identity=IDENT, options=V3)
    good, rec2 = _two_torch_saves(store)
    store.close()
    pieces = rec2.components["model.safetensors"].pieces or ()
    last = pieces[-1]
    with open(f"{b.root}/{piece_key(RUN, last.holder, last.digest)}", "r+b") as f:
        f.truncate(TIB - sum(p.size for p in pieces[:-1]))  # sparse: no disk space used
    forge_piece_sizes(b, rec2, {"model.safetensors": TIB})

    counted = Counted(b, "readinto", "get_range")
    resumed = CheckpointStore.open(b, RUN, identity=IDENT, options=dataclasses.replace(V3, resume_verify="cheap"))
    assert resumed.resumed_from is not None and resumed.resumed_from.step == 2  # sizes agree: selected
    objs = _torch_objects(5)
    ckpt = Checkpointer(resumed, objs, async_save=False, handle_signals=False)
    with pytest.warns(RuntimeWarning, match="resume point step 2 is corrupt; resuming from step 1"):
        assert ckpt.resume() == 2
    assert _same_bits(_weights(objs), good)
    assert not [c for calls in counted.calls.values() for c in calls if last.digest in str(c[0])]
    ckpt.close()


def test_the_cli_reports_a_terabyte_piece_claim_and_keeps_the_last_good_save(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    root = tmp_path / "store"
    st = CheckpointStore.open(root, RUN, identity=IDENT, options=V3)
    with st.save(1) as s:
        s.put("model", b"good weights")
    good = s.ref
    with st.save(2) as s:
        s.put("model", b"x" * 100)
    assert s.ref is not None and good is not None
    st.close()
    forge_piece_sizes(LocalBackend(root), s.ref.record, {"model": TIB})
    capsys.readouterr()
    assert cli_main(["verify", str(root), RUN, "--step", "2"]) == 1
    out = capsys.readouterr()
    assert "1099511627776" in out.out + out.err and "Traceback" not in out.err
    assert cli_main(["latest", str(root), RUN, "--deep", "--json"]) == 0
    assert '"step": 1' in capsys.readouterr().out
    assert cli_main(["gc", str(root), RUN, "--apply", "--keep-last", "1", "--grace", "0"]) == 0
    capsys.readouterr()
    assert_selected_and_whole(root, good, data={"model": b"good weights"})


#: distinct holders one forged record names (2 MiB of record; 16 MiB would hold about 150,000)
MANY_HOLDERS = 20_000
#: what checking one candidate may cost in listings, whatever its record claims (the scale of the
#: selection's own bound on candidate records, THREATS.md §4.2)
LISTING_BOUND = 1_000


@pytest.mark.backends("memory", "local")
def test_a_record_naming_thousands_of_holders_costs_selection_a_bounded_number_of_listings(
    backend_factory: Callable[[], Backend],
) -> None:
    """A commit record that decodes (sizes add up, blake3 is its piece list's digest) but names
    pieces under 20,000 distinct holders, none of which exist: selection skips it and selects the
    last good save, with a cost bounded by what the store holds, never by the claim (THREATS.md
    §4.8: bounded by what the store can prove)."""
    store = CheckpointStore.open(backend_factory(), RUN, identity=IDENT, options=V3)
    with store.save(1) as s:
        s.put("model", b"good weights")
    good = s.ref
    with store.save(2) as s:
        s.put("model", b"x" * 10)
    assert s.ref is not None and good is not None
    store.close()
    rec = s.ref.record
    ps = tuple(PieceRef(f"000000000001-00000001-{i:012x}", "ab" * 32, 1) for i in range(MANY_HOLDERS))
    comp = dataclasses.replace(rec.components["model"], size=len(ps), pieces=ps, blake3=pieces_digest(ps))
    forged = dataclasses.replace(rec, components={"model": comp}, stored_digest="", body_digest="")
    key = P.LATEST_LAYOUT.commit_key(RUN, 2, 1)
    RawAccess(backend_factory()).set(key, forged.encode())
    assert len(P.CommitRecord.decode(forged.encode(), key).piece_refs()) == MANY_HOLDERS  # a readable record

    b = backend_factory()
    listings = {"n": 0}
    real_list = b.list

    def counted_list(*args: Any, **kw: Any) -> Any:
        listings["n"] += 1
        return real_list(*args, **kw)

    b.list = counted_list  # type: ignore[method-assign]
    latest = CheckpointStore.open(b, RUN, mode="r").latest_complete()
    assert latest is not None and latest.save_id == good.save_id  # holds today: the last good save is selected
    assert listings["n"] <= LISTING_BOUND, f"{listings['n']} listings to check one candidate"


# -- control characters in keys under pieces/: never raw on a terminal ---------------------------------------------

#: a save ID but for an escape sequence in its random part, and a digest with one at its end
EVIL_HOLDER_ID = "000000000001-00000001-\x1b[31m0000"
EVIL_DIGEST = "a" * 60 + "\x1b[2J"
COMMANDS = [["ls"], ["ls", "--deep"], ["latest"], ["latest", "--deep"], ["verify"], ["verify", "--step", "1"],
            ["gc", "--grace", "0"], ["gc", "--apply", "--grace", "0"]]


def evil_piece_keys(ref: SaveRef) -> list[str]:
    """Keys under pieces/ with control characters in the holder position, the digest position,
    and both."""
    return [
        f"{RUN}/pieces/{EVIL}/{'a' * 64}",
        f"{RUN}/pieces/{EVIL_HOLDER_ID}/{'b' * 64}",
        f"{RUN}/pieces/{ref.save_id}/{EVIL}",
        f"{RUN}/pieces/{ref.save_id}/{EVIL_DIGEST}",
        f"{RUN}/pieces/{EVIL}/{EVIL}",
    ]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c))
def test_control_characters_in_piece_keys_never_reach_the_terminal_raw(tmp_path: Path, command: list[str]) -> None:
    root = tmp_path / "store"
    st = CheckpointStore.open(root, RUN, identity=IDENT, options=V3)
    with st.save(1) as s:
        s.put("model", b"weights")
    assert s.ref is not None
    st.close()
    for key in evil_piece_keys(s.ref):
        path = root.joinpath(*key.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    for extra in ([], ["--json"]):
        p = cli(command[0], str(root), RUN, *command[1:], *extra)
        assert_clean(p.stdout + p.stderr)
        assert p.returncode == 0, p.stdout + p.stderr  # the junk is ignored: the save is whole and selected
        if extra:
            json.loads(p.stdout)  # JSON escapes every control character itself
        elif "pwned" in p.stdout:  # a junk key may be listed (gc's ignored keys): then only escaped
            assert "\\x1b]0;pwned\\x07" in p.stdout, p.stdout
    for key in evil_piece_keys(s.ref):  # never deleted either
        assert root.joinpath(*key.split("/")).read_bytes() == b"x"
    assert_selected_and_whole(root, s.ref, data={"model": b"weights"})


@pytest.fixture
def memory_run() -> Iterator[tuple[str, Backend]]:
    name = "evil-pieces"
    yield f"memory://{name}", named_memory_backend(name)


def test_control_characters_in_piece_keys_of_an_object_store_never_reach_the_terminal_raw(
    memory_run: tuple[str, Backend], capsys: pytest.CaptureFixture[str],
) -> None:
    """On an object store a key is any string: a newline, and a ``/`` inside the planted part."""
    url, backend = memory_run
    st = CheckpointStore.open(backend, RUN, identity=IDENT, options=V3)
    with st.save(1) as s:
        s.put("model", b"weights")
    assert s.ref is not None
    st.close()
    planted = [*evil_piece_keys(s.ref), f"{RUN}/pieces/{s.ref.save_id}/{'c' * 64}\n{EVIL}/{'d' * 64}"]
    raw = RawAccess(backend)
    for key in planted:
        raw.set(key, b"x")
    for command in COMMANDS:
        for extra in ([], ["--json"]):
            capsys.readouterr()
            rc = cli_main([command[0], url, RUN, *command[1:], *extra])
            out = capsys.readouterr()
            assert_clean(out.out + out.err)
            assert rc == 0 and "Traceback" not in out.err, (command, extra, out.out + out.err)
    assert all(raw.get(k) == b"x" for k in planted)
    assert_selected_and_whole(backend, s.ref, data={"model": b"weights"})
