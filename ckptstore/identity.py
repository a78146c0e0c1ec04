"""Run identity: what makes two processes the *same* experiment.

A run ID is bound to its identity when the run is created (``RUN.json``,
created exclusively). Reopening the run under a different identity is refused
with every mismatched field named. Pure logic, no I/O.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from .errors import InvalidInputError
from .protocol.canonical import canonical_json

#: The fields the seeds name; every one must match for a resume.
CORE_FIELDS = ("data_digest", "code_digest", "optimizer_revision", "feature_contract", "world_size", "environment")


@dataclass(frozen=True)
class RunIdentity:
    """The identity a run is bound to.

    ``environment`` holds facts like the torch version and device type;
    ``extra`` holds any user field (split seed, tokenizer digest, ...). Every
    value must be JSON-representable (str, int, float, bool, None, lists,
    string-keyed dicts).
    """

    data_digest: str
    code_digest: str
    optimizer_revision: str = ""
    feature_contract: str = ""
    world_size: int = 1
    environment: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "data_digest": self.data_digest,
            "code_digest": self.code_digest,
            "optimizer_revision": self.optimizer_revision,
            "feature_contract": self.feature_contract,
            "world_size": self.world_size,
            "environment": dict(self.environment),
        }
        for k, v in self.extra.items():
            if k in out:
                raise InvalidInputError(f"identity extra field {k!r} shadows a core field")
            out[k] = v
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunIdentity:
        known = {k: d[k] for k in CORE_FIELDS if k in d}
        extra = {k: v for k, v in d.items() if k not in CORE_FIELDS}
        return cls(**known, extra=extra)

    def replace(self, **changes: Any) -> RunIdentity:
        d = self.to_dict()
        d.update(changes)
        return RunIdentity.from_dict(d)


def normalize_identity(identity: RunIdentity | Mapping[str, Any]) -> dict[str, Any]:
    """Return the identity as a canonical, JSON-checked dict."""
    if isinstance(identity, RunIdentity):
        d = identity.to_dict()
    elif isinstance(identity, Mapping):
        d = dict(identity)
    else:
        raise InvalidInputError(f"identity must be a RunIdentity or a mapping, got {type(identity).__name__}")
    if not d:
        raise InvalidInputError("identity must name at least one field (data_digest, code_digest, ...)")
    for k in d:
        if not isinstance(k, str) or not k:
            raise InvalidInputError(f"identity field names must be non-empty strings, got {k!r}")
    try:
        canonical_json(d)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"identity must be JSON-representable: {exc}") from None
    return d


def identity_digest(identity: Mapping[str, Any]) -> str:
    return blake3.blake3(canonical_json(dict(identity))).hexdigest()


def diff_identity(stored: Mapping[str, Any], requested: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every field whose value differs (a field present on one side only counts)."""
    out: dict[str, tuple[Any, Any]] = {}
    for k in sorted(set(stored) | set(requested)):
        a, b = stored.get(k, _MISSING), requested.get(k, _MISSING)
        if canonical_json({"v": a if a is not _MISSING else "<absent>"}) != canonical_json(
            {"v": b if b is not _MISSING else "<absent>"}
        ):
            out[k] = (None if a is _MISSING else a, None if b is _MISSING else b)
    return out


_MISSING = object()


def digest_tree(root: str | os.PathLike[str], patterns: Iterable[str] = ("**/*.py",)) -> str:
    """A code digest: BLAKE3 over the sorted relative paths and contents of the
    files under ``root`` matching ``patterns`` (``__pycache__`` excluded)."""
    base = Path(root)
    if not base.is_dir():
        raise InvalidInputError(f"code digest: {str(base)!r} is not a directory")
    files: set[Path] = set()
    for pat in patterns:
        files.update(p for p in base.glob(pat) if p.is_file() and "__pycache__" not in p.parts)
    h = blake3.blake3()
    for p in sorted(files):
        rel = p.relative_to(base).as_posix().encode()
        h.update(len(rel).to_bytes(8, "little") + rel)
        data = p.read_bytes()
        h.update(len(data).to_bytes(8, "little") + data)
    return "blake3:" + h.hexdigest()
