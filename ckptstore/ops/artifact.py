"""Serving artifacts: a save's model weights as safetensors, linked to the save by ``provenance.json``.

An artifact is a directory (or an object-store prefix) holding

* ``model.safetensors`` — or, above the shard size, ``model-00001-of-0000N.safetensors``
  ... with ``model.safetensors.index.json`` (Hugging Face's layout:
  ``{"metadata": {"total_size": N}, "weight_map": {tensor: file}}``);
* ``config.json`` / ``generation_config.json`` when the save came from the
  Hugging Face callback and holds them (so ``from_pretrained`` loads it);
* ``provenance.json`` (:data:`FORMAT`): run ID, save ID, step, attempt, the
  commit's manifest digest, every other file's size and BLAKE3, the digest of
  the model tensors (:func:`tensors_digest`), the identity, and what the
  caller adds (eval metrics, attempts, budget line). With a signing key it
  carries an ``auth`` tag made with the run's key (record kind ``artifact``).

Only model weights are written: never optimizer state, RNG state or pickles.
Three save formats are read: ``ckptstore.torch/1`` (the Checkpointer's; the
``model`` entry), ``ckptstore.hf/1`` (the Trainer callback's files) and DCP
saves of :class:`~ckptstore.distributed.dcp.StoreWriter` (the ``model.``
items, consolidated from every rank's chunks one tensor at a time: at most
one shard is held in memory, never the whole model twice). Every byte read
from the store is verified (BLAKE3) before it is used.

Publication is atomic: a local artifact is written into a hidden sibling
directory, fsynced, then renamed to its final name (which must not exist);
on an object store (``s3://``, ``gs://``, ``memory://``) the files are put
first and ``provenance.json`` is created last, exclusively: an artifact
without its provenance is not an artifact (:func:`verify_artifact` refuses it).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch

from ..backends.base import Backend
from ..backends.schemes import backend_from_url
from ..errors import CorruptionError, InvalidInputError, NotFoundError
from ..protocol import canonical_json, decode_json
from ..protocol.auth import AuthTag, Keyring
from ..protocol.selection import SaveRef
from ..store import CheckpointStore
from ..torch.codec import tree_from_json, unflatten
from ..torch.safetensors_io import DTYPE_TO_ST, load_safetensors, safetensors_stream
from ..torch.tensor_read import read_tensors

FORMAT = "ckptstore.artifact/1"
PROVENANCE = "provenance.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: Hugging Face's default ``max_shard_size`` (5 GB)
DEFAULT_SHARD_BYTES = 5 * 10**9
#: the largest provenance document read back
MAX_PROVENANCE = 16 << 20
#: the largest config file copied from a Hugging Face save
MAX_CONFIG = 4 << 20
#: config files copied from a Hugging Face save, beside the weights
HF_CONFIG_FILES = ("config.json", "generation_config.json")
AUTH_KIND = "artifact"
#: where the Hugging Face callback keeps a checkpoint directory's files (integrations.hf.FILES)
HF_FILES = "files/"
#: the DCP writer's metadata component (distributed.dcp.METADATA_COMPONENT)
DCP_METADATA = "dcp/metadata.json"
CHUNK = 8 << 20


@dataclass(frozen=True)
class TensorSource:
    """One tensor of the model: what it is, and how to get its bytes (verified)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass
class ModelSource:
    """The model tensors of a save, and the files to copy beside them."""

    format: str
    tensors: list[TensorSource]
    extra_files: dict[str, bytes] = field(default_factory=dict)


# ------------------------------------------------------------------ reading a save


def model_source(store: CheckpointStore, ref: SaveRef, *, entry: str = "model") -> ModelSource:
    """The model weights of ``ref``, whatever wrote it (see the module docstring).
    A save without model weights is :class:`InvalidInputError`; a damaged
    one :class:`CorruptionError`."""
    fmt = ref.metadata.get("format")
    if fmt == "ckptstore.hf/1":
        return _hf_source(store, ref, HF_FILES)
    if DCP_METADATA in ref.components:
        return _dcp_source(store, ref, entry)
    if "state.json" in ref.components:
        return _torch_source(store, ref, entry)
    raise InvalidInputError(f"save {ref.save_id} (step {ref.step}) was not written by the Checkpointer, the "
                            "Hugging Face callback or the DCP writer: no model weights to promote")


