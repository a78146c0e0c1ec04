"""Hugging Face ``Trainer`` plug-in: publish each ``checkpoint-N`` as one save; restore the latest complete one.

The ``Trainer`` writes ``output_dir/checkpoint-N`` as a plain directory and,
on resume (``resume_from_checkpoint=True``), takes the highest-numbered one
without checking that it is complete: a process killed while writing it
leaves a directory that the next start trusts. With ckptstore:

* :class:`StoreCallback` publishes each ``checkpoint-N`` directory as one save
  of step ``N`` once it is fully written. ``on_save`` runs after the Trainer
  wrote the directory. Single process: it publishes at once. Several
  processes: every process enters a barrier (so every rank's files, e.g.
  ``rng_state_<rank>.pth``, are on disk), then the world main process alone
  publishes, then a second barrier (so no rank runs ahead of a failed
  publication). The directory must be on a filesystem the main process sees
  (as the Trainer's own resume requires).
* :func:`restore_latest` copies the newest complete save back into
  ``output_dir/checkpoint-N`` (every byte BLAKE3-verified on the way) and
  returns that path for ``trainer.train(resume_from_checkpoint=path)``. Newer
  ``checkpoint-K`` directories, which the store never saw complete, are
  renamed aside (``checkpoint-K.incomplete-<time>``), never deleted.

The files are treated as opaque bytes: ckptstore reads and writes them and
never unpickles them (the Trainer's own ``optimizer.pt`` and
``rng_state.pth`` are ``torch.save`` files; loading them is the Trainer's
doing, as without ckptstore).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
from transformers import (
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from ..errors import CommitConflictError, CorruptionError, InvalidInputError
from ..protocol import validate_component_name
from ..store import CheckpointStore, SaveRef

FORMAT = "ckptstore.hf/1"
FILES = "files/"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_MARKER = ".ckptstore-restored.json"

__all__ = ["FORMAT", "StoreCallback", "publish_checkpoint_dir", "restore_latest", "restore_step"]


def _dist() -> Any | None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency of transformers' Trainer
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


def _files(directory: Path) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for n in sorted(names):
            p = Path(root) / n
            rel = p.relative_to(directory).as_posix()
            try:
                validate_component_name(FILES + rel)
            except InvalidInputError as exc:
                raise InvalidInputError(f"{p}: cannot be stored under this name ({exc})") from None
            out.append((rel, p))
    return out


def _digest_file(p: Path) -> str:
    h = blake3.blake3()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _matches(ref: SaveRef, directory: Path) -> bool:
    """The directory holds exactly the save's files, byte for byte."""
    if not directory.is_dir():
        return False
    want = {n[len(FILES):]: c for n, c in ref.components.items() if n.startswith(FILES)}
    try:
        have = dict(_files(directory))
    except InvalidInputError:
        return False
    if set(have) != set(want):
        return False
    return all(have[r].stat().st_size == c.size and _digest_file(have[r]) == c.blake3 for r, c in want.items())


def publish_checkpoint_dir(store: CheckpointStore, directory: str | os.PathLike[str], step: int) -> SaveRef:
    """Publish every file under ``directory`` as one save of ``step``.

    If this attempt already published ``step`` with the same bytes, that save
    is returned; with other bytes, :class:`~ckptstore.CommitConflictError`.
    """
    d = Path(directory)
    files = _files(d) if d.is_dir() else []
    if not files:
        raise InvalidInputError(f"{d}: no checkpoint files to publish")
    metadata = {"format": FORMAT, "checkpoint": d.name, "global_step": step}
    try:
        with store.save(step, metadata=metadata, expect=[FILES + r for r, _ in files]) as s:
            for rel, p in files:
                with open(p, "rb") as f:
                    s.put(FILES + rel, f)
    except CommitConflictError:
        assert store.attempt is not None
        ref = store.get_save(step, store.attempt.number)
        if _matches(ref, d):
            return ref
        raise
    assert s.ref is not None
    return s.ref


class StoreCallback(TrainerCallback):
    """Publish every ``checkpoint-N`` the Trainer writes as one ckptstore save.

    ``store``: a writable :class:`~ckptstore.CheckpointStore`, or a function
    that opens one (called once, on the world main process only, at the first
    save: pass a function in multi-process runs so that only that process
    registers an attempt).
    """

    def __init__(self, store: CheckpointStore | Callable[[], CheckpointStore]) -> None:
        self._store = store if isinstance(store, CheckpointStore) else None
        self._open = None if isinstance(store, CheckpointStore) else store
        #: The saves published by this callback, oldest first.
        self.published: list[SaveRef] = []

    @property
    def store(self) -> CheckpointStore:
        if self._store is None:
            assert self._open is not None
            self._store = self._open()
        return self._store

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl | None:
        _barrier()  # every process has written its part of the directory
        try:
            if state.is_world_process_zero:
                directory = Path(str(args.output_dir)) / f"checkpoint-{state.global_step}"
                self.published.append(publish_checkpoint_dir(self.store, directory, state.global_step))
        finally:
            _barrier()
        return None


