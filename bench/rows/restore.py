"""Row 4: resume into a live model and optimizer, verified.

ckptstore: ``Checkpointer.open`` + ``resume()``, the default path (the resume
point chosen by its sizes, every byte read once and verified while read), and
``CheckpointStore.open`` with its own default (every byte of the chosen save
re-hashed at open) + ``Checkpointer(...).resume()``, which reads it twice. Peers: torch.load +
load_state_dict, dcp.load in place + load_state_dict. Floor: max(raw read of
the same bytes, BLAKE3 of them in memory), measured in the same round. Warm
page cache, and cold (``drop_caches`` before each measurement) when permitted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import blake3
import torch

from bench import torchstate as ts
from bench.common import (
    IDENTITY,
    Config,
    Measure,
    Row,
    drop_caches,
    human,
    interleave,
    memory_shortfall,
    read_file,
    scratch,
)
from ckptstore import CheckpointStore
from ckptstore.torch import Checkpointer


def fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, bytes]:
    """BLAKE3 of every tensor of the state: what a restore must reproduce,
    without keeping a second copy of the state in memory."""
    return {k: blake3.blake3(memoryview(v.contiguous().view(-1).view(torch.uint8).numpy()),
                             max_threads=blake3.blake3.AUTO).digest()
            for k, v in ts.tensors(model, opt).items()}


def memory_needed(nbytes: int) -> int:
    """The row's peak: the live state, one transient copy (torch.load's fresh
    tensors, the fresh-memory read), and the build's gradients (a third)."""
    return nbytes * 2 + nbytes // 3 + (256 << 20)


def run(cfg: Config) -> list[Row]:
    short = memory_shortfall(memory_needed(cfg.size), f"row 4 at {human(cfg.size)}")
    if short:
        return [Row("4", f"resume {human(cfg.size)}", "s", None, [], {"bytes": cfg.size}, [short])]
    src_model, src_opt = ts.build(cfg.size, seed=1)
    n = ts.state_bytes(src_model, src_opt)
    rows = []
    with scratch(cfg.disk_dir, "bench-row4-") as d:
        url = os.path.join(d, "store")
        st = CheckpointStore.open(url, "row4", identity=IDENTITY)
        with Checkpointer(st, {"model": src_model, "optimizer": src_opt}, async_save=False, handle_signals=False) as ck:
            ck.save(7)
        st.close()
        raw, tpath, dpath = os.path.join(d, "raw.bin"), os.path.join(d, "t.pt"), os.path.join(d, "dcp")
        ts.raw_save(raw, src_model, src_opt)
        ts.torch_save(tpath, src_model, src_opt)
        ts.dcp_save(dpath, src_model, src_opt)
        want = fingerprint(src_model, src_opt)
        del src_model, src_opt  # one copy of the state in memory: the live objects restored into
        model, opt = ts.build(cfg.size, seed=2)
        data = ts.buffers(model, opt)  # the hash floor hashes the state's bytes where they are

        for cold in (False, True) if cfg.cold else (False,):
            def prep(cold: bool = cold) -> None:
                if cold:
                    drop_caches()

            def timed(fn: Callable[[], None], check: bool = True) -> Callable[[int], float]:
                def go(r: int) -> float:
                    for p in model.parameters():  # start from different values each time
                        p.data.fill_(r)
                    prep()
                    t = time.perf_counter()
                    fn()
                    dt = time.perf_counter() - t
                    if check and fingerprint(model, opt) != want:
                        raise AssertionError("restore did not reproduce the saved state")
                    return dt
                return go

            def ours_default() -> None:
                with Checkpointer.open(url, "row4", IDENTITY, {"model": model, "optimizer": opt}, async_save=False,
                                       handle_signals=False) as c:
                    assert c.resume() == 8

            def ours_deep() -> None:
                s = CheckpointStore.open(url, "row4", identity=IDENTITY)
                c = Checkpointer(s, {"model": model, "optimizer": opt}, async_save=False, handle_signals=False)
                assert c.resume() == 8
                c.close()
                s.close()

            def hash_floor() -> None:
                h = blake3.blake3()
                for mv in data:
                    for i in range(0, len(mv), 8 << 20):
                        h.update(mv[i : i + (8 << 20)])
                h.hexdigest()

            def fresh_read_hash() -> None:
                # what any verified restore into new memory pays: page faults of fresh memory, the read, the hash
                with open(raw, "rb", buffering=0) as f:
                    buf = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8)
                    f.readinto(memoryview(buf.numpy()))
                blake3.blake3(memoryview(buf.numpy())).digest()

            contenders: dict[str, Callable[[int], float | None]] = {
                "fresh-memory read, then BLAKE3 (no overlap)": timed(fresh_read_hash, check=False),
                "raw read": timed(lambda: (read_file(raw), None)[1], check=False),
                "BLAKE3 in memory": timed(hash_floor, check=False),
                "ckptstore Checkpointer.open+resume (default, one pass)": timed(ours_default),
                "ckptstore CheckpointStore.open (deep) + resume": timed(ours_deep),
                "torch.load+load_state_dict": timed(lambda: ts.torch_load(tpath, model, opt)),
                "dcp.load+load_state_dict": timed(lambda: ts.dcp_load(dpath, model, opt)),
            }
            with torch.no_grad():
                res = interleave(contenders, cfg.repeat, warmup=0 if cold else 1)
            rd, hs = res.pop("raw read"), res.pop("BLAKE3 in memory")
            floor = Measure("max(raw read, BLAKE3)", [max(a, b) for a, b in zip(rd, hs, strict=True)])
            cache = "cold page cache" if cold else "warm page cache"
            rows.append(Row("4", f"resume {human(n)}, {cache}", "s", floor,
                            [Measure("raw read", rd), Measure("BLAKE3 in memory", hs)] + [Measure(k, v) for k, v in res.items()],
                            {"bytes": n, "cold": cold}))
    if not cfg.cold:
        rows[-1].notes.append("cold-cache rows skipped: writing /proc/sys/vm/drop_caches was refused")
    return rows
