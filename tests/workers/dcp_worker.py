"""One rank of a DCP test job: DTensor save/load through the store (gloo, CPU).

    python tests/workers/dcp_worker.py SPEC_JSON      (see tests/workers/dist_launch.py)

Scenarios: "save" (dcp.save of a row-sharded DTensor, a replicated tensor and
a nested dict at args.step, then dcp.async_save at step+1 unless disabled),
"load" (load into this job's own sharding and compare with the expected
values), "fail" (args.fail_rank raises or is SIGKILLed inside write_data).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptstore.distributed import open_distributed
from ckptstore.distributed.dcp import StoreReader, StoreWriter

ROWS, COLS = 12, 5


def emit(**kw: Any) -> None:
    print("RESULT " + json.dumps(kw, sort_keys=True), flush=True)


def expected(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(ROWS, COLS, generator=g), "b": torch.randn(COLS, generator=g),
            "opt.m": torch.arange(7, dtype=torch.float64) * step}


def state_for(world: int, values: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    src = values or {k: torch.zeros_like(v) for k, v in expected(0).items()}
    return {
        "model": {"w": distribute_tensor(src["w"].clone(), mesh, [Shard(0)]),
                  "b": distribute_tensor(src["b"].clone(), mesh, [Replicate()])},
        "optim": {"m": src["opt.m"].clone()},
    }


def check(state: dict[str, Any], step: int) -> bool:
    exp = expected(step)
    w = state["model"]["w"]
    full = w.full_tensor() if isinstance(w, DTensor) else w
    b = state["model"]["b"]
    fb = b.full_tensor() if isinstance(b, DTensor) else b
    return bool(torch.equal(full, exp["w"]) and torch.equal(fb, exp["b"]) and torch.equal(state["optim"]["m"], exp["opt.m"]))


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(spec["rank"]), int(spec["world"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    args: dict[str, Any] = spec.get("args", {})
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=float(args.get("pg_timeout", 60))))
    ident = {"data_digest": "d", "code_digest": "c", "world_size": world}
    try:
        run = open_distributed(spec["url"], "run", identity=ident, storage_options=spec.get("opts") or None,
                               timeout=30, reshard=bool(args.get("reshard", False)))
    except Exception as exc:  # noqa: BLE001
        emit(event="open", ok=False, type=type(exc).__name__, message=str(exc))
        dist.destroy_process_group()
        return
    emit(event="open", ok=True, resumed=run.resumed_from.step if run.resumed_from else None, resharded=run.resharded)
    scenario, step = spec["scenario"], int(args.get("step", 1))
    if scenario == "save":
        state = state_for(world, expected(step))
        w = StoreWriter(run, step=step, thread_count=int(args.get("threads", 1)))
        dcp.save(state, storage_writer=w)
        emit(event="save", ok=True, ref=w.ref.save_id if w.ref else None)
        if args.get("async", True):
            state2 = state_for(world, expected(step + 1))
            fut = dcp.async_save(state2, storage_writer=StoreWriter(run, step=step + 1))
            fut.result(timeout=60)
            emit(event="async_save", ok=True)
    elif scenario == "load":
        state = state_for(world, None)
        dcp.load(state, storage_reader=StoreReader(run))
        emit(event="load", ok=check(state, run.resumed_from.step if run.resumed_from else -1),
             step=run.resumed_from.step if run.resumed_from else None)
    elif scenario == "fail":
        fail_rank, how = int(args["fail_rank"]), args["how"]
        if rank == fail_rank:
            orig = StoreWriter._write_component

            def broken(self: StoreWriter, *a: Any, **kw: Any) -> Any:
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(f"disk full on rank {rank} (injected)")

            StoreWriter._write_component = broken  # type: ignore[method-assign]
            _ = orig
        state = state_for(world, expected(step))
        try:
            dcp.save(state, storage_writer=StoreWriter(run, step=step))
            emit(event="save", ok=True)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            emit(event="save", ok=False, type=type(exc).__name__, message=str(exc)[:2000])
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(3)
