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
import copy
import math
import platform
import random
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
    load_safetensors,
    safetensors_stream,
    tree_from_json,
    tree_to_json,
    unflatten,
)
from .loaders import is_stateful_dataloader, loader_generators

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


def _type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def describe(objects: Mapping[str, Any]) -> dict[str, Any]:
    """What a save records about each object beside its state: the class
    (checked at restore for optimizers, schedulers, scalers, loaders) and an
    optimizer's parameter-group layout (parameter shapes per group)."""
    out: dict[str, Any] = {}
    for name, obj in objects.items():
        d: dict[str, Any] = {"type": _type_name(obj)}
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
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, str], torch.Tensor] = {}
        self._pin = torch.cuda.is_available()

    def copy(self, entry: str, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get((entry, key))
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin)
            self._bufs[(entry, key)] = buf
        buf.copy_(t.detach(), non_blocking=self._pin and t.device.type == "cuda")
        return buf


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
    store: CheckpointStore, step: int, snap: Snapshot, *, metadata: Mapping[str, Any] | None = None
) -> SaveRef:
    """Write a snapshot as one save and publish it."""
    components = {name: f"{name}.safetensors" for name in snap.tensors}
    doc = {
        "format": FORMAT,
        "step": step,
        "trees": snap.trees,
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
        for name, comp in sorted(components.items()):
            _size, chunks = safetensors_stream(snap.tensors[name])
            s.put(comp, chunks)
        s.put(STATE_COMPONENT, doc_bytes)
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


def read_save(store: CheckpointStore, ref: SaveRef) -> SavedState:
    """Read and decode a save; every byte verified while reading, every record
    field checked. Hostile or damaged content is a :class:`CorruptionError`."""
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
    for name, comp in comps.items():
        if name not in trees or comp != f"{name}.safetensors":
            raise CorruptionError(f"{where}: tensor component {comp!r} of entry {name!r} is not a valid reference")
    out = {}
    for name, tree in trees.items():
        comp = comps.get(name)
        tensors = load_safetensors(store.read(ref, comp)) if comp else {}
        out[name] = unflatten(tree, tensors)
    return SavedState(out, objs)


def read_state(store: CheckpointStore, ref: SaveRef) -> dict[str, Any]:
    """Every entry's state tree, tensors included, verified while reading."""
    return read_save(store, ref).trees


def _kind(x: Any) -> str:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return "tensor"
    if isinstance(x, (bool, int, float)):
        return "number"
    if isinstance(x, str):
        return "string"
    if x is None:
        return "none"
    if isinstance(x, (list, tuple)):
        return "list"
    if isinstance(x, Mapping):
        return "mapping"
    if isinstance(x, torch.dtype):
        return "dtype"
    return "other"


def _p(path: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in path) or "(top)"


def _scan(saved: Any, path: tuple[Any, ...], problems: list[str]) -> None:
    """Nothing callable and nothing but state-tree values anywhere."""
    k = _kind(saved)
    if k == "other" or (callable(saved) and k != "tensor"):
        problems.append(f"{_p(path)}: {type(saved).__name__} is not a state value")
    elif k == "mapping":
        for kk, v in saved.items():
            _scan(v, (*path, kk), problems)
    elif k == "list":
        for i, v in enumerate(saved):
            _scan(v, (*path, i), problems)


def compare_tree(live: Any, saved: Any, path: tuple[Any, ...], problems: list[str], *, keys: bool = True) -> None:
    """The saved tree has the shape of the live ``state_dict()``: same keys in
    every non-empty string-keyed mapping (``keys=True``), the same kind of
    value everywhere both have one (None and empty containers are open)."""
    lk, sk = _kind(live), _kind(saved)
    if sk == "other" or (callable(saved) and sk != "tensor"):
        problems.append(f"{_p(path)}: {type(saved).__name__} is not a state value")
        return
    if lk == "none" or sk == "none":
        _scan(saved, path, problems)
        return
    if lk != sk:
        problems.append(f"{_p(path)}: saved a {sk}, this object has a {lk}")
        return
    if lk == "mapping":
        strict = keys and bool(live) and all(isinstance(x, str) for x in live)
        if strict:
            missing, extra = sorted(set(live) - set(saved), key=str), sorted(set(saved) - set(live), key=str)
            problems.extend(f"{_p((*path, m))}: missing from the save" for m in missing)
            problems.extend(f"{_p((*path, e))}: in the save, unknown to this object" for e in extra)
        for kk, v in saved.items():
            if kk in live:
                compare_tree(live[kk], v, (*path, kk), problems, keys=keys)
            else:
                _scan(v, (*path, kk), problems)
    elif lk == "list":
        for i, v in enumerate(saved):
            if i < len(live):
                compare_tree(live[i], v, (*path, i), problems, keys=keys)
            else:
                _scan(v, (*path, i), problems)


def _check_module(name: str, module: torch.nn.Module, saved: Any) -> list[str]:
    if not isinstance(saved, Mapping):
        return [f"saved state is a {_kind(saved)}, not a mapping of tensors"]
    want = module.state_dict()
    problems: list[str] = []
    missing = sorted(set(want) - set(saved))
    extra = sorted(set(saved) - set(want), key=str)
    problems.extend(f"{k}: missing from the save" for k in missing)
    problems.extend(f"{k}: in the save, not in this model" for k in extra)
    for k in sorted(set(want) & set(saved)):
        a, b = want[k], saved[k]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape:
                problems.append(f"{k}: shape {tuple(b.shape)} saved, {tuple(a.shape)} expected")
            elif a.dtype != b.dtype:
                problems.append(f"{k}: dtype {b.dtype} saved, {a.dtype} expected")
        elif isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            problems.append(f"{k}: saved a {_kind(b)}, this model has a {_kind(a)}")
    return problems


def _check_optimizer(opt: torch.optim.Optimizer, saved: Any, meta: Mapping[str, Any]) -> list[str]:
    if not isinstance(saved, Mapping) or not isinstance(saved.get("param_groups"), list):
        return ["saved optimizer state has no param_groups"]
    live = opt.state_dict()
    if set(saved) != set(live):
        return [f"top-level keys {sorted(map(str, saved))} saved, {sorted(live)} expected"]
    groups = saved["param_groups"]
    mine = live["param_groups"]
    if not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        return ["saved param_groups are malformed"]
    problems: list[str] = []
    if len(groups) != len(mine) or any(len(g["params"]) != len(m["params"]) for g, m in zip(groups, mine)):
        return [(f"parameters per group: {[len(g['params']) for g in groups]} saved, "
                 f"{[len(m['params']) for m in mine]} in this optimizer")]
    layout = meta.get("layout")
    live_layout = [[list(p.shape) for p in g["params"]] for g in opt.param_groups]
    if layout is not None and layout != live_layout:
        for gi, (a, b) in enumerate(zip(layout, live_layout)):
            for pi, (sa, sb) in enumerate(zip(a, b)):
                if sa != sb:
                    problems.append(f"group {gi} parameter {pi}: shape {tuple(sa)} saved, {tuple(sb)} here")
    for gi, (g, m) in enumerate(zip(groups, mine)):
        for k in sorted(set(m) - set(g)):
            problems.append(f"group {gi}: option {k!r} missing from the save")
        for k in sorted(set(g) - set(m), key=str):
            problems.append(f"group {gi}: option {k!r} in the save, unknown to {type(opt).__name__}")
    params = [p for g in opt.param_groups for p in g["params"]]
    state = saved.get("state", {})
    if not isinstance(state, Mapping):
        return [*problems, "saved optimizer state is not a mapping"]
    for idx, st in state.items():
        if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < len(params):
            problems.append(f"state names parameter {idx!r}, which does not exist")
            continue
        if not isinstance(st, Mapping):
            problems.append(f"state of parameter {idx} is not a mapping")
            continue
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != params[idx].shape:
                problems.append(f"state {k!r} of parameter {idx}: shape {tuple(v.shape)}, "
                                f"the parameter has {tuple(params[idx].shape)}")
            elif _kind(v) not in ("tensor", "number", "none"):
                problems.append(f"state {k!r} of parameter {idx}: a {_kind(v)} is no optimizer state")
    return problems


_CHECKED_TYPES: tuple[type, ...] = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
                                     torch.optim.lr_scheduler.ReduceLROnPlateau, torch.amp.GradScaler)


