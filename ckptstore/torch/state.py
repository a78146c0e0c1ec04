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

import platform
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import CkptStoreError, CorruptionError, InvalidInputError, NotFoundError
from ..store import CheckpointStore, SaveRef
from .codec import Flattened, flatten, load_safetensors, safetensors_stream, tree_from_json, tree_to_json, unflatten

FORMAT = "ckptstore.torch/1"
STATE_COMPONENT = "state.json"
RNG_KEY = "rng"


class CheckpointMismatchError(CkptStoreError):
    """A save does not fit the objects it is loaded into (other model shape,
    dtype, missing optimizer state, ...). Nothing was loaded."""


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
        "python": random.getstate(),
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
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointMismatchError(f"saved RNG state cannot be restored: {exc}") from None


def _tuples(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_tuples(v) for v in x)
    return x


# ------------------------------------------------------------------ capture


def collect(objects: Mapping[str, Any], *, include_rng: bool = True) -> dict[str, Any]:
    """The state trees of every object (``state_dict()`` where it has one)."""
    out: dict[str, Any] = {}
    for name, obj in objects.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith((".", "-")):
            raise InvalidInputError(f"state entry name {name!r} must be a simple non-empty string")
        if name == RNG_KEY and include_rng:
            raise InvalidInputError(f"state entry name {RNG_KEY!r} is reserved for the RNG states")
        out[name] = obj.state_dict() if has_state(obj) else obj
    if include_rng:
        out[RNG_KEY] = capture_rng()
    return out


@dataclass
class Snapshot:
    """A state flattened into JSON trees and CPU tensors ready to stream."""

    trees: dict[str, Any]
    tensors: dict[str, dict[str, torch.Tensor]]
    nbytes: int


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


def snapshot(state: Mapping[str, Any], buffers: HostBuffers | None = None) -> Snapshot:
    """Flatten every entry. With ``buffers`` every tensor is copied into a reused
    host buffer (so training may continue while the copy is written);
    without, CPU contiguous tensors are referenced as they are (zero copy, for
    synchronous saves)."""
    trees: dict[str, Any] = {}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    nbytes = 0
    stream = None
    if buffers is not None and torch.cuda.is_available():
        stream = torch.cuda.Stream()
    ctx = torch.cuda.stream(stream) if stream is not None else _null()
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
    if stream is not None:
        stream.synchronize()
    return Snapshot(trees, tensors, nbytes)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


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
        "torch": torch.__version__,
    }
    try:
        doc_bytes = tree_to_json(doc)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"training state cannot be encoded as JSON: {exc}") from None
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
    return write_snapshot(store, step, snapshot(collect(objects)), metadata=metadata)


# ------------------------------------------------------------------ load


def read_state(store: CheckpointStore, ref: SaveRef) -> dict[str, Any]:
    """Every entry's state tree, tensors included, verified while reading."""
    try:
        doc = tree_from_json(store.read(ref, STATE_COMPONENT))
    except NotFoundError:
        raise CheckpointMismatchError(
            f"save {ref.save_id} (step {ref.step}) is not a ckptstore.torch save (no {STATE_COMPONENT})"
        ) from None
    except ValueError as exc:
        raise CorruptionError(f"save {ref.save_id}: {STATE_COMPONENT} is not valid JSON: {exc}") from None
    if doc.get("format") != FORMAT:
        raise CheckpointMismatchError(f"save {ref.save_id}: unknown format {doc.get('format')!r}")
    out = {}
    for name, tree in doc["trees"].items():
        comp = doc["tensor_components"].get(name)
        tensors = load_safetensors(store.read(ref, comp)) if comp else {}
        out[name] = unflatten(tree, tensors)
    return out


def _check_module(name: str, module: torch.nn.Module, saved: Mapping[str, Any]) -> None:
    want = module.state_dict()
    problems = []
    missing = sorted(set(want) - set(saved))
    extra = sorted(set(saved) - set(want))
    if missing:
        problems.append(f"missing keys {missing[:8]}{'…' if len(missing) > 8 else ''}")
    if extra:
        problems.append(f"unexpected keys {extra[:8]}{'…' if len(extra) > 8 else ''}")
    for k in sorted(set(want) & set(saved)):
        a, b = want[k], saved[k]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape:
                problems.append(f"{k}: shape {tuple(b.shape)} saved, {tuple(a.shape)} expected")
            elif a.dtype != b.dtype:
                problems.append(f"{k}: dtype {b.dtype} saved, {a.dtype} expected")
    if problems:
        raise CheckpointMismatchError(f"{name}: the save does not fit this model: " + "; ".join(problems))


def _check_optimizer(name: str, opt: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list):
        raise CheckpointMismatchError(f"{name}: saved optimizer state has no param_groups")
    mine = opt.state_dict()["param_groups"]
    if len(groups) != len(mine) or any(len(g["params"]) != len(m["params"]) for g, m in zip(groups, mine)):
        raise CheckpointMismatchError(
            f"{name}: saved optimizer has {[len(g['params']) for g in groups]} parameters per group, "
            f"this one has {[len(m['params']) for m in mine]}"
        )
    params = [p for g in opt.param_groups for p in g["params"]]
    state = saved.get("state", {})
    for idx, st in state.items():
        if not isinstance(idx, int) or idx >= len(params):
            raise CheckpointMismatchError(f"{name}: saved optimizer state names parameter {idx!r}, which does not exist")
        for k, v in st.items() if isinstance(st, Mapping) else []:
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != params[idx].shape:
                raise CheckpointMismatchError(
                    f"{name}: optimizer state {k!r} of parameter {idx} has shape {tuple(v.shape)}, "
                    f"the parameter has {tuple(params[idx].shape)}"
                )


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
    saved = read_state(store, ref)
    missing = [n for n in objects if n not in saved]
    if missing:
        raise CheckpointMismatchError(
            f"save {ref.save_id} (step {ref.step}) has no state for {missing}; it has {sorted(saved)}. "
            "Refusing a partial load: start a new run if the state is meant to be fresh."
        )
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            _check_module(name, obj, saved[name])
        elif isinstance(obj, torch.optim.Optimizer):
            _check_optimizer(name, obj, saved[name])
    for name, obj in objects.items():
        if has_state(obj):
            try:
                if isinstance(obj, torch.nn.Module):
                    obj.load_state_dict(saved[name], strict=True)
                else:
                    obj.load_state_dict(saved[name])
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointMismatchError(f"{name}: load_state_dict refused the saved state: {exc}") from None
    if restore_rng_state and RNG_KEY in saved:
        restore_rng(saved[RNG_KEY])
    return saved
