"""The benchmark suite: one entry that runs every row (``./dev bench``'s default).

    ./dev bench [--size 256M|1G|4G] [--repeat 5] [--rows save,restore,...] [--dir PATH] [--quick]

Interleaves ckptstore and its peers in the same run, takes medians and reports
each median as a ratio to a floor measured in the same run. Writes
bench/results/latest.md (committed) and latest.json (not) and prints the table.

A row is one module ``bench/rows/NAME.py`` with ``run(cfg: Config) -> list[Row]``
plus one line in :data:`ROWS` (bench/README.md).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Config, Row, drop_caches, machine, markdown, parse_size, write_results

#: the suite's rows, in the order they run: bench/rows/<name>.py (issue 14's row numbers in the comments)
ROWS = [
    "save",  # 1: save+commit of bytes against raw write+fsync
    "sync_save",  # 2: sync save of a torch state against torch.save, safetensors, DCP
    "async_save",  # 3: async save, loop blocked, against a copy into preallocated buffers and DCP async_save
    "restore",  # 4: resume into live objects against torch.load, dcp.load and the read/hash floor
    "fresh_restore",  # 4f: the same resume in a fresh process (a restart), against torch.load in one
    "history",  # 5 and 6: latest_complete() and list_saves() against history length
    "memory",  # 7: peak memory of save and restore
    "restart",  # 8: end to end, restart to the first useful step
    "coordination",  # 9: the coordinator's cost against world size, dcp.save StoreWriter vs FileSystemWriter
    "list_and_retention",  # 10: list_saves() of 10,000 saves (disk) and 2,000 (SeaweedFS); retention per save vs history
    "fsyncs",  # 11: fsyncs per save by protocol version (issue 32), and the same saves' seconds
    "peer_copies",  # 12: peer copies (issue 33): loop blocked on/off, bytes sent per save, recovery peer vs durable
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256M", help="state size of the save/restore rows (256M, 1G, 4G)")
    ap.add_argument("--repeat", type=int, default=5, help="interleaved rounds per row")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"which rows, by name ({', '.join(ROWS)})")
    ap.add_argument("--dir", default=None, help="a directory on the local disk (default: the system temp dir)")
    ap.add_argument("--shm", default="/dev/shm", help="a directory on tmpfs")
    ap.add_argument("--histories", default="100,1000,10000", help="history lengths of row 5")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) request counts of row 5")
    ap.add_argument("--s3-max", type=int, default=1000, help="longest history of row 5 counted on S3 (moto)")
    ap.add_argument("--world-sizes", default="2,4,8,16", help="rank counts of the coordination row")
    ap.add_argument("--quick", action="store_true", help="smaller everything (a smoke run)")
    ap.add_argument("--stem", default="latest", help="results file name under bench/results/")
    a = ap.parse_args(argv)
    cfg = Config(
        size=parse_size(a.size), repeat=a.repeat, disk_dir=a.dir or tempfile.gettempdir(), shm_dir=a.shm,
        cold=drop_caches(), quick=a.quick, histories=tuple(int(h) for h in a.histories.split(",")), s3=not a.no_s3,
        s3_max=a.s3_max, stem=a.stem, world_sizes=tuple(int(w) for w in a.world_sizes.split(",")),
    )
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    t0 = time.perf_counter()
    meta: dict[str, Any] = {"started": started, "size": cfg.size, "repeat": cfg.repeat, "argv": sys.argv[1:], "machine": machine(cfg),
            "row_seconds": {}}
    row_seconds: dict[str, float] = meta["row_seconds"]
    rows: list[Row] = []
    unknown = [k for k in a.rows.split(",") if k not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; the rows are {', '.join(ROWS)}")
    for key in a.rows.split(","):
        mod = importlib.import_module(f"bench.rows.{key}")
        t = time.perf_counter()
        print(f"suite: row {key} (bench/rows/{key}.py) ...", file=sys.stderr, flush=True)
        new = mod.run(cfg)
        row_seconds[key] = round(time.perf_counter() - t, 1)
        rows.extend(new)
        meta["wall_seconds"] = time.perf_counter() - t0
        write_results(rows, meta, a.stem)  # partial results survive a later row's failure
    meta["wall_seconds"] = time.perf_counter() - t0
    js, md = write_results(rows, meta, a.stem)
    print(markdown(rows, meta))
    print(f"suite: wrote {js} and {md}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
