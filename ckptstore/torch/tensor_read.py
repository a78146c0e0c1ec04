"""Reading a save's tensor components in one verified pass.

Each component is read straight into one fresh CPU buffer (its final home:
the tensors handed out are views of it), hashed chunk by chunk in a helper
thread while the next chunk is read (:meth:`CheckpointStore.read_into`), and
parsed without a copy (:func:`tensors_from_buffer`). Components are read
concurrently. Nothing is returned unless every component verified, so a
caller that applies the tensors only after this returns never applies a
corrupt byte.

The buffers are plain :func:`torch.empty` memory (see :func:`fresh_buffer`
for why not huge pages).

The size allocated is the commit record's claim, which is storage input: it
is checked against the caller's bound for the entry first (what the live
objects can hold, :mod:`.bounds`), and an allocation that fails anyway
(``MemoryError``, torch's allocator ``RuntimeError``) is a
:class:`CorruptionError` of the save, so a restore falls back to an older one.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import SaveRef
from ..errors import CorruptionError
from .contract import CheckpointerStore
from .safetensors_io import tensors_from_buffer

#: components read at the same time (each also keeps one hashing thread busy)
MAX_PARALLEL = 4


def fresh_buffer(size: int) -> torch.Tensor:
    """``size`` bytes of fresh, writable CPU memory as a uint8 tensor.

    Plain :func:`torch.empty`. Measured and rejected (docs/performance.md):
    an anonymous mapping advised to use transparent huge pages reads a warm
    file 1.6 times faster once the process has reused its huge pages, but the
    first restores of a fresh process (a restart: the case that matters) ran
    3 to 6 times slower on the virtual machine here (probably because its
    host reclaims freed huge pages, so each first touch is the host's fault too)."""
    return torch.empty(size, dtype=torch.uint8)


def _allocate(ref: SaveRef, comp: str, size: int, limit: int | None, entry: str) -> torch.Tensor:
    """The read buffer of a component whose size the commit record claims."""
    where = f"save {ref.save_id} (step {ref.step}): component {comp!r}"
    if limit is not None and size > limit:
        raise CorruptionError(
            f"{where} claims {size} bytes, more than the live {entry!r} can hold ({limit} bytes with the "
            "safetensors header cap): the save is damaged or forged, or was made for a larger object "
            "(restore it into an object of that size)"
        )
    try:
        return fresh_buffer(size)
    except (MemoryError, OSError, RuntimeError) as exc:
        msg = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__
        raise CorruptionError(
            f"{where} claims {size} bytes, which cannot be allocated ({msg}): treating the save as damaged"
        ) from None


def _read_one(store: CheckpointerStore, ref: SaveRef, comp: str, limit: int | None, entry: str) -> dict[str, torch.Tensor]:
    buf = _allocate(ref, comp, store.component(ref, comp).size, limit, entry)
    store.read_into(ref, comp, buf.numpy())
    return tensors_from_buffer(buf)


def read_tensors(
    store: CheckpointerStore, ref: SaveRef, components: Mapping[str, str], limits: Mapping[str, int] | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """``{entry: {tensor key: tensor}}`` for ``{entry: component name}``,
    every byte verified before anything is returned. ``limits``: the most
    bytes each entry's component may claim (entries not named: no bound but
    the allocation's own); a larger claim is a :class:`CorruptionError`
    raised before anything is allocated or read."""
    for name, comp in components.items():
        if not isinstance(comp, str):
            raise CorruptionError(f"save {ref.save_id}: entry {name!r} names a component that is not a string")
    bound = dict(limits or {})
    items = sorted(components.items(), key=lambda kv: str(kv[1]))
    if len(items) <= 1:
        return {name: _read_one(store, ref, comp, bound.get(name), name) for name, comp in items}
    for name, comp in items:  # every claim checked before any buffer is allocated
        if name in bound:
            size = store.component(ref, comp).size
            if size > bound[name]:
                _allocate(ref, comp, size, bound[name], name)
    with ThreadPoolExecutor(min(MAX_PARALLEL, len(items)), thread_name_prefix="ckptstore-read") as pool:
        futures = {name: pool.submit(_read_one, store, ref, comp, bound.get(name), name) for name, comp in items}
        return {name: fut.result() for name, fut in futures.items()}
