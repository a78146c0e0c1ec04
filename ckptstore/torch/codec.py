"""State trees to (JSON, tensors) and back — no pickle anywhere.

A state tree is what ``state_dict()`` methods return: nested dicts, lists and
tuples of tensors, numpy arrays, numbers, strings, bools and None. Tensors
(and numpy arrays) go to safetensors files; the rest of the tree goes to JSON
with references to them. Anything JSON cannot represent faithfully is refused
at save time with its key path named.

JSON encoding of the non-JSON shapes (tagged single-key objects):

* ``{"__t": "<tensor key>"}`` a torch tensor; ``{"__np": "<key>"}`` a numpy array
* ``{"__tuple": [...]}`` a tuple
* ``{"__map": [[k, v], ...]}`` a dict with non-string keys (optimizer state uses int keys), or one whose
  keys are not in sorted order (the stored JSON objects have sorted keys; a list keeps insertion order)
* ``{"__float": "nan" | "inf" | "-inf"}`` non-finite floats
* ``{"__dtype": "float32"}`` a torch dtype
* a dict whose keys start with ``__`` is escaped as ``{"__map": ...}`` too.

Lossless encodings of common non-JSON values (see :func:`encode_extra`):

* ``{"__path": [class name, str]}`` a ``pathlib`` path (``Path``, ``PurePosixPath``, ...)
* ``{"__set": [...]}`` / ``{"__frozenset": [...]}`` (elements in a canonical order)
* ``{"__bytes": base64}`` / ``{"__bytearray": base64}``
* ``{"__datetime": {"iso": ..., "tz": zone key or null, "fold": 0|1}}``, ``{"__date": iso}``,
  ``{"__timedelta": [days, seconds, microseconds]}``
* ``{"__device": "cuda:0"}`` a ``torch.device``
* ``{"__namespace": {...}}`` an ``argparse.Namespace``
* ``{"__enum": [name, value]}`` / ``{"__dataclass": [name, {field: value}]}`` an enum member
  or a dataclass instance of a type registered by name in a :class:`TypeRegistry`
  (the process-wide :data:`TYPES` unless one is passed). An unregistered enum or
  dataclass is refused with its key path, like every other unsupported object.
* ``{"__type": name}`` a class as a value (registered with ``register_class``, or OmegaConf's
  ``DictConfig``/``ListConfig``, which Lightning stores as ``hparams_type``)
* ``{"__omegaconf": {"content": ..., "flags": [...]}}`` an OmegaConf ``DictConfig``/``ListConfig``
  (unresolved content; structured configs are refused). omegaconf is imported only to decode one.

The safetensors file is written by a streaming writer here (header + the
tensors' own memory, no copy into one big bytes object, which
``safetensors.torch.save`` would make); it is read back with the
``safetensors`` library itself, from bytes already verified by BLAKE3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import CorruptionError, InvalidInputError
from ..protocol.canonical import canonical_json, decode_json
from .codec_types import (
    EXTRA_TAGS,
    NOT_EXTRA,
    TYPES,
    TypeRegistry,
    decode_extra,
    encode_extra,
    path_str,
    register_type,
)
from .safetensors_io import (
    DTYPE_BY_NAME,
    DTYPE_TO_ST,
    ST_TO_DTYPE,
    load_safetensors,
    safetensors_stream,
)

__all__ = [
    "DTYPE_BY_NAME", "DTYPE_TO_ST", "EXTRA_TAGS", "ST_TO_DTYPE", "TYPES", "Flattened", "TypeRegistry", "flatten",
    "load_safetensors", "path_str", "register_type", "safetensors_stream", "tree_from_json", "tree_to_json", "unflatten",
]

#: Largest state document read back (the JSON half of a save; tensors are separate).
MAX_STATE_DOCUMENT = 256 << 20

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@dataclass
class Flattened:
    tree: Any
    #: tensor key -> tensor (CPU or device; the writer makes them contiguous CPU)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def flatten(state: Any, *, prefix: str = "", registry: TypeRegistry | None = None) -> Flattened:
    """Split a state tree into a JSON-able tree and a dict of tensors.

    The same tensor object reachable twice (tied weights) is stored once.
    Enums and dataclasses are encoded only when their type is registered in
    ``registry`` (default: :data:`TYPES`). Order is kept: a dict comes back
    from :func:`unflatten` with its keys in insertion order (a dict whose keys
    are not already in sorted order is encoded as ``{"__map": [[k, v], ...]}``,
    since the stored JSON objects are written with sorted keys), and the
    tensors are listed in the order the walk meets them.
    """
    return _Flattener(prefix, TYPES if registry is None else registry).run(state)


class _Flattener:
    """One walk of :func:`flatten`: each kind of value has its own step."""

    def __init__(self, prefix: str, types: TypeRegistry) -> None:
        self.prefix = prefix
        self.types = types
        self.out = Flattened(None)
        self.by_id: dict[int, str] = {}

    def run(self, state: Any) -> Flattened:
        self.out.tree = self.walk(state, ())
        return self.out

    def walk(self, x: Any, path: tuple[Any, ...]) -> Any:
        tx = type(x)
        if tx is int or tx is str or tx is bool or x is None:  # exact types: no enum or subclass gets here
            return x
        if (tx is list or tx is tuple) and all(type(v) is int for v in x):  # e.g. an RNG state
            return list(x) if tx is list else {"__tuple": list(x)}
        extra = encode_extra(x, path, self.walk, self.types)
        if extra is not NOT_EXTRA:
            return extra
        if isinstance(x, torch.Tensor):
            return self.tensor(x, path)
        if isinstance(x, np.ndarray):
            return self.array(x, path)
        if isinstance(x, np.generic):
            return self.walk(x.item(), path)
        if x is None or isinstance(x, (bool, str, int, float)):
            return self.scalar(x)
        if isinstance(x, torch.dtype):
            return self.dtype(x, path)
        if isinstance(x, tuple):
            return {"__tuple": [self.walk(v, (*path, i)) for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [self.walk(v, (*path, i)) for i, v in enumerate(x)]
        if isinstance(x, dict):
            return self.mapping(x, path)
        raise InvalidInputError(
            f"{path_str(path)}: object of type {type(x).__module__}.{type(x).__qualname__} cannot be stored "
            "without pickle; store its state_dict() or convert it to tensors/JSON values"
        )

    def tensor_key(self, t: torch.Tensor, path: tuple[Any, ...]) -> str:
        """The key of ``t`` among the tensors: its path, made unique; the same object keeps its first key."""
        k = self.by_id.get(id(t))
        if k is None:
            k = self.prefix + ".".join(str(p) for p in path) if path else self.prefix + "_"
            base, i = k, 1
            while k in self.out.tensors:
                k = f"{base}~{i}"
                i += 1
            self.by_id[id(t)] = k
            self.out.tensors[k] = t
        return k

    def tensor(self, x: torch.Tensor, path: tuple[Any, ...]) -> Any:
        if x.is_sparse or x.layout != torch.strided:
            raise InvalidInputError(f"{path_str(path)}: sparse/non-strided tensors are not supported")
        if x.dtype not in DTYPE_TO_ST:
            raise InvalidInputError(f"{path_str(path)}: tensor dtype {x.dtype} has no safetensors encoding")
        return {"__t": self.tensor_key(x, path)}

    def array(self, x: np.ndarray[Any, Any], path: tuple[Any, ...]) -> Any:
        k = self.tensor_key(torch.from_numpy(np.ascontiguousarray(x)), path)
        return {"__np": k}

    @staticmethod
    def scalar(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return {"__float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
        return x

    @staticmethod
    def dtype(x: torch.dtype, path: tuple[Any, ...]) -> Any:
        name = str(x).removeprefix("torch.")
        if DTYPE_BY_NAME.get(name) is not x:
            raise InvalidInputError(f"{path_str(path)}: dtype {x} is not in the codec's dtype table")
        return {"__dtype": name}

    def mapping(self, x: dict[Any, Any], path: tuple[Any, ...]) -> Any:
        """A JSON object when its keys are plain strings already in sorted order (the order the
        stored JSON has); else ``{"__map": [[k, v], ...]}`` in insertion order."""
        keys = list(x)
        if all(isinstance(k, str) and not k.startswith("__") for k in keys) and keys == sorted(keys):
            return {k: self.walk(v, (*path, k)) for k, v in x.items()}
        items = []
        for k, v in x.items():
            if not isinstance(k, (str, int, bool)) and k is not None:
                raise InvalidInputError(
                    f"{path_str(path)}: dict key {k!r} of type {type(k).__name__} cannot be stored without pickle"
                )
            items.append([k, self.walk(v, (*path, k))])
        return {"__map": items}


def unflatten(tree: Any, tensors: dict[str, torch.Tensor], *, registry: TypeRegistry | None = None) -> Any:
    """Rebuild a state tree. The tree may come from hostile storage: every
    malformed tag is a :class:`CorruptionError`, never a raw TypeError,
    AttributeError or RecursionError, and no tag can produce a callable."""
    try:
        return _unflatten(tree, tensors, TYPES if registry is None else registry)
    except RecursionError:
        raise CorruptionError("state tree is nested too deeply to be a saved training state") from None


def _bad(tag: str, val: Any) -> CorruptionError:
    shown = repr(val)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return CorruptionError(f"state tree has a malformed {tag!r} tag: {shown}")


def _unflatten(tree: Any, tensors: dict[str, torch.Tensor], types: TypeRegistry) -> Any:
    def walk(x: Any) -> Any:
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            if len(x) == 1:
                (tag, val), = x.items()
                if tag == "__t":
                    return _tensor(tag, val)
                if tag == "__np":
                    t = _tensor(tag, val)
                    try:
                        return t.numpy()
                    except (TypeError, RuntimeError):
                        raise _bad(tag, val) from None
                if tag == "__tuple":
                    if not isinstance(val, list):
                        raise _bad(tag, val)
                    return tuple(walk(v) for v in val)
                if tag == "__map":
                    if not isinstance(val, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in val):
                        raise _bad(tag, val)
                    out: dict[Any, Any] = {}
                    for k, v in val:
                        if k is not None and not isinstance(k, (str, int, bool)):
                            raise _bad(tag, k)
                        out[k] = walk(v)
                    return out
                if tag == "__float":
                    if not isinstance(val, str) or val not in _NONFINITE:
                        raise _bad(tag, val)
                    return _NONFINITE[val]
                if tag == "__dtype":
                    if not isinstance(val, str) or val not in DTYPE_BY_NAME:
                        raise _bad(tag, val)
                    return DTYPE_BY_NAME[val]
                if tag in EXTRA_TAGS:
                    try:
                        return decode_extra(tag, val, walk, types)
                    except CorruptionError:
                        raise
                    except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
                        raise _bad(tag, val) from None
            for k in x:
                if k.startswith("__"):  # flatten escapes such keys as "__map"; a bare one is no tag we know
                    raise _bad(k, x[k])
            return {k: walk(v) for k, v in x.items()}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise _bad("value", x)

    def _tensor(tag: str, k: Any) -> torch.Tensor:
        if not isinstance(k, str):
            raise _bad(tag, k)
        try:
            return tensors[k]
        except KeyError:
            raise CorruptionError(f"state tree references tensor {k!r}, which is not in the saved tensors") from None

    return walk(tree)


def tree_to_json(tree: Any) -> bytes:
    """The state document's bytes: the project's one canonical JSON encoder."""
    return canonical_json(tree)


def tree_from_json(data: bytes) -> Any:
    """Parse a stored state document strictly (size cap, no NaN/duplicate
    keys, bounded nesting); anything malformed is a :class:`CorruptionError`."""
    return decode_json(data, where="state document", max_bytes=MAX_STATE_DOCUMENT)
