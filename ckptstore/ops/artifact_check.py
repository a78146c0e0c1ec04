"""Verifying a promoted artifact (:mod:`ckptstore.ops.artifact` writes them).

:func:`verify_artifact` re-hashes every file against ``provenance.json``,
refuses files it does not list, checks the index and re-derives the tensor
digest from the weight files; with the store it also checks that the save
the provenance names is complete, verifies, and holds exactly the
artifact's tensors and config files, and compares every field the run's
records determine (:mod:`.provenance`), reporting which fields it confirmed
and which rest on the provenance alone; with a key it checks the
provenance's tag. Every read is bounded (the provenance by
:data:`MAX_PROVENANCE`, each file by its declared size), and a local
artifact is read through :class:`~.artifact_dir.ArtifactDir` (no link
followed, no FIFO or other special file opened for reading).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch

from ..backends.schemes import backend_from_url
from ..errors import CkptStoreError, CorruptionError, InvalidInputError, NotFoundError
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
from .artifact_dir import ArtifactDir
from .provenance import (
    RECORD_FIELDS,
    SAVE_FIELDS,
    record_fields,
    recorded_budget,
    same,
    shown,
    without_parameters,
)
from .report import build_record
from .weights import model_source


@dataclass
class ArtifactReport:
    """What :func:`verify_artifact` found: ``ok`` only without any problem.

    ``confirmed``: the provenance fields the store's records confirmed
    (empty without the store); ``unconfirmed``: the fields present that
    nothing confirmed — the promoter's own word (:data:`~.provenance.OPERATOR_FIELDS`),
    fields this format does not define, and without the store every field
    about the run. ``directory_id``: the (st_dev, st_ino) of a local
    artifact's directory as read (None on an object store)."""

    location: str
    provenance: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)
    checked_store: bool = False
    authenticated: bool | None = None
    confirmed: list[str] = field(default_factory=list)
    unconfirmed: list[str] = field(default_factory=list)
    directory_id: tuple[int, int] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        p = self.provenance or {}
        return {"ok": self.ok, "location": self.location, "problems": self.problems,
                "checked_store": self.checked_store, "authenticated": self.authenticated,
                "confirmed": self.confirmed, "unconfirmed": self.unconfirmed,
                **{k: p.get(k) for k in ("run_id", "save_id", "step", "attempt", "manifest_digest")}}


class _Reader:
    """Bounded reads of an artifact's files, local (:class:`~.artifact_dir.ArtifactDir`:
    no link followed, nothing but regular files read) or on an object store."""

    def __init__(self, location: str, storage_options: Mapping[str, Any] | None) -> None:
        local = "://" not in location or location.startswith("file://")
        path = location[len("file://"):] if location.startswith("file://") else location
        self.dir = ArtifactDir(path) if local else None
        self.backend = None if local else backend_from_url(location, storage_options=storage_options)

    def close(self) -> None:
        if self.dir is not None:
            self.dir.close()

    def names(self) -> list[str]:
        if self.dir is not None:
            return self.dir.names()
        assert self.backend is not None
        return sorted(o.key for o in self.backend.list(""))

    def read(self, name: str, max_bytes: int) -> bytes:
        if self.dir is not None:
            return self.dir.read(name, max_bytes)
        assert self.backend is not None
        data = self.backend.get_range(name, 0, max_bytes + 1)
        if len(data) > max_bytes:
            raise CorruptionError(f"{name}: larger than the {max_bytes} bytes allowed")
        return data

    def digest(self, name: str, size: int) -> tuple[int, str]:
        """(bytes read, BLAKE3 hex) of at most ``size + 1`` bytes: a longer file reads as ``size + 1``."""
        h, n = blake3.blake3(), 0
        if self.dir is not None:
            for block in self.dir.blocks(name, size):
                h.update(block)
                n += len(block)
            return n, h.hexdigest()
        assert self.backend is not None
        while n <= size:
            block = self.backend.get_range(name, n, min(size + 1, n + CHUNK))
            if not block:
                break
            h.update(block)
            n += len(block)
        return n, h.hexdigest()


