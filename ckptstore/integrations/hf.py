"""Hugging Face ``Trainer`` plug-in: publish each ``checkpoint-N`` as one save; restore the latest complete one.

The ``Trainer`` writes ``output_dir/checkpoint-N`` as a plain directory and,
on resume (``resume_from_checkpoint=True``), takes the highest-numbered one
without checking that it is complete: a process killed while writing it
leaves a directory that the next start trusts. With ckptstore:

* :class:`StoreCallback` publishes each ``checkpoint-N`` directory as one save
  of step ``N`` once it is fully written. ``on_save`` runs after the Trainer
  wrote the directory. Single process: it publishes at once. Several
  processes: every process enters a barrier (so every rank's files, e.g.
  ``rng_state_<rank>.pth``, are on disk), then global rank 0 alone
  publishes and sends the outcome to every rank over the process group (a
  failed publication raises on every rank, none runs ahead of it). The
  directory must be on a filesystem the main process sees (as the Trainer's
  own resume requires).
* :func:`restore_latest` copies the newest complete save back into
  ``output_dir/checkpoint-N`` (every byte BLAKE3-verified on the way) and
  returns that path for ``trainer.train(resume_from_checkpoint=path)``. Newer
  ``checkpoint-K`` directories, which the store never saw complete, are
  renamed aside (``checkpoint-K.incomplete-<time>``), never deleted.

Nothing is followed: publishing refuses a ``checkpoint-N`` that is, or holds,
a symbolic link or a special file (an error naming it; nothing is published),
or that holds more than ``max_bytes`` (default 256 GiB: a planted sparse file
is refused before a byte is read),
restoring writes only into a directory it created, and only
``checkpoint-<int>`` in its one canonical spelling counts as a checkpoint
directory (:mod:`ckptstore.integrations.hf_files`). Ranks learn the restored
path from rank 0 over the process group (canonical JSON in a ``uint8``
tensor: no pickle, no file).

The files are treated as opaque bytes: ckptstore reads and writes them and
never unpickles them (the Trainer's own ``optimizer.pt`` and
``rng_state.pth`` are ``torch.save`` files; loading them is the Trainer's
doing, as without ckptstore).
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import (
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from ..errors import (
    CkptStoreError,
    CommitConflictError,
    CorruptionError,
    InvalidInputError,
    NotFoundError,
    SaveNotPublishedError,
    StoreUnavailableError,
)
from ..protocol import canonical_json, decode_json, validate_component_name
from ..store import CheckpointStore, SaveRef
from ..util import files as durable
from .hf_files import CheckpointTree, checkpoint_step, write_tree

FORMAT = "ckptstore.hf/1"
FILES = "files/"
#: the most bytes one published ``checkpoint-N`` may hold (the sum of its files' sizes as listed) unless
#: ``max_bytes`` raises it: a model of about 16 billion parameters with Adam's fp32 states. A planted (sparse)
#: file of a terabyte is refused before a byte is read, instead of being streamed into the store.
DEFAULT_MAX_PUBLISH_BYTES = 256 << 30
#: the largest message rank 0 sends the other ranks (a path or an error message)
MAX_SHARED_BYTES = 1 << 16
#: what the Trainer itself takes for a checkpoint directory (transformers.trainer_utils): any Unicode digits
_TRAINER_CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")

__all__ = ["DEFAULT_MAX_PUBLISH_BYTES", "FORMAT", "StoreCallback", "publish_checkpoint_dir", "restore_latest", "restore_step"]


def _dist() -> Any | None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency of transformers' Trainer
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _broadcast(dist: Any, message: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's ``message`` on every rank, sent over the default process group as
    canonical JSON in a ``uint8`` tensor (no pickle, no file). Rank 0 passes the
    message, the other ranks None. A collective: every rank must call it."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if dist.get_rank() == 0:
        assert message is not None
        data = canonical_json(message)
        if len(data) > MAX_SHARED_BYTES:
            data = canonical_json({"error": "CkptStoreError", "message": f"rank 0's message of {len(data)} bytes is too long"})
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    n = int(size.item())
    if not 0 < n <= MAX_SHARED_BYTES:
        raise CorruptionError(f"rank 0 announced a message of {n} bytes (at most {MAX_SHARED_BYTES}): not this callback's")
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if dist.get_rank() == 0
           else torch.empty(n, dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=0)
    if dist.get_rank() == 0:
        assert message is not None
        return message
    got = decode_json(bytes(buf.cpu().tolist()), where="rank 0's message", max_bytes=MAX_SHARED_BYTES, canonical=True)
    if not isinstance(got, dict):
        raise CorruptionError("rank 0's message is not a JSON object: not this callback's")
    return got


#: the classes a failure on rank 0 is raised as on the other ranks (any other: CkptStoreError)
_RERAISED: dict[str, type[CkptStoreError]] = {
    c.__name__: c for c in (InvalidInputError, CorruptionError, NotFoundError, StoreUnavailableError)
}


def _on_rank0(dist: Any, what: str, fn: Callable[[], str | None], failed: type[CkptStoreError] | None = None) -> str | None:
    """Run ``fn`` on rank 0 and return its result on every rank; its failure
    raises on every rank (on the others as ``failed``, or as the same ckptstore
    class as on rank 0)."""
    if dist.get_rank() == 0:
        try:
            value = fn()
        except BaseException as exc:
            _broadcast(dist, {"error": type(exc).__name__, "message": str(exc)[:8000]})
            raise
        _broadcast(dist, {"value": value})
        return value
    got = _broadcast(dist, None)
    if set(got) == {"value"} and (got["value"] is None or isinstance(got["value"], str)):
        return got["value"]
    if set(got) == {"error", "message"} and isinstance(got["error"], str) and isinstance(got["message"], str):
        cls = failed or _RERAISED.get(got["error"], CkptStoreError)
        raise cls(f"rank 0 could not {what}: {got['error']}: {got['message']}")
    raise CorruptionError(f"rank 0's message has fields {sorted(got)[:8]}: not this callback's")


def _tree_files(tree: CheckpointTree) -> list[tuple[str, int]]:
    files = tree.files()
    for rel, _ in files:
        try:
            validate_component_name(FILES + rel)
        except InvalidInputError as exc:
            raise InvalidInputError(f"{tree.path / rel}: cannot be stored under this name ({exc})") from None
    return files


def _matches(ref: SaveRef, directory: Path) -> bool:
    """The directory (a real one, not a link) holds exactly the save's files, byte for byte."""
    want = {n[len(FILES):]: c for n, c in ref.components.items() if n.startswith(FILES)}
    try:
        with CheckpointTree(directory) as tree:
            have = dict(_tree_files(tree))
            if set(have) != set(want):
                return False
            return all(have[r] == c.size and c.matches(tree.blocks(r, c.size)) for r, c in want.items())
    except (InvalidInputError, OSError):
        return False


