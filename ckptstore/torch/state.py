"""Capture, save, load and restore a whole training state.

A *training state* is a mapping of names to either objects with
``state_dict()`` / ``load_state_dict()`` (model, optimizer, LR scheduler, grad
scaler, a torchdata ``StatefulDataLoader``, :class:`ResumableSampler`, ...) or
plain state trees (counters, epoch, data position). RNG states are added under
``"rng"`` automatically.

On storage a save has one ``state.json`` (the trees with tensor references and
an inventory) and one ``<name>.safetensors`` per entry that holds tensors.
"""

from __future__ import annotations

import contextlib
import mmap
import platform
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from .. import (
    CheckpointStore,
    CkptStoreError,
    CorruptionError,
    InvalidInputError,
    NotFoundError,
    SaveRef,
)
from .codec import (
    Flattened,
    flatten,
    safetensors_stream,
    tree_from_json,
    tree_to_json,
    unflatten,
)
from .contract import CheckpointerStore
from .loaders import is_stateful_dataloader, loader_generators
from .tensor_read import read_tensors

FORMAT = "ckptstore.torch/1"
STATE_COMPONENT = "state.json"
RNG_KEY = "rng"


class CheckpointMismatchError(CkptStoreError):
    """A save does not fit the objects it is loaded into (other model shape,
    dtype, missing optimizer state, another optimizer class, ...). Nothing was loaded."""


def summarize(head: str, problems: Sequence[str], *, limit: int = 5) -> str:
    """``head`` and the first ``limit`` problems, one per line, then a count."""
    shown = [p if len(p) <= 160 else p[:157] + "..." for p in problems[:limit]]
    more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
    n = len(problems)
    return f"{head} ({n} difference{'s' if n != 1 else ''}):\n  - " + "\n  - ".join(shown) + more


def has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def torch_environment() -> dict[str, Any]:
    """Environment facts for a :class:`~ckptstore.RunIdentity`."""
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__.split("+")[0],
        "device_type": "cuda" if cuda else "cpu",
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version().rsplit(".", 1)[0],
    }


# ------------------------------------------------------------------ RNG


def capture_rng() -> dict[str, Any]:
    """Python ``random``, NumPy's global generator, torch CPU and every CUDA device."""
    out: dict[str, Any] = {
        "python": random.getstate(),  # (version, 625 ints, gauss): JSON-able
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(state: Mapping[str, Any]) -> None:
    try:
        random.setstate(_tuples(state["python"]))
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, OverflowError) as exc:
        raise CheckpointMismatchError(f"saved RNG state cannot be restored: {str(exc)[:200]}") from None


def check_rng(state: Any) -> None:
    """Restore into scratch generators: a malformed RNG entry is refused before anything is loaded."""
    try:
        random.Random().setstate(_tuples(state["python"]))
        np.random.RandomState().set_state(state["numpy"])
        torch.Generator().set_state(state["torch"])
        for gens in state.get("generators", {}).values():
            for g in gens.values():
                torch.Generator().set_state(g)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, OverflowError, AttributeError) as exc:
        raise CheckpointMismatchError(f"saved RNG state cannot be restored: {str(exc)[:200]}") from None


def _tuples(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_tuples(v) for v in x)
    return x


# ------------------------------------------------------------------ capture


def type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def describe(objects: Mapping[str, Any]) -> dict[str, Any]:
    """What a save records about each object beside its state: the class
    (checked at restore for optimizers, schedulers, scalers, loaders) and an
    optimizer's parameter-group layout (parameter shapes per group)."""
    out: dict[str, Any] = {}
    for name, obj in objects.items():
        d: dict[str, Any] = {"type": type_name(obj)}
        if isinstance(obj, torch.optim.Optimizer):
            d["layout"] = [[list(p.shape) for p in g["params"]] for g in obj.param_groups]
        out[name] = d
    return out


def collect(objects: Mapping[str, Any], *, include_rng: bool = True) -> dict[str, Any]:
    """The state trees of every object (``state_dict()`` where it has one)."""
    out: dict[str, Any] = {}
    gens: dict[str, dict[str, torch.Tensor]] = {}
    for name, obj in objects.items():
        check_name(name, include_rng=include_rng)
        out[name] = obj.state_dict() if has_state(obj) else obj
        if is_stateful_dataloader(obj):
            g = {k: v.get_state() for k, v in loader_generators(obj).items()}
            if g:
                gens[name] = g
    if include_rng:
        out[RNG_KEY] = capture_rng()
        if gens:
            out[RNG_KEY]["generators"] = gens
    return out