def check_fit(objects: Mapping[str, Any], saved: SavedState, ref: SaveRef) -> None:
    """Raise :class:`CheckpointMismatchError` unless every object can take its
    saved state. Loads nothing."""
    trees = saved.trees
    missing = [n for n in objects if n not in trees]
    if missing:
        raise CheckpointMismatchError(
            f"save {ref.save_id} (step {ref.step}) has no state for {missing}; it has {sorted(trees)}. "
            "Refusing a partial load: start a new run if the state is meant to be fresh."
        )
    from .loaders import ResumableLoader
    from .sampler import ResumableSampler

    if RNG_KEY in trees:
        check_rng(trees[RNG_KEY])
    for name, obj in objects.items():
        st = trees[name]
        meta = saved.objects.get(name, {})
        problems: list[str] = []
        saved_type = meta.get("type") if isinstance(meta, Mapping) else None
        if isinstance(obj, (*_CHECKED_TYPES, ResumableSampler, ResumableLoader)) and saved_type is not None \
                and saved_type != _type_name(obj):
            raise CheckpointMismatchError(
                f"{name}: saved by a {saved_type}, this run uses a {_type_name(obj)}; a different "
                f"{'optimizer' if isinstance(obj, torch.optim.Optimizer) else 'object'} is a different experiment "
                "(start a new run with lineage=store.lineage_of(ref) to reuse the weights)"
            )
        if isinstance(obj, torch.nn.Module):
            problems = _check_module(name, obj, st)
            what = "model"
        elif isinstance(obj, torch.optim.Optimizer):
            problems = _check_optimizer(obj, st, meta if isinstance(meta, Mapping) else {})
            what = "optimizer"
        elif is_stateful_dataloader(obj):  # its live state_dict() would start workers: values only
            _scan(st, (), problems)
            what = "loader"
        elif has_state(obj):
            compare_tree(obj.state_dict(), st, (), problems)
            what = type(obj).__name__
        else:
            _scan(st, (), problems)
            what = "entry"
        if problems:
            raise CheckpointMismatchError(summarize(f"{name}: the save does not fit this {what}", problems))


