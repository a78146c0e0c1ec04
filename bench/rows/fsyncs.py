"""Row 10: fsyncs per save (issue 32 item 1), by protocol version, on the local disk.

Counts every ``os.fsync`` / ``os.fdatasync`` (and the files created, renames,
links, directories made) issued while one save runs — a Checkpointer sync save
of the torch state of the other rows, and a plain ``CheckpointStore.save`` of
one component — for protocol versions 2 and 3, each attributed to its call
site. The floor is safetensors ``save_file`` + fsync of the file and its
directory. A busy (shared, cloud) disk charges per fsync, so the count is the
measure; the seconds of the same saves are a second row.

    python -m bench.rows.fsyncs [--size 256M] [--repeat 3]   # the table by call site

Counting wraps the ``os`` functions in this process (the backend calls them
through ``os``), so threads are counted too; a pool thread's call is named by
its thread (``ckptstore-fsync``: ``LocalBackend.settle``). The intent write a
version-3 save starts in the background after its commit is waited for and
counted with that save. ``tests/store/test_fsync_count.py`` pins the counts.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import ckptstore  # noqa: E402
from bench import torchstate as ts  # noqa: E402
from bench.common import IDENTITY, Config, Measure, Row, human, interleave, parse_size, rm, scratch, sync  # noqa: E402
from ckptstore import CheckpointStore, OpenOptions  # noqa: E402
from ckptstore.core.intents import PieceTiming  # noqa: E402
from ckptstore.torch import Checkpointer  # noqa: E402

PKG = os.path.dirname(os.path.abspath(ckptstore.__file__)) + os.sep
#: frames that only carry a call down to the system (the site is the caller above them)
_PLUMBING = ("backends/posix.py", "util/files.py", "backends/local.py", "core/bounded_io.py", "retry.py")
KINDS = ("fsync file", "fsync dir", "fdatasync", "create", "rename", "link", "mkdir")
_NAMES = [(re.compile(r"\d{12}-\d{8}-[0-9a-f]{12}"), "<save>"), (re.compile(r"[0-9a-f]{64}"), "<digest>"),
          (re.compile(r"\.[^/]*\.ckpt-tmp-[0-9a-f]+$"), ".<tmp>"), (re.compile(r"\d{8}-[0-9a-f]{12}\.json"), "<intent>"),
          (re.compile(r"\d{20}-[a-z-]+-[0-9a-f]{8}\.json"), "<event>"), (re.compile(r"\d{12}\.\d{8}-\d{12}\.\d{8}\.json"),
                                                                         "<commit>")]


def _site() -> str:
    """The innermost ckptstore frame that is not plumbing, and the backend frame below it."""
    f = sys._getframe(3)
    backend = ""
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(PKG):
            rel = name[len(PKG):]
            if rel.endswith("backends/local.py") and not backend:
                backend = f"local.{f.f_code.co_name}"
            if not rel.endswith(_PLUMBING):
                where = f"{rel}:{f.f_code.co_name}"
                return f"{where} ({backend})" if backend else where
        f = f.f_back
    t = re.sub(r"_\d+$", "", threading.current_thread().name)
    return f"thread {t}" + (f" ({backend})" if backend else "")


def _what(fd: int, root: str) -> str:
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"
    rel = os.path.relpath(path, root) if path.startswith(root) else os.path.basename(path)
    for pat, sub in _NAMES:
        rel = pat.sub(sub, rel)
    return rel


class Counter:
    """Counts the ``os`` calls of a save while :meth:`on` is active (all threads)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._lock = threading.Lock()
        self._active = False

    def _rec(self, kind: str, what: str = "") -> None:
        if self._active:
            site = _site()
            with self._lock:
                self.counts[(kind, site, what)] += 1

    @contextmanager
    def installed(self) -> Iterator[Counter]:
        real = {n: getattr(os, n) for n in ("fsync", "fdatasync", "open", "rename", "link", "mkdir")}

        def fsync(fd: int) -> None:
            try:
                d = stat.S_ISDIR(os.fstat(fd).st_mode)
            except OSError:
                d = False
            self._rec("fsync dir" if d else "fsync file", _what(fd, self.root))
            real["fsync"](fd)

        def fdatasync(fd: int) -> None:
            self._rec("fdatasync", _what(fd, self.root))
            real["fdatasync"](fd)

        def open_(path: Any, flags: int, *a: Any, **k: Any) -> int:
            if flags & os.O_CREAT:
                self._rec("create")
            return int(real["open"](path, flags, *a, **k))

        def wrap(name: str) -> Callable[..., Any]:
            def call(*a: Any, **k: Any) -> Any:
                self._rec(name)
                return real[name](*a, **k)
            return call

        patched = {"fsync": fsync, "fdatasync": fdatasync, "open": open_, "rename": wrap("rename"),
                   "link": wrap("link"), "mkdir": wrap("mkdir")}
        for n, fn in patched.items():
            setattr(os, n, fn)
        try:
            yield self
        finally:
            for n, fn in real.items():
                setattr(os, n, fn)

    @contextmanager
    def on(self) -> Iterator[None]:
        self._active = True
        try:
            yield
        finally:
            _join_background()
            self._active = False

    def total(self, *kinds: str) -> int:
        return sum(n for (k, _s, _w), n in self.counts.items() if k in kinds)

    def fsyncs(self) -> int:
        return self.total("fsync file", "fsync dir", "fdatasync")


