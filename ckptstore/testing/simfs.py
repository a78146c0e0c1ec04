"""A simulated POSIX filesystem with power loss, for the local backend's ``ops``.

In the style of LevelDB/RocksDB's fault-injection env and LazyFS: file data and
directory entries each have a *volatile* state (what the running process sees)
and a *durable* state (what survives a power loss). ``fsync(fd)`` makes a
file's data durable; ``fsync_dir(path)`` makes a directory's entries durable.
Nothing else does.

``SimFS.crash_states()`` enumerates the filesystems a power loss may leave:
every un-synced directory-entry change is independently kept or lost, and
every file whose data was not fsynced keeps its durable data, all of its
volatile data, or a torn prefix. A directory whose own entry was lost takes
its subtree with it. Up to ``limit`` states are enumerated exhaustively;
beyond that, a seeded sample is drawn.

``crash_after`` makes the N-th mutating system call raise
:class:`~ckptstore.backends.faults.Crashed` before it takes effect, so the
moment of the power loss can be every syscall boundary of a save.
"""

from __future__ import annotations

import copy
import itertools
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ..backends.base import MAX_KEY_DEPTH, too_deep
from ..backends.faults import Crashed
from ..backends.local import PosixOps

Entry = tuple[str, object]  # ("f", ino) | ("d", path)

@dataclass
class _Inode:
    data: bytearray = field(default_factory=bytearray)
    durable: bytes = b""


@dataclass
class _Dir:
    vol: dict[str, Entry] = field(default_factory=dict)
    dur: dict[str, Entry] = field(default_factory=dict)