# ------------------------------------------------------------------ configuration

#: scheduler / scaler entries that are progress, not configuration
PROGRESS_KEYS = frozenset({
    "last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial", "_initial_step",
    "verbose", "best", "num_bad_epochs", "cooldown_counter", "scale", "_growth_tracker",
})


@dataclass(frozen=True)
class ConfigDiff:
    """A hyperparameter whose configured value differs from the saved one."""

    entry: str
    path: tuple[Any, ...]
    saved: Any
    configured: Any

    def describe(self) -> str:
        where = self.entry + "".join(f"[{k!r}]" if not isinstance(k, int) else f"[{k}]" for k in self.path)
        return f"{where}: saved {_short(self.saved)}, configured {_short(self.configured)}"

    def to_json(self) -> dict[str, Any]:
        return {"entry": self.entry, "path": [str(p) for p in self.path], "saved": _short(self.saved),
                "configured": _short(self.configured)}


def _short(v: Any) -> str:
    r = repr(v.tolist() if isinstance(v, torch.Tensor) and v.numel() <= 8 else v)
    return r if len(r) <= 60 else r[:57] + "..."


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and bool(torch.equal(a, b)))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def _tree_diffs(entry: str, live: Any, saved: Any, path: tuple[Any, ...], out: list[ConfigDiff]) -> None:
    if isinstance(live, Mapping) and isinstance(saved, Mapping):
        for k in live:
            if k in PROGRESS_KEYS or k not in saved:
                continue
            _tree_diffs(entry, live[k], saved[k], (*path, k), out)
    elif isinstance(live, list) and isinstance(saved, list) and live and isinstance(live[0], Mapping):
        for i, (a, b) in enumerate(zip(live, saved)):
            _tree_diffs(entry, a, b, (*path, i), out)
    elif not _same(live, saved):
        out.append(ConfigDiff(entry, path, saved, live))


