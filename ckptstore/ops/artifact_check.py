"""Verifying a promoted artifact (:mod:`ckptstore.ops.artifact` writes them).

:func:`verify_artifact` re-hashes every file against ``provenance.json``,
refuses files it does not list, checks the index and re-derives the tensor
digest from the weight files; with the store it also checks that the save
the provenance names is complete, verifies, and holds exactly the
artifact's tensors; with a key it checks the provenance's tag. Every read is
bounded (the provenance by :data:`MAX_PROVENANCE`, each file by its declared size).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch

from ..backends.schemes import backend_from_url
from ..errors import CorruptionError, InvalidInputError, NotFoundError
from ..protocol import decode_json
from ..protocol.auth import AuthTag, Keyring
from ..store import CheckpointStore
from ..torch.safetensors_io import load_safetensors
from .artifact import (
    AUTH_KIND,
    CHUNK,
    FORMAT,
    INDEX,
    MAX_PROVENANCE,
    PROVENANCE,
    SINGLE,
    body_digest,
    tensors_digest,
)
from .weights import model_source


@dataclass
class ArtifactReport:
    """What :func:`verify_artifact` found: ``ok`` only without any problem."""

    location: str
    provenance: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)
    checked_store: bool = False
    authenticated: bool | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        p = self.provenance or {}
        return {"ok": self.ok, "location": self.location, "problems": self.problems,
                "checked_store": self.checked_store, "authenticated": self.authenticated,
                **{k: p.get(k) for k in ("run_id", "save_id", "step", "attempt", "manifest_digest")}}


class _Reader:
    """Bounded reads of an artifact's files, local or on an object store."""

    def __init__(self, location: str, storage_options: Mapping[str, Any] | None) -> None:
        self.local = "://" not in location or location.startswith("file://")
        self.path = location[len("file://"):] if location.startswith("file://") else location
        self.backend = None if self.local else backend_from_url(location, storage_options=storage_options)

    def names(self) -> list[str]:
        if self.backend is not None:
            return sorted(o.key for o in self.backend.list(""))
        try:
            return sorted(os.listdir(self.path))
        except FileNotFoundError:
            raise NotFoundError(f"{self.path}: no such artifact") from None

    def size(self, name: str) -> int:
        if self.backend is not None:
            return self.backend.size(name)
        st = os.lstat(os.path.join(self.path, name))
        if not os.path.isfile(os.path.join(self.path, name)) or os.path.islink(os.path.join(self.path, name)):
            raise CorruptionError(f"{name}: not a regular file")
        return st.st_size

    def read(self, name: str, max_bytes: int) -> bytes:
        if self.size(name) > max_bytes:
            raise CorruptionError(f"{name}: larger than the {max_bytes} bytes allowed")
        if self.backend is not None:
            return self.backend.get(name)
        fd = os.open(os.path.join(self.path, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise CorruptionError(f"{name}: larger than the {max_bytes} bytes allowed")
        return data

    def digest(self, name: str, size: int) -> tuple[int, str]:
        h, n = blake3.blake3(), 0
        if self.backend is not None:
            at = 0
            total = self.backend.size(name)
            while at < total:
                block = self.backend.get_range(name, at, min(total, at + CHUNK))
                if not block:
                    break
                h.update(block)
                at += len(block)
            return at, h.hexdigest()
        fd = os.open(os.path.join(self.path, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            while block := f.read(min(CHUNK, size + 1 - n)):
                h.update(block)
                n += len(block)
                if n > size:
                    break
        return n, h.hexdigest()


def read_provenance(location: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The provenance document of an artifact, strictly parsed (bounded, no
    duplicate keys, the fields verification needs present and typed)."""
    r = _Reader(location, storage_options)
    try:
        data = r.read(PROVENANCE, MAX_PROVENANCE)
    except (FileNotFoundError, NotFoundError):
        raise NotFoundError(f"{location}: no {PROVENANCE} (not an artifact, or one never published)") from None
    doc = decode_json(data, where=f"{location}/{PROVENANCE}", max_bytes=MAX_PROVENANCE)
    _check_provenance(doc, location)
    return dict(doc)


def _check_provenance(doc: Any, location: str) -> None:
    where = f"{location}/{PROVENANCE}"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptionError(f"{where}: not a {FORMAT} document")
    for k, typ in (("run_id", str), ("save_id", str), ("step", int), ("attempt", int), ("manifest_digest", str),
                   ("tensors_digest", str), ("files", dict)):
        if not isinstance(doc.get(k), typ) or isinstance(doc.get(k), bool):
            raise CorruptionError(f"{where}: field {k!r} is missing or not a {typ.__name__}")
    for name, f in doc["files"].items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith(".") or name == PROVENANCE:
            raise CorruptionError(f"{where}: files names {str(name)[:80]!r}, which is not a file of the artifact")
        if not isinstance(f, dict) or type(f.get("size")) is not int or f["size"] < 0 or \
                not isinstance(f.get("blake3"), str):
            raise CorruptionError(f"{where}: files[{name!r}] is not {{size, blake3}}")


def verify_artifact(
    location: str,
    *,
    store: CheckpointStore | None = None,
    keyring: Keyring | None = None,
    require_auth: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    on_file: Callable[[str, int], None] | None = None,
) -> ArtifactReport:
    """Re-hash every file against the provenance, refuse files it does not
    list, check the index and the weight files' tensors against the recorded
    tensor digest; with ``store`` (the run the provenance names) also check
    that the save exists, is complete, verifies (every byte), has the
    recorded manifest digest, and that its model tensors are exactly the
    artifact's. With ``keyring`` the ``auth`` tag is checked (a missing tag
    is a problem under ``require_auth``). Never raises for a bad artifact:
    every finding is in ``problems``."""
    rep = ArtifactReport(location, None)
    try:
        doc = read_provenance(location, storage_options)
    except (CorruptionError, NotFoundError, OSError) as exc:
        rep.problems.append(str(exc))
        return rep
    rep.provenance = doc
    reader = _Reader(location, storage_options)
    listed = dict(doc["files"])
    present = [n for n in reader.names() if n != PROVENANCE]
    for n in present:
        if n not in listed:
            rep.problems.append(f"{n}: a file the provenance does not list")
    for name, f in sorted(listed.items()):
        if name not in present:
            rep.problems.append(f"{name}: listed in the provenance, missing from the artifact")
            continue
        try:
            size, digest = reader.digest(name, f["size"])
        except (OSError, CorruptionError) as exc:
            rep.problems.append(f"{name}: unreadable: {exc}")
            continue
        if on_file is not None:
            on_file(name, size)
        if size != f["size"]:
            rep.problems.append(f"{name}: {size} bytes, the provenance says {f['size']}")
        elif digest != f["blake3"]:
            rep.problems.append(f"{name}: BLAKE3 {digest[:16]}…, the provenance says {str(f['blake3'])[:16]}…")
    if rep.problems:
        return rep
    weights = _weight_files(reader, listed, rep)
    if weights is None:
        return rep
    art_digest = _artifact_digest(reader, weights, listed, rep)
    if art_digest is not None and art_digest != doc["tensors_digest"]:
        rep.problems.append("the weight files' tensors do not match the provenance's tensors_digest")
    _check_auth(doc, keyring, require_auth, rep)
    if store is not None:
        _check_store(doc, store, art_digest, rep)
    return rep


def _weight_files(reader: _Reader, listed: Mapping[str, Any], rep: ArtifactReport) -> list[str] | None:
    if INDEX in listed:
        try:
            idx = decode_json(reader.read(INDEX, MAX_PROVENANCE), where=INDEX, max_bytes=MAX_PROVENANCE)
        except (CorruptionError, OSError) as exc:
            rep.problems.append(f"{INDEX}: {exc}")
            return None
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            rep.problems.append(f"{INDEX}: no weight_map of tensor names to files")
            return None
        files = sorted(set(wm.values()))
        missing = [f for f in files if f not in listed]
        if missing:
            rep.problems.append(f"{INDEX}: names files the artifact does not have: {missing[:5]}")
            return None
        return files
    if SINGLE not in listed:
        rep.problems.append(f"neither {SINGLE} nor {INDEX}: no weights")
        return None
    return [SINGLE]


def _artifact_digest(reader: _Reader, weights: list[str], listed: Mapping[str, Any],
                     rep: ArtifactReport) -> str | None:
    everything: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    for name in weights:
        try:
            tensors = load_safetensors(reader.read(name, int(listed[name]["size"])))
        except (CorruptionError, OSError) as exc:
            rep.problems.append(f"{name}: {exc}")
            return None
        dup = seen.intersection(tensors)
        if dup:
            rep.problems.append(f"{name}: tensor {sorted(dup)[0]!r} appears in two weight files")
            return None
        seen.update(tensors)
        everything.extend(tensors.items())
    return tensors_digest(everything)


def _check_auth(doc: Mapping[str, Any], keyring: Keyring | None, require: bool, rep: ArtifactReport) -> None:
    tag = AuthTag.parse(doc.get("auth")) if doc.get("auth") is not None else None
    if doc.get("auth") is not None and tag is None:
        rep.problems.append("provenance auth tag is malformed")
        return
    if keyring is None:
        if require:
            rep.problems.append("authentication required, but no key is configured to check the provenance")
        return
    if tag is None:
        rep.authenticated = False
        if require:
            rep.problems.append("the provenance is not authenticated (no tag) and authentication is required")
        return
    why = keyring.check(AUTH_KIND, str(doc["run_id"]), body_digest(doc), tag)
    rep.authenticated = why is None
    if why is not None:
        rep.problems.append(f"the provenance's auth tag does not verify: {why}")


def _check_store(doc: Mapping[str, Any], store: CheckpointStore, art_digest: str | None,
                 rep: ArtifactReport) -> None:
    rep.checked_store = True
    if store.run_id != doc["run_id"]:
        rep.problems.append(f"the store's run is {store.run_id!r}, the provenance names run {doc['run_id']!r}")
        return
    try:
        ref = store.get_save(int(doc["step"]), int(doc["attempt"]))
    except (NotFoundError, CorruptionError) as exc:
        rep.problems.append(f"the save the provenance names is not a complete save of the run: {exc}")
        return
    if ref.save_id != doc["save_id"] or ref.manifest_digest != doc["manifest_digest"]:
        rep.problems.append(f"step {ref.step} attempt {ref.attempt} is save {ref.save_id} with manifest "
                            f"{ref.manifest_digest[:16]}…, the provenance names {str(doc['save_id'])[:80]} with "
                            f"manifest {str(doc['manifest_digest'])[:16]}…")
        return
    vr = store.verify(ref, deep=True)
    if not vr.ok:
        rep.problems.append("the save does not verify: " + "; ".join(d for _, d in vr.problems))
        return
    try:
        src = model_source(store, ref)
        save_digest = tensors_digest((t.name, t.load()) for t in src.tensors)
    except (CorruptionError, InvalidInputError) as exc:
        rep.problems.append(f"the save's model cannot be read: {exc}")
        return
    if save_digest != doc["tensors_digest"] or (art_digest is not None and art_digest != save_digest):
        rep.problems.append("the artifact's tensors are not the save's model tensors")