class SimFS(PosixOps):
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.inodes: dict[int, _Inode] = {}
        self.dirs: dict[str, _Dir] = {self.root: _Dir()}
        self.fds: dict[int, int] = {}
        self._next = 1
        self.ops = 0
        self.crash_at: int | None = None
        self.log: list[str] = []
        self.clock = 1_000_000.0

    # -- crash scheduling --------------------------------------------------
    def crash_after(self, n: int | None) -> None:
        """The ``n``-th mutating call from now raises Crashed before its effect."""
        self.crash_at = None if n is None else self.ops + n

    def _tick(self, what: str) -> None:
        self.ops += 1
        if self.crash_at is not None and self.ops >= self.crash_at:
            self.log.append(f"#{self.ops} {what}: POWER LOSS")
            raise Crashed(f"power loss at syscall #{self.ops} ({what})")
        self.log.append(f"#{self.ops} {what}")

    # -- lookup ------------------------------------------------------------
    def _split(self, path: str) -> tuple[_Dir, str]:
        parent, name = os.path.split(os.path.abspath(path))
        d = self.dirs.get(parent)
        if d is None or not self._reachable(parent):
            raise FileNotFoundError(2, "No such file or directory", parent)
        return d, name

    def _reachable(self, path: str) -> bool:
        if path == self.root:
            return True
        parent, name = os.path.split(path)
        d = self.dirs.get(parent)
        return d is not None and d.vol.get(name) == ("d", path) and self._reachable(parent)

    def _entry(self, path: str) -> Entry | None:
        path = os.path.abspath(path)
        if path == self.root:
            return ("d", self.root)
        try:
            d, name = self._split(path)
        except FileNotFoundError:
            return None
        return d.vol.get(name)

    def _ino(self, path: str) -> _Inode:
        e = self._entry(path)
        if e is None:
            raise FileNotFoundError(2, "No such file or directory", path)
        if e[0] != "f":
            raise IsADirectoryError(21, "Is a directory", path)
        return self.inodes[e[1]]  # type: ignore[index]

    # -- mutating ops --------------------------------------------------------
    def open_new(self, path: str) -> int:
        self._tick(f"open_new {path}")
        d, name = self._split(path)
        if name in d.vol:
            raise FileExistsError(17, "File exists", path)
        ino = self._next
        self._next += 1
        self.inodes[ino] = _Inode()
        d.vol[name] = ("f", ino)
        self.fds[ino] = ino
        return ino

    def write(self, fd: int, buf: object) -> None:
        self._tick(f"write fd{fd} {len(memoryview(buf))}B")  # type: ignore[arg-type]
        self.inodes[fd].data += bytes(memoryview(buf))  # type: ignore[arg-type]

    def fsync(self, fd: int) -> None:
        self._tick(f"fsync fd{fd}")
        ino = self.inodes[fd]
        ino.durable = bytes(ino.data)

    def close(self, fd: int) -> None:
        self.fds.pop(fd, None)

    def rename(self, src: str, dst: str) -> None:
        self._tick(f"rename {src} -> {dst}")
        sd, sn = self._split(src)
        dd, dn = self._split(dst)
        if sn not in sd.vol:
            raise FileNotFoundError(2, "No such file", src)
        dd.vol[dn] = sd.vol.pop(sn)

    def link(self, src: str, dst: str) -> None:
        self._tick(f"link {src} -> {dst}")
        sd, sn = self._split(src)
        dd, dn = self._split(dst)
        if dn in dd.vol:
            raise FileExistsError(17, "File exists", dst)
        if sn not in sd.vol:
            raise FileNotFoundError(2, "No such file", src)
        dd.vol[dn] = sd.vol[sn]

    def unlink(self, path: str) -> None:
        self._tick(f"unlink {path}")
        d, name = self._split(path)
        e = d.vol.get(name)
        if e is None:
            raise FileNotFoundError(2, "No such file", path)
        if e[0] != "f":
            raise IsADirectoryError(21, "Is a directory", path)
        del d.vol[name]

    def mkdir(self, path: str) -> None:
        self._tick(f"mkdir {path}")
        path = os.path.abspath(path)
        d, name = self._split(path)
        if name in d.vol:
            raise FileExistsError(17, "File exists", path)
        d.vol[name] = ("d", path)
        self.dirs[path] = _Dir()

    def rmdir(self, path: str) -> None:
        self._tick(f"rmdir {path}")
        path = os.path.abspath(path)
        if self.dirs.get(path) is None or self.dirs[path].vol:
            raise OSError(39, "Directory not empty", path)
        d, name = self._split(path)
        d.vol.pop(name, None)

    def fsync_dir(self, path: str) -> None:
        self._tick(f"fsync_dir {path}")
        path = os.path.abspath(path)
        self.dirs[path].dur = dict(self.dirs[path].vol)

    # -- reading ops -------------------------------------------------------
    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        data = bytes(self._ino(path).data)
        return data[start:] if end is None else data[start:end]

    def readinto(self, path: str, start: int, out: memoryview) -> int:
        data = self.read(path, start, start + len(out))
        out[: len(data)] = data
        return len(data)

    def stat(self, path: str) -> tuple[int, float]:
        return len(self._ino(path).data), self.clock

    def is_dir(self, path: str) -> bool:
        e = self._entry(path)
        return e is not None and e[0] == "d"

    def exists(self, path: str) -> bool:
        return self._entry(path) is not None

    def walk(
        self, top: str, *, descend: bool = True, max_depth: int = MAX_KEY_DEPTH, prune_deep: bool = False
    ) -> Iterator[tuple[str, list[str], list[str]]]:
        top = os.path.abspath(top)
        if not self.is_dir(top):
            return
        todo: list[tuple[str, int]] = [(top, 0)]  # depth first, top down, without recursion
        while todo:
            path, depth = todo.pop()
            if not self.is_dir(path):
                continue
            d = self.dirs[path]
            subdirs = sorted(n for n, e in d.vol.items() if e[0] == "d")
            files = sorted(n for n, e in d.vol.items() if e[0] == "f")
            yield path, subdirs, files
            if not descend:
                return
            if subdirs and depth >= max_depth:
                if prune_deep:
                    continue
                raise too_deep(top, os.path.join(path, subdirs[0]))
            todo += [(os.path.join(path, s), depth + 1) for s in reversed(subdirs)]

    # -- durability --------------------------------------------------------
    def sync_all(self) -> None:
        """Make everything durable (set-up before the window under test)."""
        for ino in self.inodes.values():
            ino.durable = bytes(ino.data)
        for d in self.dirs.values():
            d.dur = dict(d.vol)

    def _decisions(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for path, d in sorted(self.dirs.items()):
            for name in sorted(set(d.vol) | set(d.dur)):
                if d.vol.get(name) != d.dur.get(name):
                    out.append(("entry", (path, name)))
        for ino_id, ino in sorted(self.inodes.items()):
            if bytes(ino.data) != ino.durable:
                out.append(("data", ino_id))
        return out

    def crash_states(self, limit: int = 512, seed: int = 0) -> Iterable[tuple[str, SimFS]]:
        """Every filesystem a power loss may leave now (sampled beyond ``limit``)."""
        decisions = self._decisions()
        options = [(0, 1) if kind == "entry" else (0, 1, 2) for kind, _ in decisions]
        total = 1
        for o in options:
            total *= len(o)
        if total <= limit:
            combos: Iterable[tuple[int, ...]] = itertools.product(*options)
        else:
            rng = random.Random(seed)
            combos = [tuple(rng.choice(o) for o in options) for _ in range(limit)]
            combos = [tuple(0 for _ in options), tuple(o[-1] for o in options), *combos]
        for combo in combos:
            yield self._describe(decisions, combo), self._after(decisions, combo)

    def _describe(self, decisions: list[tuple[str, object]], combo: tuple[int, ...]) -> str:
        parts = []
        for (kind, what), c in zip(decisions, combo, strict=True):
            if kind == "entry":
                parts.append(f"{'kept' if c else 'lost'} entry {what[1]} in {what[0]}")  # type: ignore[index]
            else:
                parts.append(f"ino{what}: {['durable data', 'all data', 'torn data'][c]}")
        return "; ".join(parts) or "nothing pending"

    def _after(self, decisions: list[tuple[str, object]], combo: tuple[int, ...]) -> SimFS:
        fs = SimFS(self.root)
        fs.inodes = {i: _Inode(bytearray(n.durable), n.durable) for i, n in self.inodes.items()}
        fs.dirs = {p: _Dir(dict(d.dur), dict(d.dur)) for p, d in self.dirs.items()}
        fs._next = self._next
        for (kind, what), c in zip(decisions, combo, strict=True):
            if kind == "entry":
                assert isinstance(what, tuple)
                path, name = str(what[0]), str(what[1])
                if c:
                    v = self.dirs[path].vol.get(name)
                    if v is None:
                        fs.dirs[path].vol.pop(name, None)
                    else:
                        fs.dirs[path].vol[name] = v
            else:
                src = self.inodes[what]  # type: ignore[index]
                if c == 1:
                    fs.inodes[what].data = bytearray(src.data)  # type: ignore[index]
                elif c == 2:
                    keep = len(src.durable) + (len(src.data) - len(src.durable)) // 2
                    fs.inodes[what].data = bytearray(src.data[:keep])  # type: ignore[index]
        for d in fs.dirs.values():
            d.dur = dict(d.vol)
        for ino in fs.inodes.values():
            ino.durable = bytes(ino.data)
        return fs

    def clone(self) -> SimFS:
        return copy.deepcopy(self)