def read_provenance(location: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The provenance document of an artifact, strictly parsed (bounded, no
    duplicate keys, the fields verification needs present and typed; a local
    artifact read without following a link, a FIFO or other special file refused)."""
    r = _Reader(location, storage_options)
    try:
        return _provenance(r, location)
    finally:
        r.close()


def _provenance(r: _Reader, location: str) -> dict[str, Any]:
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
    tensor digest. With ``store`` (the run the provenance names) also check
    that the save exists, is complete, verifies (every byte), has the
    recorded save ID and manifest digest, that its model tensors (and copied
    config files) are exactly the artifact's, and that every field the run's
    records determine (:data:`~.provenance.RECORD_FIELDS`: identity, eval
    metrics, attempts, budget figures, ...) is what the records say: a
    field edited in the provenance is a problem naming it. ``confirmed`` and
    ``unconfirmed`` of the report say which fields were vouched for by the
    store and which rest on the provenance alone. With ``keyring`` the
    ``auth`` tag is checked (a missing tag is a problem under
    ``require_auth``). Never raises for a bad artifact: every finding is in
    ``problems``; a local artifact is read without following a link and
    without opening anything but regular files (a FIFO never hangs it)."""
    rep = ArtifactReport(location, None)
    try:
        reader = _Reader(location, storage_options)
    except (CorruptionError, NotFoundError, OSError) as exc:
        rep.problems.append(str(exc))
        return rep
    try:
        rep.directory_id = reader.dir.id if reader.dir is not None else None
        _verify(reader, location, store, keyring, require_auth, on_file, rep)
    finally:
        reader.close()
    return rep


def _verify(reader: _Reader, location: str, store: CheckpointStore | None, keyring: Keyring | None,
            require_auth: bool, on_file: Callable[[str, int], None] | None, rep: ArtifactReport) -> None:
    try:
        doc = _provenance(reader, location)
    except (CorruptionError, NotFoundError, OSError) as exc:
        rep.problems.append(str(exc))
        return
    rep.provenance = doc
    listed = dict(doc["files"])
    try:
        present = [n for n in reader.names() if n != PROVENANCE]
    except (CorruptionError, OSError) as exc:
        rep.problems.append(f"{location}: cannot be listed: {exc}")
        return
    for n in present:
        if n not in listed:
            rep.problems.append(f"{n}: a file the provenance does not list")
    for name, f in sorted(listed.items()):
        if name not in present:
            rep.problems.append(f"{name}: listed in the provenance, missing from the artifact")
            continue
        try:
            size, digest = reader.digest(name, f["size"])
        except (OSError, CorruptionError, NotFoundError) as exc:
            rep.problems.append(f"{name}: unreadable: {exc}")
            continue
        if on_file is not None:
            on_file(name, size)
        if size != f["size"]:
            got = f"more than {f['size']}" if size > f["size"] else str(size)  # the read stops at size + 1
            rep.problems.append(f"{name}: {got} bytes, the provenance says {f['size']}")
        elif digest != f["blake3"]:
            rep.problems.append(f"{name}: BLAKE3 {digest[:16]}…, the provenance says {str(f['blake3'])[:16]}…")
    if rep.problems:
        return
    weights = _weight_files(reader, listed, rep)
    if weights is None:
        return
    art = _artifact_tensors(reader, weights, listed, rep)
    if art is not None:
        if art[0] != doc["tensors_digest"]:
            rep.problems.append("the weight files' tensors do not match the provenance's tensors_digest")
        if "tensors" in doc and not same(doc["tensors"], art[1]):
            rep.problems.append(f"tensors: the provenance says {shown(doc['tensors'])}, the weight files hold {art[1]}")
    _check_auth(doc, keyring, require_auth, rep)
    if store is not None:
        _check_store(doc, store, None if art is None else art[0], weights, rep)
    confirmed = set(rep.confirmed)
    rep.unconfirmed = sorted(k for k in _claims(doc) if k not in confirmed and k not in ("format", "auth"))


def _claims(doc: Mapping[str, Any]) -> list[str]:
    """The provenance's fields, ``budget.parameters`` apart from the budget figures."""
    out = [k for k in doc if k != "budget"]
    b = doc.get("budget")
    if b is not None:
        if not isinstance(b, Mapping) or set(b) - {"parameters"}:
            out.append("budget")
        if isinstance(b, Mapping) and "parameters" in b:
            out.append("budget.parameters")
    return out


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


def _artifact_tensors(reader: _Reader, weights: list[str], listed: Mapping[str, Any],
                      rep: ArtifactReport) -> tuple[str, int] | None:
    """The weight files' tensor digest and tensor count (None with the problem recorded)."""
    everything: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    for name in weights:
        try:
            tensors = load_safetensors(reader.read(name, int(listed[name]["size"])))
        except (CorruptionError, NotFoundError, OSError) as exc:
            rep.problems.append(f"{name}: {exc}")
            return None
        dup = seen.intersection(tensors)
        if dup:
            rep.problems.append(f"{name}: tensor {sorted(dup)[0]!r} appears in two weight files")
            return None
        seen.update(tensors)
        everything.extend(tensors.items())
    return tensors_digest(everything), len(everything)


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


def _check_store(doc: Mapping[str, Any], store: CheckpointStore, art_digest: str | None, weights: list[str],
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
    rep.confirmed += list(SAVE_FIELDS)
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
        return
    rep.confirmed += ["tensors_digest", "tensors"]
    if _check_files(doc, src.format, src.extra_files, weights, rep):
        rep.confirmed.append("files")
    if "source_format" in doc:
        if same(doc["source_format"], src.format):
            rep.confirmed.append("source_format")
        else:
            rep.problems.append(f"source_format: the provenance says {shown(doc['source_format'])}, the save was "
                                f"written as {src.format!r}")
    _check_record_fields(doc, store, rep)


def _check_files(doc: Mapping[str, Any], fmt: str, extra: Mapping[str, bytes], weights: list[str],
                 rep: ArtifactReport) -> bool:
    """The artifact's files are its weights, their index when sharded, and
    exactly the save's copied config files, byte for byte."""
    ok = True
    listed = doc["files"]
    expected = set(weights) | set(extra) | ({INDEX} if INDEX in listed else set())
    for name in sorted(set(listed) - expected):
        rep.problems.append(f"{name}: a file that is neither a weight file nor one the save ({fmt}) holds")
        ok = False
    for name, data in sorted(extra.items()):
        f = listed.get(name)
        if f is None or f["size"] != len(data) or f["blake3"] != blake3.blake3(data).hexdigest():
            rep.problems.append(f"{name}: not the save's {name}" + (" (missing)" if f is None else ""))
            ok = False
    return ok


def _check_record_fields(doc: Mapping[str, Any], store: CheckpointStore, rep: ArtifactReport) -> None:
    """Every :data:`RECORD_FIELDS` field present, against the run's records now."""
    where = f"{rep.location}/{PROVENANCE}"
    present = [k for k in RECORD_FIELDS if k in doc]
    if not present:
        return
    try:
        budget = recorded_budget(doc, where)
        expected = record_fields(store, build_record(store, budget, deep=False))
    except CkptStoreError as exc:
        rep.problems.append(f"the run's records cannot be read to confirm the provenance ({', '.join(present)}): "
                            f"{exc}")
        return
    for k in present:
        got, want = doc[k], expected[k]
        if k == "budget":
            got, want = without_parameters(got), without_parameters(want)
        if same(got, want):
            rep.confirmed.append(k)
        else:
            rep.problems.append(f"{k}: the provenance says {shown(got)}, the run's records say {shown(want)} "
                                "(edited after promotion, or the run changed since: promote again)")
