"""Lossless encodings of the non-tensor values a training state holds beyond
plain JSON (paths, sets, bytes, dates, devices, namespaces, OmegaConf
configs), and the explicit registry for enums and dataclasses. Used by
:mod:`ckptstore.torch.codec`; a decoded value is never a callable unless its
class was registered by the caller."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime as _dt
import enum
import json
import pathlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..errors import CorruptionError, InvalidInputError

# ------------------------------------------------- lossless extra encodings

def path_str(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)



_T = TypeVar("_T", bound=type)
NOT_EXTRA: Any = object()
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


def encode_extra(
    x: Any, path: tuple[Any, ...], walk: Callable[[Any, tuple[Any, ...]], Any], types: TypeRegistry
) -> Any:
    """The tagged encoding of ``x`` when it is one of the extra kinds, else ``NOT_EXTRA``."""
    if isinstance(x, type):
        name = types.name_of(x) or _BUILTIN_CLASSES.get((x.__module__, x.__name__))
        if name is None:
            raise InvalidInputError(
                f"{path_str(path)}: the class {x.__module__}.{x.__qualname__} is stored only when registered "
                "(ckptstore.torch.codec.TYPES.register_class)"
            )
        return {"__type": name}
    if isinstance(x, enum.Enum):
        name = types.name_of(type(x))
        if name is None:
            raise InvalidInputError(
                f"{path_str(path)}: enum {type(x).__module__}.{type(x).__qualname__} is not registered; "
                "register it with ckptstore.torch.codec.register_type to store it"
            )
        return {"__enum": [name, walk(x.value, path)]}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        name = types.name_of(type(x))
        if name is None:
            raise InvalidInputError(
                f"{path_str(path)}: dataclass {type(x).__module__}.{type(x).__qualname__} is not registered; "
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
                    f"{path_str(path)}: datetime with tzinfo {tz!r} cannot be stored losslessly "
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
    return NOT_EXTRA


def _encode_omegaconf(x: Any, path: tuple[Any, ...], walk: Callable[[Any, tuple[Any, ...]], Any]) -> Any:
    """An OmegaConf ``DictConfig``/``ListConfig`` (Hydra hyper-parameters): its unresolved content
    (interpolations and ``???`` kept as written) and the root's readonly/struct flags."""
    from omegaconf import OmegaConf

    if type(x).__name__ == "DictConfig" and OmegaConf.get_type(x) is not dict:
        raise InvalidInputError(
            f"{path_str(path)}: a structured OmegaConf config ({OmegaConf.get_type(x)!r}) cannot be stored "
            "losslessly; store OmegaConf.to_container(cfg) instead"
        )
    content = OmegaConf.to_container(x, resolve=False, enum_to_str=False)
    flags = [f for f, on in (("readonly", OmegaConf.is_readonly(x)), ("struct", OmegaConf.is_struct(x))) if on]
    return {"__omegaconf": {"content": walk(content, path), "flags": flags}}


def decode_extra(tag: str, val: Any, walk: Callable[[Any], Any], types: TypeRegistry) -> Any:
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