def config_diffs(objects: Mapping[str, Any], trees: Mapping[str, Any]) -> list[ConfigDiff]:
    """Configured (live, before loading) versus saved hyperparameters: optimizer
    group options (lr, weight decay, betas, ...; the learning rate a scheduler
    drives is compared as its ``initial_lr``), LR scheduler configuration
    (horizon: ``T_max``, ``total_steps``, milestones, ``base_lrs``, ...) and
    grad-scaler options. Progress (step counts, current lr) is not configuration."""
    out: list[ConfigDiff] = []
    schedulers = [o for o in objects.values() if isinstance(o, torch.optim.lr_scheduler.LRScheduler)]
    for name, obj in objects.items():
        saved = trees.get(name)
        if isinstance(obj, torch.optim.Optimizer) and isinstance(saved, Mapping):
            driven = any(getattr(s, "optimizer", None) is obj for s in schedulers)
            for gi, (g, sg) in enumerate(zip(obj.state_dict()["param_groups"], saved.get("param_groups", []))):
                skip = {"params"}
                if driven or "initial_lr" in g:
                    skip.add("lr")
                if "max_momentum" in g:  # a cyclic schedule drives momentum / betas
                    skip.update({"momentum", "betas"})
                for k in g:
                    if k not in skip and k in sg and not _same(g[k], sg[k]):
                        out.append(ConfigDiff(name, ("param_groups", gi, k), sg[k], g[k]))
        elif isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)) and isinstance(
            saved, Mapping
        ):
            _tree_diffs(name, obj.state_dict(), saved, (), out)
    return out


def _set_path(tree: Any, path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = copy.deepcopy(value)


def take_configured(objects: Mapping[str, Any], diffs: Sequence[ConfigDiff]) -> None:
    """After loading the saved state: put the configured values back."""
    by_entry: dict[str, list[ConfigDiff]] = {}
    for d in diffs:
        by_entry.setdefault(d.entry, []).append(d)
    for name, ds in by_entry.items():
        obj = objects[name]
        if isinstance(obj, torch.optim.Optimizer):
            for d in ds:
                _, gi, k = d.path
                obj.param_groups[gi][k] = copy.deepcopy(d.configured)
        else:
            sd = obj.state_dict()
            for d in ds:
                _set_path(sd, d.path, d.configured)
            obj.load_state_dict(sd)


# ------------------------------------------------------------------ restore


def apply_state(
    objects: Mapping[str, Any], trees: Mapping[str, Any], *, restore_rng_state: bool = True
) -> None:
    """Load checked trees into the objects (see :func:`check_fit`)."""
    for name, obj in objects.items():
        if has_state(obj):
            try:
                if isinstance(obj, torch.nn.Module):
                    obj.load_state_dict(trees[name], strict=True)
                else:
                    obj.load_state_dict(trees[name])
            except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
                msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CheckpointMismatchError(
                    f"{name}: load_state_dict refused the saved state: {msg[:300]}"
                ) from None
    if restore_rng_state and RNG_KEY in trees:
        restore_rng(trees[RNG_KEY])


def restore_state(
    store: CheckpointStore,
    ref: SaveRef,
    objects: Mapping[str, Any],
    *,
    restore_rng_state: bool = True,
) -> dict[str, Any]:
    """Load a save into ``objects``: every object with ``load_state_dict`` gets
    its saved state; every name must be present in the save (a missing
    optimizer or scheduler is an error, not a silent fresh start). Everything
    is checked before anything is loaded. Returns every saved tree (plain
    entries such as counters included)."""
    saved = read_save(store, ref)
    check_fit(objects, saved, ref)
    apply_state(objects, saved.trees, restore_rng_state=restore_rng_state)
    return saved.trees