def _check_size(d: Path, files: list[tuple[str, int]], max_bytes: int) -> None:
    total = sum(size for _, size in files)
    if total <= max_bytes:
        return
    rel, size = max(files, key=lambda f: f[1])
    raise InvalidInputError(
        f"{d}: {total} bytes to publish, more than the cap of {max_bytes} bytes (max_bytes; default "
        f"{DEFAULT_MAX_PUBLISH_BYTES}); its largest file {d / rel} has {size} bytes. Nothing was published: "
        "remove that file if it does not belong to the checkpoint, or, if the checkpoint is really this "
        "large, raise the cap (StoreCallback(store, max_bytes=N), publish_checkpoint_dir(..., max_bytes=N))"
    )


def publish_checkpoint_dir(
    store: CheckpointStore, directory: str | os.PathLike[str], step: int, *,
    max_bytes: int = DEFAULT_MAX_PUBLISH_BYTES,
) -> SaveRef:
    """Publish every file under ``directory`` (named ``checkpoint-<step>``) as one save of ``step``.

    Refused with :class:`~ckptstore.InvalidInputError` (nothing published) when
    the directory has another name, is a symbolic link, or holds a link or a
    special file anywhere (the error names it), or when its files (the sizes
    the listing saw) sum to more than ``max_bytes`` (the error names the
    largest file, its size, the cap and the option) -- refused before any byte
    is read or uploaded; each file is then read to its listed size and no
    further (one that changed meanwhile is an error, and the save is not
    committed). If this attempt already
    published ``step`` with the same bytes, that save is returned; with other
    bytes, :class:`~ckptstore.CommitConflictError`.
    """
    d = Path(directory)
    if checkpoint_step(d.name) != step:
        raise InvalidInputError(f"{d}: a checkpoint directory of step {step} must be named 'checkpoint-{step}'")
    try:
        tree = CheckpointTree(d)
    except FileNotFoundError:
        raise InvalidInputError(f"{d}: no checkpoint files to publish") from None
    except OSError as exc:
        raise InvalidInputError(f"{d}: cannot read the checkpoint directory ({exc.strerror or exc})") from None
    try:
        with tree:
            files = _tree_files(tree)
            if not files:
                raise InvalidInputError(f"{d}: no checkpoint files to publish")
            _check_size(d, files, max_bytes)
            metadata = {"format": FORMAT, "checkpoint": d.name, "global_step": step}
            with store.save(step, metadata=metadata, expect=[FILES + r for r, _ in files]) as s:
                for rel, size in files:
                    s.put(FILES + rel, tree.blocks(rel, size))
    except CommitConflictError:
        assert store.attempt is not None
        ref = store.get_save(step, store.attempt.number)
        if _matches(ref, d):
            return ref
        raise
    except OSError as exc:
        if isinstance(exc, CkptStoreError):  # NotFoundError is a FileNotFoundError too: the store's, not the directory's
            raise
        raise InvalidInputError(f"{d}: cannot read the checkpoint directory ({exc.strerror or exc}: {exc.filename})") from None
    assert s.ref is not None
    return s.ref


