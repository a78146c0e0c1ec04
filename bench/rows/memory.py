"""Row 7: peak memory of a save and of a restore, over state size.

Each measurement runs in a fresh interpreter (``python -m bench.rows.memory
child OP BYTES DIR``): it builds the live state, resets the RSS high-water
mark (``/proc/self/clear_refs`` 5), performs one operation and reports
``VmHWM`` minus the RSS before it: the memory the operation added at its peak
on top of the live model and optimizer (freed heap memory of the build is
returned with ``malloc_trim`` first, so that it cannot hide an allocation). Reported in MiB and as a ratio to the
state size (1.00x = one extra copy of the whole state).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Callable

from bench.common import IDENTITY, Config, Measure, Row, human, read_file, reset_hwm, run_child, scratch, vm_hwm_kib, vm_rss_kib

SAVES = ["raw write+fsync", "ckptstore Checkpointer.save (sync)", "ckptstore Checkpointer.save (async, until committed)",
         "torch.save+fsync", "DCP save", "safetensors save_file+fsync"]
RESTORES = ["raw read", "ckptstore open+resume", "torch.load+load_state_dict", "dcp.load+load_state_dict"]


def child(op: str, nbytes: int, d: str) -> dict[str, float]:
    import torch

    from bench import torchstate as ts
    from ckptstore import CheckpointStore
    from ckptstore.torch import Checkpointer

    model, opt = ts.build(nbytes, seed=3)
    n = ts.state_bytes(model, opt)
    out = os.path.join(d, f"out-{os.getpid()}")

    def ck_save(async_save: bool) -> None:
        st = CheckpointStore.open(os.path.join(d, "store-mem"), f"m{os.getpid()}", identity=IDENTITY)
        with Checkpointer(st, {"model": model, "optimizer": opt}, async_save=async_save, handle_signals=False) as ck:
            ck.save(1)
            ck.wait()

    def ck_resume() -> None:
        st = CheckpointStore.open(os.path.join(d, "store"), "row7", identity=IDENTITY)
        with Checkpointer(st, {"model": model, "optimizer": opt}, async_save=False, handle_signals=False) as ck:
            assert ck.resume() == 2

    ops: dict[str, Callable[[], object]] = {
        "raw write+fsync": lambda: ts.raw_save(out, model, opt),
        "ckptstore Checkpointer.save (sync)": lambda: ck_save(False),
        "ckptstore Checkpointer.save (async, until committed)": lambda: ck_save(True),
        "torch.save+fsync": lambda: ts.torch_save(out, model, opt),
        "DCP save": lambda: ts.dcp_save(out, model, opt),
        "safetensors save_file+fsync": lambda: ts.safetensors_save(out, model, opt),
        "raw read": lambda: read_file(os.path.join(d, "raw.bin")),
        "ckptstore open+resume": ck_resume,
        "torch.load+load_state_dict": lambda: ts.torch_load(os.path.join(d, "t.pt"), model, opt),
        "dcp.load+load_state_dict": lambda: ts.dcp_load(os.path.join(d, "dcp"), model, opt),
    }
    gc.collect()
    _malloc_trim()  # freed heap pages of the build (Adam's warm-up grads) would otherwise be reused unseen
    before_hwm = vm_hwm_kib()
    reset = reset_hwm()
    rss0 = vm_rss_kib()
    with torch.no_grad():
        ops[op]()
    peak = vm_hwm_kib()
    return {"extra_mib": (peak - rss0) / 1024, "state_mib": n / 2**20, "reset": reset, "build_hwm_mib": before_hwm / 1024}


def _malloc_trim() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def prepare(nbytes: int, d: str) -> None:
    from bench import torchstate as ts
    from ckptstore import CheckpointStore
    from ckptstore.torch import Checkpointer

    model, opt = ts.build(nbytes, seed=4)
    st = CheckpointStore.open(os.path.join(d, "store"), "row7", identity=IDENTITY)
    with Checkpointer(st, {"model": model, "optimizer": opt}, async_save=False, handle_signals=False) as ck:
        ck.save(1)
    ts.raw_save(os.path.join(d, "raw.bin"), model, opt)
    ts.torch_save(os.path.join(d, "t.pt"), model, opt)
    ts.dcp_save(os.path.join(d, "dcp"), model, opt)


def run(cfg: Config) -> list[Row]:
    rows = []
    for nbytes in sorted({max(cfg.size // 4, 16 << 20), cfg.size}):
        with scratch(cfg.disk_dir, "bench-row7-") as d:
            run_child(["-W", "ignore", "-m", "bench.rows.memory", "prepare", str(nbytes), d])
            for kind, ops in (("save", SAVES), ("restore", RESTORES)):
                res = {op: run_child(["-W", "ignore", "-m", "bench.rows.memory", "child", op, str(nbytes), d]) for op in ops}
                state = next(iter(res.values()))["state_mib"]
                row = Row("7", f"peak memory of a {kind}, {human(state * 2**20)} state", "MiB",
                          Measure("state size", [state]), [Measure(op, [r["extra_mib"]]) for op, r in res.items()],
                          {"bytes": nbytes, "state_mib": state})
                if not all(r["reset"] for r in res.values()):
                    row.notes.append("clear_refs refused: the peaks include building the state")
                rows.append(row)
    rows[0].notes.append("VmHWM above the RSS before the operation, one fresh process each; ratio = extra / state size")
    return rows


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(int(sys.argv[2]), sys.argv[3])
        print("{}")
    else:
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
