"""One rank of a frozen-backbone fine-tuning job on a protocol-version-3 run
(pieces, PROTOCOL.md §9), as users write it (gloo on 127.0.0.1).

    python tests/workers/piece_rank_worker.py SPEC_JSON

The spec is tests/workers/dist_launch.py's. Every rank: a frozen backbone
(a 2 MiB weight, the same on every rank) under a trainable head, AdamW on the
head, per-rank data, ``Checkpointer(RankStore(run))`` with its defaults
(asynchronous saves) saving every 2 steps, ``keep_last`` from the args.
Prints ``RESULT`` lines: ``open`` and ``ckpt`` (start step, the final weights
and optimizer moments of the head, as digests of their bytes) or the error of either.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ckptstore import OpenOptions, PieceTiming
from ckptstore.distributed import open_distributed
from ckptstore.distributed.ranked import RankStore
from ckptstore.torch import Checkpointer


def emit(**kw: Any) -> None:
    print("RESULT " + json.dumps(kw, sort_keys=True), flush=True)


def err_json(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "type": type(exc).__name__, "message": str(exc)}


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(run: Any, args: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)  # the same backbone on every rank
    backbone = torch.nn.Linear(1024, 512, bias=False)
    backbone.weight.requires_grad_(False)
    head = torch.nn.Linear(512, 4)
    model = torch.nn.Sequential(backbone, head)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    ckpt = Checkpointer(RankStore(run), {"model": model, "optimizer": opt}, every_steps=2,
                        keep_last=args.get("keep_last"))
    start = ckpt.resume()
    for step in range(start, int(args["stop"])):
        g = torch.Generator().manual_seed(1000 * run.rank + step)  # per-rank data, a function of the step
        x, y = torch.randn(8, 1024, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        ckpt.step_end(step)
    ckpt.close()
    moments = [v for st in opt.state_dict()["state"].values() for _k, v in sorted(st.items()) if torch.is_tensor(v)]
    # digests of the exact bytes (a line of every float would fill the pipe the launcher drains rank by rank)
    return {"ok": True, "start": start, "head": digest(list(head.parameters())), "moments": digest(moments),
            "backbone": digest([backbone.weight]),
            "retention_errors": [str(e) for e in ckpt.retention_errors]}


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(spec["rank"]), int(spec["world"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    args: dict[str, Any] = spec.get("args", {})
    ident = {"data_digest": "d", "code_digest": "c", "world_size": world}
    timing = PieceTiming(window=float(args["window"]), intent_ttl=float(args["intent_ttl"]))
    try:
        run = open_distributed(spec["url"], "run", identity=ident, storage_options=spec.get("opts") or None,
                               timeout=60, save_timeout=30, options=OpenOptions(pieces=timing))
    except Exception as exc:  # noqa: BLE001
        emit(event="open", **err_json(exc))
        dist.destroy_process_group()
        return
    emit(event="open", ok=True, attempt=run.attempt.number)
    try:
        emit(event="ckpt", **train(run, args))
    except Exception as exc:  # noqa: BLE001
        emit(event="ckpt", **err_json(exc))
    ch = run.channel  # keep the rendezvous store (rank 0 hosts it) up until every rank is done
    tag = ch.next()
    ch.post(tag, "done", {})
    if rank == 0:
        ch.gather(tag, "done", timeout=60)
    run.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(3)
