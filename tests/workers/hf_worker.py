"""One rank of a multi-process Hugging Face callback job (gloo on 127.0.0.1).

    python tests/workers/hf_worker.py SPEC_JSON

SPEC (tests/workers/dist_launch.py): rank, world, port, url, opts, scenario (``ops``), args. ``args["ops"]``
runs in order on every rank, each printing one ``RESULT <json>`` line (event ``op<i>``):

* ``{"op": "publish", "step": N}``: ``StoreCallback.on_save`` for step N (the ``checkpoint-N``
  directory is already in ``args["out"]``); rank 0's store is opened at the first save with
  ``single_writer=True`` (the "rank 0 saves" pattern).
* ``{"op": "restore", "out": DIR, "run": RUN_ID}``: ``restore_latest`` of that run into DIR.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist
from transformers import TrainerControl, TrainerState

from ckptstore import CheckpointStore, OpenOptions
from ckptstore.integrations.hf import StoreCallback, restore_latest


def emit(**kw: Any) -> None:
    print("RESULT " + json.dumps(kw, sort_keys=True), flush=True)


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(spec["rank"]), int(spec["world"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    args: dict[str, Any] = spec["args"]
    opts = spec.get("opts") or None
    if spec["scenario"] != "ops":
        raise SystemExit(f"unknown scenario {spec['scenario']!r}")
    cb = StoreCallback(lambda: CheckpointStore.open(
        spec["url"], args["run"], identity=args["identity"], options=OpenOptions(single_writer=True),
        storage_options=opts))
    try:
        for i, op in enumerate(args["ops"]):
            try:
                if op["op"] == "publish":
                    cb.on_save(SimpleNamespace(output_dir=args["out"]), TrainerState(global_step=op["step"]),  # type: ignore[arg-type]
                               TrainerControl())
                    emit(event=f"op{i}", ok=True, published=[r.step for r in cb.published])
                else:
                    path = restore_latest(spec["url"], op["out"], run_id=op["run"], storage_options=opts)
                    emit(event=f"op{i}", ok=True, path=path)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                emit(event=f"op{i}", ok=False, type=type(exc).__name__, message=str(exc))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(3)
