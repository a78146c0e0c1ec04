"""Reading a save's tensor components in one verified pass.

Each component is read straight into the memory of the tensors handed out (a
scatter read, :meth:`CheckpointStore.read_into` with one buffer per tensor):
its safetensors header is read first (a bounded range read, parsed strictly,
**not yet trusted**), one tensor of the header's dtype and shape is allocated
per entry with :func:`torch.empty` on the calling thread (:func:`_plan`:
torch's allocator, the same allocations torch.load makes for its own
storages on the same thread, so the process's freed memory is reused the
same way; every tensor aligned, no copy of small tensors), then the
whole component is read into [header, tensor, tensor, ...], hashed span by
span in a helper thread while the next span is read. The tensors are handed
out only after the component's digest matched and the verified header equals
the one that shaped them (a header that differs, e.g. a tier's copy damaged
or a file rewritten between the two reads, sends the component down the
one-buffer path below, decided by the verified bytes alone). Components are
read concurrently. Nothing is returned unless every component verified, so a
caller that applies the tensors only after this returns never applies a
corrupt byte.

A header that cannot be read or parsed before the verified read falls back
to the one-buffer path: the component read into one fresh buffer
(:func:`fresh_buffer`, plain :func:`torch.empty` memory; see there for why not
huge pages), verified, then parsed (:func:`tensors_from_buffer`); a damaged
component then fails its digest as before.

The size allocated is the commit record's claim, which is storage input: it
is checked against the caller's bound for the entry first (what the live
objects can hold, :mod:`.bounds`), and an allocation that fails anyway
(``MemoryError``, torch's allocator ``RuntimeError``) is a
:class:`CorruptionError` of the save, so a restore falls back to an older one.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .. import SaveRef
from ..errors import CorruptionError, NotFoundError
from .contract import CheckpointerStore
from .safetensors_io import check_bools, header_span, parse_layout, tensors_from_buffer

#: components read at the same time (each also keeps one hashing thread busy)
MAX_PARALLEL = 4
#: bytes read for the header before the verified read (a longer header costs a second range read)
HEAD_GUESS = 64 << 10


def fresh_buffer(size: int) -> torch.Tensor:
    """``size`` bytes of fresh, writable CPU memory as a uint8 tensor.

    Plain :func:`torch.empty`. Measured and rejected (docs/performance.md):
    an anonymous mapping advised to use transparent huge pages reads a warm
    file 1.6 times faster once the process has reused its huge pages, but the
    first restores of a fresh process (a restart: the case that matters) ran
    3 to 6 times slower on the virtual machine here (probably because its
    host reclaims freed huge pages, so each first touch is the host's fault too)."""
    return torch.empty(size, dtype=torch.uint8)


def _claim_error(ref: SaveRef, comp: str, size: int, limit: int | None, entry: str) -> CorruptionError | None:
    if limit is not None and size > limit:
        return CorruptionError(
            f"save {ref.save_id} (step {ref.step}): component {comp!r} claims {size} bytes, more than the live "
            f"{entry!r} can hold ({limit} bytes with the safetensors header cap): the save is damaged or forged, or "
            "was made for a larger object (restore it into an object of that size)"
        )
    return None


def _no_memory(ref: SaveRef, comp: str, size: int, exc: BaseException) -> CorruptionError:
    msg = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__
    return CorruptionError(
        f"save {ref.save_id} (step {ref.step}): component {comp!r} claims {size} bytes, which cannot be allocated "
        f"({msg}): treating the save as damaged"
    )


def _allocate(ref: SaveRef, comp: str, size: int, limit: int | None, entry: str) -> torch.Tensor:
    """The read buffer of a component whose size the commit record claims."""
    err = _claim_error(ref, comp, size, limit, entry)
    if err is not None:
        raise err
    try:
        return fresh_buffer(size)
    except (MemoryError, OSError, RuntimeError) as exc:
        raise _no_memory(ref, comp, size, exc) from None


def _read_head(store: CheckpointerStore, ref: SaveRef, comp: str, size: int) -> bytes:
    """The component's header bytes (length field included), read but not verified."""
    head = store.read_range(ref, comp, 0, min(size, HEAD_GUESS))
    need = header_span(head, size)
    if need > len(head):
        head = store.read_range(ref, comp, 0, need)
    return head[:need]


@dataclass
class _Planned:
    """A component's read prepared on the calling thread: its claimed size and,
    when its header could be read and parsed first, that header (not yet
    trusted) and one new tensor per entry (None: the one-buffer path)."""

    comp: str
    size: int
    head: bytes | None = None
    tensors: list[tuple[str, torch.Tensor]] | None = None


def _plan(store: CheckpointerStore, ref: SaveRef, comp: str, limit: int | None, entry: str) -> _Planned:
    """Check the claim, read the header and allocate the tensors it describes.

    Runs on the thread that called :func:`read_tensors`, never in the read
    pool: glibc gives each thread its own malloc arena, and memory the caller
    freed (the state being replaced, a model's build) is reused only by
    allocations on the same thread. Allocated in the pool, every tensor was
    fresh memory, paid for in page faults: a restart's 240 MiB restore read in
    137 ms from the pool against 104 ms on the calling thread (median of 4
    fresh processes, docs/performance.md)."""
    size = store.component(ref, comp).size
    err = _claim_error(ref, comp, size, limit, entry)
    if err is not None:
        raise err
    try:
        head = _read_head(store, ref, comp, size)
        _start, entries = parse_layout(head, size)
    except (CorruptionError, NotFoundError):
        return _Planned(comp, size)
    try:  # the entries tile size - start bytes: the allocation is the claim, bounded by the caller
        tensors = [(name, torch.empty(shape, dtype=dtype)) for name, dtype, shape, _b, _e in entries]
    except (MemoryError, OSError, RuntimeError) as exc:
        raise _no_memory(ref, comp, size, exc) from None
    return _Planned(comp, size, head, tensors)


def _read_scattered(store: CheckpointerStore, ref: SaveRef, plan: _Planned) -> dict[str, torch.Tensor] | None:
    """The component read straight into its planned tensors (see the module
    docstring); None when the verified header differs from the one read first."""
    assert plan.head is not None and plan.tensors is not None
    start = len(plan.head)
    header = bytearray(start)
    store.read_into(ref, plan.comp, [header, *(_bytes_of(t) for _n, t in plan.tensors if t.numel())])
    if header != plan.head:
        return None
    for name, t in plan.tensors:
        check_bools(name, t)
    return dict(plan.tensors)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def _fill(store: CheckpointerStore, ref: SaveRef, plan: _Planned, limit: int | None, entry: str) -> dict[str, torch.Tensor]:
    """Read a planned component: scattered into its tensors, else (no usable
    header, or the verified one differs) into one fresh buffer, parsed after it verified."""
    if plan.tensors is not None:
        out = _read_scattered(store, ref, plan)
        if out is not None:
            return out
        plan.tensors = None  # the header changed under us: drop the tensors before the buffer is allocated
    buf = _allocate(ref, plan.comp, plan.size, limit, entry)
    store.read_into(ref, plan.comp, buf.numpy())
    return tensors_from_buffer(buf)


def _read_one(store: CheckpointerStore, ref: SaveRef, comp: str, limit: int | None, entry: str) -> dict[str, torch.Tensor]:
    return _fill(store, ref, _plan(store, ref, comp, limit, entry), limit, entry)


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
            err = _claim_error(ref, comp, store.component(ref, comp).size, bound[name], name)
            if err is not None:
                raise err
    plans = {name: _plan(store, ref, comp, bound.get(name), name) for name, comp in items}  # this thread (_plan)
    with ThreadPoolExecutor(min(MAX_PARALLEL, len(items)), thread_name_prefix="ckptstore-read") as pool:
        futures = {name: pool.submit(_fill, store, ref, plan, bound.get(name), name) for name, plan in plans.items()}
        return {name: fut.result() for name, fut in futures.items()}
