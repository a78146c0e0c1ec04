"""Row 3: asynchronous save, the time the training loop is blocked.

Checkpointer (async) vs DCP ``async_save`` with a reused stager
(``DefaultStager`` with synchronous staging, no pinned/shared memory, which
this CPU-only build cannot give: the copy happens in the call, into storages
the stager caches and reuses, so the call's duration is the blocked time);
floor: copying every tensor into preallocated buffers. A second row reports
the time until the save is durable (ckptstore: committed) against a floor of
copy + raw write+fsync; a third (3c) the first save of a new Checkpointer on
a fresh run (whose constructor starts allocating the host buffers in the
background): right after the constructor, one optimizer step after it, and
after ``resume()`` and the whole background allocation, against the same
floor measured in those rounds.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from bench import torchstate as ts
from bench.common import IDENTITY, Config, Measure, Row, human, interleave, memory_shortfall, rm, scratch, sync
from bench.rows.sync_save import changed
from ckptstore import CheckpointStore
from ckptstore.torch import Checkpointer


def memory_needed(nbytes: int) -> int:
    """The row's peak: the live state and three copies of it held at once (the
    floor's buffers, the Checkpointer's host buffers, DCP's stager cache), and
    the gradients of row 3c's optimizer step."""
    return 4 * nbytes + 2 * (nbytes // 3) + (256 << 20)


def run(cfg: Config) -> list[Row]:
    short = memory_shortfall(memory_needed(cfg.size), f"row 3 at {human(cfg.size)}")
    if short:
        return [Row("3", f"async save {human(cfg.size)}", "s", None, [], {"bytes": cfg.size}, [short])]
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import async_save

    model, opt = ts.build(cfg.size)
    n = ts.state_bytes(model, opt)
    src = ts.tensors(model, opt)
    bufs = {k: torch.empty_like(v) for k, v in src.items()}
    blocked: dict[str, list[float]] = {}
    durable: dict[str, list[float]] = {}

    def note(name: str, r: int, b: float, d: float) -> None:
        if r >= 0:
            blocked.setdefault(name, []).append(b)
            durable.setdefault(name, []).append(d)

    with scratch(cfg.disk_dir, "bench-row3-") as d:
        st = CheckpointStore.open(os.path.join(d, "store"), "row3", identity=IDENTITY)
        ck = Checkpointer(st, {"model": model, "optimizer": opt}, async_save=True, handle_signals=False)
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                              use_non_blocking_copy=False))

        def floor(r: int) -> float:
            p = os.path.join(d, f"raw-{r}")
            sync()
            t = time.perf_counter()
            for k, v in src.items():
                bufs[k].copy_(v)
            b = time.perf_counter() - t
            ts.raw_save(p, model, opt)  # stands for writing the buffers: same bytes
            note("floor", r, b, time.perf_counter() - t)
            rm(p)
            return b

        def ours(r: int) -> float:
            sync()
            t = time.perf_counter()
            ck.save(r + 1)
            b = time.perf_counter() - t
            ck.wait()
            note("ckptstore", r, b, time.perf_counter() - t)
            st.gc(keep_last=1, grace_seconds=0, deep=False)
            return b

        def theirs(r: int) -> float:
            p = os.path.join(d, f"dcp-{r}")
            sync()
            t = time.perf_counter()
            fut = async_save(ts.state_dict(model, opt), storage_writer=FileSystemWriter(p, sync_files=True),
                                 async_stager=stager)
            b = time.perf_counter() - t
            fut.result()  # type: ignore[union-attr]
            note("dcp", r, b, time.perf_counter() - t)
            rm(p)
            return b

        contenders: dict[str, Callable[[int], float | None]] = {
            k: changed(fn, model, opt) for k, fn in {"floor": floor, "ckptstore": ours, "dcp": theirs}.items()}
        with torch.no_grad():
            interleave(contenders, cfg.repeat, warmup=1)  # warm-up: first async save allocates the buffers
        ck.close()
        st.close()
        ck, stager = None, None  # type: ignore[assignment]  # free their host buffers before row 3c
        first = first_saves(cfg, d, model, opt, n, src, bufs)
    names = {"ckptstore": "ckptstore Checkpointer (async)", "dcp": "DCP async_save, reused stager"}
    return [
        Row("3", f"async save {human(n)}: loop blocked", "s", Measure("copy into preallocated buffers", blocked["floor"]),
            [Measure(names[k], blocked[k]) for k in ("ckptstore", "dcp")], {"bytes": n},
            ["first (warm-up) round excluded: both allocate their host buffers then"]),
        Row("3b", f"async save {human(n)}: until durable/committed", "s", Measure("copy + raw write+fsync", durable["floor"]),
            [Measure(names[k], durable[k]) for k in ("ckptstore", "dcp")], {"bytes": n}),
        Row("3c", f"async save {human(n)}: the first save of a Checkpointer, loop blocked", "s",
            Measure("copy into preallocated buffers", first["floor"]), [
                Measure("first save right after the constructor (no resume(), no step_end, no step)", first["cold"]),
                Measure("first save one optimizer step after the constructor (no resume(), no step_end)",
                        first["step"]),
                Measure("first save after resume() and the whole background allocation", first["prepared"]),
                Measure("  the background allocation itself (off the loop)", first["allocation"]),
                Measure("  the optimizer step (Adam, off the measure)", first["adam"]),
            ], {"bytes": n},
            ["a fresh Checkpointer on a fresh run each round, its constructor starts the background allocation; "
             "right after it the save shares that allocation (it allocates from the front what the thread has not "
             "reached); after resume() the save waits until the allocation is done (what a few training steps give "
             "it), at most 30 s; later saves: row 3",
             "fresh memory: glibc may hand the freed buffers of rows 3/3b back without page faults (its mmap "
             "threshold grows after a free); run with MALLOC_MMAP_THRESHOLD_=1048576 for fresh pages every time, as "
             "in a new training process",
             "median of each save's ratio to the floor copy right after it (the same moment of the machine): "
             + ", ".join(f"{k} {statistics.median(first[k + '/floor']):.2f}x" for k in ("cold", "step", "prepared"))]),
    ]


