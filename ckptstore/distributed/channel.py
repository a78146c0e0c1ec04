"""Canonical-JSON messages between the ranks of a process group.

Every message is a JSON object encoded canonically (sorted keys, UTF-8) and
carried as bytes through the process group's rendezvous key-value store (the
c10d ``Store`` that ``init_process_group`` created). Nothing is pickled.

Why the store and not tensor collectives: every wait here has its own
deadline, and a gather that times out knows exactly which ranks did not
answer, so the error can name them. A collective on a group with a dead rank
only tells "connection closed" (or hangs until the group's timeout), and the
group is unusable afterwards.

Keys: ``ckptstore/<name>/<group>/<nonce>/<seq>/<what>/<rank>``. The store
may outlive the processes that wrote to it (under torchrun it is the elastic
agent's store, reused by every restarted generation of workers), so nothing
a process counts by itself can tell generations apart: ``nonce`` is 128
random bits drawn by the group's rank 0 when the channel is created and
broadcast to the group through the process group itself (one collective, at
open). Keys of earlier generations therefore never match; each rank deletes
its own keys of earlier generations (it records them under
``ckptstore/<name>/<group>/live/<rank>``) and its keys of finished exchanges,
where the store supports deletion. ``seq`` counts this channel's exchanges;
every rank performs the same exchanges in the same order (they are all
entered collectively), so the keys line up.

Liveness: every rank's channel beats (``.../<nonce>/beat/<rank>``, a counter
incremented every second by a daemon thread). A wait gives up on a rank
whose beat stopped for :attr:`Channel.dead_after` seconds (60; 5 once
:meth:`Channel.alert` was called, i.e. after a termination signal), and
:meth:`Channel.abandon` ends every wait at once (a process that is leaving).
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CkptStoreError, CorruptionError
from ..protocol.canonical import canonical_json, decode_json
from ..shims.torch_private import default_store

_POLL = 0.02
#: a gather's first pause after a message arrived (doubled up to _POLL while none does)
_POLL_FIRST = 0.0005
#: seconds between heartbeats
BEAT_INTERVAL = 1.0
#: a rank whose heartbeat stopped this long is dead (normal / after a termination signal)
DEAD_AFTER = 60.0
DEAD_AFTER_ALERT = 5.0
#: at most this many keys of a rank are recorded as live (older ones are deleted first)
_MAX_LIVE = 64
_MAX_LIVE_RECORD = 64 * 1024
#: the largest message a rank accepts from another (an inventory of many components fits)
MAX_MESSAGE_BYTES = 64 * 2**20

# The live keys of this process's channels, per key base and nonce (two
# channels of one process may share a base: the same run ID opened twice).
_LIVE: dict[str, dict[str, list[str]]] = {}
_LIVE_LOCK = threading.Lock()


class ChannelError(CkptStoreError):
    """A message exchange between ranks failed."""


class RanksFailedError(ChannelError):
    """Some ranks did not answer an exchange within its deadline."""

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class CoordinatorLostError(ChannelError):
    """The coordinator's answer did not arrive (it died, or the rendezvous
    store it hosts is gone)."""


def encode(payload: Mapping[str, Any]) -> bytes:
    """A message's bytes: the canonical JSON of :mod:`ckptstore.protocol.canonical`."""
    return canonical_json(dict(payload))


def decode(data: bytes) -> dict[str, Any]:
    """A message read from the rendezvous store, decoded with the strict, bounded
    decoder (at most :data:`MAX_MESSAGE_BYTES`); anything else is a :class:`ChannelError`."""
    try:
        obj = decode_json(data, where="message between ranks", max_bytes=MAX_MESSAGE_BYTES)
    except CorruptionError as exc:
        raise ChannelError(str(exc)) from None
    if not isinstance(obj, dict):
        raise ChannelError("message is not a JSON object")
    return obj


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def agree_nonce(group: dist.ProcessGroup | None, src: int) -> str:
    """128 random bits drawn by global rank ``src`` and broadcast to ``group``
    (collective: every member calls it)."""
    t = torch.zeros(2, dtype=torch.int64, device=collective_device(group))
    if dist.get_rank() == src:
        t[0], t[1] = secrets.randbits(63), secrets.randbits(63)
    try:
        dist.broadcast(t, src=src, group=group)
    except Exception as exc:  # noqa: BLE001 - DistBackendError, RuntimeError: the group failed
        raise ChannelError(
            f"cannot agree on a channel nonce through the process group ({type(exc).__name__}: {exc}); "
            "a rank is gone: restart the job"
        ) from None
    a, b = (int(x) for x in t.tolist())
    return f"{a:016x}{b:016x}"


