"""One rank of a multi-process test job (gloo on 127.0.0.1).

    python tests/workers/dist_worker.py SPEC_JSON

SPEC: rank, world, port, url, opts, scenario (a name), args (``protocol_version``: of the
run the job creates; absent: the default). Prints one
``RESULT <json>`` line per outcome; the driver (tests/workers/dist_launch.py) reads
them. Faults are real: the process sends itself SIGKILL at the named point.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptstore import OpenOptions
from ckptstore.distributed import coordinator, open_distributed


def emit(**kw: Any) -> None:
    print("RESULT " + json.dumps(kw, sort_keys=True), flush=True)


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def blob(step: int, rank: int, n: int = 200_000) -> bytes:
    seed = f"<{step}:{rank}>".encode()
    return (seed * (n // len(seed) + 1))[:n]


def err_json(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "type": type(exc).__name__, "message": str(exc)}


def save(run: Any, step: int, fault: dict[str, Any] | None) -> dict[str, Any]:
    mine = fault is not None and fault["rank"] == run.rank
    point = fault["point"] if mine and fault else None
    if point in ("before_gather", "before_publish", "after_publish"):
        coordinator.at_phase(point, die)
    # the fault may bound this one save's wait for the ranks' inventories
    timeout = float(fault["save_timeout"]) if fault is not None and "save_timeout" in fault else None
    try:
        with run.save(step, metadata={"step": step}, timeout=timeout) as s:
            if point == "before_write":
                die()
            if point == "raise":
                raise ValueError(f"rank {run.rank} failed on purpose")
            if point == "during_write":

                def chunks() -> Iterator[bytes]:
                    yield blob(step, run.rank)[:1000]
                    die()
                    yield b""

                s.put(f"rank{run.rank}/model", chunks())
            s.put(f"rank{run.rank}/model", blob(step, run.rank))
            s.put(f"rank{run.rank}/extra", blob(step, run.rank, 3000))
            if point == "after_write":
                die()
        assert s.ref is not None
        return {"ok": True, "step": s.ref.step, "save_id": s.ref.save_id, "digest": s.ref.manifest_digest}
    except Exception as exc:  # noqa: BLE001
        return err_json(exc)


def checkpointer(run: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Per-rank RNG and data position through Checkpointer(RankStore(run)):
    train to args.stop (saving every 2 steps), record the draws after each step."""
    import random

    import torch

    from ckptstore.distributed.ranked import RankStore
    from ckptstore.torch import Checkpointer

    class Position:
        def __init__(self) -> None:
            self.pos = 0

        def state_dict(self) -> dict[str, Any]:
            return {"pos": self.pos}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.pos = int(sd["pos"])

    torch.manual_seed(1000 + run.rank)  # per-rank streams
    random.seed(2000 + run.rank)
    model = torch.nn.Linear(3, 2)
    pos = Position()
    ckpt = Checkpointer(RankStore(run), {"model": model, "data": pos}, every_steps=2, async_save=False,
                        handle_signals=False)
    start = ckpt.resume()
    draws = {}
    for step in range(start, int(args["stop"])):
        pos.pos += 1 + run.rank  # each rank walks its own shard of the data
        draws[step] = [float(torch.rand(1)), random.random(), pos.pos]
        ckpt.step_end(step)
    ckpt.close()
    return {"ok": True, "start": start, "draws": draws}


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(spec["rank"]), int(spec["world"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    args: dict[str, Any] = spec.get("args", {})
    ident = args.get("identity", {"data_digest": "d", "code_digest": "c", "world_size": world})
    if spec["scenario"] == "mixed_identity" and rank == 1:
        ident = {**ident, "data_digest": "other"}
    opts = spec.get("opts") or None
    try:
        run = open_distributed(
            spec["url"], "run", identity=ident, storage_options=opts, timeout=float(args.get("timeout", 60)),
            save_timeout=float(args.get("save_timeout", 30)), reshard=bool(args.get("reshard", False)),
            options=OpenOptions(protocol_version=args["protocol_version"]) if "protocol_version" in args else None,
        )
    except Exception as exc:  # noqa: BLE001
        emit(event="open", **err_json(exc))
        return
    emit(event="open", ok=True, attempt=run.attempt.number,
         resumed=run.resumed_from.step if run.resumed_from else None, resharded=run.resharded)
    scenario = spec["scenario"]
    if scenario == "saves":
        for step in args.get("steps", [1]):
            emit(event=f"save{step}", **save(run, step, args.get("faults", {}).get(str(step))))
    elif scenario == "two_places":
        # the same run ID opened a second time, in another store, by the same job
        other = open_distributed(spec["url"] + "-b", "run", identity=ident, storage_options=opts, timeout=60)
        emit(event="other", ok=True, attempt=other.attempt.number)
        emit(event="save1", **save(run, 1, None))
        emit(event="save1b", **save(other, 1, None))
    elif scenario == "checkpointer":
        emit(event="ckpt", **checkpointer(run, args))
    if run.resumed_from is not None:
        try:
            data = run.store.read(run.resumed_from, f"rank{rank}/model")
            emit(event="read", ok=data == blob(run.resumed_from.step, rank))
        except Exception as exc:  # noqa: BLE001 - e.g. a rank added by resharding has no component of its own
            emit(event="read", **err_json(exc))
    # keep the rendezvous store (rank 0) alive until every rank that is still
    # running is done; a rank this job SIGKILLs never answers, so it is not
    # waited for (waiting would only burn the timeout)
    ch = run.channel
    tag = ch.next()
    ch.post(tag, "done", {})
    if rank == 0:
        killed = {int(f["rank"]) for f in args.get("faults", {}).values() if f.get("point") != "raise"}
        with contextlib.suppress(Exception):
            ch.gather(tag, "done", ranks=[r for r in range(world) if r not in killed], timeout=60)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(3)
