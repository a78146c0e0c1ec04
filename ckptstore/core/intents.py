"""Save intents and the timing every writer and gc of a run agree on
(PROTOCOL.md §9.3-9.4): :class:`PieceTiming`, the intent a writer holds
(:class:`Intent`), and reading a run's intents for gc (:func:`list_intents`),
bounded and strict. Writing and renewing a writer's intent is the piece
writer's (:class:`ckptstore.core.pieces.PieceWriter`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import CorruptionError, LimitReachedError
from ..protocol.layout import intents_prefix, parse_intent_key
from ..protocol.records import MAX_INTENT_RECORD, IntentRecord
from .bounded_io import RunIO

#: An intent older than this share of its lifetime is renewed before a save relies on it.
RENEW_SHARE = 0.5


@dataclass(frozen=True)
class PieceTiming:
    """The two times every writer and gc of a run must agree on (§9.4).

    ``window``: a gc deletes pieces only within ``window / 2`` of listing the
    intents; a writer relies on its intent only ``window`` after creating it.
    ``intent_ttl``: how long an intent lives; gc's grace period must be at
    least this long (gc refuses to sweep otherwise).
    """

    window: float = 2.0
    intent_ttl: float = 3600.0
    #: the wall clock (epoch seconds) intents are dated and judged by, and gc
    #: ages pieces by; every writer and gc of a run must agree on it to well
    #: within ``window`` (§9.5 "Assumptions"). Tests inject one to decide races
    #: without waiting.
    clock: Callable[[], float] = time.time
    #: how a writer waits for its intent to be ``window`` old (§9.4 step 2); tests inject one to
    #: see which saves wait, without waiting
    sleep: Callable[[float], None] = time.sleep


# --------------------------------------------------------------------- intents
@dataclass
class Intent:
    """The writer's current save intent: what it names and when it landed."""

    key: str
    record: IntentRecord
    #: ``time.monotonic()`` when its create returned (it was visible by then)
    landed: float

    @property
    def names(self) -> frozenset[tuple[str, str]]:
        return frozenset(self.record.pieces)


#: Save intents one gc reads at most, and their listed bytes in all (§9.5 step 4): past
#: either, the sweep is refused with the reason (a writer keeps one or two intents; a
#: 1 TB model's intent names ~130,000 pieces in ~18 MiB).
MAX_INTENTS = 4096
MAX_INTENT_BYTES = 64 << 20


@dataclass
class IntentCache:
    """The intents one gc read, by key, each with the (size, mtime, version) its
    listing showed: a later round of the same sweep reads an intent again only
    when its listing changed (§9.5 step 4)."""

    items: dict[str, tuple[tuple[int, float, str], IntentRecord]] = field(default_factory=dict)
    #: intent bytes read by this cache's owner in all
    bytes_read: int = 0
    #: intents read (not served from the cache)
    reads: int = 0


def list_intents(io: RunIO, cache: IntentCache | None = None, *, max_count: int = MAX_INTENTS,
                 max_bytes: int = MAX_INTENT_BYTES) -> tuple[dict[str, IntentRecord], list[str]]:
    """Every intent record of the run (key -> record) and the keys that could
    not be read. With ``cache``, an intent whose listing shows the same size
    time and version as when it was read is not read again. More than ``max_count``
    intents, or more than ``max_bytes`` listed bytes of them: :class:`LimitReachedError`
    (nothing is read past the listing)."""
    cache = cache if cache is not None else IntentCache()
    good: dict[str, IntentRecord] = {}
    bad: list[str] = []
    listed = [o for o in io.list(intents_prefix(io.run_id), flat=True) if parse_intent_key(io.run_id, o.key) is not None]
    total = sum(o.size for o in listed)
    if len(listed) > max_count or total > max_bytes:
        raise LimitReachedError(
            f"{intents_prefix(io.run_id)}: {len(listed)} save intent(s) of {total} bytes, more than gc reads "
            f"({max_count} intents, {max_bytes} bytes); a writer keeps one or two: remove the ones no live "
            "writer made (ckptstore ls shows the run's attempts)")
    fresh = [o for o in listed if (c := cache.items.get(o.key)) is None or c[0] != (o.size, o.mtime, o.version)]
    for o in listed:
        c = cache.items.get(o.key)
        if c is not None and c[0] == (o.size, o.mtime, o.version):
            good[o.key] = c[1]
    datas = io.get_many_bounded([o.key for o in fresh], MAX_INTENT_RECORD, [o.size for o in fresh]) if fresh else []
    for o, data in zip(fresh, datas, strict=True):
        if data is None:
            continue  # removed since the listing: it protects nothing any more
        cache.reads += 1
        cache.bytes_read += len(data)
        try:
            rec = IntentRecord.decode(data, io.where(o.key), run_id=io.run_id,
                                      attempt=parse_intent_key(io.run_id, o.key))
        except CorruptionError as exc:
            bad.append(f"{o.key}: {str(exc)[:200]}")
            continue
        good[o.key] = rec
        cache.items[o.key] = ((o.size, o.mtime, o.version), rec)
    gone = set(cache.items) - {o.key for o in listed}
    for key in gone:
        del cache.items[key]
    return good, bad
