"""Row 1: save+commit of N bytes vs raw write+fsync of the same bytes (the floor).

On the local disk, and on tmpfs (where the disk drops out and what is left is
ckptstore's own CPU work: BLAKE3 while writing, records, the commit).
"""

from __future__ import annotations

import os

from bench.common import IDENTITY, Config, Measure, Row, fsync_write, human, interleave, scratch, sync
from ckptstore import CheckpointStore


def measure(cfg: Config, where: str, base: str, data: memoryview) -> Row:
    with scratch(base, "bench-row1-") as d:
        def floor(r: int) -> float:
            p = os.path.join(d, f"plain-{r}.bin")
            sync()  # no dirty pages left over from the other side
            t = _now()
            fsync_write(p, [data])
            dt = _now() - t
            os.unlink(p)
            return dt

        def ours(r: int) -> float:
            st = CheckpointStore.open(os.path.join(d, "store"), f"r{r}", identity=IDENTITY)
            sync()
            t = _now()
            with st.save(1) as s:
                s.put("model", data)
            dt = _now() - t
            st.close()
            import shutil

            shutil.rmtree(os.path.join(d, "store", f"r{r}"), ignore_errors=True)
            return dt

        res = interleave({"raw write+fsync": floor, "ckptstore save+commit": ours}, cfg.repeat, warmup=1)
    return Row("1", f"save+commit {human(len(data))}, {where}", "s", Measure("raw write+fsync", res["raw write+fsync"]),
               [Measure("ckptstore save+commit", res["ckptstore save+commit"])], {"bytes": len(data), "where": where})


def _now() -> float:
    import time

    return time.perf_counter()


def run(cfg: Config) -> list[Row]:
    # random in every byte: a repeated block would let version 3 (the default) store each distinct piece
    # once, and the row would measure deduplication instead of a save
    data = memoryview(bytearray(os.urandom(cfg.size)))
    return [measure(cfg, "local disk", cfg.disk_dir, data), measure(cfg, "tmpfs", cfg.shm_dir, data)]