def check_name(name: Any, *, include_rng: bool = True) -> None:
    if not isinstance(name, str) or not name or "/" in name or name.startswith((".", "-")):
        raise InvalidInputError(f"state entry name {name!r} must be a simple non-empty string")
    if name == RNG_KEY and include_rng:
        raise InvalidInputError(f"state entry name {RNG_KEY!r} is reserved for the RNG states")


class CopyStreams(Protocol):
    """The stream operations an asynchronous snapshot needs (CUDA, or a fake in tests)."""

    def current(self) -> Any: ...
    def new(self) -> Any: ...
    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...


class CudaStreams:
    def current(self) -> Any:
        return torch.cuda.current_stream()

    def new(self) -> Any:
        return torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)


@dataclass
class Snapshot:
    """A state flattened into JSON trees and CPU tensors ready to stream."""

    trees: dict[str, Any]
    tensors: dict[str, dict[str, torch.Tensor]]
    nbytes: int
    #: blocks until every device-to-host copy of the snapshot has finished
    ready: Callable[[], None] | None = None
    #: :func:`describe` of the objects
    objects: dict[str, Any] = field(default_factory=dict)

    def wait_ready(self) -> None:
        if self.ready is not None:
            self.ready()
            self.ready = None


class HostBuffers:
    """Reused host buffers for asynchronous snapshots (pinned when CUDA is present).

    Reusing buffers matters: copying into preallocated memory is ~2x faster
    than into fresh memory, and the first touch of fresh pages is slower still.
    :meth:`prepare_for` takes that first allocation off the training loop: the
    buffers of the objects' current tensors are allocated and touched in a
    background thread, so the first save copies into memory that is ready.

    A save that starts before that thread finished shares the work with it
    instead of duplicating it (issue 32): the thread allocates from the back of
    the save's order, the save's :meth:`copy` goes from the front; a buffer the
    thread has not started yet is taken by the copy (allocated there, and then
    skipped by the thread), one the thread is allocating right now is waited
    for (one tensor's allocation at most). So a set never holds two buffers of
    one tensor, and host memory stays bounded by one copy of the state a set.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, str], torch.Tensor] = {}
        self._pin = torch.cuda.is_available()
        self._lock = threading.Condition()
        #: buffers a background preparation will allocate, not started yet (a copy may take them)
        self._queued: set[tuple[str, str]] = set()
        #: the buffers background preparations are allocating right now (a copy waits for them)
        self._working: set[tuple[str, str]] = set()

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers allocated so far."""
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._bufs.values())

    @property
    def preparing(self) -> bool:
        """Whether a background preparation still has buffers to allocate."""
        with self._lock:
            return bool(self._queued or self._working)

    def _new(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self._pin)

    def copy(self, entry: str, key: str, t: torch.Tensor) -> torch.Tensor:
        k = (entry, key)
        with self._lock:
            while k in self._working:  # being allocated in the background: wait, never allocate it twice
                self._lock.wait()
            self._queued.discard(k)  # taken by this copy: the background thread skips it
            buf = self._bufs.get(k)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._new(t.shape, t.dtype)
            with self._lock:
                self._bufs[k] = buf
        buf.copy_(t.detach(), non_blocking=self._pin and t.device.type == "cuda")
        return buf

    def prepare_for(self, objects: Mapping[str, Any]) -> threading.Thread | None:
        """Allocate and touch, in a daemon thread, a buffer for every tensor
        the objects hold now that has none yet (nor one being prepared); their
        shapes are read here, on the caller's thread; nothing is copied.
        Returns the thread (None: nothing to allocate). Objects whose
        ``state_dict()`` would have side effects (a ``StatefulDataLoader``) and
        entries that cannot be flattened are left to the first save. An
        allocation that fails (out of memory) ends the preparation quietly:
        the save allocates what is missing itself, and raises there."""
        want: list[tuple[tuple[str, str], torch.Size, torch.dtype]] = []
        for name, obj in objects.items():
            if is_stateful_dataloader(obj):
                continue
            try:
                fl = flatten(obj.state_dict() if has_state(obj) else obj)
            except (InvalidInputError, RuntimeError, TypeError, ValueError):
                continue
            with self._lock:
                for k, t in fl.tensors.items():
                    key = (name, k)
                    if t.numel() and key not in self._bufs and key not in self._queued and key not in self._working:
                        want.append((key, t.shape, t.dtype))
                        self._queued.add(key)
        if not want:
            return None
        want.reverse()  # from the back of the save's order: a save that starts now fills from the front

        def allocate() -> None:
            for key, shape, dtype in want:
                with self._lock:
                    if key not in self._queued:
                        continue  # a save's copy took it
                    self._queued.discard(key)
                    self._working.add(key)
                buf = None
                try:
                    buf = self._new(shape, dtype)
                    touch_pages(buf)  # fault every page in now, not in the first save's copy
                except (MemoryError, RuntimeError):
                    buf = None
                finally:
                    with self._lock:
                        self._working.discard(key)
                        if buf is not None:
                            self._bufs.setdefault(key, buf)
                        else:  # out of memory: leave the rest to the save
                            self._queued.difference_update(k for k, _, _ in want)
                        self._lock.notify_all()
                if buf is None:
                    return

        th = threading.Thread(target=allocate, name="ckptstore-host-buffers", daemon=True)
        th.start()
        return th


