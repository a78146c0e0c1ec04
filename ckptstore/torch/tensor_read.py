"""Reading a save's tensor components in one verified pass.

Each component is read straight into one fresh CPU buffer (its final home:
the tensors handed out are views of it), hashed chunk by chunk in a helper
thread while the next chunk is read (:meth:`CheckpointStore.read_into`), and
parsed without a copy (:func:`tensors_from_buffer`). Components are read
concurrently. Nothing is returned unless every component verified, so a
caller that applies the tensors only after this returns never applies a
corrupt byte.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import CheckpointStore, SaveRef
from ..errors import CorruptionError
from .safetensors_io import tensors_from_buffer

#: components read at the same time (each also keeps one hashing thread busy)
MAX_PARALLEL = 4


def _read_one(store: CheckpointStore, ref: SaveRef, comp: str) -> dict[str, torch.Tensor]:
    buf = torch.empty(store.component(ref, comp).size, dtype=torch.uint8)
    store.read_into(ref, comp, buf.numpy())
    return tensors_from_buffer(buf)


def read_tensors(store: CheckpointStore, ref: SaveRef, components: Mapping[str, str]) -> dict[str, dict[str, torch.Tensor]]:
    """``{entry: {tensor key: tensor}}`` for ``{entry: component name}``,
    every byte verified before anything is returned."""
    for name, comp in components.items():
        if not isinstance(comp, str):
            raise CorruptionError(f"save {ref.save_id}: entry {name!r} names a component that is not a string")
    items = sorted(components.items(), key=lambda kv: str(kv[1]))
    if len(items) <= 1:
        return {name: _read_one(store, ref, comp) for name, comp in items}
    with ThreadPoolExecutor(min(MAX_PARALLEL, len(items)), thread_name_prefix="ckptstore-read") as pool:
        futures = {name: pool.submit(_read_one, store, ref, comp) for name, comp in items}
        return {name: fut.result() for name, fut in futures.items()}
