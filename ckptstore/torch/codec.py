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

Lossless encodings of common non-JSON values (see :func:`_encode_extra`):

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

import argparse
import base64
import dataclasses
import datetime as _dt
import enum
import json
import math
import pathlib
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

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


def _path_str(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)


@dataclass
class Flattened:
    tree: Any
    #: tensor key -> tensor (CPU or device; the writer makes them contiguous CPU)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: keys of tensors that came from numpy arrays
    numpy_keys: set[str] = field(default_factory=set)


def flatten(state: Any, *, prefix: str = "", registry: TypeRegistry | None = None) -> Flattened:
    """Split a state tree into a JSON-able tree and a dict of tensors.

    The same tensor object reachable twice (tied weights) is stored once.
    Enums and dataclasses are encoded only when their type is registered in
    ``registry`` (default: :data:`TYPES`).
    """
    types = TYPES if registry is None else registry
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
        extra = _encode_extra(x, path, walk, types)
        if extra is not _NOT_EXTRA:
            return extra
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
            return {"__dtype": str(x).removeprefix("torch.")}
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


def unflatten(tree: Any, tensors: dict[str, torch.Tensor], *, registry: TypeRegistry | None = None) -> Any:
    types = TYPES if registry is None else registry

    def walk(x: Any) -> Any:
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            if len(x) == 1:
                (tag, val), = x.items()
                if tag == "__t":
                    return _tensor(val)
                if tag == "__np":
                    return _tensor(val).numpy()
                if tag == "__tuple":
                    return tuple(walk(v) for v in val)
                if tag == "__map":
                    return {k: walk(v) for k, v in val}
                if tag == "__float":
                    return float(val)
                if tag == "__dtype":
                    return getattr(torch, val)
                if tag in EXTRA_TAGS:
                    return _decode_extra(tag, val, walk, types)
            return {k: walk(v) for k, v in x.items()}
        return x

    def _tensor(k: str) -> torch.Tensor:
        try:
            return tensors[k]
        except KeyError:
            raise CorruptionError(f"state tree references tensor {k!r}, which is not in the saved tensors") from None

    return walk(tree)


# ------------------------------------------------- lossless extra encodings

_T = TypeVar("_T", bound=type)
_NOT_EXTRA: Any = object()
EXTRA_TAGS = frozenset({
    "__path", "__set", "__frozenset", "__bytes", "__bytearray", "__datetime", "__date", "__timedelta",
    "__device", "__namespace", "__enum", "__dataclass", "__omegaconf", "__type",
})
#: classes that may be stored as values (not instances) without registration, by a fixed name
_BUILTIN_CLASSES = {("omegaconf.dictconfig", "DictConfig"): "omegaconf.DictConfig",
                    ("omegaconf.listconfig", "ListConfig"): "omegaconf.ListConfig"}
_PATH_CLASSES = {c.__name__: c for c in (pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePath,
                                         pathlib.PurePosixPath, pathlib.PureWindowsPath)}