def touch_pages(buf: torch.Tensor) -> None:
    """Write one byte in every page of ``buf`` (contiguous), so the kernel
    maps them all now: cheaper than zeroing it (the kernel zeroes each page
    it maps anyway)."""
    raw = torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage())  # its bytes, whatever the dtype
    raw[::_PAGE].zero_()
    raw[-1:].zero_()


_PAGE = mmap.PAGESIZE


def snapshot(
    state: Mapping[str, Any], buffers: HostBuffers | None = None, *, streams: CopyStreams | None = None
) -> Snapshot:
    """Flatten every entry. With ``buffers`` every tensor is copied into a reused
    host buffer (so training may continue while the copy is written);
    without, CPU contiguous tensors are referenced as they are (zero copy, for
    synchronous saves).

    Device copies are ordered by construction: the copy stream first waits for
    the current (training) stream, so it copies the values after the step that
    was just queued (an async save right after ``optimizer.step()`` captures
    the update); the training stream then waits for the copy stream, so the
    next step's in-place updates cannot overwrite a tensor being copied; and
    :meth:`Snapshot.wait_ready` (called by the writer before any byte is
    written) waits for the copies to land in host memory.
    """
    trees: dict[str, Any] = {}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    nbytes = 0
    if streams is None and buffers is not None and torch.cuda.is_available():
        streams = CudaStreams()
    side = cur = None
    ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if streams is not None and buffers is not None:
        cur, side = streams.current(), streams.new()
        side.wait_stream(cur)
        ctx = streams.use(side)
    with ctx:
        for name, tree in state.items():
            try:
                fl: Flattened = flatten(tree)
            except InvalidInputError as exc:
                raise InvalidInputError(f"{name}: {exc}".replace(f"{name}: state", f"state[{name!r}]")) from None
            ts: dict[str, torch.Tensor] = {}
            for k, t in fl.tensors.items():
                if buffers is not None:
                    ts[k] = buffers.copy(name, k, t)
                elif t.device.type != "cpu" or not t.is_contiguous():
                    ts[k] = t.detach().to("cpu").contiguous()
                else:
                    ts[k] = t.detach()
                nbytes += t.numel() * t.element_size()
            trees[name] = fl.tree
            if ts:
                tensors[name] = ts
    ready = None
    if side is not None and cur is not None:
        cur.wait_stream(side)
        event = side.record_event()
        ready = event.synchronize
    return Snapshot(trees, tensors, nbytes, ready)


# ------------------------------------------------------------------ save


