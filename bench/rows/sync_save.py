"""Row 2: synchronous save of a torch state (Linear stack + Adam) through the
Checkpointer, next to torch.save+fsync, DCP FileSystemWriter and safetensors
save_file (+fsync); floor: raw write+fsync of the same tensor bytes.

Every contender ends durable (file data and directory entries fsynced), so the
comparison is like for like; the peers are not crash-consistent as a set
(no commit), ckptstore is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from bench import torchstate as ts
from bench.common import IDENTITY, Config, Measure, Row, human, interleave, rm, scratch, sync
from ckptstore import CheckpointStore
from ckptstore.torch import Checkpointer


def changed(fn: Callable[[int], float | None], model: torch.nn.Module, opt: torch.optim.Optimizer
            ) -> Callable[[int], float | None]:
    """``fn`` after the state changed (untimed): every contender saves a state that differs in every byte
    from its previous save, as after a training step (full fine-tuning, the worst case of version 3)."""
    def go(r: int) -> float | None:
        ts.perturb(model, opt)
        return fn(r)
    return go


def run(cfg: Config) -> list[Row]:
    model, opt = ts.build(cfg.size)
    n = ts.state_bytes(model, opt)
    with scratch(cfg.disk_dir, "bench-row2-") as d:
        st = CheckpointStore.open(os.path.join(d, "store"), "row2", identity=IDENTITY)
        ck = Checkpointer(st, {"model": model, "optimizer": opt}, async_save=False, handle_signals=False)

        def timed(fn: Callable[[str], None], name: str) -> Callable[[int], float]:
            def go(r: int) -> float:
                p = os.path.join(d, f"{name}-{r}")
                sync()
                t = time.perf_counter()
                fn(p)
                dt = time.perf_counter() - t
                rm(p)
                return dt
            return go

        def ours(r: int) -> float:
            sync()
            t = time.perf_counter()
            ck.save(r + 1)  # rounds start at -1 (the warm-up)
            dt = time.perf_counter() - t
            if r >= 0:
                st.gc(keep_last=1, grace_seconds=0, deep=False)  # keep the disk from filling; not timed
            return dt

        contenders: dict[str, Callable[[int], float | None]] = {
            "raw write+fsync": timed(lambda p: ts.raw_save(p, model, opt), "raw"),
            "ckptstore Checkpointer.save (sync)": ours,
            "torch.save+fsync": timed(lambda p: ts.torch_save(p, model, opt), "torch"),
            "DCP save (FileSystemWriter)": timed(lambda p: ts.dcp_save(p, model, opt), "dcp"),
            "safetensors save_file+fsync": timed(lambda p: ts.safetensors_save(p, model, opt), "st"),
        }
        contenders = {k: changed(fn, model, opt) for k, fn in contenders.items()}
        with torch.no_grad():
            res = interleave(contenders, cfg.repeat, warmup=1)
        ck.close()
        st.close()
    floor = Measure("raw write+fsync", res.pop("raw write+fsync"))
    return [Row("2", f"sync save of a torch state, {human(n)} (Linear+Adam), local disk", "s", floor,
                [Measure(k, v) for k, v in res.items()], {"bytes": n},
                ["safetensors holds the tensors only (no param_groups); DCP writes .metadata + one file per rank",
                 "every byte of the state changed since each contender's previous save (as after a training step; "
                 "a version-3 save of an unchanged state would write nothing); ckptstore at the run's default "
                 "protocol version",
                 "Checkpointer with record_events on (its default): one ledger record per save"])]
