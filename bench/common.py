"""Shared machinery of the benchmark suite: timing, interleaving, medians, the
floor, cache control, the machine description and the JSON/Markdown output.

Every row measures ckptstore and its peers *in the same run*, interleaved
(ABAB..., the order rotated each round so nobody always goes first), and
reports medians and the ratio of each median to a floor measured in that same
run. On a shared, noisy machine the absolute seconds move; the ratios are
what the suite is for.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
MiB = 1 << 20
GiB = 1 << 30
IDENTITY = {"data_digest": "bench", "code_digest": "bench"}


# ------------------------------------------------------------------ configuration


@dataclass
class Config:
    size: int  # bytes of state per save/restore row
    repeat: int  # interleaved rounds per row (medians over these)
    disk_dir: str  # a directory on the local disk
    shm_dir: str  # a directory on tmpfs
    cold: bool  # whether drop_caches works (cold-cache resume rows)
    quick: bool = False
    histories: tuple[int, ...] = (100, 1000, 10000)
    s3: bool = True
    stem: str = "latest"  # results file names under bench/results/
    s3_max: int = 1000  # longest history copied into moto (10,000 takes minutes)
    world_sizes: tuple[int, ...] = (2, 4, 8, 16)  # rank counts of the coordination row


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": MiB, "G": GiB}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


def human(n: float) -> str:
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n:.0f} B"


# ------------------------------------------------------------------ results


@dataclass
class Measure:
    """One contender of a row: its samples (seconds, bytes or counts) and median."""

    name: str
    samples: list[float]
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")


@dataclass
class Row:
    """One line of the table: a floor and contenders, each reported as median and ratio to the floor."""

    item: str  # issue 14 row number, e.g. "2"
    title: str
    unit: str  # "s", "ms", "requests", "MiB"
    floor: Measure | None
    contenders: list[Measure]
    params: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def ratio(self, m: Measure) -> float | None:
        if self.floor is None or not self.floor.median or self.floor.median != self.floor.median:
            return None
        return m.median / self.floor.median

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"item": self.item, "title": self.title, "unit": self.unit, "params": self.params,
                             "notes": self.notes}
        d["floor"] = asdict(self.floor) | {"median": self.floor.median} if self.floor else None
        d["contenders"] = [asdict(m) | {"median": m.median, "ratio": self.ratio(m)} for m in self.contenders]
        return d


def fmt(v: float, unit: str) -> str:
    if v != v:
        return "n/a"
    if unit == "s":
        return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.3f} s"
    if unit == "ms":
        return f"{v:.3f} ms" if v < 10 else f"{v:.1f} ms"
    if unit == "MiB":
        return f"{v:.0f} MiB"
    if unit == "%":
        return f"{v:.1f} %"
    return f"{v:g} {unit}"


def markdown(rows: Sequence[Row], meta: dict[str, Any]) -> str:
    out = [
        f"Suite run {meta['started']} UTC, state size {human(meta['size'])}, {meta['repeat']} interleaved rounds per row, "
        f"medians; wall time {meta['wall_seconds']:.0f} s. Ratio = median / floor (same run).",
        "",
        "| # | row | contender | median | floor | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        floor = f"{r.floor.name}: {fmt(r.floor.median, r.unit)}" if r.floor else "—"
        for m in r.contenders:
            ratio = r.ratio(m)
            rs = f"{ratio:.2f}x" if ratio is not None else "—"
            name = m.name + (f" ({m.note})" if m.note else "")
            out.append(f"| {r.item} | {r.title} | {name} | {fmt(m.median, r.unit)} | {floor} | {rs} |")
    notes = [f"* row {r.item} ({r.title}): {n}" for r in rows for n in r.notes]
    if notes:
        out += ["", "Notes:", "", *notes]
    return "\n".join(out) + "\n"


def write_results(rows: Sequence[Row], meta: dict[str, Any], stem: str = "latest") -> tuple[Path, Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    js = RESULTS / f"{stem}.json"
    md = RESULTS / f"{stem}.md"
    js.write_text(json.dumps({"meta": meta, "rows": [r.to_json() for r in rows]}, indent=1, default=str) + "\n")
    md.write_text(markdown(rows, meta))
    return js, md


# ------------------------------------------------------------------ timing


def interleave(contenders: dict[str, Callable[[int], float | None]], repeat: int, warmup: int = 0) -> dict[str, list[float]]:
    """Run each contender ``repeat`` times, ABAB..., rotating the order each
    round. A contender is called with the round number and returns its own
    measurement (or None to be timed from outside with ``perf_counter``).
    ``warmup`` rounds run first and are discarded."""
    names = list(contenders)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(-warmup, repeat):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t = time.perf_counter()
            v = contenders[n](r)
            dt = time.perf_counter() - t
            if r >= 0:
                out[n].append(dt if v is None else v)
    return out


def sync() -> None:
    os.sync()


def drop_caches() -> bool:
    """``sync`` then drop the page cache; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_write(path: str, buffers: Sequence[memoryview | bytes], chunk: int = 8 * MiB) -> None:
    """The floor of every save: write the bytes in ``chunk`` pieces, fsync the file and its directory."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for buf in buffers:
            mv = memoryview(buf).cast("B")
            for i in range(0, len(mv), chunk):
                os.write(fd, mv[i : i + chunk])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    dfd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` (what a crash-consistent peer must add)."""
    for top, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(top, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(top)


def read_file(path: str, chunk: int = 8 * MiB) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        mv = memoryview(buf)
        while True:
            k = f.readinto(mv)
            if not k:
                return n
            n += k


@contextmanager
def scratch(base: str, prefix: str) -> Iterator[str]:
    d = tempfile.mkdtemp(prefix=prefix, dir=base)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a job's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(module: str, specs: Sequence[dict[str, Any]], timeout: float, label: str) -> list[dict[str, Any]]:
    """Run one process per spec (``python -m module SPEC_JSON``, a rank each) to the end; each one's
    result, the last line of its stdout as JSON. A rank that fails or a job past ``timeout`` raises."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("GROUP_RANK", None)  # each rank says its node itself
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-m", module, json.dumps(spec)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for spec in specs]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for r, p in enumerate(procs):
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"{label}: rank {r} failed ({p.returncode}):\n{se[-3000:]}")
            results.append(json.loads(so.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{label}: the job did not finish within {timeout:.0f} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


# ------------------------------------------------------------------ memory


def vm_hwm_kib() -> int:
    """This process's resident-set high-water mark (VmHWM), KiB."""
    return _status_field("VmHWM")


def vm_rss_kib() -> int:
    return _status_field("VmRSS")


def _status_field(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{name} not in /proc/self/status")


def memory_shortfall(need: int, what: str) -> str | None:
    """None when ``MemAvailable`` covers ``need`` bytes, else why a row is skipped."""
    avail = next(int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                 if ln.startswith("MemAvailable"))
    if avail >= need:
        return None
    return f"{what} skipped: it needs about {human(need)} of memory, {human(avail)} is available"


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (``clear_refs`` 5, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


def run_child(args: Sequence[str], timeout: float = 900) -> dict[str, Any]:
    """Run ``python -m bench.<args>`` in a fresh interpreter; its last stdout line is JSON."""
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env=os.environ | {"PYTHONPATH": str(ROOT)})
    if p.returncode != 0:
        raise RuntimeError(f"child {args} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


# ------------------------------------------------------------------ machine


def _cmd(args: Sequence[str]) -> str:
    try:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine(cfg: Config) -> dict[str, Any]:
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
    df = _cmd(["df", "-hT", cfg.disk_dir, cfg.shm_dir])
    dev = _cmd(["df", "--output=source", cfg.disk_dir]).splitlines()[-1:]
    lsblk = _cmd(["lsblk", "-d", "-o", "NAME,ROTA,SIZE,MODEL"])
    try:
        import safetensors

        st_version = safetensors.__version__
    except ImportError:
        st_version = "absent"
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem / (1 << 20), 1),
        "kernel": platform.release(),
        "disk_dir": cfg.disk_dir,
        "disk_device": dev[0] if dev else "",
        "df": df,
        "lsblk": lsblk,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": st_version,
        "drop_caches": cfg.cold,
        "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
    }
