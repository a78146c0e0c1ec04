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
Three save formats are read (:mod:`.weights`): ``ckptstore.torch/1`` (the Checkpointer's; the
``model`` entry), ``ckptstore.hf/1`` (the Trainer callback's files) and DCP
saves of :class:`~ckptstore.distributed.dcp.StoreWriter` (the ``model.``
items, consolidated from every rank's chunks one tensor at a time: at most
one shard is held in memory, never the whole model twice). Every byte read
from the store is verified (BLAKE3) before it is used.

Verification is :mod:`.artifact_check`. Publication is atomic: a local artifact is written into a private
hidden sibling directory held by descriptor, fsynced, then renamed to its final name (which must not exist),
checked to be the directory created, and only then given its published modes (:mod:`.artifact_dir`);
on an object store (``s3://``, ``gs://``, ``memory://``) the files are put
first and ``provenance.json`` is created last, exclusively: an artifact
without its provenance is not an artifact (:func:`~.artifact_check.verify_artifact` refuses it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import blake3
import torch

from ..backends.base import Backend
from ..backends.schemes import backend_from_url
from ..errors import CorruptionError, InvalidInputError
from ..protocol import canonical_json
from ..protocol.auth import Keyring
from ..torch.safetensors_io import DTYPE_TO_ST, safetensors_stream
from .artifact_dir import NewArtifactDir
from .weights import ModelSource, TensorSource

FORMAT = "ckptstore.artifact/1"
PROVENANCE = "provenance.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: Hugging Face's default ``max_shard_size`` (5 GB)
DEFAULT_SHARD_BYTES = 5 * 10**9
#: the largest provenance document read back
MAX_PROVENANCE = 16 << 20
AUTH_KIND = "artifact"

CHUNK = 8 << 20


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
    """Where an artifact is written: files first, :meth:`publish` last.
    ``published_id`` is the (st_dev, st_ino) of a local artifact's directory
    once published (None on an object store)."""

    location: str
    published_id: tuple[int, int] | None = None

    def write(self, name: str, chunks: Iterable[Any]) -> tuple[int, str]:
        raise NotImplementedError

    def publish(self, provenance: bytes) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class LocalSink(Sink):
    """A private hidden sibling directory, held by descriptor, renamed to
    ``path`` once complete (:class:`~.artifact_dir.NewArtifactDir`: nothing is
    written through a link or into a directory this process did not create,
    and the published directory is checked to be the one created).
    ``on_stage`` is :class:`~.artifact_dir.NewArtifactDir`'s fault point."""

    def __init__(self, path: str, *, on_stage: Callable[[str], None] | None = None) -> None:
        self.dir = NewArtifactDir(path, on_stage=on_stage)
        self.location = self.path = self.dir.path
        self.tmp = self.dir.tmp

    def write(self, name: str, chunks: Iterable[Any]) -> tuple[int, str]:
        return self.dir.write(name, chunks)

    def publish(self, provenance: bytes) -> None:
        self.dir.write(PROVENANCE, [provenance])
        self.published_id = self.dir.publish()
        self.dir.close()  # on a failure write_artifact calls abort, which closes it

    def abort(self) -> None:
        try:
            self.dir.abort()
        finally:
            self.dir.close()


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