def _write_tmp(store: CheckpointStore, ref: SaveRef, tmp: Path) -> None:
    for name in sorted(ref.components):
        if not name.startswith(FILES):
            continue
        target = tmp / name[len(FILES):]
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:
            # the last block is yielded only once the whole file verified
            f.writelines(store.iter_read(ref, name))
            f.flush()
            os.fsync(f.fileno())


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _set_aside(d: Path, stamp: str) -> Path:
    aside = d.with_name(f"{d.name}.incomplete-{stamp}")
    os.replace(d, aside)
    return aside


def restore_latest(
    store: CheckpointStore | str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    run_id: str | None = None,
    storage_options: dict[str, Any] | None = None,
    set_aside_newer: bool = True,
) -> str | None:
    """Restore the newest complete save into ``output_dir/checkpoint-N``; return that path.

    ``store``: an open store, or a URL (then ``run_id`` is needed; it is opened
    read-only). None when the run has no complete save (start fresh). An
    existing ``checkpoint-N`` whose files match the save byte for byte is kept;
    otherwise it is renamed aside and replaced. A save whose bytes fail
    verification while being copied is skipped for the next older complete one.

    Multi-process (``torch.distributed`` initialized): the global rank 0
    restores; every other rank waits at a barrier and returns the same path.
    """
    out = Path(output_dir)
    dist = _dist()
    if dist is not None and dist.get_rank() != 0:
        _barrier()
        marker = json.loads((out / _MARKER).read_text())
        return marker["path"] if isinstance(marker.get("path"), str) else None
    try:
        path = _restore(store, out, run_id, storage_options, set_aside_newer, None)
        if dist is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / _MARKER).write_text(json.dumps({"path": path}))
    finally:
        if dist is not None:
            _barrier()
    return path


def restore_step(
    store: CheckpointStore | str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    step: int,
    *,
    run_id: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> str | None:
    """Restore the complete save of ``step`` into ``output_dir/checkpoint-<step>`` (as
    :func:`restore_latest` does for the newest); None when the run has no complete save of
    that step. Newer directories are left alone. Single process (no barrier)."""
    return _restore(store, Path(output_dir), run_id, storage_options, False, step)


def _restore(
    store: CheckpointStore | str | os.PathLike[str],
    out: Path,
    run_id: str | None,
    storage_options: dict[str, Any] | None,
    set_aside_newer: bool,
    step: int | None,
) -> str | None:
    if not isinstance(store, CheckpointStore):
        if run_id is None:
            raise InvalidInputError("restore_latest(url, ...) needs run_id=")
        store = CheckpointStore.open(store, run_id, mode="r", storage_options=storage_options)
    candidates = [i.ref for i in store.list_saves() if i.ref is not None and i.state.value == "committed"]
    if step is not None:
        candidates = [r for r in candidates if r.step == step]
    else:
        latest = store.latest_complete()
        # the selection's answer first, then older complete saves
        candidates = [latest] + [r for r in candidates if r.step < latest.step] if latest is not None else []
    stamp = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    for ref in candidates:
        if ref.metadata.get("format") != FORMAT:
            raise InvalidInputError(f"save {ref.save_id} is not a Hugging Face checkpoint (format {ref.metadata.get('format')!r})")
        out.mkdir(parents=True, exist_ok=True)
        target = out / f"checkpoint-{ref.step}"
        if not _matches(ref, target):
            tmp = out / f".checkpoint-{ref.step}.ckptstore-restore-{stamp}"
            try:
                _write_tmp(store, ref, tmp)
            except CorruptionError:
                shutil.rmtree(tmp, ignore_errors=True)
                continue  # this save's bytes rotted at rest: try the next older one
            if target.exists():
                _set_aside(target, stamp)
            os.replace(tmp, target)
            _fsync_dir(out)
        if set_aside_newer:
            for d in out.iterdir():
                m = _CHECKPOINT_RE.match(d.name)
                if m and d.is_dir() and int(m.group(1)) > ref.step:
                    _set_aside(d, stamp)
            _fsync_dir(out)
        return str(target)
    return None
