"""Rows 5 and 6: ``latest_complete()`` over a run of H saves, and ``list_saves()`` over 10,000.

A run of H committed saves (one tiny component each) is made once on tmpfs
through the public API (a protocol-version-2 run: commit names sort newest
first), then copied file for file to the local disk (same layout, no need to
pay H fsyncs twice) and, for the request counts, object by object into a
bucket of a loopback moto S3 server. Time per call is the median of several
calls (the two filesystems interleaved). Floor: one listing of the run's
``commits`` and ``saves`` directories (what a selection that scans its
history must at least do; version 2 no longer does). ``list_saves()`` is
timed twice: on a store opened for the call (every commit record read) and
again on the same store (records are cached per store: listings only). On
S3: backend operations per call (counted by
``ckptstore.backends.faults.FaultyBackend``'s trace) and HTTP requests per call
(counted with a botocore ``before-send`` hook on the s3fs client), each on a
store opened for the call. A plot of time per call against H is written to
``bench/results/history.svg``.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import IDENTITY, RESULTS, Config, Measure, Row, interleave, scratch
from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import FaultyBackend

RUN = "hist"


#: the folders of a run whose every entry a listing reads: version 2 keeps its saves' bytes under saves/,
#: version 3 (the default) under pieces/ (one folder per save that wrote any)
DATA_DIRS = ("saves", "pieces")


def make_history(base: str, h: int, every: int = 1) -> str:
    """A run of ``h`` committed saves of 64 bytes at steps 0, every, 2*every, ..., each of other bytes (as a
    training run's saves: version 3 then writes a piece for each, under a folder of its own)."""
    url = os.path.join(base, f"h{h}" if every == 1 else f"h{h}-e{every}")
    st = CheckpointStore.open(url, RUN, identity=IDENTITY)
    for i in range(h):
        with st.save(i * every) as s:
            s.put("model", b"w" * 56 + i.to_bytes(8, "big"))
    st.close()
    return url


def scan_floor(url: str) -> Callable[[int], float | None]:
    subs = [s for s in ("commits", *DATA_DIRS) if os.path.isdir(os.path.join(url, RUN, s))]

    def go(r: int) -> None:
        for sub in subs:
            with os.scandir(os.path.join(url, RUN, sub)) as it:
                for e in it:
                    e.is_dir()
    return go


def _discard(fn: Callable[[], Any]) -> Callable[[int], float | None]:
    def go(r: int) -> None:
        fn()
    return go


def fresh_list(url: str) -> Callable[[int], float | None]:
    """list_saves() on a store opened for it (open not timed): every record is read."""
    def go(r: int) -> float:
        st = CheckpointStore.open(url, RUN, mode="r")
        t = time.perf_counter()
        st.list_saves()
        dt = time.perf_counter() - t
        st.close()
        return dt
    return go


def timed_calls(urls: dict[str, str], call: str, repeat: int) -> dict[str, list[float]]:
    stores = {k: CheckpointStore.open(u, RUN, mode="r") for k, u in urls.items()}
    contenders: dict[str, Callable[[int], float | None]] = {}
    for k, st in stores.items():
        fn: Callable[[], Any] = st.latest_complete if call == "latest" else st.list_saves
        contenders[k] = _discard(fn)
        if call == "list":
            contenders[f"fresh {k}"] = fresh_list(urls[k])
        contenders[f"floor {k}"] = scan_floor(urls[k])
    res = interleave(contenders, repeat, warmup=1)
    for st in stores.values():
        st.close()
    return res


def count_s3(h_values: list[int], sources: dict[int, str]) -> dict[int, dict[str, float]]:
    """Backend operations and HTTP requests per latest_complete() / list_saves() call on moto."""
    import uuid

    from ckptstore.backends.schemes import backend_from_url
    from devservers.servers import BUCKET, SERVERS

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    srv = SERVERS["moto"]().start()
    out: dict[int, dict[str, float]] = {}
    try:
        for h in h_values:
            url = f"s3://{BUCKET}/hist-{uuid.uuid4().hex[:8]}"
            inner: Backend = backend_from_url(url, storage_options=srv.storage_options())  # type: ignore[attr-defined]
            src = Path(sources[h])
            root = inner.root  # type: ignore[attr-defined]
            inner.fs.pipe({f"{root}/{p.relative_to(src).as_posix()}": p.read_bytes()  # type: ignore[attr-defined]
                           for p in sorted(src.rglob("*")) if p.is_file()})  # copy the run object for object
            http = [0]

            def on_send(http: list[int] = http, **kw: Any) -> None:
                http[0] += 1

            fs = inner.fs  # type: ignore[attr-defined]
            client = fs.s3 if getattr(fs, "s3", None) is not None else None
            if client is None:
                from fsspec.asyn import sync

                sync(fs.loop, fs.set_session)
                client = fs.s3
            client.meta.events.register("before-send.s3", on_send)
            fb = FaultyBackend(inner)
            res: dict[str, float] = {}
            kinds: dict[str, dict[str, int]] = {}
            for call in ("latest", "list"):
                st = CheckpointStore.open(fb, RUN, mode="r")  # a store opened for the call: nothing cached
                fn: Callable[[], Any] = st.latest_complete if call == "latest" else st.list_saves
                fs.invalidate_cache()
                ops0, http0, seen = fb.count, http[0], len(fb.trace)
                t = time.perf_counter()
                fn()
                res[f"{call}_s"] = time.perf_counter() - t
                res[f"{call}_ops"] = fb.count - ops0
                res[f"{call}_http"] = http[0] - http0
                kinds[call] = {}
                for e in fb.trace[seen:]:
                    kinds[call][e.op] = kinds[call].get(e.op, 0) + 1
            res["op_kinds"] = kinds  # type: ignore[assignment]
            out[h] = res
    finally:
        srv.stop()
    return out


def svg_plot(path: Path, series: dict[str, list[tuple[int, float]]]) -> None:
    """A log-log line plot, by hand (no matplotlib in the venv)."""
    import math

    w, h, m = 640, 400, 60
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts if y > 0]
    x0, x1 = math.log10(min(xs)), math.log10(max(xs))
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    x1 = x1 if x1 > x0 else x0 + 1
    y1 = y1 if y1 > y0 else y0 + 1

    def px(x: float) -> float:
        return m + (math.log10(x) - x0) / (x1 - x0) * (w - 2 * m)

    def py(y: float) -> float:
        return h - m - (math.log10(y) - y0) / (y1 - y0) * (h - 2 * m)

    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
    el = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
          f'<rect width="{w}" height="{h}" fill="white"/>',
          f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">time per call vs history length (log-log)</text>',
          f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="black"/>',
          f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="black"/>',
          f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">saves in the run (H)</text>',
          f'<text x="15" y="{h / 2}" text-anchor="middle" transform="rotate(-90 15 {h / 2})">seconds per call</text>']
    for x in sorted(set(xs)):
        el.append(f'<text x="{px(x):.1f}" y="{h - m + 16}" text-anchor="middle">{x:,}</text>')
    for e in range(int(y0), int(y1) + 1):
        y = 10.0**e
        el.append(f'<line x1="{m}" y1="{py(y):.1f}" x2="{w - m}" y2="{py(y):.1f}" stroke="#ddd"/>')
        el.append(f'<text x="{m - 5}" y="{py(y) + 4:.1f}" text-anchor="end">1e{e}</text>')
    for i, (name, pts) in enumerate(series.items()):
        c = colors[i % len(colors)]
        pts = sorted(p for p in pts if p[1] > 0)
        el.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                  + " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts) + '"/>')
        el += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>' for x, y in pts]
        el.append(f'<text x="{m + 10}" y="{m + 14 * i}" fill="{c}">{name}</text>')
    el.append("</svg>")
    path.write_text("\n".join(el) + "\n")