class TypeRegistry:
    """Enums and dataclasses that may be stored, each under a stable name.

    Only registered types are encoded (and decoded): the name in the JSON
    picks a class from this table, never an import path from the file.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, type] = {}
        self._by_type: dict[type, str] = {}

    def register(self, cls: _T, name: str | None = None) -> _T:
        """Register an ``enum.Enum`` subclass or a dataclass; usable as a decorator."""
        if not isinstance(cls, type) or not (issubclass(cls, enum.Enum) or dataclasses.is_dataclass(cls)):
            raise InvalidInputError(f"{cls!r}: only enum.Enum subclasses and dataclasses can be registered")
        key = name or f"{cls.__module__}.{cls.__qualname__}"
        if self._by_name.get(key, cls) is not cls:
            raise InvalidInputError(f"type name {key!r} is already registered for {self._by_name[key]!r}")
        if self._by_type.get(cls, key) != key:
            raise InvalidInputError(f"{cls!r} is already registered as {self._by_type[cls]!r}")
        self._by_name[key] = cls
        self._by_type[cls] = key
        return cls

    def register_class(self, cls: _T, name: str | None = None) -> _T:
        """Allow the class *itself* to be stored as a value (``{"__type": name}``); its
        instances are not made storable by this."""
        if not isinstance(cls, type):
            raise InvalidInputError(f"{cls!r} is not a class")
        key = name or f"{cls.__module__}.{cls.__qualname__}"
        if self._by_name.get(key, cls) is not cls:
            raise InvalidInputError(f"type name {key!r} is already registered for {self._by_name[key]!r}")
        self._by_name[key] = cls
        self._by_type.setdefault(cls, key)
        return cls

    def name_of(self, cls: type) -> str | None:
        return self._by_type.get(cls)

    def lookup(self, name: str) -> type:
        try:
            return self._by_name[name]
        except KeyError:
            raise CorruptionError(
                f"the save names type {name!r}, which is not registered in this process "
                "(register it with ckptstore.torch.codec.register_type before loading)"
            ) from None


#: The process-wide registry used when no other is passed.
TYPES = TypeRegistry()


def register_type(cls: _T, name: str | None = None) -> _T:
    """Register an enum or dataclass in :data:`TYPES` (usable as a decorator)."""
    return TYPES.register(cls, name)


def _sort_key(encoded: Any) -> str:
    return json.dumps(encoded, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _encode_extra(
    x: Any, path: tuple[Any, ...], walk: Callable[[Any, tuple[Any, ...]], Any], types: TypeRegistry
) -> Any:
    """The tagged encoding of ``x`` when it is one of the extra kinds, else ``_NOT_EXTRA``."""
    if isinstance(x, type):
        name = types.name_of(x) or _BUILTIN_CLASSES.get((x.__module__, x.__name__))
        if name is None:
            raise InvalidInputError(
                f"{_path_str(path)}: the class {x.__module__}.{x.__qualname__} is stored only when registered "
                "(ckptstore.torch.codec.TYPES.register_class)"
            )
        return {"__type": name}
    if isinstance(x, enum.Enum):
        name = types.name_of(type(x))
        if name is None:
            raise InvalidInputError(
                f"{_path_str(path)}: enum {type(x).__module__}.{type(x).__qualname__} is not registered; "
                "register it with ckptstore.torch.codec.register_type to store it"
            )
        return {"__enum": [name, walk(x.value, path)]}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        name = types.name_of(type(x))
        if name is None:
            raise InvalidInputError(
                f"{_path_str(path)}: dataclass {type(x).__module__}.{type(x).__qualname__} is not registered; "
                "register it with ckptstore.torch.codec.register_type to store it"
            )
        fields = {f.name: walk(getattr(x, f.name), (*path, f.name)) for f in dataclasses.fields(x)}
        return {"__dataclass": [name, fields]}
    if isinstance(x, pathlib.PurePath):
        kind = type(x).__name__
        if kind not in _PATH_CLASSES:
            kind = "PureWindowsPath" if isinstance(x, pathlib.PureWindowsPath) else "PurePosixPath"
        return {"__path": [kind, str(x)]}
    if isinstance(x, (set, frozenset)):
        items = sorted((walk(v, (*path, "<set item>")) for v in x), key=_sort_key)
        return {"__frozenset" if isinstance(x, frozenset) else "__set": items}
    if isinstance(x, (bytes, bytearray)):
        return {"__bytearray" if isinstance(x, bytearray) else "__bytes": base64.b64encode(bytes(x)).decode()}
    if isinstance(x, _dt.datetime):
        tz = x.tzinfo
        zone: str | None = None
        if tz is not None and not isinstance(tz, _dt.timezone):
            zone = getattr(tz, "key", None)  # zoneinfo.ZoneInfo
            if not isinstance(zone, str):
                raise InvalidInputError(
                    f"{_path_str(path)}: datetime with tzinfo {tz!r} cannot be stored losslessly "
                    "(use datetime.timezone or zoneinfo.ZoneInfo)"
                )
            x = x.replace(tzinfo=None)
        return {"__datetime": {"iso": x.isoformat(), "tz": zone, "fold": x.fold}}
    if isinstance(x, _dt.date):
        return {"__date": x.isoformat()}
    if isinstance(x, _dt.timedelta):
        return {"__timedelta": [x.days, x.seconds, x.microseconds]}
    if isinstance(x, torch.device):
        return {"__device": str(x)}
    if isinstance(x, argparse.Namespace):
        return {"__namespace": walk(dict(vars(x)), path)}
    if type(x).__module__.startswith("omegaconf.") and type(x).__name__ in ("DictConfig", "ListConfig"):
        return _encode_omegaconf(x, path, walk)
    return _NOT_EXTRA


def _encode_omegaconf(x: Any, path: tuple[Any, ...], walk: Callable[[Any, tuple[Any, ...]], Any]) -> Any:
    """An OmegaConf ``DictConfig``/``ListConfig`` (Hydra hyper-parameters): its unresolved content
    (interpolations and ``???`` kept as written) and the root's readonly/struct flags."""
    from omegaconf import OmegaConf

    if type(x).__name__ == "DictConfig" and OmegaConf.get_type(x) is not dict:
        raise InvalidInputError(
            f"{_path_str(path)}: a structured OmegaConf config ({OmegaConf.get_type(x)!r}) cannot be stored "
            "losslessly; store OmegaConf.to_container(cfg) instead"
        )
    content = OmegaConf.to_container(x, resolve=False, enum_to_str=False)
    flags = [f for f, on in (("readonly", OmegaConf.is_readonly(x)), ("struct", OmegaConf.is_struct(x))) if on]
    return {"__omegaconf": {"content": walk(content, path), "flags": flags}}


