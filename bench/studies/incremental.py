"""Bench rows of issue 21 item 4: incremental saves (protocol version 3, pieces
addressed by content) against a full save of today's path (version 2), side
by side in one run, on a local directory. Self-contained:

    ./dev bench study incremental [--mib 256] [--rounds 3] [--saves 100]

Rows (medians, or with ``--stat best`` the best, of ``--rounds``, interleaved;
ratios against the full save):

1. frozen backbone holding 90 % of the parameters, AdamW on the head: bytes
   written per save, save time, restore time (v3 vs v2);
2. full fine-tuning (every tensor changes): save time (v3 vs v2);
3. a store of ``--saves`` such frozen-backbone saves: bytes on storage.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ckptstore import CheckpointStore, OpenOptions
from ckptstore.core.intents import PieceTiming
from ckptstore.torch import Checkpointer

IDENT = {"data_digest": "bench-21", "code_digest": "bench-21"}
DEFAULT_TIMING = PieceTiming()


def model(mib: int, frozen_share: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Square float32 layers of 4 MiB; the first ``frozen_share`` of them frozen."""
    n_layers = max(10, mib // 4)
    width = 1024 if mib >= 40 else 512
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width, bias=False) for _ in range(n_layers)]
    m = torch.nn.Sequential(*layers)
    n_frozen = min(n_layers - 1, round(n_layers * frozen_share))
    for layer in layers[:n_frozen]:
        layer.weight.requires_grad_(False)
    o = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    return m, o


def train(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    o.zero_grad()
    width = next(iter(m.parameters())).shape[1]
    m(torch.randn(4, width)).pow(2).mean().backward()
    o.step()


def touch_all(m: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1e-3)


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_saves(root: Path, version: int, frozen_share: float, mib: int, saves: int, full_ft: bool,
              timing: PieceTiming = DEFAULT_TIMING, restore_repeats: int = 3) -> dict[str, float]:
    """``saves`` saves of one run; the median seconds of the saves after the
    first, bytes written by the last, the best of ``restore_repeats`` restores."""
    path = root / f"v{version}-{frozen_share}-{full_ft}"
    m, o = model(mib, frozen_share)
    store = CheckpointStore.open(path, "run", identity=IDENT,
                                 options=OpenOptions(protocol_version=version, pieces=timing))
    ck = Checkpointer(store, {"model": m, "optimizer": o}, async_save=False, handle_signals=False)
    ck.resume()
    times: list[float] = []
    ref = None
    for s in range(1, saves + 1):
        train(m, o)
        if full_ft:
            touch_all(m)
        if s > 1 and timing.window > 0.5:
            time.sleep(timing.window)  # training time between saves, at least the window (docs/incremental.md)
        t = time.perf_counter()
        ref = ck.save(s, blocking=True)
        if s > 1:
            times.append(time.perf_counter() - t)
    ck.close()
    assert ref is not None
    written = ref.record.bytes_written()
    restores = []
    for _ in range(restore_repeats):  # the best of a few restores (each opens the store afresh)
        m2, o2 = model(mib, frozen_share)
        t = time.perf_counter()
        ck2 = Checkpointer(CheckpointStore.open(path, "run", identity=IDENT, options=OpenOptions(resume_verify="cheap")),
                           {"model": m2, "optimizer": o2}, async_save=False, handle_signals=False)
        ck2.resume()
        restores.append(time.perf_counter() - t)
        ck2.close()
    restore = min(restores)
    return {"save_s": statistics.median(times), "written": written, "total": ref.total_bytes, "restore_s": restore,
            "on_disk": du(path)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="model size (float32 parameters)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--saves", type=int, default=100, help="saves in the storage row")
    ap.add_argument("--store-mib", type=int, default=8, help="model size in the storage row")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--stat", choices=["median", "best"], default="median",
                    help="per row: the median of the rounds, or the best (a shared machine's noise only adds time)")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-inc-", dir=a.dir))
    try:
        rows: dict[str, list[dict[str, float]]] = {}
        for r in range(a.rounds):
            order = [(3, False), (2, False)] if r % 2 else [(2, False), (3, False)]
            for version, full in order + [(3, True), (2, True)][:: (-1 if r % 2 else 1)]:
                out = run_saves(root / str(r), version, 0.9, a.mib, 3, full)
                rows.setdefault(f"v{version}-{'full' if full else 'frozen'}", []).append(out)
            shutil.rmtree(root / str(r), ignore_errors=True)

        def med(key: str, field: str) -> float:
            vals = [x[field] for x in rows[key]]
            return min(vals) if a.stat == "best" else statistics.median(vals)

        full_bytes = med("v2-frozen", "written")
        print(f"model {a.mib} MiB float32, 90 % frozen, AdamW on the rest; {a.stat} of {a.rounds} rounds, "
              f"local disk ({os.cpu_count()} CPUs)")
        print(f"row 1 frozen-90%: bytes written per save  v3 {med('v3-frozen', 'written') / 2**20:8.1f} MiB  "
              f"v2 {full_bytes / 2**20:8.1f} MiB  ratio {med('v3-frozen', 'written') / full_bytes:.3f}")
        print(f"row 1 frozen-90%: save time               v3 {med('v3-frozen', 'save_s'):8.3f} s    "
              f"v2 {med('v2-frozen', 'save_s'):8.3f} s    ratio {med('v3-frozen', 'save_s') / med('v2-frozen', 'save_s'):.3f}")
        rr = med('v3-frozen', 'restore_s') / med('v2-frozen', 'restore_s')
        print(f"row 1 frozen-90%: restore time            v3 {med('v3-frozen', 'restore_s'):8.3f} s    "
              f"v2 {med('v2-frozen', 'restore_s'):8.3f} s    ratio {rr:.3f}")
        print(f"row 2 full fine-tuning: save time         v3 {med('v3-full', 'save_s'):8.3f} s    "
              f"v2 {med('v2-full', 'save_s'):8.3f} s    ratio {med('v3-full', 'save_s') / med('v2-full', 'save_s'):.3f}")
        print(f"row 2 full fine-tuning: restore time      v3 {med('v3-full', 'restore_s'):8.3f} s    "
              f"v2 {med('v2-full', 'restore_s'):8.3f} s    ratio {med('v3-full', 'restore_s') / med('v2-full', 'restore_s'):.3f}")
        quick = PieceTiming(window=0.05, intent_ttl=3600)  # bytes on storage do not depend on the window
        v3 = run_saves(root / "many", 3, 0.9, a.store_mib, a.saves, False, quick, restore_repeats=1)
        v2 = run_saves(root / "many", 2, 0.9, a.store_mib, a.saves, False, quick, restore_repeats=1)
        print(f"row 3 {a.saves} frozen-90% saves of a {a.store_mib} MiB model, no gc: bytes on storage")
        print(f"      v3 {v3['on_disk'] / 2**20:9.1f} MiB  "
              f"v2 {v2['on_disk'] / 2**20:9.1f} MiB  ratio {v3['on_disk'] / v2['on_disk']:.4f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
