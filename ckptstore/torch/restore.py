"""Checking a saved state against the live objects, and restoring it.

Before anything is loaded, every saved tree is compared with the live
object's own ``state_dict()`` (same keys, same kinds of values, nothing
callable), the optimizer's class and parameter layout are checked, and
configured hyperparameters that differ from the saved ones are reported
(:class:`ConfigDiff`). Only then is anything applied.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import (
    CheckpointStore,
    SaveRef,
)
from .bounds import component_bounds
from .contract import CheckpointerStore
from .loaders import is_stateful_dataloader
from .state import (
    RNG_KEY,
    CheckpointMismatchError,
    SavedState,
    check_rng,
    has_state,
    read_save,
    restore_rng,
    summarize,
    type_name,
)


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
    if len(groups) != len(mine) or any(len(g["params"]) != len(m["params"]) for g, m in zip(groups, mine, strict=False)):
        return [(f"parameters per group: {[len(g['params']) for g in groups]} saved, "
                 f"{[len(m['params']) for m in mine]} in this optimizer")]
    layout = meta.get("layout")
    live_layout = [[list(p.shape) for p in g["params"]] for g in opt.param_groups]
    if layout is not None and layout != live_layout:
        for gi, (a, b) in enumerate(zip(layout, live_layout, strict=False)):
            for pi, (sa, sb) in enumerate(zip(a, b, strict=False)):
                if sa != sb:
                    problems.append(f"group {gi} parameter {pi}: shape {tuple(sa)} saved, {tuple(sb)} here")
    for gi, (g, m) in enumerate(zip(groups, mine, strict=False)):
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
                and saved_type != type_name(obj):
            raise CheckpointMismatchError(
                f"{name}: saved by a {saved_type}, this run uses a {type_name(obj)}; a different "
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
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=False))
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
        for i, (a, b) in enumerate(zip(live, saved, strict=False)):
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
            for gi, (g, sg) in enumerate(zip(obj.state_dict()["param_groups"], saved.get("param_groups", []), strict=False)):
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
    saved = read_save(store, ref, component_bounds(objects))
    check_fit(objects, saved, ref)
    apply_state(objects, saved.trees, restore_rng_state=restore_rng_state)
    return saved.trees


def read_with_fallback(
    store: CheckpointerStore,
    ref: SaveRef,
    check: Callable[[SavedState, SaveRef], None] | None = None,
    objects: Mapping[str, Any] | None = None,
) -> tuple[SavedState, SaveRef]:
    """Read the resume point; if its bytes turn out corrupt (possible with
    ``resume_verify="cheap"``, which checks sizes only), fall back to the
    newest older complete save that reads back intact, register an attempt
    that resumes from it (so the corrupt save leaves the run's history) and
    record why. Nothing has been applied when this returns.

    The decision is the store's :meth:`~ckptstore.torch.contract.CheckpointerStore.read_resume_point`:
    one process decides alone (:meth:`CheckpointStore.read_resume_point`); on
    many ranks (:class:`ckptstore.distributed.RankStore`) the coordinator
    decides for all ranks: every rank reads its own part, and if any part is
    corrupt every rank falls back to the same older save.

    ``check(saved, ref)`` (e.g. :func:`check_fit`) is applied to the save that
    was chosen; its error is raised (never a reason to fall back), on many
    ranks on every rank alike. ``objects``: the live objects the state is for;
    each component's claimed size is bounded by what they can hold before it
    is allocated (a larger claim is corrupt)."""
    limits = component_bounds(objects) if objects is not None else None
    return store.read_resume_point(ref, lambda r: read_save(store, r, limits), check)
