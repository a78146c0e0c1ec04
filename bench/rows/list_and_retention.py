"""Row 10 (issue 32, item 4): ``list_saves()`` of a long run, and retention after a save, against history length.

    ./dev bench --rows list_and_retention              # in the suite (10,000 saves on disk, 2,000 on SeaweedFS)
    python -m bench.rows.list_and_retention [--saves 10000] [--s3-saves 2000] [--no-s3] [--repeat 5]

**Listing.** A run of H committed saves (one 64-byte component each, made once
on tmpfs through the public API, then copied file for file to the local disk)
is listed with ``list_saves()`` on a store opened for the call (cold: nothing
of the run known to the process) and again on the same store (warm). Floors,
in the same rounds: a bare ``os.scandir`` of the run's ``commits/`` and
``saves/`` or ``pieces/`` (what any listing of the run must at least read), and that plus
one ``scandir`` of each save's folder (what judging every save by its listed
components must read without an index). On S3 (SeaweedFS on loopback, started
by ``devservers/servers.py``; the run copied object for object): seconds and
HTTP requests of a cold ``list_saves()`` without a record pack and with the
one the run's writer leaves (PROTOCOL.md §4.7.1), against ``backend.list_keys``
of the run's ``commits/`` prefix.

**Retention.** A run whose history holds K saves kept by ``keep_every`` (steps
0, N, 2N, ...: what a long run with ``keep_every=N`` accumulates) is extended
by one save at a time on the local disk, each followed by retention with
``keep_last=2, keep_every=N``; the seconds of the retention call per save, for
a full ``gc()`` and for ``gc(incremental=True)`` (the Checkpointer's retention,
when the installed ckptstore has it), against K, with the save itself as the
floor (its seconds in the same rounds).
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import IDENTITY, Config, Measure, Row, interleave, markdown, scratch
from bench.rows.history import DATA_DIRS, RUN, fresh_list, make_history, scan_floor
from ckptstore import CheckpointStore

KEEP_EVERY = 10


def _walk_floor(url: str) -> Callable[[int], float | None]:
    data = [d for d in DATA_DIRS if os.path.isdir(os.path.join(url, RUN, d))]

    def go(r: int) -> None:
        with os.scandir(os.path.join(url, RUN, "commits")) as it:
            for e in it:
                e.stat(follow_symlinks=False)
        for d in data:
            with os.scandir(os.path.join(url, RUN, d)) as it:
                for e in it:
                    with os.scandir(e.path) as sub:
                        for f in sub:
                            f.stat(follow_symlinks=False)
    return go


def listing_rows(disk: str, shm: str, h: int, repeat: int) -> list[Row]:
    src = make_history(shm, h)
    url = os.path.join(disk, os.path.basename(src))
    shutil.copytree(src, url)
    os.sync()
    warm = CheckpointStore.open(url, RUN, mode="r")
    n = len(warm.list_saves())
    assert n == h, (n, h)

    def warm_call(r: int) -> None:
        warm.list_saves()

    res = interleave({"cold": fresh_list(url), "warm": warm_call, "top": scan_floor(url), "walk": _walk_floor(url)},
                     repeat, warmup=1)
    warm.close()
    shutil.rmtree(src)
    return [
        Row("10", f"list_saves(), H={h:,}, local disk", "s", Measure("scandir of commits/ and saves/ or pieces/", res["top"]), [
            Measure("list_saves(), store opened for the call (cold)", res["cold"]),
            Measure("list_saves(), same store again (warm)", res["warm"]),
            Measure("floor 2: scandir+stat of commits/ and of every save's folder", res["walk"]),
        ], {"history": h}, [f"goal: cold < 0.2 s at 10,000 saves (issue 32); {h:,} saves listed"]),
        ], url


def s3_rows(src: str, h: int) -> list[Row]:
    """Cold list_saves() on SeaweedFS: seconds and HTTP requests, against a list_keys of commits/."""
    from ckptstore.backends.schemes import backend_from_url
    from devservers.servers import BUCKET, SERVERS

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    srv = SERVERS["seaweedfs"]().start()
    try:
        url = f"s3://{BUCKET}/lr-{uuid.uuid4().hex[:8]}"
        be = backend_from_url(url, storage_options=srv.storage_options())  # type: ignore[attr-defined]
        root = be.root  # type: ignore[attr-defined]
        srcp = Path(src)
        t = time.perf_counter()
        files = [p for p in sorted(srcp.rglob("*")) if p.is_file()]
        for i in range(0, len(files), 500):
            be.fs.pipe({f"{root}/{p.relative_to(srcp).as_posix()}": p.read_bytes()  # type: ignore[attr-defined]
                        for p in files[i : i + 500]})
        copied = time.perf_counter() - t
        http = [0]

        def on_send(http: list[int] = http, **kw: Any) -> None:
            http[0] += 1

        fs = be.fs  # type: ignore[attr-defined]
        if getattr(fs, "s3", None) is None:
            from fsspec.asyn import sync

            sync(fs.loop, fs.set_session)
        fs.s3.meta.events.register("before-send.s3", on_send)
        samples: dict[str, list[float]] = {"cold_s": [], "cold_http": [], "warm_s": [], "warm_http": [],
                                           "floor_s": [], "floor_http": [], "nopack_s": [], "nopack_http": []}
        pack = f"{RUN}/index/commits.json"
        for _ in range(3):
            if be.exists(pack):
                be.delete(pack)
            st = CheckpointStore.open(be, RUN, mode="r")
            fs.invalidate_cache()
            h0, t = http[0], time.perf_counter()
            st.list_saves()
            samples["nopack_s"].append(time.perf_counter() - t)
            samples["nopack_http"].append(http[0] - h0)
            # what the run's writer leaves behind after a full listing or gc (the record pack, §4.7.1)
            wr = CheckpointStore.open(be, RUN, identity=IDENTITY)
            wr.list_saves()
            wr.close()
            fs.invalidate_cache()
            h0, t = http[0], time.perf_counter()
            be.list_keys(f"{RUN}/commits/")
            samples["floor_s"].append(time.perf_counter() - t)
            samples["floor_http"].append(http[0] - h0)
            st = CheckpointStore.open(be, RUN, mode="r")
            fs.invalidate_cache()
            h0, t = http[0], time.perf_counter()
            n = len(st.list_saves())
            samples["cold_s"].append(time.perf_counter() - t)
            samples["cold_http"].append(http[0] - h0)
            fs.invalidate_cache()
            h0, t = http[0], time.perf_counter()
            st.list_saves()
            samples["warm_s"].append(time.perf_counter() - t)
            samples["warm_http"].append(http[0] - h0)
            assert n == h, (n, h)
    finally:
        srv.stop()
    return [
        Row("10", f"list_saves(), H={h:,}, S3 (SeaweedFS)", "s", Measure("list_keys of commits/", samples["floor_s"]), [
            Measure("list_saves(), store opened for the call (cold), no record pack", samples["nopack_s"]),
            Measure("list_saves(), store opened for the call (cold), the writer's record pack", samples["cold_s"]),
            Measure("list_saves(), same store again (warm)", samples["warm_s"]),
        ], {"history": h, "copy_seconds": round(copied, 1)}),
        Row("10", f"list_saves(), H={h:,}, S3 (SeaweedFS), HTTP requests", "requests",
            Measure("list_keys of commits/", samples["floor_http"]), [
                Measure("list_saves() cold, no record pack", samples["nopack_http"]),
                Measure("list_saves() cold, the writer's record pack", samples["cold_http"]),
                Measure("list_saves() warm", samples["warm_http"]),
            ], {"history": h}),
    ]


def retention_rows(disk: str, shm: str, ks: list[int], saves: int) -> list[Row]:
    incremental = "incremental" in inspect.signature(CheckpointStore.gc).parameters
    rows = []
    for k in ks:
        src = make_history(shm, k, KEEP_EVERY)
        modes = ["full", "incremental"] if incremental else ["full"]
        res: dict[str, list[float]] = {f"{m} {w}": [] for m in modes for w in ("save", "gc")}
        for mode in modes:
            url = os.path.join(disk, f"ret-{mode}-{k}")
            shutil.copytree(src, url)
            st = CheckpointStore.open(url, RUN, identity=IDENTITY)
            kw: dict[str, Any] = {"incremental": True} if mode == "incremental" else {}
            st.gc(keep_last=2, keep_every=KEEP_EVERY, **kw)  # the first retention of a process lists the run
            step = k * KEEP_EVERY
            for _ in range(saves):
                step += 1 if step % KEEP_EVERY else 1
                t = time.perf_counter()
                with st.save(step) as s:
                    s.put("model", b"w" * 64)
                t1 = time.perf_counter()
                st.gc(keep_last=2, keep_every=KEEP_EVERY, **kw)
                res[f"{mode} gc"].append(time.perf_counter() - t1)
                res[f"{mode} save"].append(t1 - t)
            st.close()
            shutil.rmtree(url)
        shutil.rmtree(src)
        ms = [Measure(f"retention after a save, {m} gc()" if m == "full" else "retention after a save, "
                      "gc(incremental=True)", res[f"{m} gc"]) for m in modes]
        rows.append(Row("10", f"retention per save, {k:,} saves kept by keep_every={KEEP_EVERY}", "s",
                        Measure("the save itself", res["full save"]), ms, {"kept": k, "saves": saves}))
    return rows


def run(cfg: Config) -> list[Row]:
    h = 1000 if cfg.quick else max(cfg.histories)
    ks = [100, 1000] if cfg.quick else [100, 1000, 10000]
    rows: list[Row] = []
    with scratch(cfg.shm_dir, "bench-row10-") as shm, scratch(cfg.disk_dir, "bench-row10-") as disk:
        got, _url = listing_rows(disk, shm, h, max(3, cfg.repeat))
        rows += got
        if cfg.s3:
            src = make_history(shm, 200 if cfg.quick else min(2000, cfg.s3_max * 2))
            rows += s3_rows(src, 200 if cfg.quick else min(2000, cfg.s3_max * 2))
        rows += retention_rows(disk, shm, ks, 5 if cfg.quick else 10)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--saves", type=int, default=10000, help="saves in the listed run (local disk)")
    ap.add_argument("--s3-saves", type=int, default=2000, help="saves in the listed run on SeaweedFS")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--kept", default="100,1000,10000", help="history lengths of the retention rows")
    ap.add_argument("--retention-saves", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip", default="", help="comma list of listing,s3,retention to skip")
    a = ap.parse_args(argv)
    skip = set(a.skip.split(","))
    rows: list[Row] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-row10-", dir="/dev/shm") as shm, \
            tempfile.TemporaryDirectory(prefix="bench-row10-") as disk:
        if "listing" not in skip:
            got, _url = listing_rows(disk, shm, a.saves, a.repeat)
            rows += got
        if not a.no_s3 and "s3" not in skip:
            rows += s3_rows(make_history(shm, a.s3_saves), a.s3_saves)
        if "retention" not in skip:
            rows += retention_rows(disk, shm, [int(k) for k in a.kept.split(",")], a.retention_saves)
    meta = {"started": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "size": 64, "repeat": a.repeat,
            "wall_seconds": time.perf_counter() - t0}
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
