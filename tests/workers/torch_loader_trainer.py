"""A training process for the loader kill tests (tests/pytorch/test_loaders.py).

    python tests/workers/torch_loader_trainer.py STORE RUN --loader KIND [--steps N] [--save-every K]
        [--log FILE] [--result FILE] [--step-sleep S]

What a skeptical user runs: BatchNorm, dropout, AdamW, linear warm-up then
cosine, gradient accumulation (2 micro-batches), clipping, a grad scaler,
shuffled data with sample IDs and random augmentation in the dataset, async
saves with retention. KIND picks the loader:

* ``sampler0``   plain DataLoader + ResumableSampler, no workers, *no* generator (the pitfall)
* ``rloader0``   ResumableLoader, no workers
* ``rloader2``   ResumableLoader, 2 workers
* ``sdl0``       torchdata StatefulDataLoader, no workers, generator=
* ``sdl2``       torchdata StatefulDataLoader, 2 workers, no generator, WorkerRngState
* ``sdl2raw``    the same *without* WorkerRngState (warned at build time: augmentation in workers not saved)
* ``sampler2``   plain DataLoader + ResumableSampler, 2 workers (warned at the first batch: prefetch, worker RNG)

Lines on stdout: ``FRESH`` / ``RESUMED <step>``, ``STEP <k>``, ``COMMITTED <k>``,
``FINAL <digest>``. The log has one line per micro-batch:
``step micro ids digest-of-inputs`` (the inputs include the augmentation).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ckptstore import CheckpointStore
from ckptstore.torch import (
    Checkpointer,
    ResumableLoader,
    ResumableSampler,
    WorkerRngState,
)

N, D, BATCH, ACCUM = 48, 8, 4, 2


class Receipts(torch.utils.data.Dataset[Any]):
    """Fixed features; each fetch adds random augmentation (torch noise, a python-random flip)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(N, D, generator=g)
        self.y = torch.randint(0, 3, (N,), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = self.x[i] + 0.1 * torch.randn(D)
        if random.random() < 0.5:
            x = -x
        x = x + float(np.random.uniform(-0.01, 0.01))
        return x, self.y[i], 1000 + i


def build_loader(kind: str, ds: Receipts) -> tuple[Any, dict[str, Any]]:
    """(iterable of batches, objects to register)"""
    if kind == "sampler0":
        sampler = ResumableSampler(N, seed=3)
        dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler)  # no generator=: the pitfall
        return dl, {"sampler": sampler}
    if kind == "sampler2":
        sampler = ResumableSampler(N, seed=3)
        dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2,
                                         generator=torch.Generator().manual_seed(3))
        return dl, {"sampler": sampler}
    if kind in ("rloader0", "rloader2"):
        rl = ResumableLoader(ds, batch_size=BATCH, seed=3, num_workers=2 if kind == "rloader2" else 0)
        return rl, {"loader": rl}
    from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]

    if kind == "sdl0":
        sdl = StatefulDataLoader(ds, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(3))
    elif kind == "sdl2":
        sdl = StatefulDataLoader(WorkerRngState(ds), batch_size=BATCH, shuffle=True, num_workers=2)
    elif kind == "sdl2raw":
        sdl = StatefulDataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2)
    else:
        raise SystemExit(f"unknown loader {kind}")
    return sdl, {"loader": sdl}


def digest(*trees: Any) -> str:
    h = hashlib.blake2b(digest_size=16)

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(x.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    for t in trees:
        walk(t)
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("run")
    ap.add_argument("--loader", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--log")
    ap.add_argument("--result")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--forget-data", action="store_true", help="control: do not save/restore the data position")
    a = ap.parse_args()

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    ds = Receipts()
    loader, data_objs = build_loader(a.loader, ds)
    model = torch.nn.Sequential(
        torch.nn.Linear(D, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.05)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=3)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps - 3)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[3])
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    ident = {"data_digest": "receipts-48", "code_digest": "loader-trainer", "optimizer_revision": "adamw",
             "feature_contract": a.loader}
    store = CheckpointStore.open(a.store, a.run, identity=ident)
    ckpt = Checkpointer(
        store,
        {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler,
         **({} if a.forget_data else data_objs)},
        every_steps=a.save_every,
        keep_last=3,
    )
    start = ckpt.resume()
    print("FRESH" if start == 0 else f"RESUMED {start - 1}", flush=True)
    log = open(a.log, "a") if a.log else None  # noqa: SIM115

    def batches() -> Iterator[Any]:
        while True:
            yield from loader

    it = batches()
    crit = torch.nn.CrossEntropyLoss()
    seen = 0
    for step in range(start, a.steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(ACCUM):
            x, y, ids = next(it)
            if log:
                log.write(f"{step} {micro} {','.join(map(str, ids.tolist()))} {digest(x)}\n")
            loss = crit(model(x), y) / ACCUM
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
        if log:
            log.flush()
        if a.step_sleep:
            time.sleep(a.step_sleep)
        print(f"STEP {step}", flush=True)
        ckpt.step_end(step)
        while seen < len(ckpt.saves):
            print(f"COMMITTED {ckpt.saves[seen]['step']}", flush=True)
            seen += 1
    ckpt.finish(a.steps - 1)
    final = digest(model.state_dict(), opt.state_dict(), sched.state_dict(), scaler.state_dict())
    if a.result:
        with open(a.result, "w") as f:
            json.dump({"final_digest": final, "resumed_from": start - 1 if start else None,
                       "steps_kept": sorted(i.step for i in ckpt.store.list_saves())}, f)
    print(f"FINAL {final}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