def _join_background() -> None:
    """Wait for the intent write a version-3 save starts after its commit (it belongs to that save)."""
    for t in threading.enumerate():
        if t.name == "ckptstore-intent":
            t.join()


# ------------------------------------------------------------------ the saves counted


def _open(d: str, version: int, run: str) -> CheckpointStore:
    return CheckpointStore.open(os.path.join(d, "store"), run, identity=IDENTITY,
                                options=OpenOptions(protocol_version=version))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Full fine-tuning: every parameter and both Adam moments change."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    for p in model.parameters():
        p.grad = None


def count_saves(d: str, size: int, repeat: int = 1) -> dict[str, list[Counter]]:
    """Per contender: one Counter per counted save (after one save that is not
    counted, so a version-3 save has an intent and pieces to skip)."""
    model, opt = ts.build(size)
    buf = bytearray(os.urandom(size))  # no two pieces alike
    data = memoryview(buf)
    out: dict[str, list[Counter]] = {}
    for version in (2, 3):
        st = _open(d, version, f"ck-v{version}")
        ck = Checkpointer(st, {"model": model, "optimizer": opt}, async_save=False, handle_signals=False)
        runs = out.setdefault(f"Checkpointer.save v{version}", [])
        for step in range(repeat + 1):
            _step(model, opt)
            c = Counter(d)
            with c.installed(), c.on():
                ck.save(step)
            if step:
                runs.append(c)
        ck.close()
        st.close()
        st = _open(d, version, f"plain-v{version}")
        runs = out.setdefault(f"CheckpointStore.save v{version}", [])
        for step in range(repeat + 1):
            buf[:: 1 << 20] = bytes([step % 256]) * len(buf[:: 1 << 20])  # every piece changes
            c = Counter(d)
            with c.installed(), c.on(), st.save(step) as s:
                s.put("model", data)
            if step:
                runs.append(c)
        st.close()
    runs = out.setdefault("safetensors save_file+fsync", [])
    for r in range(repeat):
        c = Counter(d)
        p = os.path.join(d, f"st-{r}.safetensors")
        with c.installed(), c.on():
            ts.safetensors_save(p, model, opt)
        os.unlink(p)
        runs.append(c)
    return out