def _parse_live(data: bytes, base: str) -> dict[str, list[str]]:
    """A stored live-key record, strictly: junk yields nothing to delete."""
    try:
        obj = decode_json(data, where="live-key record", max_bytes=_MAX_LIVE_RECORD)
    except CorruptionError:
        return {}
    if not isinstance(obj, dict):
        return {}
    out: dict[str, list[str]] = {}
    for nonce, keys in obj.items():
        if not (isinstance(nonce, str) and len(nonce) == 32 and isinstance(keys, list)) or len(keys) > _MAX_LIVE:
            return {}
        mine = f"{base}/{nonce}/"
        if not all(isinstance(k, str) and k.startswith(mine) and ".." not in k for k in keys):
            return {}
        out[nonce] = list(keys)
    return out


@dataclass(frozen=True)
class StoreCounters:
    """What one channel sent through the rendezvous store so far (a snapshot
    from :attr:`Channel.counters`; subtract two snapshots for one exchange).

    ``requests``: round trips to the store (set, get, check, wait, delete),
    heartbeats excluded; ``messages``: values set (each one message or
    live-key record); ``bytes_sent`` / ``bytes_received``: the values' bytes
    set and got (keys and framing not counted); ``beats``: heartbeat
    increments (one a second, from the beat thread)."""

    requests: int = 0
    messages: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    beats: int = 0

    def __sub__(self, other: StoreCounters) -> StoreCounters:
        return StoreCounters(self.requests - other.requests, self.messages - other.messages,
                             self.bytes_sent - other.bytes_sent, self.bytes_received - other.bytes_received,
                             self.beats - other.beats)


