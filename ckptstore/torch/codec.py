"""State trees to (JSON, tensors) and back — no pickle anywhere.

A state tree is what ``state_dict()`` methods return: nested dicts, lists and
tuples of tensors, numpy arrays, numbers, strings, bools and None. Tensors
(and numpy arrays) go to safetensors files; the rest of the tree goes to JSON
with references to them. Anything JSON cannot represent faithfully is refused
at save time with its key path named.

JSON encoding of the non-JSON shapes (tagged single-key objects):

* ``{"__t": "<tensor key>"}`` a torch tensor; ``{"__np": "<key>"}`` a numpy array
* ``{"__tuple": [...]}`` a tuple
* ``{"__map": [[k, v], ...]}`` a dict with non-string keys (optimizer state uses int keys)
* ``{"__float": "nan" | "inf" | "-inf"}`` non-finite floats
* ``{"__dtype": "float32"}`` a torch dtype
* a dict whose keys start with ``__`` is escaped as ``{"__map": ...}`` too.

The safetensors file is written by a streaming writer here (header + the
tensors' own memory, no copy into one big bytes object, which
``safetensors.torch.save`` would make); it is read back with the
``safetensors`` library itself, from bytes already verified by BLAKE3.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import CorruptionError, InvalidInputError

DTYPE_TO_ST = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _st in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("float8_e4m3fn", "F8_E4M3"),
                   ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPE_TO_ST[getattr(torch, _name)] = _st
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}

#: The only dtypes a ``{"__dtype": NAME}`` tag may name. Decoding looks NAME up
#: here and nowhere else: never ``getattr(torch, NAME)``, which would hand a
#: hostile save any attribute of the torch module (functions included).
DTYPE_BY_NAME: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    _d = getattr(torch, _name, None)  # build time, fixed names: the table, not the save, decides
    if isinstance(_d, torch.dtype):
        DTYPE_BY_NAME[_name] = _d
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _path_str(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)


@dataclass
class Flattened:
    tree: Any
    #: tensor key -> tensor (CPU or device; the writer makes them contiguous CPU)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: keys of tensors that came from numpy arrays
    numpy_keys: set[str] = field(default_factory=set)


def flatten(state: Any, *, prefix: str = "") -> Flattened:
    """Split a state tree into a JSON-able tree and a dict of tensors.

    The same tensor object reachable twice (tied weights) is stored once.
    """
    out = Flattened(None)
    by_id: dict[int, str] = {}

    def tensor_key(t: torch.Tensor, path: tuple[Any, ...]) -> str:
        k = by_id.get(id(t))
        if k is None:
            k = prefix + ".".join(str(p) for p in path) if path else prefix + "_"
            base, i = k, 1
            while k in out.tensors:
                k = f"{base}~{i}"
                i += 1
            by_id[id(t)] = k
            out.tensors[k] = t
        return k

    def walk(x: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(x, torch.Tensor):
            if x.is_sparse or x.layout != torch.strided:
                raise InvalidInputError(f"{_path_str(path)}: sparse/non-strided tensors are not supported")
            if x.dtype not in DTYPE_TO_ST:
                raise InvalidInputError(f"{_path_str(path)}: tensor dtype {x.dtype} has no safetensors encoding")
            return {"__t": tensor_key(x, path)}
        if isinstance(x, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(x))
            k = tensor_key(t, path)
            out.numpy_keys.add(k)
            return {"__np": k}
        if isinstance(x, np.generic):
            return walk(x.item(), path)
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            if math.isfinite(x):
                return x
            return {"__float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
        if isinstance(x, torch.dtype):
            name = str(x).removeprefix("torch.")
            if DTYPE_BY_NAME.get(name) is not x:
                raise InvalidInputError(f"{_path_str(path)}: dtype {x} is not in the codec's dtype table")
            return {"__dtype": name}
        if isinstance(x, tuple):
            return {"__tuple": [walk(v, (*path, i)) for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [walk(v, (*path, i)) for i, v in enumerate(x)]
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: walk(v, (*path, k)) for k, v in x.items()}
            items = []
            for k, v in x.items():
                if not isinstance(k, (str, int, bool)) and k is not None:
                    raise InvalidInputError(
                        f"{_path_str(path)}: dict key {k!r} of type {type(k).__name__} cannot be stored without pickle"
                    )
                items.append([k, walk(v, (*path, k))])
            return {"__map": items}
        raise InvalidInputError(
            f"{_path_str(path)}: object of type {type(x).__module__}.{type(x).__qualname__} cannot be stored "
            "without pickle; store its state_dict() or convert it to tensors/JSON values"
        )

    out.tree = walk(state, ())
    return out


def unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild a state tree. The tree may come from hostile storage: every
    malformed tag is a :class:`CorruptionError`, never a raw TypeError,
    AttributeError or RecursionError, and no tag can produce a callable."""
    try:
        return _unflatten(tree, tensors)
    except RecursionError:
        raise CorruptionError("state tree is nested too deeply to be a saved training state") from None


def _bad(tag: str, val: Any) -> CorruptionError:
    shown = repr(val)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return CorruptionError(f"state tree has a malformed {tag!r} tag: {shown}")


def _unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
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
    return json.dumps(tree, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def tree_from_json(data: bytes) -> Any:
    """Parse a stored state document; anything malformed is a :class:`CorruptionError`."""
    try:
        return json.loads(data.decode())
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptionError(f"state document is not valid JSON: {str(exc)[:200]}") from None


# --------------------------------------------------------------- safetensors


def _raw_view(t: torch.Tensor) -> memoryview:
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def safetensors_stream(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[int, Iterator[memoryview]]:
    """(total size, buffers) of a safetensors file holding ``tensors``.

    Tensors must be contiguous CPU tensors; their memory is streamed as is.
    """
    header: dict[str, Any] = {}
    offset = 0
    order = sorted(tensors)
    for k in order:
        t = tensors[k]
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"tensor {k!r} must be contiguous on the CPU before streaming")
        n = t.numel() * t.element_size()
        header[k] = {"dtype": DTYPE_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    total = 8 + len(hb) + offset

    def gen() -> Iterator[memoryview]:
        yield memoryview(struct.pack("<Q", len(hb)) + hb)
        for k in order:
            if tensors[k].numel():
                yield _raw_view(tensors[k])

    return total, gen()


def load_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as exc:  # noqa: BLE001 - report as corruption, never a deep traceback
        raise CorruptionError(f"safetensors component cannot be parsed: {exc}") from None
