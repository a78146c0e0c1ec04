"""Save+commit of N MiB to the local disk next to a plain write+fsync of the same bytes.

    ./dev bench save_local [--mib 1024] [--repeat 3] [--dir PATH]

Prints medians and the ratio (ckptstore / plain), measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from ckptstore import CheckpointStore


def plain_write(path: str, data: memoryview, chunk: int = 8 << 20) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(0, len(data), chunk):
            os.write(fd, data[i : i + chunk])
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="ckpt-bench-", dir=a.dir)
    data = memoryview(bytearray(os.urandom(1 << 20)) * a.mib)
    plain, ours = [], []
    try:
        def run_plain(r: int) -> None:
            p = os.path.join(base, f"plain-{r}.bin")
            os.sync()  # start from no dirty pages, so neither side pays for the other's writeback
            t = time.perf_counter()
            plain_write(p, data)
            plain.append(time.perf_counter() - t)
            os.unlink(p)

        def run_ours(r: int) -> None:
            st = CheckpointStore.open(os.path.join(base, "store"), f"bench{r}", identity={"data_digest": "b"})
            os.sync()
            t = time.perf_counter()
            with st.save(1) as s:
                s.put("model", data)
            ours.append(time.perf_counter() - t)
            shutil.rmtree(os.path.join(base, "store", f"bench{r}"))

        for r in range(a.repeat):  # alternate the order, so neither side always goes first
            first, second = (run_plain, run_ours) if r % 2 == 0 else (run_ours, run_plain)
            first(r)
            second(r)
        mp, mo = statistics.median(plain), statistics.median(ours)
        gb = a.mib / 1024
        print(f"local disk, {a.mib} MiB, median of {a.repeat}:")
        print(f"  plain write+fsync      {mp:7.3f} s  ({gb / mp:5.2f} GiB/s)")
        print(f"  ckptstore save+commit  {mo:7.3f} s  ({gb / mo:5.2f} GiB/s; BLAKE3 while writing, fsync, link commit)")
        print(f"  ratio ckptstore/plain  {mo / mp:7.2f}x")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
