"""Canonical-JSON messages between the ranks of a process group.

Every message is a JSON object encoded canonically (sorted keys, UTF-8) and
carried as bytes through the process group's rendezvous key-value store (the
c10d ``Store`` that ``init_process_group`` created). Nothing is pickled.

Why the store and not tensor collectives: every wait here has its own
deadline, and a gather that times out knows exactly which ranks did not
answer, so the error can name them. A collective on a group with a dead rank
only tells "connection closed" (or hangs until the group's timeout), and the
group is unusable afterwards.

Keys: ``ckptstore/<name>/<group>/<seq>/<what>/<rank>``. ``seq`` counts the
exchanges of every channel of this process with that name and group; every
rank performs the same exchanges in the same order (they are all entered
collectively), so the keys line up.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import CkptStoreError

_POLL = 0.02

# Exchange counters per key prefix, shared by every Channel of this process:
# two channels with the same name and group (the same run ID opened twice, or
# in two stores) continue one sequence, so their keys never collide. Every
# rank creates its channels and exchanges in the same order, so the numbers
# line up across ranks.
_SEQ: dict[str, int] = {}
_SEQ_LOCK = threading.Lock()


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
    return json.dumps(dict(payload), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def decode(data: bytes) -> dict[str, Any]:
    obj = json.loads(data.decode("utf-8"))
    if not isinstance(obj, dict):
        raise ChannelError("message is not a JSON object")
    return obj


class Channel:
    """JSON messages among the ranks of ``group`` (default: the world)."""

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
        self._store = dist.distributed_c10d._get_default_store()
        gid = hashlib.sha1(",".join(map(str, self.ranks)).encode()).hexdigest()[:10]
        self.prefix = f"ckptstore/{name}/{gid}"

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def next(self) -> str:
        """A new exchange tag; every rank must call this in the same order."""
        with _SEQ_LOCK:
            n = _SEQ[self.prefix] = _SEQ.get(self.prefix, 0) + 1
        return f"{self.prefix}/{n}"

    # -------------------------------------------------------------- primitives
    def _key(self, tag: str, what: str, rank: int | str) -> str:
        return f"{tag}/{what}/{rank}"

    def post(self, tag: str, what: str, payload: Mapping[str, Any]) -> None:
        """This rank's message ``what`` of exchange ``tag``."""
        try:
            self._store.set(self._key(tag, what, self.rank), encode(payload))  # type: ignore[arg-type]
        except Exception as exc:
            raise CoordinatorLostError(f"rank {self.rank}: cannot reach the rendezvous store ({exc})") from exc

    def gather(
        self, tag: str, what: str, *, ranks: Sequence[int] | None = None, timeout: float | None = None
    ) -> dict[int, dict[str, Any]]:
        """Wait for message ``what`` from every rank (default: all). Raises
        :class:`RanksFailedError` naming the ranks missing at the deadline."""
        want = list(range(self.world_size)) if ranks is None else list(ranks)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        got: dict[int, dict[str, Any]] = {}
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
            if time.monotonic() >= deadline:
                missing = [r for r in want if r not in got]
                raise RanksFailedError(
                    f"rank(s) {', '.join(map(str, missing))} did not answer ({what}) within "
                    f"{self.timeout if timeout is None else timeout:.0f}s (dead, hung or much slower)",
                    missing,
                )
            time.sleep(_POLL)

    def receive(self, tag: str, what: str, *, src: int = 0, timeout: float | None = None) -> dict[str, Any]:
        """Wait for rank ``src``'s message ``what``."""
        key = self._key(tag, what, src)
        t = self.timeout if timeout is None else timeout
        try:
            self._store.wait([key], timedelta(seconds=t))
            return decode(self._store.get(key))
        except ChannelError:
            raise
        except Exception as exc:
            raise CoordinatorLostError(
                f"rank {self.rank}: no answer ({what}) from rank {src} within {t:.0f}s ({exc})"
            ) from exc

    def exchange_from_coordinator(
        self, tag: str, what: str, payload: Mapping[str, Any] | None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Coordinator: post ``payload``; everyone: return the coordinator's payload."""
        if self.is_coordinator:
            assert payload is not None
            self.post(tag, what, payload)
            return dict(payload)
        return self.receive(tag, what, timeout=timeout)