def first_saves(cfg: Config, d: str, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int,
                src: dict[str, torch.Tensor], bufs: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """The first async save's loop-blocked time of a new Checkpointer on a
    fresh run (its constructor starts the background allocation): right after
    the constructor, one optimizer step after it, and after ``resume()`` and
    the whole background allocation; the floor (a copy into preallocated
    buffers) right after each of those saves is committed (``KIND/floor``: the ratio of
    each save to its own floor)."""
    out: dict[str, list[float]] = {"cold": [], "step": [], "prepared": [], "allocation": [], "adam": [], "floor": []}
    rounds = max(1, min(cfg.repeat, 3))
    kinds = ("cold", "step", "prepared")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the step's gradients (Adam's work does not depend on their values)
    for r in range(rounds):
        for kind in kinds[r % 3:] + kinds[:r % 3]:
            sync()  # before the constructor: nothing else between it and the save than what the kind says
            st = CheckpointStore.open(os.path.join(d, "store-first"), f"first-{kind}-{r}", identity=IDENTITY)
            built = time.perf_counter()
            ck = Checkpointer(st, {"model": model, "optimizer": opt}, async_save=True, handle_signals=False)
            if kind == "step":
                t = time.perf_counter()
                opt.step()
                out["adam"].append(time.perf_counter() - t)
            if kind == "prepared":
                assert ck.resume() == 0
                deadline = built + 30.0
                while ck.preparing_host_buffers and time.perf_counter() < deadline:
                    time.sleep(0.005)
                out["allocation"].append(time.perf_counter() - built)  # from the constructor, which starts it
            with torch.no_grad():
                t = time.perf_counter()
                ck.save(1)
                out[kind].append(time.perf_counter() - t)
            ck.close()  # waits for the save: nothing in flight during the floor
            st.close()
            t = time.perf_counter()  # the floor right after each save: about the same moment of a loaded machine
            for k, v in src.items():
                bufs[k].copy_(v)
            out["floor"].append(time.perf_counter() - t)
            out.setdefault(f"{kind}/floor", []).append(out[kind][-1] / out["floor"][-1])
            del ck
            rm(os.path.join(d, "store-first"))
    for p in model.parameters():
        p.grad = None
    return out