def _torch_source(store: CheckpointStore, ref: SaveRef, entry: str) -> ModelSource:
    where = f"save {ref.save_id} (step {ref.step})"
    doc = tree_from_json(store.read(ref, "state.json"))
    if not isinstance(doc, dict) or not isinstance(doc.get("trees"), dict) or not isinstance(
            doc.get("tensor_components"), dict):
        raise CorruptionError(f"{where}: state.json lacks its trees / tensor_components tables")
    comp = doc["tensor_components"].get(entry)
    if entry not in doc["trees"] or comp != f"{entry}.safetensors":
        raise InvalidInputError(f"{where} holds no {entry!r} entry with tensors: nothing to promote "
                                f"(entries: {', '.join(sorted(doc['trees']))[:200]})")
    tensors = read_tensors(store, ref, {entry: comp}, None)
    tree = unflatten(doc["trees"][entry], tensors.get(entry, {}))
    if not isinstance(tree, Mapping):
        raise InvalidInputError(f"{where}: the {entry!r} entry is not a state dict")
    out: list[TensorSource] = []
    for name, t in tree.items():
        if not isinstance(t, torch.Tensor):
            continue  # e.g. a module's extra state: not a weight
        if not isinstance(name, str) or not name:
            raise CorruptionError(f"{where}: a tensor of {entry!r} has no name")
        if t.dtype not in DTYPE_TO_ST:
            raise InvalidInputError(f"{where}: tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold")
        out.append(TensorSource(name, t.dtype, tuple(t.shape), _const(t)))
    return ModelSource("ckptstore.torch/1", out)