def table(counted: dict[str, list[Counter]]) -> str:
    """The calls of each contender's last counted save, by call site."""
    lines = []
    for label, cs in counted.items():
        c = cs[-1]
        lines.append(f"== {label}: {c.fsyncs()} fsyncs, {c.total('create')} files created, "
                     f"{c.total('rename')} renames, {c.total('link')} links, {c.total('mkdir')} mkdirs, "
                     f"{c.total('fsync dir')} directory fsyncs")
        for (kind, site, what), n in sorted(c.counts.items(), key=lambda x: (KINDS.index(x[0][0]), x[0][1], x[0][2])):
            lines.append(f"  {n:4d}  {kind:10s}  {site:55s}  {what}")
    return "\n".join(lines)


def run(cfg: Config) -> list[Row]:
    size = min(cfg.size, 64 << 20) if cfg.quick else cfg.size
    with scratch(cfg.disk_dir, "bench-row10-") as d:
        counted = count_saves(d, size, max(1, min(cfg.repeat, 3)))
        times = time_saves(d, size, cfg.repeat)
    floor = Measure("safetensors save_file+fsync", [float(c.fsyncs()) for c in counted.pop("safetensors save_file+fsync")])
    rows = [Row("11", f"fsyncs per save, {human(size)} torch state (Linear+Adam, every tensor changed), local disk",
                "fsyncs", floor, [Measure(k, [float(c.fsyncs()) for c in v]) for k, v in counted.items()],
                {"bytes": size},
                ["counted by wrapping os.fsync/os.fdatasync in the process; `python -m bench.rows.fsyncs` prints them "
                 "by call site; version 3 writes one piece file per 8 MiB of changed bytes"])]
    tfloor = Measure("raw write+fsync", times.pop("raw write+fsync"))
    rows.append(Row("11b", f"sync save time by protocol version, {human(size)} torch state, local disk", "s", tfloor,
                    [Measure(k, v) for k, v in times.items()], {"bytes": size}))
    return rows


def time_saves(d: str, size: int, repeat: int) -> dict[str, list[float]]:
    """Seconds of a Checkpointer sync save in each version (every tensor changed), interleaved; a
    version-3 save comes at least the piece window after the previous one (as after a training
    step), so it does not wait for its intent (docs/incremental.md)."""
    model, opt = ts.build(size)
    stores = {v: _open(d, v, f"time-v{v}") for v in (2, 3)}
    cks = {v: Checkpointer(st, {"model": model, "optimizer": opt}, async_save=False, handle_signals=False)
           for v, st in stores.items()}

    def ours(v: int) -> Callable[[int], float]:
        def go(r: int) -> float:
            _step(model, opt)
            if v == 3:  # training time between saves, at least the window: the intent is old enough (§9.4)
                time.sleep(PieceTiming().window)
            sync()
            t = time.perf_counter()
            cks[v].save(r + 1)
            dt = time.perf_counter() - t
            _join_background()
            stores[v].gc(keep_last=1, grace_seconds=0, deep=False)
            return dt
        return go

    def raw(r: int) -> float:
        p = os.path.join(d, f"raw-{r}")
        sync()
        t = time.perf_counter()
        ts.raw_save(p, model, opt)
        dt = time.perf_counter() - t
        rm(p)
        return dt

    res = interleave({"raw write+fsync": raw, "Checkpointer.save v2": ours(2), "Checkpointer.save v3": ours(3)},
                     repeat, warmup=1)
    for v in (2, 3):
        cks[v].close()
        stores[v].close()
    return {k: v for k, v in res.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256M")
    ap.add_argument("--repeat", type=int, default=1, help="saves counted per contender (the table shows the last)")
    ap.add_argument("--time", type=int, default=0, help="also time this many interleaved rounds of each version")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args(argv)
    import tempfile

    with scratch(a.dir or tempfile.gettempdir(), "bench-fsyncs-") as d:
        print(table(count_saves(d, parse_size(a.size), a.repeat)))
        if a.time:
            for k, v in time_saves(d, parse_size(a.size), a.time).items():
                print(f"{k:24s} median {sorted(v)[len(v) // 2]:.3f} s  ({', '.join(f'{x:.3f}' for x in v)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
