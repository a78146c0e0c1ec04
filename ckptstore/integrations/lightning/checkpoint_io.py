"""Lightning ``CheckpointIO`` backed by a :class:`~ckptstore.CheckpointStore`.

``Trainer(plugins=[StoreCheckpointIO(url, run_id, identity=...)])`` makes every
checkpoint Lightning writes (``ModelCheckpoint``, ``trainer.save_checkpoint``)
one crash-consistent save in the store, and puts a small *pointer file* at the
path Lightning asked for, so that Lightning's own bookkeeping (file exists,
``-v1`` versions, ``last.ckpt``, top-k removal, ``ckpt_path=...``) keeps working.

Save, in this order:

1. the checkpoint dict is split per top-level key: tensors go to one
   safetensors component per key (``tensors/<key>.safetensors``), everything
   else to ``checkpoint.json`` as the tagged JSON of :mod:`ckptstore.torch.codec`
   (nothing is pickled; an object it cannot represent is refused here, with its
   key path, before anything is written);
2. the save is committed (the store's atomic publication);
3. the pointer is written atomically (local: temp file + fsync + rename +
   directory fsync; remote: one fsspec PUT, atomic on object stores).

A crash before 3 leaves no pointer (Lightning sees no file; the store may hold
a complete save, which :func:`write_pointer_for_latest` can point to). A
pointer always names a committed save. (The asynchronous variant reserves a
path that has no file yet with a reservation file on the caller's thread,
replaced by the pointer in 3; a crash leaves the reservation, which loads as
:class:`NotFoundError` naming that fix.)

A second checkpoint at the same ``global_step`` in the same process (the
``last.ckpt`` beside the top-k file, a second ``ModelCheckpoint``,
``trainer.save_checkpoint`` after ``fit``) does not write the tensors again:
each key's tensors are hashed and compared with the save's component digests;
keys whose tensors and tree are identical are referenced, keys that differ
(callback scores, loop counters) are carried inside the pointer, digest-checked
and, with a key, tagged, up to ``max_inline_bytes``. Different large tensors at
the same step are refused (a store holds one save per step and attempt).

Loading reads the pointer (no link followed, at most
``2 * max_inline_bytes + 1 MiB``, strict JSON: no duplicate key, no unknown
field, every type checked), refuses one that names another store or run than
the plug-in's unless ``allow_other_stores=True``, checks that the save it
names still has the same manifest digest (and, under ``auth_policy`` warn or
require, that its commit record is authenticated and inline state carries the
run key's tag), and reads every component verified against its BLAKE3 digest.
Below the directories it saves into (its *checkpoint directories*,
:mod:`.paths`) no path it reads, writes or removes goes through a link: every
component is opened no-follow from the directory's descriptor.
``remove_checkpoint`` removes only the pointer (the bytes are the store's and
go through its gc), and only a file it proves it wrote: a pointer to its own
run inside one of its checkpoint directories, or a detached file it wrote,
never through a link or a path with ``..`` (anything else is kept, with a
:class:`RemovalRefusedWarning`).
``protocol_spec/THREATS.md`` §4.5 has the rules and their tests.

Pointer file (JSON, one object)::

    {"format": "ckptstore.lightning-pointer/1", "store": URL, "run_id": ...,
     "step": N, "attempt": A, "save_id": ..., "manifest_digest": ...,
     "keys": [top-level keys in order], "inline": {key: {"tree": ..., "tensors": base64 safetensors | null}},
     "inline_digest": BLAKE3 of the canonical JSON of "inline",
     "auth": {"key_id": ..., "tag": ...}}   # with a key: the record tag (kind "event") of
                                             # BLAKE3("ckptstore/v1/lightning-pointer" 0x00 canonical JSON of the rest)

A dict without an integer ``global_step`` is not a training checkpoint (Lightning's
spawn launcher hands the trained weights to the main process this way): it is
written at the path, outside the store, as a *detached* file: a magic line, a
small header (size, BLAKE3 of the rest, and a keyed BLAKE3 tag under a random
secret the plug-in makes when constructed and that travels only with its
pickled copies to spawned workers), the JSON tree and the safetensors bytes.
``load_checkpoint`` reads one only if that tag verifies (so only in the job
that wrote it) and never as a training checkpoint.

Multi-process: Lightning calls ``save_checkpoint`` on global rank 0 only. The
store is opened for writing lazily, at the first save, as the job's single
writer (``single_writer=True``), so only that process registers an attempt;
every rank loads through a store opened for reading. Pass
``url``/``run_id``/``identity`` (not an open store) when the strategy spawns
processes (the plug-in then pickles; one built on an open store refuses to).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ... import RecordAuth
from ...errors import (
    CkptStoreError,
    CorruptionError,
    InvalidInputError,
)
from ...identity import RunIdentity
from ...options import AuthOptions, OpenOptions
from ...protocol.auth import AuthPolicy, Keyring
from ...shims.lightning_private import PATH
from ...store import CheckpointStore
from ...torch.codec import (
    TypeRegistry,
    load_safetensors,
    tree_from_json,
    tree_to_json,
    unflatten,
)
from ...torch.tensor_read import read_tensors
from .files import (
    DEFAULT_MAX_INLINE_BYTES,
    DETACHED_MAGIC,
    DOC_COMPONENT,
    FORMAT,
    POINTER_FORMAT,
    Published,
    check_writable,
    detached_bytes,
    encode_checkpoint,
    inline_state,
    make_pointer,
    map_tensors,
    mark_done,
    pending_bytes,
    publish,
    reserve_path,
    tensor_bytes,
    url_scheme,
    wait_in_flight,
    write_atomic,
    write_pointer_for_latest,
)
from .paths import CheckpointDirs, outside
from .trust import (
    RemovalRefusedWarning,
    check_inline,
    detached_header,
    inline_tensor_bytes,
    is_detached,
    is_pending,
    load_detached,
    named_save,
    open_checked,
    parse_pointer,
    pointer_cap,
    read_at_most,
    read_pointer,
    remove_own_file,
    reservation_not_a_checkpoint,
    reservation_of,
)

__all__ = [
    "DOC_COMPONENT",
    "FORMAT",
    "POINTER_FORMAT",
    "StoreCheckpointIO",
    "load_module",
    "RemovalRefusedWarning",
    "read_pointer",
    "write_pointer_for_latest",
]


# ------------------------------------------------------------------ the plug-in


class StoreCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves into a ckptstore run.

    Pass an open writable ``store``, or ``url``, ``run_id`` and ``identity``
    (opened at the first save, on the process that saves: Lightning saves on
    global rank 0 only, so the store is opened with ``single_writer=True``).
    ``url`` and ``run_id`` without ``identity``: it only loads, from that run.
    With none of them it only loads, and only with ``allow_other_stores=True``
    (a pointer names its own store). ``registry``: the enums and dataclasses
    allowed in checkpoints (default: the process-wide
    :data:`ckptstore.torch.codec.TYPES`).

    What it reads is input (``protocol_spec/THREATS.md`` §4.5): a pointer is
    parsed strictly within a size cap, never through a link; a pointer naming
    another store or run than the plug-in's is refused unless
    ``allow_other_stores=True`` (that store is then opened with the same
    ``auth_policy`` and key); under ``auth_policy="require"`` the commit it names
    must be authenticated and inline state must carry the run key's tag. A
    detached file (a dict without ``global_step``) is loaded only if this
    plug-in or one of its spawned copies wrote it. ``remove_checkpoint``
    removes only such files (a pointer to this plug-in's run inside a directory
    it saved into, or a detached file it wrote), never through a link or a
    ``..``; anything else is kept with a :class:`RemovalRefusedWarning`. Below
    the directories it saved into, a path through a link is refused for
    reading and saving too (``protocol_spec/THREATS.md`` §4.5).

    ``auth_policy``/``keyring``: as for :meth:`CheckpointStore.open`, for the
    stores it opens (with an open ``store``, that store's are used).
    """

    def __init__(
        self,
        store: CheckpointStore | None = None,
        *,
        url: str | None = None,
        run_id: str | None = None,
        identity: RunIdentity | Mapping[str, Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        registry: TypeRegistry | None = None,
        max_inline_bytes: int = DEFAULT_MAX_INLINE_BYTES,
        auth_policy: AuthPolicy | str = "off",
        keyring: Keyring | None = None,
        allow_other_stores: bool = False,
    ) -> None:
        self.read_only = store is None and identity is None
        if store is not None and (url is not None or run_id is not None or identity is not None):
            raise InvalidInputError("StoreCheckpointIO takes a store, or url=, run_id= and identity=, not both")
        if store is None and (url is None) != (run_id is None):
            raise InvalidInputError("StoreCheckpointIO needs a writable store, or url=, run_id= and identity=")
        if store is None and identity is not None and url is None:
            raise InvalidInputError("StoreCheckpointIO needs a writable store, or url=, run_id= and identity=")
        if store is not None and store.mode != "w":
            raise InvalidInputError("StoreCheckpointIO needs a store opened for writing (identity=...)")
        if store is not None and (auth_policy != "off" or keyring is not None):
            raise InvalidInputError("with an open store, its auth_policy and keyring apply: pass them to CheckpointStore.open")
        self._store = store
        self._url = url
        self._run_id = run_id
        self._identity = identity
        self.storage_options = dict(storage_options or {})
        self.registry = registry
        self.max_inline_bytes = max_inline_bytes
        self.allow_other_stores = allow_other_stores
        self.auth: RecordAuth = store.auth if store is not None else RecordAuth(auth_policy, keyring)
        self._given_store = store is not None
        #: authenticates the detached hand-off files of this plug-in and its spawned copies (never stored)
        self._detached_key = os.urandom(32)
        self._lock = threading.Lock()
        self._published: dict[int, Published] = {}
        self._readers: dict[tuple[str, str], CheckpointStore] = {}
        #: the directories it saved into: below them nothing is followed, outside them no pointer is removed
        self._dirs = CheckpointDirs()

    # ------------------------------------------------------------------ pickling (ddp_spawn sends plug-ins to workers)
    def __getstate__(self) -> dict[str, Any]:
        if self._given_store:
            raise TypeError(
                "a StoreCheckpointIO built on an open store cannot be sent to another process; "
                "construct it with url=, run_id= and identity= (it opens the store where it saves)"
            )
        state = dict(self.__dict__)
        state.update(_store=None, _lock=None, _published={}, _readers={})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ store
    @property
    def store(self) -> CheckpointStore:
        """The writable store (opened now if it was given by URL)."""
        with self._lock:
            if self._store is None:
                if self.read_only:
                    raise InvalidInputError(
                        "this StoreCheckpointIO was made without a store (for loading only); "
                        "pass a writable store, or url=, run_id= and identity= to save"
                    )
                assert self._url is not None and self._run_id is not None
                self._store = CheckpointStore.open(
                    self._url, self._run_id, identity=self._identity, storage_options=self.storage_options or None,
                    options=OpenOptions(single_writer=True,  # Lightning saves on global rank 0 only
                                        auth=AuthOptions(self.auth.policy, self.auth.keyring)),
                )
            return self._store

    def _options_for(self, url: str) -> dict[str, Any] | None:
        """The plug-in's storage options, for URLs of its own store's scheme only (pointer files
        beside the store, another store when allowed)."""
        own = self._url if self._url is not None else self._store.backend.url if self._store is not None else None
        if not self.storage_options or own is None or url_scheme(url) != url_scheme(own):
            return None
        return self.storage_options

    def _open_reader(self, url: str, run_id: str) -> CheckpointStore:
        key = (url, run_id)
        if key not in self._readers:
            self._readers[key] = CheckpointStore.open(
                url, run_id, mode="r", storage_options=self._options_for(url),
                options=OpenOptions(auth=AuthOptions(self.auth.policy, self.auth.keyring)),
            )
        return self._readers[key]

    def _own(self) -> CheckpointStore | None:
        """The plug-in's own run (for reading), or None when it has none."""
        if self._store is not None:
            return self._store
        if self._url is None or self._run_id is None:
            return None
        return self._open_reader(self._url, self._run_id)

    def _reader(self, ptr: Mapping[str, Any], where: str) -> CheckpointStore:
        """The store a pointer names: the plug-in's own, or another only when allowed."""
        own = self._own()
        if own is not None and own.backend.url == ptr["store"] and own.run_id == ptr["run_id"]:
            return own
        if not self.allow_other_stores:
            mine = f"run {own.run_id!r} at {own.backend.url}" if own is not None else "no store (load-only)"
            raise CorruptionError(
                f"{where}: the pointer names run {ptr['run_id']!r} at {ptr['store']}, not this plug-in's "
                f"({mine}); refusing to read another store — pass url=/run_id= of that run, or "
                "allow_other_stores=True if pointers may name other stores"
            )
        return self._open_reader(ptr["store"], ptr["run_id"])

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, checkpoint: dict[str, Any], path: PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by StoreCheckpointIO; "
                "pass storage_options when constructing it"
            )
        step = checkpoint.get("global_step") if isinstance(checkpoint, Mapping) else None
        if not isinstance(step, int) or isinstance(step, bool):
            self._save_detached(checkpoint, path)
            return
        try:
            self._save_pointed(checkpoint, step, path)
        except BaseException:
            self.release(path)  # a reservation the save made for this path goes with it
            raise
        finally:
            mark_done(path)  # a load waiting for this reservation reads the pointer (or no file) now

    def reserve(self, path: PATH, step: int) -> bool:
        """Put a reservation file at ``path`` if nothing is there, for a save of ``step`` that
        will replace it (:class:`AsyncStoreCheckpointIO` does this on the caller's thread, so
        that ``ModelCheckpoint``'s ``-v1`` version naming sees the path taken at once, as it
        would after a synchronous save). True if this call made it."""
        store = self.store
        return reserve_path(path, pending_bytes(store.backend.url, store.run_id, step), self._options_for(os.fspath(path)),
                            self._dirs)

    def release(self, path: PATH) -> None:
        """Remove the reservation at ``path`` if one of this plug-in's run is there (else nothing)."""
        def reservation(f: Any, where: str, inside: bool) -> str | None:
            ours = inside and is_pending(f.read(len(DETACHED_MAGIC))) and self._mine_pending(f, where) is None
            return None if ours else "-"

        try:
            remove_own_file(path, reservation, self._options_for(os.fspath(path)), self._dirs)
        except (OSError, CkptStoreError):
            pass  # called while a save fails: that failure is what is raised

    def _save_pointed(self, checkpoint: dict[str, Any], step: int, path: PATH) -> None:
        parts = encode_checkpoint(checkpoint, self.registry)  # refuses unrepresentable objects before any write
        check_writable(path, self._dirs)  # and a pointer path through a link, before the commit
        store = self.store
        keys = list(parts)
        with self._lock:
            pub = self._published.get(step)
        if pub is None or pub.ref.attempt != (store.attempt.number if store.attempt else None):
            pub = publish(store, step, parts, os.fspath(path))
            with self._lock:
                self._published[step] = pub
                for old in sorted(self._published)[:-8]:  # a step is revisited only right after its save
                    del self._published[old]
        data = make_pointer(pub.ref, store.backend.url, keys, inline_state(pub, parts, step, self.max_inline_bytes), self.auth)
        write_atomic(path, data, self._options_for(os.fspath(path)), self._dirs)

    def _save_detached(self, checkpoint: Mapping[str, Any], path: PATH) -> None:
        parts = encode_checkpoint(checkpoint, self.registry)  # same refusals, same messages
        tensors = {f"{i}/{k}": t for i, p in enumerate(parts.values()) for k, t in p.tensors.items()}
        doc = {"keys": list(parts), "trees": {k: p.tree for k, p in parts.items()}}
        data = detached_bytes(tree_to_json(doc), tensor_bytes(tensors), self._detached_key)
        write_atomic(path, data, self._options_for(os.fspath(path)), self._dirs)


    # ------------------------------------------------------------------ load
    def load_checkpoint(
        self, path: PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read the save the pointer at ``path`` names. ``weights_only`` is accepted and
        moot: nothing is unpickled. Tensors come back on the CPU unless
        ``map_location`` is a device or device string. A pointer that is not
        well-formed, names another store (unless allowed), or carries state
        its auth policy does not accept is a :class:`CorruptionError`."""
        where = os.fspath(path)
        cap = pointer_cap(self.max_inline_bytes)
        with open_checked(path, self._options_for(os.fspath(path)), self._dirs) as f:
            head = f.read(len(DETACHED_MAGIC))
            if is_detached(head):
                f.seek(0)
                return load_detached(f, where, self._detached_key, self.registry, map_location)
            pending = is_pending(head)
            if pending and not wait_in_flight(path):  # a save of this process still running: its pointer comes
                raise reservation_not_a_checkpoint(f, where)
            raw = b"" if pending else read_at_most(f, cap, where, head)
        if pending:
            return self.load_checkpoint(path, map_location, weights_only)
        ptr = parse_pointer(raw, where, cap)
        store = self._reader(ptr, where)
        ref = named_save(store, ptr, where, self.auth)
        if ptr["inline"]:
            check_inline(self.auth, ptr, where)
        doc = tree_from_json(store.read(ref, DOC_COMPONENT))
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            fmt = doc.get("format") if isinstance(doc, dict) else None
            raise CorruptionError(f"save {ref.save_id}: unknown format {fmt!r}")
        out: dict[str, Any] = {}
        for key in ptr["keys"]:
            if key in ptr["inline"]:
                item = ptr["inline"][key]
                blob = inline_tensor_bytes(item, f"{where}: inline tensors of {key[:64]!r}")
                tensors = load_safetensors(blob) if blob else {}
                tree = item["tree"]
            else:
                if key not in doc["trees"]:
                    raise CorruptionError(f"{where}: key {key!r} is neither inline nor in save {ref.save_id}")
                comp = doc["tensor_components"].get(key)
                tensors = read_tensors(store, ref, {key: comp}).get(key, {}) if comp else {}
                tree = doc["trees"][key]
            tensors = map_tensors(tensors, map_location)
            out[key] = unflatten(tree, tensors, registry=self.registry)
        return out


    # ------------------------------------------------------------------ remove
    def remove_checkpoint(self, path: PATH) -> None:
        """Remove the pointer only (the save stays in the store until gc), and
        only a file this plug-in wrote: a well-formed pointer to its own run, or
        a detached file it wrote. A link, a special file, a path with ``..`` or
        any other file is kept, with a :class:`RemovalRefusedWarning`; a missing
        file is nothing to do."""
        why = remove_own_file(path, self._mine, self._options_for(os.fspath(path)), self._dirs)
        if why is not None:
            warnings.warn(
                f"{os.fspath(path)}: not removed: {why}; the ckptstore Lightning plug-in removes only the "
                "pointer and hand-off files it wrote (remove the file yourself if it should go)",
                RemovalRefusedWarning,
                stacklevel=2,
            )

    def _mine(self, f: Any, where: str, inside: bool) -> str | None:
        """None if the open file ``f`` is a detached file this plug-in (or a copy) wrote (its tag
        proves it, wherever it is: the spawn launcher's hand-off in a temporary directory), or,
        ``inside`` one of its checkpoint directories, a pointer or reservation of its own run
        (``allow_other_stores`` does not widen what it removes): such a file names a run, not
        where it was written, so outside those directories it is kept."""
        cap = pointer_cap(self.max_inline_bytes)
        try:
            head = f.read(len(DETACHED_MAGIC))
            if is_detached(head):
                f.seek(0)
                detached_header(f, where, self._detached_key)
                return None
            if not inside:
                return outside(self._dirs.roots())
            if is_pending(head):
                return self._mine_pending(f, where)
            ptr = parse_pointer(read_at_most(f, cap, where, head), where, cap)
            own = self._own()
        except CkptStoreError as exc:
            return f"not a file this plug-in wrote ({str(exc).removeprefix(where + ': ')})"
        if own is None or (own.backend.url, own.run_id) != (ptr["store"], ptr["run_id"]):
            return (f"not a file this plug-in wrote (a pointer to run {ptr['run_id']!r} at {ptr['store']}, "
                    "not to this plug-in's run)")
        return None


    def _mine_pending(self, f: Any, where: str) -> str | None:
        """None if ``f`` (read past its magic line) is a reservation for this plug-in's own run."""
        own = self._store if self._store is not None else self._own()
        return reservation_of(f, where, None if own is None else (own.backend.url, own.run_id))


def load_module(
    cls: Any,
    path: PATH,
    *,
    map_location: Any | None = None,
    strict: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    registry: TypeRegistry | None = None,
    url: str | None = None,
    run_id: str | None = None,
    auth_policy: AuthPolicy | str = "off",
    keyring: Keyring | None = None,
    allow_other_stores: bool = False,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path)`` for a pointer file (which ``torch.load`` cannot read).

    Builds the ``LightningModule`` (or ``LightningDataModule``) from the saved
    hyper-parameters (``kwargs`` override them) and loads its state, as
    Lightning's own ``load_from_checkpoint`` does after its ``torch.load``.
    ``url``/``run_id``: the run the pointer must name (or ``allow_other_stores=True``:
    whichever it names); ``auth_policy``/``keyring``: as for :class:`StoreCheckpointIO`.
    """
    import lightning.pytorch as pl

    from ...shims.lightning_private import load_state, migrate_checkpoint

    io = StoreCheckpointIO(url=url, run_id=run_id, storage_options=storage_options, registry=registry,
                           auth_policy=auth_policy, keyring=keyring, allow_other_stores=allow_other_stores)
    checkpoint = migrate_checkpoint(io.load_checkpoint(path, map_location), checkpoint_path=os.fspath(path))
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return load_state(cls, checkpoint, **kwargs)
    return load_state(cls, checkpoint, strict=strict, **kwargs)