def _decode_extra(tag: str, val: Any, walk: Callable[[Any], Any], types: TypeRegistry) -> Any:
    try:
        if tag == "__path":
            kind, s = val
            return _PATH_CLASSES[kind](s)
        if tag == "__set":
            return {walk(v) for v in val}
        if tag == "__frozenset":
            return frozenset(walk(v) for v in val)
        if tag == "__bytes":
            return base64.b64decode(val, validate=True)
        if tag == "__bytearray":
            return bytearray(base64.b64decode(val, validate=True))
        if tag == "__datetime":
            d = _dt.datetime.fromisoformat(val["iso"])
            if val.get("tz") is not None:
                from zoneinfo import ZoneInfo

                d = d.replace(tzinfo=ZoneInfo(val["tz"]), fold=int(val.get("fold", 0)))
            return d
        if tag == "__date":
            return _dt.date.fromisoformat(val)
        if tag == "__timedelta":
            days, seconds, micro = val
            return _dt.timedelta(days=days, seconds=seconds, microseconds=micro)
        if tag == "__device":
            return torch.device(val)
        if tag == "__namespace":
            return argparse.Namespace(**walk(val))
        if tag == "__enum":
            name, value = val
            return types.lookup(name)(walk(value))
        if tag == "__type":
            if val == "omegaconf.DictConfig":
                from omegaconf import DictConfig

                return DictConfig
            if val == "omegaconf.ListConfig":
                from omegaconf import ListConfig

                return ListConfig
            return types.lookup(val)
        if tag == "__omegaconf":
            from omegaconf import OmegaConf

            cfg = OmegaConf.create(walk(val["content"]))
            if "struct" in val["flags"]:
                OmegaConf.set_struct(cfg, True)
            if "readonly" in val["flags"]:
                OmegaConf.set_readonly(cfg, True)
            return cfg
        if tag == "__dataclass":
            name, fields = val
            cls = types.lookup(name)
            values = {k: walk(v) for k, v in fields.items()}
            init = {f.name: values.pop(f.name) for f in dataclasses.fields(cls) if f.init and f.name in values}
            obj = cls(**init)
            for k, v in values.items():
                object.__setattr__(obj, k, v)
            return obj
    except CorruptionError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CorruptionError(f"state tree has a malformed {tag} value: {exc}") from None
    raise CorruptionError(f"state tree has an unknown tag {tag!r}")


def tree_to_json(tree: Any) -> bytes:
    return json.dumps(tree, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def tree_from_json(data: bytes) -> Any:
    return json.loads(data.decode())


# --------------------------------------------------------------- safetensors


def _raw_view(t: torch.Tensor) -> memoryview:
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


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
