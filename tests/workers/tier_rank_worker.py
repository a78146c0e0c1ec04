"""One rank of a two-tier multi-rank test job (gloo on 127.0.0.1).

    python tests/workers/tier_rank_worker.py SPEC_JSON

SPEC (tests/workers/dist_launch.py): rank, world, port, url (the durable
tier), args: ``local`` (the job's local_tier: rank r uses ``<local>/rank-<r>``),
``steps``, ``every`` (replicate_every), ``flush`` (seconds each rank waits for
replication after its saves), ``kill`` ({"rank", "step"}: that rank SIGKILLs
itself when its replicator starts uploading its part of that step, once its
``save()`` of that step returned: the save is acknowledged on every rank),
``protocol_version`` (of the run the job creates; 3: pieces, with a short
``PieceTiming`` window, and each rank also writes ``rank<r>/frozen``, the same
bytes at every step), ``fault``
({"rank", "step", "point", "action"}: that rank runs ``die`` (SIGKILL) or
raises at the :func:`ckptstore.distributed.coordinator.at_phase` point
``point`` of that step's save), ``timeout`` (the channel's deadline),
``nodes`` ({rank: node name}: ``TierOptions.node``, e.g. every rank its own
node so that peer copies are kept), ``peer_copies`` (``TierOptions.peer_copies``),
``kill_in_copy`` ({"rank", "step"}: that rank SIGKILLs itself part way into
sending its peer copy of that step, once the save was acknowledged).
Prints ``RESULT <json>`` lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import threading
import traceback
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptstore import AuthOptions, OpenOptions, PieceTiming, TierOptions, keyring_from_file
from ckptstore.distributed import coordinator, open_distributed
from ckptstore.tiers import parts, peer_copies
from tests.workers.dist_worker import blob, checkpointer, die, emit, err_json, save


def fail() -> None:
    raise OSError(28, "No space left on device (injected)")


def frozen(rank: int, n: int = 1_500_000) -> bytes:
    """Rank ``rank``'s frozen component: the same bytes at every step (its pieces are reused)."""
    return random.Random(rank).randbytes(n)


def save_pieced(run: Any, step: int) -> dict[str, Any]:
    """A version-3 save of this rank's part: ``model`` and ``extra`` (new at
    each step) and ``frozen`` (unchanged)."""
    try:
        with run.save(step, metadata={"step": step}) as s:
            s.put(f"rank{run.rank}/model", blob(step, run.rank))
            s.put(f"rank{run.rank}/extra", blob(step, run.rank, 3000))
            s.put(f"rank{run.rank}/frozen", frozen(run.rank))
        assert s.ref is not None
        return {"ok": True, "step": s.ref.step, "save_id": s.ref.save_id, "digest": s.ref.manifest_digest}
    except Exception as exc:  # noqa: BLE001
        return err_json(exc)


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(spec["rank"]), int(spec["world"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    args: dict[str, Any] = spec.get("args", {})
    kill = args.get("kill")
    returned = threading.Event()  # this rank's save() of the kill step returned
    if kill is not None and int(kill["rank"]) == rank:
        upload = parts.upload_components

        def killing_upload(local: Any, durable: Any, ref: Any, names: Any = None, on_component: Any = None,
                           **kw: Any) -> None:
            if ref.step == int(kill["step"]):
                returned.wait(60)  # the upload starts at the local commit: die once every rank was told
                die()  # this rank's part of the step never reaches the durable tier
            upload(local, durable, ref, names, on_component, **kw)

        parts.upload_components = killing_upload  # type: ignore[assignment]
    copy_kill = args.get("kill_in_copy")
    if copy_kill is not None and int(copy_kill["rank"]) == rank:
        send = peer_copies.send_part

        def dying_send(link: Any, dst: int, step: int, record: Any, read: Any, names: Any) -> Any:
            if step == int(copy_kill["step"]) and record is not None:
                link.send(dst, b"\0" * 32)  # part of a frame's header is out, then the process dies
                die()
            return send(link, dst, step, record, read, names)

        peer_copies.send_part = dying_send  # type: ignore[assignment]
    ident = {"data_digest": "d", "code_digest": "c", "world_size": world}
    version = args.get("protocol_version")
    try:
        run = open_distributed(
            spec["url"], "run", identity=ident, storage_options=spec.get("opts") or None,
            timeout=float(args.get("timeout", 30)), save_timeout=20,
            options=OpenOptions(tiers=TierOptions(args["local"], replicate_every=int(args.get("every", 1)),
                                                  close_flush_seconds=float(args.get("close_flush", 10)),
                                                  node=(args.get("nodes") or {}).get(str(rank)),
                                                  peer_copies=args.get("peer_copies")),
                                auth=AuthOptions("require", keyring_from_file(args["key_file"]))
                                if args.get("key_file") else AuthOptions(),
                                protocol_version=version, pieces=PieceTiming(window=0.2) if version == 3 else PieceTiming()),
        )
    except Exception as exc:  # noqa: BLE001
        emit(event="open", **err_json(exc))
        return
    ref = run.resumed_from
    emit(event="open", ok=True, attempt=run.attempt.number, resumed=ref.step if ref else None,
         tier=ref.tier if ref else None)
    if ref is not None:
        try:
            data = run.store.read(ref, f"rank{rank}/model")
            ok = data == blob(ref.step, rank)
            if version == 3:
                ok = ok and run.store.read(ref, f"rank{rank}/frozen") == frozen(rank)
            emit(event="read", ok=ok, tier=ref.tier)
        except Exception as exc:  # noqa: BLE001
            emit(event="read", **err_json(exc))
    if "stop" in args:  # Checkpointer(RankStore(run)) on top, unchanged
        emit(event="ckpt", **checkpointer(run, args))
        from ckptstore.distributed.ranked import RankStore

        emit(event="durable", ok=RankStore(run).make_durable(20))  # collective: the coordinator's answer
    fault = args.get("fault")
    for step in args.get("steps", []):
        faulty = fault is not None and int(fault["rank"]) == rank and int(fault["step"]) == step
        if faulty:
            coordinator.at_phase(fault["point"], die if fault.get("action", "die") == "die" else fail)
        emit(event=f"save{step}", **(save_pieced(run, step) if version == 3 else save(run, step, None)))
        if kill is not None and int(kill["step"]) == step:
            returned.set()
        if faulty:
            coordinator.at_phase(fault["point"], None)
    if args.get("flush"):
        flushed = run.store.flush(float(args["flush"]))
        status = run.store.replication_status()
        emit(event="flush", ok=flushed, status=status.to_json() if status is not None else None)
    ch = run.channel
    tag = ch.next()
    ch.post(tag, "done", {})
    if rank == 0:
        killed = {int(f["rank"]) for f in (kill, fault, copy_kill) if f is not None and f.get("action", "die") == "die"}
        with contextlib.suppress(Exception):
            ch.gather(tag, "done", ranks=[r for r in range(world) if r not in killed], timeout=60)
    run.close()
    emit(event="closed", ok=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(3)
