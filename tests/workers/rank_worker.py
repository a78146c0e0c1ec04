"""One rank of a multi-process training job as users write it (gloo on 127.0.0.1).

    python tests/workers/rank_worker.py SPEC_JSON

The spec is tests/workers/dist_launch.py's (rank, world, port, url, opts, scenario,
args). Scenario ``train``: DDP over a tiny model, an SGD optimizer, a
:class:`ResumableLoader` sharded like ``DistributedSampler``, per-rank RNG,
``Checkpointer(RankStore(run))`` with its defaults (asynchronous saves, signal
handling) saving every 2 steps, ``keep_last`` from the args. Optional args: ``auth_policy`` and ``key_file``
(:func:`ckptstore.keyring_from_file`; None: no keyring), each one value for
every rank or a list with one per rank; ``protocol_version``; ``metrics_path``
(``{rank}`` is replaced by the rank). Prints ``RESULT``
lines: ``open``, ``ckpt`` (start step, per-step batch indices and RNG draws,
the final weights) or the error of either.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ckptstore import AuthOptions, OpenOptions, keyring_from_file
from ckptstore.distributed import open_distributed
from ckptstore.distributed.ranked import RankStore
from ckptstore.torch import Checkpointer, ResumableLoader

N = 22  # not a multiple of 2 or 3 ranks: DistributedSampler pads


def emit(**kw: Any) -> None:
    print("RESULT " + json.dumps(kw, sort_keys=True), flush=True)


def err_json(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "type": type(exc).__name__, "message": str(exc)}


class Indexed(torch.utils.data.Dataset[Any]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(N, 4, generator=g), torch.randn(N, 2, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i], i


def per_rank(args: dict[str, Any], name: str, rank: int, default: Any = None) -> Any:
    """``args[name]``: one value for every rank, or a list with one per rank."""
    v = args.get(name, default)
    return v[rank] if isinstance(v, list) else v


def train(run: Any, args: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = torch.nn.Linear(4, 2)
    ddp = DistributedDataParallel(model)
    if args.get("adam_on_rank") == run.rank:  # a rank whose objects do not fit the save
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = ResumableLoader(Indexed(), batch_size=2, seed=7, num_replicas=run.world_size, rank=run.rank)
    torch.manual_seed(100 + run.rank)  # per-rank training randomness
    metrics = args.get("metrics_path")
    metrics = None if metrics is None else str(metrics).replace("{rank}", str(run.rank))
    ckpt = Checkpointer(RankStore(run), {"model": model, "optimizer": opt, "loader": loader}, every_steps=2,
                        keep_last=args.get("keep_last"), metrics_path=metrics)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = ckpt.resume()
    steps: dict[int, Any] = {}
    step = start
    stop = int(args["stop"])
    while step < stop:
        for x, y, idx in loader:
            noise = float(torch.rand(1))  # per-rank randomness after every step
            opt.zero_grad()
            (ddp(x) - y).pow(2).mean().backward()
            opt.step()
            steps[step] = [idx.tolist(), noise]
            ckpt.step_end(step)
            step += 1
            if step >= stop:
                break
    ckpt.close()
    weights = [p.detach().double().flatten().tolist() for p in model.parameters()]
    return {"ok": True, "start": start, "steps": steps, "weights": weights,
            "warnings": [str(w.message) for w in caught], "retention_errors": ckpt.retention_errors,
            "attempt": run.attempt.number, "resumed": run.resumed_from.step if run.resumed_from else None}


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(spec["rank"]), int(spec["world"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    args: dict[str, Any] = spec.get("args", {})
    ident = args.get("identity", {"data_digest": "d", "code_digest": "c", "world_size": world})
    key_file = per_rank(args, "key_file", rank)
    try:
        keyring = None if key_file is None else keyring_from_file(key_file)
        run = open_distributed(
            spec["url"], "run", identity=ident, storage_options=spec.get("opts") or None, timeout=60,
            save_timeout=30, reshard=bool(args.get("reshard", False)),
            options=OpenOptions(resume_verify=args.get("resume_verify", "deep"),
                                auth=AuthOptions(per_rank(args, "auth_policy", rank, "off"), keyring),
                                protocol_version=args.get("protocol_version")),
        )
    except Exception as exc:  # noqa: BLE001
        emit(event="open", **err_json(exc))
        dist.destroy_process_group()
        return
    emit(event="open", ok=True, attempt=run.attempt.number, resharded=run.resharded,
         protocol_version=run.store.run_record["protocol_version"])
    try:
        emit(event="ckpt", **train(run, args))
    except Exception as exc:  # noqa: BLE001
        emit(event="ckpt", **err_json(exc))
    # keep the rendezvous store (rank 0 hosts it) up until every rank is done
    ch = run.channel
    tag = ch.next()
    ch.post(tag, "done", {})
    if rank == 0:
        ch.gather(tag, "done", timeout=60)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(3)
