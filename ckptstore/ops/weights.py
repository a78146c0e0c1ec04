"""The model weights of a save, whatever wrote it, read without trusting the store.

:func:`model_source` returns every model tensor's name, dtype and shape, and
a loader that reads its bytes (BLAKE3-verified) only when called:

* ``ckptstore.torch/1`` (the Checkpointer's): the ``model`` entry of ``state.json``;
* ``ckptstore.hf/1`` (the Hugging Face callback's): the ``model*.safetensors``
  files, one file in memory at a time, plus ``config.json`` /
  ``generation_config.json``;
* DCP (:class:`~ckptstore.distributed.dcp.StoreWriter`): the ``model.*`` items,
  each tensor assembled from every rank's chunks when it is loaded.

Never optimizer or RNG state, never a pickle.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CorruptionError, InvalidInputError
from ..protocol.selection import SaveRef
from ..store import CheckpointStore
from ..torch.codec import tree_from_json, unflatten
from ..torch.safetensors_io import DTYPE_TO_ST, load_safetensors
from ..torch.tensor_read import read_tensors

#: the largest config file copied from a Hugging Face save
MAX_CONFIG = 4 << 20
#: config files copied from a Hugging Face save, beside the weights
HF_CONFIG_FILES = ("config.json", "generation_config.json")
#: where the Hugging Face callback keeps a checkpoint directory's files (integrations.hf.FILES)
HF_FILES = "files/"
#: the DCP writer's metadata component (distributed.dcp.METADATA_COMPONENT)
DCP_METADATA = "dcp/metadata.json"


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
