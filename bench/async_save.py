"""Blocking time of an asynchronous save next to a synchronous one, ~1 GiB of state.

    ./dev bench async_save [--mib 1024] [--repeat 3] [--dir PATH]

The model is a stack of Linear layers holding ``mib/3`` MiB of float32
parameters; with Adam's two moments the state is ~``mib`` MiB. Blocking time
is what the training loop waits for; for the async save, the background write
and commit are measured separately.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

from ckptstore import CheckpointStore
from ckptstore.torch import Checkpointer


def build(mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 4096
    n_layers = max(1, (mib * 2**20 // 3) // (width * width * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n_layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():  # materialize Adam state without a costly forward pass
        p.grad = torch.zeros_like(p)
    opt.step()
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    model, opt = build(a.mib)
    nbytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    base = tempfile.mkdtemp(prefix="ckpt-async-", dir=a.dir)
    try:
        st = CheckpointStore.open(base, "bench", identity={"data_digest": "b"})
        results = {}
        for mode in ("sync", "async"):
            ck = Checkpointer(st, {"model": model, "optimizer": opt}, async_save=(mode == "async"),
                              handle_signals=False, record_events=False)
            blocking, total = [], []
            for r in range(a.repeat + 1):  # first async round allocates the host buffers
                step = (0 if mode == "sync" else 100) + r
                t = time.perf_counter()
                ck.save(step)
                blocking.append(ck.last_blocking_seconds)
                ck.wait()
                total.append(time.perf_counter() - t)
            ck.close()
            results[mode] = (statistics.median(blocking[1:]), statistics.median(total[1:]), blocking[0])
        gib = nbytes / 2**30
        print(f"state: {gib:.2f} GiB (model + Adam moments), local disk, median of {a.repeat}")
        print(f"  sync save:  blocks {results['sync'][0]:.3f} s (write, hash, fsync, commit)")
        print(f"  async save: blocks {results['async'][0]:.3f} s (copy into reused host buffers); "
              f"save committed after {results['async'][1]:.3f} s; first async save blocked "
              f"{results['async'][2]:.3f} s (allocating the buffers)")
        print(f"  ratio blocking async/sync: {results['async'][0] / results['sync'][0]:.3f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