def write_snapshot(
    store: CheckpointerStore,
    step: int,
    snap: Snapshot,
    *,
    metadata: Mapping[str, Any] | None = None,
    before_publish: Callable[[], None] | None = None,
) -> SaveRef:
    """Write a snapshot as one save and publish it (``before_publish`` runs
    after every component is written, just before the commit)."""
    components = {name: f"{name}.safetensors" for name in snap.tensors}
    doc = {
        "format": FORMAT,
        "step": step,
        "trees": snap.trees,
        "order": list(snap.trees),  # the JSON object "trees" is written with sorted keys
        "tensor_components": components,
        "objects": snap.objects,
        "torch": torch.__version__,
    }
    try:
        doc_bytes = tree_to_json(doc)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"training state cannot be encoded as JSON: {exc}") from None
    snap.wait_ready()  # device copies landed before any byte is written
    expect = [STATE_COMPONENT, *components.values()]
    with store.save(step, metadata={**dict(metadata or {}), "format": FORMAT}, expect=expect) as s:
        # every component in one batch, made durable together (one directory fsync; PROTOCOL.md §7.2)
        s.put_many([*[(comp, safetensors_stream(snap.tensors[name])[1]) for name, comp in sorted(components.items())],
                    (STATE_COMPONENT, doc_bytes)])
        if before_publish is not None:
            before_publish()
    assert s.ref is not None
    return s.ref


def save_state(
    store: CheckpointStore, step: int, objects: Mapping[str, Any], *, metadata: Mapping[str, Any] | None = None
) -> SaveRef:
    """Synchronously save every object's state (plus RNG) as step ``step``."""
    snap = snapshot(collect(objects))
    snap.objects = describe(objects)
    return write_snapshot(store, step, snap, metadata=metadata)


# ------------------------------------------------------------------ load


@dataclass
class SavedState:
    trees: dict[str, Any]
    #: per entry: {"type": ..., "layout": ...} (empty for saves made before it was recorded)
    objects: dict[str, Any]


def read_save(store: CheckpointerStore, ref: SaveRef, limits: Mapping[str, int] | None = None) -> SavedState:
    """Read and decode a save; every byte verified while reading, every record
    field checked. Hostile or damaged content is a :class:`CorruptionError`.
    ``limits``: the most bytes each entry's tensor component may claim
    (:func:`~.bounds.component_bounds` of the live objects), checked before
    anything is allocated."""
    try:
        doc = tree_from_json(store.read(ref, STATE_COMPONENT))
    except NotFoundError:
        raise CheckpointMismatchError(
            f"save {ref.save_id} (step {ref.step}) is not a ckptstore.torch save (no {STATE_COMPONENT})"
        ) from None
    where = f"save {ref.save_id} (step {ref.step})"
    if not isinstance(doc, dict):
        raise CorruptionError(f"{where}: {STATE_COMPONENT} is not an object")
    if doc.get("format") != FORMAT:
        raise CheckpointMismatchError(f"{where}: unknown format {doc.get('format')!r}")
    if type(doc.get("step")) is not int or doc["step"] != ref.step:
        raise CorruptionError(f"{where}: the state says step {doc.get('step')!r}, its commit says step {ref.step}")
    trees, comps, objs = doc.get("trees"), doc.get("tensor_components"), doc.get("objects", {})
    if not isinstance(trees, dict) or not isinstance(comps, dict) or not isinstance(objs, dict):
        raise CorruptionError(f"{where}: {STATE_COMPONENT} lacks its trees / tensor_components / objects tables")
    order = doc.get("order", sorted(trees))  # saves written before "order" was recorded: sorted
    if (not isinstance(order, list) or not all(isinstance(n, str) for n in order) or len(order) != len(trees)
            or set(order) != set(trees)):
        raise CorruptionError(f"{where}: {STATE_COMPONENT} field order does not list each entry of trees once")
    trees = {name: trees[name] for name in order}
    for name, comp in comps.items():
        if name not in trees or comp != f"{name}.safetensors":
            raise CorruptionError(f"{where}: tensor component {comp!r} of entry {name!r} is not a valid reference")
    tensors = read_tensors(store, ref, {name: comps[name] for name in trees if comps.get(name)}, limits)
    out = {name: unflatten(tree, tensors.get(name, {})) for name, tree in trees.items()}
    return SavedState(out, objs)


def read_state(store: CheckpointStore, ref: SaveRef) -> dict[str, Any]:
    """Every entry's state tree, tensors included, verified while reading."""
    return read_save(store, ref).trees