def _const(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


def _hf_source(store: CheckpointStore, ref: SaveRef, files: str) -> ModelSource:
    where = f"save {ref.save_id} (step {ref.step})"
    names = sorted(n for n in ref.components if n.startswith(files) and n.endswith(".safetensors")
                   and "/" not in n[len(files):])
    weights = [n for n in names if os.path.basename(n).startswith("model")]
    if not weights:
        raise InvalidInputError(f"{where}: a Hugging Face save without model*.safetensors: nothing to promote")
    out: list[TensorSource] = []
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def loader(comp: str, name: str) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            if comp not in cache:
                cache.clear()  # one file of the save in memory at a time
                cache[comp] = load_safetensors(store.read(ref, comp))
            return cache[comp][name]
        return load

    for comp in weights:
        header = _safetensors_header(store, ref, comp)
        for name, (dtype, shape) in sorted(header.items()):
            out.append(TensorSource(name, dtype, shape, loader(comp, name)))
    extra: dict[str, bytes] = {}
    for cfg in HF_CONFIG_FILES:
        c = ref.components.get(files + cfg)
        if c is not None:
            if c.size > MAX_CONFIG:
                raise CorruptionError(f"{where}: {cfg} claims {c.size} bytes, more than {MAX_CONFIG}")
            extra[cfg] = store.read(ref, files + cfg)
    return ModelSource("ckptstore.hf/1", out, extra)


def _safetensors_header(store: CheckpointStore, ref: SaveRef, comp: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Names, dtypes and shapes of a safetensors component (parsed from the verified file)."""
    tensors = load_safetensors(store.read(ref, comp))
    return {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}


def _dcp_source(store: CheckpointStore, ref: SaveRef, entry: str) -> ModelSource:
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from ..distributed.dcp import METADATA_COMPONENT
    from ..distributed.dcp.metadata import MAX_METADATA_BYTES, decode_metadata, dtype_from_name

    where = f"save {ref.save_id} (step {ref.step})"
    if ref.components[METADATA_COMPONENT].size > MAX_METADATA_BYTES:
        raise CorruptionError(f"{where}: the DCP metadata claims more than {MAX_METADATA_BYTES} bytes")
    md, items = decode_metadata(store.read(ref, METADATA_COMPONENT), f"{ref.save_id}/{METADATA_COMPONENT}")
    prefix = entry + "."
    out: list[TensorSource] = []
    for fqn, m in sorted(md.state_dict_metadata.items()):
        if not fqn.startswith(prefix) or not isinstance(m, TensorStorageMetadata):
            continue
        chunks = []
        for ch in m.chunks:
            info = items.get(MetadataIndex(fqn, ch.offsets))
            if info is None or info.component not in ref.components:
                raise CorruptionError(f"{where}: chunk {list(ch.offsets)} of {fqn!r} has no stored item")
            if info.transforms:
                raise InvalidInputError(f"{where}: {fqn!r} was stored through stream transforms "
                                        f"{list(info.transforms)}; promotion reads raw items only")
            if info.dtype is None or dtype_from_name(info.dtype) != m.properties.dtype or \
                    tuple(info.shape or ()) != tuple(ch.sizes):
                raise CorruptionError(f"{where}: item of {fqn!r} at {list(ch.offsets)} does not match its chunk")
            chunks.append((tuple(ch.offsets), tuple(ch.sizes), info))
        dtype = m.properties.dtype
        if dtype not in DTYPE_TO_ST:
            raise InvalidInputError(f"{where}: tensor {fqn!r} has dtype {dtype}, which safetensors cannot hold")

        def load(size: tuple[int, ...] = tuple(m.size), dtype: torch.dtype = dtype,
                 chunks: list[Any] = chunks, fqn: str = fqn) -> torch.Tensor:
            full = torch.empty(size, dtype=dtype)
            for offsets, sizes, info in chunks:
                raw = store.read_verified_range(ref, info.component, info.offset, info.offset + info.length,
                                                info.blake3)
                n = 1
                for s in sizes:
                    n *= s
                if len(raw) != n * dtype.itemsize:
                    raise CorruptionError(f"{where}: item of {fqn!r} holds {len(raw)} bytes for shape {list(sizes)}")
                part = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(sizes) if n else torch.empty(sizes, dtype=dtype)
                view = full
                for dim, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
                    view = view.narrow(dim, o, s)
                view.copy_(part)
            return full

        out.append(TensorSource(fqn[len(prefix):], dtype, tuple(m.size), load))
    if not out:
        raise InvalidInputError(f"{where}: the DCP save holds no {prefix}* tensors: nothing to promote")
    return ModelSource("dcp", out)


# ------------------------------------------------------------------ digest, shards


def tensors_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """BLAKE3 over every (name, dtype, shape, bytes) in name order: equal for
    two sets of tensors exactly when they hold the same model."""
    h = blake3.blake3()
    for name, t in sorted(tensors, key=lambda x: x[0]):
        h.update(json.dumps([name, DTYPE_TO_ST[t.dtype], list(t.shape)]).encode() + b"\x00")
        if t.numel():
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def plan_shards(tensors: list[TensorSource], max_shard_bytes: int) -> list[list[TensorSource]]:
    """Tensors in name order, cut into shards of at most ``max_shard_bytes``
    (a tensor larger than that gets a shard of its own)."""
    if max_shard_bytes <= 0:
        raise InvalidInputError("the shard size must be positive")
    shards: list[list[TensorSource]] = [[]]
    size = 0
    for t in sorted(tensors, key=lambda s: s.name):
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_names(n: int) -> list[str]:
    return [SINGLE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


# ------------------------------------------------------------------ sinks


class Sink:
    """Where an artifact is written: files first, :meth:`publish` last."""

    location: str

    def write(self, name: str, chunks: Iterable[Any]) -> tuple[int, str]:
        raise NotImplementedError

    def publish(self, provenance: bytes) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class LocalSink(Sink):
    """A hidden sibling directory renamed to ``path`` once complete."""

    def __init__(self, path: str) -> None:
        self.location = self.path = os.path.abspath(path)
        if os.path.lexists(self.path):
            raise InvalidInputError(f"{self.path} already exists: an artifact is never overwritten")
        parent = os.path.dirname(self.path)
        if not os.path.isdir(parent):
            raise InvalidInputError(f"{parent}: the artifact's parent directory does not exist")
        self.tmp = os.path.join(parent, f".{os.path.basename(self.path)}.partial-{uuid.uuid4().hex[:12]}")
        os.mkdir(self.tmp, 0o755)

    def write(self, name: str, chunks: Iterable[Any]) -> tuple[int, str]:
        h, size = blake3.blake3(), 0
        fd = os.open(os.path.join(self.tmp, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                     0o644)
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                h.update(c)
                f.write(c)
                size += len(memoryview(c).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        return size, h.hexdigest()

    def publish(self, provenance: bytes) -> None:
        self.write(PROVENANCE, [provenance])
        _fsync_dir(self.tmp)
        if os.path.lexists(self.path):
            raise InvalidInputError(f"{self.path} appeared while the artifact was written; left at {self.tmp}")
        os.rename(self.tmp, self.path)
        _fsync_dir(os.path.dirname(self.path))

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BackendSink(Sink):
    """An object-store prefix; ``provenance.json`` created last, exclusively."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.location = url
        self.backend: Backend = backend_from_url(url, storage_options=storage_options)
        if self.backend.exists(PROVENANCE) or self.backend.list(""):
            raise InvalidInputError(f"{url} is not empty: an artifact is never overwritten")
        self.written: list[str] = []

    def write(self, name: str, chunks: Iterable[Any]) -> tuple[int, str]:
        h = blake3.blake3()
        size = 0

        def hashed() -> Iterator[Any]:
            nonlocal size
            for c in chunks:
                h.update(c)
                size += len(memoryview(c).cast("B"))
                yield c

        self.backend.put(name, hashed())
        self.written.append(name)
        return size, h.hexdigest()

    def publish(self, provenance: bytes) -> None:
        if not self.backend.create(PROVENANCE, provenance):
            raise InvalidInputError(f"{self.location}: another promotion published here first")

    def abort(self) -> None:
        for name in self.written:
            try:
                self.backend.delete(name)
            except Exception:  # noqa: BLE001,S110 - best effort: without provenance.json it is no artifact
                pass


def sink_for(to: str, storage_options: Mapping[str, Any] | None = None) -> Sink:
    """A local sink for a path or ``file://``; a backend sink for any other URL."""
    if "://" not in to:
        return LocalSink(to)
    if to.startswith("file://"):
        return LocalSink(to[len("file://"):])
    return BackendSink(to, storage_options)


# ------------------------------------------------------------------ writing


@dataclass(frozen=True)
class WrittenArtifact:
    location: str
    files: dict[str, dict[str, Any]]
    provenance: dict[str, Any]


def write_artifact(
    source: ModelSource,
    sink: Sink,
    provenance: Mapping[str, Any],
    *,
    run_id: str,
    keyring: Keyring | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    on_tensor: Callable[[TensorSource], None] | None = None,
) -> WrittenArtifact:
    """Write the weights (sharded as planned), the extra files and, last, the
    provenance (``provenance`` plus ``files``, ``tensors_digest`` and the
    ``auth`` tag when ``keyring`` has an active key). On any failure the
    partial artifact is removed and the error raised."""
    shards = plan_shards(source.tensors, max_shard_bytes)
    names = shard_names(len(shards))
    files: dict[str, dict[str, Any]] = {}
    h = _DigestBuilder()
    weight_map: dict[str, str] = {}
    try:
        for fname, shard in zip(names, shards, strict=True):
            tensors: dict[str, torch.Tensor] = {}
            for t in shard:
                v = t.load().detach().cpu().contiguous()
                if v.dtype != t.dtype or tuple(v.shape) != t.shape:
                    raise CorruptionError(f"tensor {t.name!r}: stored as {v.dtype} {list(v.shape)}, "
                                          f"described as {t.dtype} {list(t.shape)}")
                tensors[t.name] = v
                h.add(t.name, v)
                weight_map[t.name] = fname
                if on_tensor is not None:
                    on_tensor(t)
            _, chunks = safetensors_stream(tensors, {"format": "pt"})
            size, digest = sink.write(fname, chunks)
            files[fname] = {"size": size, "blake3": digest}
            del tensors
        if len(shards) > 1:
            total = sum(t.nbytes for t in source.tensors)
            index = json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                               indent=2).encode()
            size, digest = sink.write(INDEX, [index])
            files[INDEX] = {"size": size, "blake3": digest}
        for name, data in sorted(source.extra_files.items()):
            size, digest = sink.write(name, [data])
            files[name] = {"size": size, "blake3": digest}
        doc = {**dict(provenance), "format": FORMAT, "source_format": source.format, "files": files,
               "tensors": len(source.tensors), "tensors_digest": h.hexdigest(), "auth": None}
        doc["auth"] = sign_provenance(doc, run_id, keyring)
        body = json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=True).encode() + b"\n"
        sink.publish(body)
    except BaseException:
        sink.abort()
        raise
    return WrittenArtifact(sink.location, files, doc)


class _DigestBuilder:
    """:func:`tensors_digest` built incrementally (tensors must come in name order)."""

    def __init__(self) -> None:
        self._h = blake3.blake3()
        self._last: str | None = None

    def add(self, name: str, t: torch.Tensor) -> None:
        assert self._last is None or name > self._last, "tensors must come in name order"
        self._last = name
        self._h.update(json.dumps([name, DTYPE_TO_ST[t.dtype], list(t.shape)]).encode() + b"\x00")
        if t.numel():
            self._h.update(t.reshape(-1).view(torch.uint8).numpy().data)

    def hexdigest(self) -> str:
        return str(self._h.hexdigest())


def body_digest(doc: Mapping[str, Any]) -> str:
    """BLAKE3 of the canonical JSON of the provenance without its ``auth`` field."""
    return str(blake3.blake3(canonical_json({k: v for k, v in doc.items() if k != "auth"})).hexdigest())


def sign_provenance(doc: Mapping[str, Any], run_id: str, keyring: Keyring | None) -> dict[str, str] | None:
    if keyring is None or keyring.active is None:
        return None
    tag = keyring.sign(AUTH_KIND, run_id, body_digest(doc))
    return None if tag is None else tag.to_json()


# ------------------------------------------------------------------ verifying


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