def run(cfg: Config) -> list[Row]:
    hs = list(cfg.histories)
    rows: list[Row] = []
    series: dict[str, list[tuple[int, float]]] = {}
    with scratch(cfg.shm_dir, "bench-row5-") as shm, scratch(cfg.disk_dir, "bench-row5-") as disk:
        sources: dict[int, str] = {}
        for h in hs:
            sources[h] = make_history(shm, h)
            shutil.copytree(sources[h], os.path.join(disk, f"h{h}"))
            os.sync()
            urls = {"tmpfs": sources[h], "local disk": os.path.join(disk, f"h{h}")}
            res = timed_calls(urls, "latest", cfg.repeat)
            for where in urls:
                rows.append(Row("5", f"latest_complete(), H={h:,}, {where}", "s", Measure("listing commits+saves",
                                res[f"floor {where}"]), [Measure("ckptstore latest_complete()", res[where])],
                                {"history": h, "where": where}))
                series.setdefault(f"latest_complete, {where}", []).append((h, rows[-1].contenders[0].median))
            if h == max(hs):
                res = timed_calls(urls, "list", max(3, cfg.repeat // 2))
                for where in urls:
                    rows.append(Row("6", f"list_saves(), H={h:,}, {where}", "s", Measure("listing commits+saves",
                                    res[f"floor {where}"]), [
                                        Measure("ckptstore list_saves(), store opened for the call", res[f"fresh {where}"]),
                                        Measure("ckptstore list_saves(), same store again", res[where]),
                                    ], {"history": h, "where": where}))
        if cfg.s3:
            s3_hs = [h for h in hs if h <= cfg.s3_max]
            counts = count_s3(s3_hs, sources)
            for h, c in counts.items():
                rows.append(Row("5", f"S3 (moto) per call, H={h:,}", "requests", None, [
                    Measure("latest_complete() HTTP requests", [c["latest_http"]]),
                    Measure("latest_complete() backend ops", [c["latest_ops"]]),
                    Measure("list_saves() HTTP requests", [c["list_http"]]),
                    Measure("list_saves() backend ops", [c["list_ops"]]),
                ], {"history": h, "seconds": {k: v for k, v in c.items() if k.endswith("_s")}, "op_kinds": c["op_kinds"]}))
                series.setdefault("latest_complete, S3 (moto), 1 call", []).append((h, c["latest_s"]))
    RESULTS.mkdir(parents=True, exist_ok=True)
    svg = "history.svg" if cfg.stem == "latest" else f"history-{cfg.stem}.svg"
    svg_plot(RESULTS / svg, series)
    rows[0].notes.append(f"plot: bench/results/{svg} (time per call against H)")
    return rows
