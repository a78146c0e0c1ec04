"""Which commit records a run has, by name (PROTOCOL.md §1.1, §4.4): newest
first, all of them, or those of one step. Names only — what a record says is
the catalog's business.

On a version-2 run the names sort newest first, so the newest candidates are
the first keys of the ``commits/`` listing: on an object store that is one
request whatever the length of the history (small pages first, larger ones
only when the walk goes on). A version-1 run names its commits oldest first:
its candidates are known only after the whole prefix was listed (names only).

Keys under ``commits/`` that do not parse as a commit name of the run's layout
are not ckptstore's: skipped, counted in :attr:`CommitKeys.junk`, never read.
They cost listing only (a thousand of them one more request at most), never a
record read, and cannot hide a real commit: paging goes on past them. The one
exception is a name of *another version's* pattern (a version-1 name in a
version-2 run, or the reverse): that is history a writer of the other naming
left, so it is never junk but kept in :attr:`CommitKeys.other` — the catalog
keeps its save and refuses to select or collect over it when nothing of the
run's own naming can be selected (the run record was edited, THREATS.md §4.13).

The prefix is flat (PROTOCOL.md §1.1): it is listed one level, so folders
planted under it (a chain thousands deep) are neither walked nor counted.

The walk relies on the listing's order for the names it parses (fixed width,
one folder: byte order and an S3 server's folder-by-folder order agree), and
checks it: a name out of order, or a page that does not advance, is an error
(:class:`StoreUnavailableError`), never a silently older selection.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..backends.base import ObjectInfo
from ..errors import StoreUnavailableError
from ..protocol import commits_prefix
from ..protocol.layout import history_name
from .bounded_io import RunIO

#: Keys asked for by the first listing request of a paged walk (most
#: selections stop at the newest commit), then pages grow 8x up to PAGE.
FIRST_PAGE = 16
PAGE = 1000


class CommitKeys:
    """The commit-record names of one run, through its layout."""

    def __init__(self, io: RunIO) -> None:
        self.io = io
        self.prefix = commits_prefix(io.run_id)
        #: names under ``commits/`` that did not parse, seen by the last walk
        self.junk = 0
        #: (step, attempt) -> key of the names of another version's pattern seen by the last walk
        self.other: dict[tuple[int, int], str] = {}

    def _reset(self) -> None:
        self.junk = 0
        self.other = {}

    def _parse(self, key: str) -> tuple[int, int] | None:
        sa = self.io.layout.commit_of_key(self.io.run_id, key)  # the canonical key only, never a twin
        if sa is None:
            hist = history_name(key[len(self.prefix) :]) if key.startswith(self.prefix) else None
            if hist is not None and hist[0].newest_first != self.io.layout.newest_first:
                self.other.setdefault((hist[1], hist[2]), key)  # history of the other naming, not junk
            else:
                self.junk += 1
        return sa

    def _pages(self, start_after: str) -> Iterator[list[str]]:
        """Keys after ``start_after``, ascending, a page at a time as the
        caller goes on (stop iterating and no further page is asked for)."""
        if not self.io.backend.capabilities.list_pages:
            yield self.io.list_keys(self.prefix, start_after=start_after, flat=True)
            return
        size = FIRST_PAGE
        while True:
            keys = self.io.list_keys(self.prefix, start_after=start_after, limit=size, flat=True)
            yield keys
            if len(keys) < size:
                return
            if keys[-1] == start_after:
                raise self._disorder(f"a listing after {start_after!r} returned it again")
            start_after, size = keys[-1], min(PAGE, size * 8)

    def _disorder(self, what: str) -> StoreUnavailableError:
        return StoreUnavailableError(
            f"{self.io.where(self.prefix)}: the backend's listing is out of order ({what[:300]}); "
            "refusing to select from it"
        )

    def newest_first(self) -> Iterator[tuple[int, int]]:
        """(step, attempt) of every commit, newest first (by step, then attempt)."""
        self._reset()
        if not self.io.layout.newest_first:
            # every name listed first; names are of fixed width, so in descending
            # byte order (sorted here, not trusted) they come newest first
            for k in sorted(self.io.list_keys(self.prefix, flat=True), reverse=True):
                sa = self._parse(k)
                if sa is not None:
                    yield sa
            return
        # The whole page is checked before any of it is tried (a candidate listed
        # out of place must not be taken for the newest): every key shaped like a
        # name (its length, no '/') must sort after the one before it, which for
        # names of this layout is newest first. Parsing then goes only as far
        # as the caller does.
        width = len(self.prefix) + self.io.layout.name_length
        last = ""
        for page in self._pages(""):
            for k in page:
                if len(k) == width and "/" not in k[len(self.prefix) :]:
                    if k <= last:
                        raise self._disorder(f"{k[-60:]!r} listed after {last[-60:]!r}")
                    last = k
            for k in page:
                sa = self._parse(k)
                if sa is not None:
                    yield sa

    def attempts_of(self, step: int) -> list[int]:
        """The attempts that committed ``step``, highest first: one listing
        request on either layout (the names of a step are contiguous)."""
        self._reset()
        start = self.prefix + self.io.layout.step_prefix(step)
        found: list[int] = []
        for page in self._pages(start[:-1]):
            for key in page:
                if key < start:
                    continue  # sorts between the step's digits and its names: not a name of ours
                if not key.startswith(start):
                    return sorted(found, reverse=True)
                sa = self._parse(key)
                if sa is not None and sa[0] == step:
                    found.append(sa[1])
        return sorted(found, reverse=True)

    def listed(self) -> dict[tuple[int, int], ObjectInfo]:
        """Every commit with its listing entry (size, time): one full listing."""
        self._reset()
        out: dict[tuple[int, int], ObjectInfo] = {}
        for o in self.io.list(self.prefix, flat=True):
            sa = self._parse(o.key)
            if sa is not None:
                out[sa] = o
        return out
