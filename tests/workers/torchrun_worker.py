"""One worker of a real ``torchrun`` job (tests/distributed/test_torchrun.py).

    python -m torch.distributed.run ... tests/workers/torchrun_worker.py SPEC_JSON_FILE

What a user runs: DDP over gloo, ``Checkpointer(RankStore(open_distributed(...)))``
with its defaults (asynchronous saves, signal handling on), a
``ResumableLoader`` per rank over its own shard, a save every 3 steps. Every
event is appended as one JSON line to ``<out>/events.jsonl`` (start, pause,
final, exit). Faults come from the test: at a named point the victim writes a
``pause`` event and sleeps until the test SIGKILLs it (each fault once: the
test creates ``<out>/done-<i>`` when it has killed). A fault with ``settle``
first waits for the saves in flight and the store's background work (the peer
copies, replication) so the kill lands after the newest save was copied.
``tiers`` ({"every": K}): two tiers, each node's local tier
``<out>/node-<GROUP_RANK>`` (the test deletes one to stand for a lost disk).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Subset, TensorDataset

from ckptstore import OpenOptions, TierOptions
from ckptstore.distributed import coordinator, open_distributed
from ckptstore.distributed.ranked import RankStore
from ckptstore.torch import Checkpointer, ResumableLoader

SPEC: dict[str, Any] = json.loads(Path(sys.argv[1]).read_text())
OUT = Path(SPEC["out"])
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
GEN = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def event(ev: str, **kw: Any) -> None:
    line = json.dumps({"ev": ev, "rank": RANK, "gen": GEN, "pid": os.getpid(), "t": time.time(), **kw})
    with open(OUT / "events.jsonl", "a") as f:  # one short append per line
        f.write(line + "\n")


SETTLE: list[Any] = []  # (checkpointer, run) once opened: what a settling fault waits for


def fault_at(point: str, step: int) -> None:
    """Pause here (until the test's SIGKILL) if a fault not yet done names this point."""
    for i, f in enumerate(SPEC.get("faults", [])):
        if f["rank"] == RANK and f["point"] == point and f["step"] == step and not (OUT / f"done-{i}").exists():
            if f.get("settle") and SETTLE:
                ckpt, run = SETTLE
                ckpt.wait()
                event("settled", fault=i, flushed=run.store.flush(30))
            event("pause", fault=i, point=point, step=step)
            while True:
                time.sleep(1)


def patch_saves() -> None:
    """Fault points inside a save (on the save thread)."""
    inner = coordinator.DistributedSave._finish

    def finish(self: coordinator.DistributedSave, report: dict[str, Any]) -> Any:
        fault_at("in_save", self.step)  # components written, inventory not yet sent
        return inner(self, report)

    coordinator.DistributedSave._finish = finish  # type: ignore[method-assign]
    if RANK == 0:
        state = {"step": -1}
        begin = coordinator.DistributedSave.__init__

        def init(self: coordinator.DistributedSave, *a: Any, **kw: Any) -> None:
            begin(self, *a, **kw)
            state["step"] = self.step

        coordinator.DistributedSave.__init__ = init  # type: ignore[method-assign]
        coordinator.at_phase("before_publish", lambda: fault_at("before_publish", state["step"]))


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    out = {}
    for k, v in sorted(model.state_dict().items()):
        out[f"model.{k}"] = hashlib.sha256(v.detach().contiguous().numpy().tobytes()).hexdigest()
    for i, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            if isinstance(v, torch.Tensor):
                out[f"opt.{i}.{k}"] = hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
    return out


def main() -> None:
    faulthandler.dump_traceback_later(50, exit=True)  # a hung worker says where (in the agent's log) and leaves
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    patch_saves()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(48, 4, generator=g), torch.randn(48, 3, generator=g))
    loader = ResumableLoader(Subset(data, range(RANK, len(data), WORLD)), batch_size=2, seed=100 + RANK)
    tiers = SPEC.get("tiers")
    options = None
    if tiers is not None:
        node = os.environ.get("GROUP_RANK", "0")
        options = OpenOptions(tiers=TierOptions(str(OUT / f"node-{node}"), replicate_every=int(tiers["every"]),
                                                peer_copies=tiers.get("peer_copies")))
    run = open_distributed(SPEC["url"], "run", identity={"code_digest": "c", "data_digest": "d", "world_size": WORLD},
                           timeout=30.0, save_timeout=60.0, options=options)
    ckpt = Checkpointer(RankStore(run), {"model": model, "optimizer": opt, "loader": loader}, every_steps=3)
    SETTLE[:] = [ckpt, run]
    start = ckpt.resume()
    event("start", attempt=run.attempt.number, start=start)
    ddp = DistributedDataParallel(model)
    total = int(SPEC["steps"])
    step = start
    try:
        while step < total:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if SPEC.get("preempt_at") == step and RANK == 0:
                    event("preempt-ready", step=step)
                    while not ckpt.preempted:  # the test signals the agent now
                        time.sleep(0.05)
                fault_at("step", step)
                ckpt.step_end(step)
                step += 1
                if step >= total:
                    break
        ckpt.finish(total - 1)
        event("final", digest=digest(model, opt), attempt=run.attempt.number)
        event("exit", code=0)
    except SystemExit as exc:
        event("exit", code=exc.code, step=step)
        raise
    except BaseException as exc:
        event("exit", code="error", error=f"{type(exc).__name__}: {str(exc)[:300]}", step=step)
        raise
    run.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