class _CountingStore:
    """The rendezvous store, with every call counted into :class:`StoreCounters`."""

    def __init__(self, store: Any) -> None:
        self._inner = store
        self._lock = threading.Lock()
        self._c = [0, 0, 0, 0, 0]  # requests, messages, bytes_sent, bytes_received, beats

    def _count(self, requests: int = 1, messages: int = 0, sent: int = 0, received: int = 0, beats: int = 0) -> None:
        with self._lock:
            c = self._c
            c[0] += requests
            c[1] += messages
            c[2] += sent
            c[3] += received
            c[4] += beats

    def snapshot(self) -> StoreCounters:
        with self._lock:
            return StoreCounters(*self._c)

    def set(self, key: str, value: bytes) -> None:
        self._count(messages=1, sent=len(value))
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        data: bytes = self._inner.get(key)
        self._count(received=len(data))
        return data

    def check(self, keys: list[str]) -> bool:
        self._count()
        return bool(self._inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self._count()
        self._inner.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        self._count(requests=0, beats=1)
        return int(self._inner.add(key, amount))

    def delete_key(self, key: str) -> bool:
        self._count()
        return bool(self._inner.delete_key(key))


class Channel:
    """JSON messages among the ranks of ``group`` (default: the world).

    Creating one is collective (every member of ``group`` creates it, in the
    same order): rank 0 of the group draws the nonce and broadcasts it."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: float = 600.0, name: str = "") -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise CkptStoreError("torch.distributed is not initialised: call init_process_group first")
        self.group = group
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.world_size = len(self.ranks)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise CkptStoreError("this process is not a member of the given process group")
        self.timeout = float(timeout)
        #: a rank whose heartbeat stopped this long is given up on (see :meth:`alert`)
        self.dead_after = DEAD_AFTER
        self._store = _CountingStore(default_store())
        gid = hashlib.sha1(",".join(map(str, self.ranks)).encode()).hexdigest()[:10]
        self.base = f"ckptstore/{name}/{gid}"
        self.nonce = agree_nonce(group, self.ranks[0])
        self.prefix = f"{self.base}/{self.nonce}"
        self._seq = 0
        self._mine: list[tuple[int, str]] = []  # (seq, key) of this rank's live keys
        self._abandoned = threading.Event()
        self._closed = threading.Event()
        self._beat_key = f"{self.prefix}/beat/{self.rank}"
        self._forget_earlier_generations()
        self._remember(-1, self._beat_key)
        self._beat()
        self._beater = threading.Thread(target=self._beat_loop, name="ckptstore-beat", daemon=True)
        self._beater.start()

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def counters(self) -> StoreCounters:
        """What this rank's channel sent and read through the rendezvous store so far."""
        return self._store.snapshot()

    def next(self) -> str:
        """A new exchange tag; every rank must call this in the same order.
        This rank's keys of the exchange before the previous one are deleted
        (every rank has finished it: it entered the previous one)."""
        self._seq += 1
        self._retire(self._seq - 2)
        return f"{self.prefix}/{self._seq}"

    # ------------------------------------------------------------ liveness
    def alert(self) -> None:
        """A termination signal arrived: give up on a silent rank after
        :data:`DEAD_AFTER_ALERT` seconds instead of :data:`DEAD_AFTER`."""
        self.dead_after = min(self.dead_after, DEAD_AFTER_ALERT)

    def abandon(self) -> None:
        """End every wait of this channel now (this process is leaving):
        waits raise as if the awaited ranks were dead."""
        self._abandoned.set()

    @property
    def abandoned(self) -> bool:
        return self._abandoned.is_set()

    def close(self) -> None:
        """Stop beating (the keys stay until the next generation deletes them)."""
        self._closed.set()

    def _beat(self) -> None:
        self._store.add(self._beat_key, 1)

    def _beat_loop(self) -> None:
        while not self._closed.wait(BEAT_INTERVAL):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone: nobody is listening any more
                return

    def _beats(self, ranks: Sequence[int]) -> dict[int, int]:
        out: dict[int, int] = {}
        for r in ranks:
            key = f"{self.prefix}/beat/{r}"
            with contextlib.suppress(Exception):
                if self._store.check([key]):
                    out[r] = int(self._store.get(key).decode("ascii"))
        return out

    # --------------------------------------------------------- key upkeep
    def _write_live(self) -> None:
        with _LIVE_LOCK:
            mine = _LIVE.setdefault(self.base, {})
            mine[self.nonce] = [k for _, k in self._mine]
            data = encode(mine)
        with contextlib.suppress(Exception):
            self._store.set(f"{self.base}/live/{self.rank}", data)

    def _remember(self, seq: int, key: str) -> None:
        self._mine.append((seq, key))
        if len(self._mine) > _MAX_LIVE:
            self._mine = [(s, k) for s, k in self._mine if s < 0 or s >= self._seq - 1]
        self._write_live()

    def _delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            try:
                self._store.delete_key(k)
            except Exception:  # noqa: BLE001 - this store cannot delete (or is gone): the keys are only ignored
                return

    def _retire(self, upto: int) -> None:
        old = [k for s, k in self._mine if 0 <= s <= upto]
        if not old:
            return
        self._mine = [(s, k) for s, k in self._mine if not 0 <= s <= upto]
        self._write_live()
        self._delete(old)

    def _forget_earlier_generations(self) -> None:
        """Delete this rank's keys that an earlier generation of workers left
        in a store that outlived it (never those of a channel of this process)."""
        key = f"{self.base}/live/{self.rank}"
        try:
            stored = _parse_live(self._store.get(key), self.base) if self._store.check([key]) else {}
        except Exception:  # noqa: BLE001 - nothing readable: nothing proven ours to delete
            return
        with _LIVE_LOCK:
            ours = set(_LIVE.get(self.base, {}))
        for nonce, keys in stored.items():
            if nonce not in ours and nonce != self.nonce:
                self._delete(keys)

    # -------------------------------------------------------------- primitives
    def _key(self, tag: str, what: str, rank: int | str) -> str:
        return f"{tag}/{what}/{rank}"

    def post(self, tag: str, what: str, payload: Mapping[str, Any]) -> None:
        """This rank's message ``what`` of exchange ``tag``."""
        key = self._key(tag, what, self.rank)
        try:
            self._store.set(key, encode(payload))
        except Exception as exc:
            raise CoordinatorLostError(f"rank {self.rank}: cannot reach the rendezvous store ({exc})") from exc
        seq = tag.rsplit("/", 1)[-1]
        self._remember(int(seq) if seq.isdigit() else 0, key)

    def _silent(self, ranks: Sequence[int], seen: dict[int, tuple[int, float]]) -> list[int]:
        """The ranks among ``ranks`` whose heartbeat stopped for ``dead_after`` s."""
        now = time.monotonic()
        beats = self._beats(ranks)
        dead = []
        for r in ranks:
            v = beats.get(r, 0)
            last = seen.get(r)
            if last is None or last[0] != v:
                seen[r] = (v, now)
            elif now - last[1] >= self.dead_after:
                dead.append(r)
        return dead

    def gather(
        self, tag: str, what: str, *, ranks: Sequence[int] | None = None, timeout: float | None = None
    ) -> dict[int, dict[str, Any]]:
        """Wait for message ``what`` from every rank (default: all). Raises
        :class:`RanksFailedError` naming the ranks missing at the deadline,
        whose heartbeat stopped, or all missing ones once :meth:`abandon` was called."""
        want = list(range(self.world_size)) if ranks is None else list(ranks)
        t = self.timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + t
        got: dict[int, dict[str, Any]] = {}
        seen: dict[int, tuple[int, float]] = {}
        next_beat_check = start
        arrived, pause = 0, _POLL_FIRST / 2
        while True:
            for r in want:
                if r in got:
                    continue
                key = self._key(tag, what, r)
                try:
                    if self._store.check([key]):
                        got[r] = decode(self._store.get(key))
                except ChannelError:
                    raise
                except Exception as exc:
                    raise CoordinatorLostError(f"rendezvous store unreachable ({exc})") from exc
            if len(got) == len(want):
                return got
            missing = [r for r in want if r not in got]
            now = time.monotonic()
            if self.abandoned:
                raise RanksFailedError(
                    f"rank {self.rank} stopped waiting for rank(s) {', '.join(map(str, missing))} ({what}): "
                    "this process is leaving", missing,
                )
            if now >= next_beat_check:
                next_beat_check = now + BEAT_INTERVAL / 2
                dead = self._silent([r for r in missing if r != self.rank], seen)
                if dead:
                    raise RanksFailedError(
                        f"rank(s) {', '.join(map(str, dead))} did not answer ({what}) and stopped beating for "
                        f"{self.dead_after:.0f}s (dead or hung)", dead,
                    )
            if now >= deadline:
                raise RanksFailedError(
                    f"rank(s) {', '.join(map(str, missing))} did not answer ({what}) within "
                    f"{t:.0f}s (dead, hung or much slower)",
                    missing,
                )
            # poll again soon after progress, backing off to the poll interval
            # while nothing arrives: ranks that finish together are seen within
            # a millisecond or two, not a whole interval later. (Not the
            # store's own wait: c10d logs two warning lines per timed-out wait.)
            if len(got) > arrived:
                arrived, pause = len(got), _POLL_FIRST
            else:
                pause = min(2 * pause, _POLL if now - start < 1.0 else 5 * _POLL)
            time.sleep(pause)

    def receive(self, tag: str, what: str, *, src: int = 0, timeout: float | None = None) -> dict[str, Any]:
        """Wait for rank ``src``'s message ``what`` (until the deadline, until
        ``src`` stops beating, or until :meth:`abandon`)."""
        key = self._key(tag, what, src)
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        seen: dict[int, tuple[int, float]] = {}
        while True:
            now = time.monotonic()
            # a short server-side wait: answers the moment the key is set, and
            # leaves the store client to the heartbeat in between
            with contextlib.suppress(Exception):
                self._store.wait([key], timedelta(seconds=max(0.01, min(BEAT_INTERVAL / 2, deadline - now))))
            try:
                if self._store.check([key]):
                    return decode(self._store.get(key))
            except ChannelError:
                raise
            except Exception as exc:
                raise CoordinatorLostError(
                    f"rank {self.rank}: no answer ({what}) from rank {src}: rendezvous store unreachable ({exc})"
                ) from exc
            if self.abandoned:
                raise CoordinatorLostError(
                    f"rank {self.rank} stopped waiting for rank {src} ({what}): this process is leaving"
                )
            if self._silent([src], seen):
                raise CoordinatorLostError(
                    f"rank {self.rank}: no answer ({what}) from rank {src}, which stopped beating for "
                    f"{self.dead_after:.0f}s (dead or hung)"
                )
            if time.monotonic() >= deadline:
                raise CoordinatorLostError(f"rank {self.rank}: no answer ({what}) from rank {src} within {t:.0f}s")

    def exchange_from_coordinator(
        self, tag: str, what: str, payload: Mapping[str, Any] | None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Coordinator: post ``payload``; everyone: return the coordinator's payload."""
        if self.is_coordinator:
            assert payload is not None
            self.post(tag, what, payload)
            return dict(payload)
        return self.receive(tag, what, timeout=timeout)