class StoreCallback(TrainerCallback):
    """Publish every ``checkpoint-N`` the Trainer writes as one ckptstore save.

    ``store``: a writable :class:`~ckptstore.CheckpointStore`, or a function
    that opens one (called once, on the world main process only, at the first
    save: pass a function in multi-process runs so that only that process
    registers an attempt).

    ``max_bytes``: the most bytes one ``checkpoint-N`` may hold (default
    :data:`DEFAULT_MAX_PUBLISH_BYTES`, 256 GiB); a larger one is refused before
    anything is uploaded (:func:`publish_checkpoint_dir`).

    Multi-process: every rank waits for the others, rank 0 publishes, and the
    outcome reaches every rank over the process group; a failed publication
    raises :class:`~ckptstore.SaveNotPublishedError` on the other ranks (and
    its own error on rank 0).
    """

    def __init__(self, store: CheckpointStore | Callable[[], CheckpointStore], *,
                 max_bytes: int = DEFAULT_MAX_PUBLISH_BYTES) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
            raise InvalidInputError(f"StoreCallback(max_bytes={max_bytes!r}): a positive number of bytes")
        self.max_bytes = max_bytes
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

    def _publish(self, args: TrainingArguments, step: int) -> str:
        directory = Path(str(args.output_dir)) / f"checkpoint-{step}"
        ref = publish_checkpoint_dir(self.store, directory, step, max_bytes=self.max_bytes)
        self.published.append(ref)
        return ref.save_id

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl | None:
        dist = _dist()
        if dist is None:
            if state.is_world_process_zero:
                self._publish(args, state.global_step)
            return None
        dist.barrier()  # every process has written its part of the directory
        _on_rank0(dist, f"publish checkpoint-{state.global_step}", lambda: self._publish(args, state.global_step),
                  SaveNotPublishedError)
        return None


def _write_tmp(store: CheckpointStore, ref: SaveRef, out: Path, name: str) -> None:
    files = ((n[len(FILES):], store.iter_read(ref, n)) for n in sorted(ref.components) if n.startswith(FILES))
    # each file's last block is yielded only once the whole file verified
    write_tree(out, name, files)


def _in_the_way(name: str, step: int) -> bool:
    """Whether the Trainer's own ``get_last_checkpoint`` (``checkpoint-(\\d+)``, any
    Unicode digits, ``int()`` of them) could prefer ``name`` over the restored
    ``checkpoint-<step>``: a newer step, or another spelling of the same one."""
    m = _TRAINER_CHECKPOINT_RE.fullmatch(name)
    if m is None:
        return False
    try:
        value = int(m.group(1))
    except ValueError:  # more digits than int() converts
        return True
    return value > step or (value == step and checkpoint_step(name) != step)


def _set_aside(d: Path, stamp: str) -> Path:
    aside = d.with_name(f"{d.name}.incomplete-{stamp}")
    os.replace(d, aside)  # renames the entry itself: a link is moved, never followed
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
    otherwise it is renamed aside and replaced (a link there is renamed, never
    followed). A save whose bytes fail verification while being copied is
    skipped for the next older complete one. With ``set_aside_newer``, every
    directory or link the Trainer's own ``resume_from_checkpoint=True`` could
    prefer is renamed aside (never deleted, never followed): a newer
    ``checkpoint-K``, and names the Trainer reads as a step although they are
    not its canonical spelling (``checkpoint-0100``, ``checkpoint-١٠٠``) when
    that step is not older. Other names (``checkpoint-x``) are left alone.

    Multi-process (``torch.distributed`` initialized): the global rank 0
    restores; every other rank receives the path (or rank 0's error, raised as
    the same ckptstore class) over the process group and returns the same path.
    """
    out = Path(output_dir)
    dist = _dist()
    if dist is None:
        return _restore(store, out, run_id, storage_options, set_aside_newer, None)
    return _on_rank0(dist, f"restore into {out}", lambda: _restore(store, out, run_id, storage_options, set_aside_newer, None))


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
    that step. Newer directories are left alone. Single process (no collective)."""
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
            tmp = f".checkpoint-{ref.step}.ckptstore-restore-{stamp}"
            try:
                _write_tmp(store, ref, out, tmp)
            except CorruptionError:
                shutil.rmtree(out / tmp, ignore_errors=True)  # ours (created exclusively); rmtree follows no link
                continue  # this save's bytes rotted at rest: try the next older one
            except BaseException:
                shutil.rmtree(out / tmp, ignore_errors=True)
                raise
            if os.path.lexists(target):
                _set_aside(target, stamp)
            durable.replace_durably(out / tmp, target)
        if set_aside_newer:
            with os.scandir(out) as it:
                newer = [e.name for e in it if _in_the_way(e.name, ref.step) and (e.is_dir(follow_symlinks=False) or e.is_symlink())]
            for name in newer:
                _set_aside(out / name, stamp)
            durable.fsync_dir(out)
        return str(target)
    return None
