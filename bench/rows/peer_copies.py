"""Row 12: peer copies (issue 33): what they cost the training loop, and what
they save when a node's disk is lost.

Two rank processes on two simulated nodes (gloo over 127.0.0.1, the
rendezvous TCPStore hosted by rank 0, ``OMP_NUM_THREADS=1``): rank ``r`` is
node ``node-r`` (``TierOptions.node``) with a local tier root of its own
(``<tmp>/node-r``, standing for that node's disk); the durable tier is a
directory on the same local disk. Each rank holds a part of ``--size / 8``
bytes (32 MiB at the default 256M, 4 MiB with ``--quick``) in four float32
tensors, and a small MLP whose steps stand for training: a step is as many
MLP iterations as make ``EVERY`` steps take about part / :data:`INTERVAL_RATE`
(1 s at 32 MiB; calibrated at start, the slower rank's count), so that a
save's copy (about 0.3 s at 32 MiB on 2 cores) is done before the next save,
as in training, where saves are minutes apart.

Each round runs both modes, the order alternating round by round: *on*
(``peer_copies=1``: each rank's part also copied to the other node after
the acknowledgement, on the save's background thread) and *off* (``peer_copies=0``). A mode's
round is a fresh run:

* ``SAVES`` saves, ``EVERY`` training steps apart, as users save: a
  ``Checkpointer(RankStore(run), {"part": ...})`` with its defaults
  (asynchronous saves: ``save()`` captures the state and returns; the write,
  the local commit, the acknowledgement by every rank and, with peer copies,
  the copies run on its background thread: a save is complete when its
  copies landed), every rank entering after a barrier, with
  ``replicate_every=SAVES``: the durable tier holds the first save of the
  round, the local tiers (and in mode *on* the peer copies) all of them;
* **loop blocked per save**: each rank's time inside ``save()``, the slower
  rank's per save; the background work runs during the next ``EVERY`` steps,
  which are timed too (**steps between saves**: the save's write and the copy
  compete with them for the cores), except after the last save of mode *on*,
  whose copy is timed alone (**copy landed**: ``save()``'s return to both of
  this rank's pairs reporting it in ``replication_status().peers``, the
  slower rank's) against the interval;
* **bytes sent per save**: from ``replication_status().peers`` after
  ``flush()`` (the "sends-to" pair's bytes / copies), against ``k`` x this
  rank's part (k = 1: two nodes);
* then the run is closed, node 1's tier root deleted (its own parts and the
  copies it held of rank 0's), and the job reopened: **recovery** is the
  time from ``open_distributed`` (after a barrier) to the first useful step
  on the slower rank: the open (with peer copies: the repair, node 1's part
  received from rank 0 and written back, every part re-hashed; without: the
  durable resume point's check), the verified read of the rank's part into
  its tensors (``Checkpointer.resume``) and one training step. **Steps lost**: the
  newest step saved minus the step resumed from (``steps_lost_with_local_tier``
  of the ``resume-tier`` event says the same).

Medians over the rounds (every save of every round for the per-save rows).
Floors: mode *off* for the cost rows (ratio = on / off; the issue's goal for
the loop-blocked time is <= 1.05x) and the durable resume for the recovery
row (ratio = peer / durable). Both tiers are on the same local disk here, so
the durable resume reads at local-disk speed: a remote durable tier (S3)
makes it slower, and the steps lost are what the peer copies save in any
case. On a 2-core machine the two ranks, their copy threads and their
replicators share the cores.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

from bench.common import IDENTITY, Config, Measure, MiB, Row, free_port, human, run_ranks, scratch

#: saves per round and mode (the durable tier holds the first, ``replicate_every=SAVES``)
SAVES = 4
#: training steps between saves (a save's step number is a multiple of it)
EVERY = 10
#: tensors per rank's part
TENSORS = 4
MODES = ("on", "off")
#: the steps between two saves take about part / INTERVAL_RATE seconds (1 s at 32 MiB; at least 0.25 s): a
#: copy (about 0.3 s at 32 MiB on the 2-core machine) fits in the interval, as in training, where the
#: interval is minutes
INTERVAL_RATE = 32 * MiB



def landed(run: Any, step: int, since: float, timeout: float = 60.0) -> float | None:
    """Seconds from ``since`` until this rank's copy pairs report ``step`` copied (both ways); None on timeout."""
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        st = run.store.replication_status()
        peers = st.peers if st is not None else ()
        if peers and all(p.last_step == step for p in peers):
            return time.perf_counter() - since
        if any(p.stopped for p in peers):
            return None
        time.sleep(0.002)
    return None


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: for each round, both modes (a fresh run each): saves, flush, node 1 lost, recovery."""
    import torch
    import torch.distributed as dist

    from ckptstore import OpenOptions, TierOptions
    from ckptstore.distributed import RankStore, open_distributed
    from ckptstore.torch import Checkpointer

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    rank, world, rounds, part = int(spec["rank"]), int(spec["world"]), int(spec["rounds"]), int(spec["part"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    g = torch.Generator().manual_seed(rank)
    state = [torch.randn(part // TENSORS // 4, generator=g) for _ in range(TENSORS)]

    class Part(torch.nn.Module):
        """This rank's part: four tensors, saved by the Checkpointer as users save a model."""

        def __init__(self, tensors: list[Any]) -> None:
            super().__init__()
            for j, t in enumerate(tensors):
                self.register_buffer(f"t{j}", t)

    saved, restored = Part(state), Part([torch.zeros_like(t) for t in state])
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)

    def iteration() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()

    # one training step: enough iterations that EVERY steps take about spec["interval"] seconds (the same
    # count on both ranks and in both modes: the slower rank's calibration)
    for _ in range(3):
        iteration()
    t = time.perf_counter()
    for _ in range(20):
        iteration()
    per = (time.perf_counter() - t) / 20
    n = torch.tensor([max(1, round(float(spec["interval"]) / EVERY / per))])
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    iterations = int(n.item())

    def train_step() -> None:
        for _ in range(iterations):
            iteration()
        state[0][0] += 1  # the state moves between saves

    ident = {**IDENTITY, "world_size": world, "bench": "peer_copies"}
    out: dict[str, Any] = {"rank": rank, "rounds": [], "iterations": iterations}
    for rnd in range(rounds):
        for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
            base = os.path.join(spec["dir"], f"{mode}-{rnd}")
            durable, local = os.path.join(base, "durable"), os.path.join(base, f"node-{rank}")
            opts = OpenOptions(tiers=TierOptions(local, replicate_every=SAVES, node=f"node-{rank}",
                                                 peer_copies=1 if mode == "on" else 0, close_flush_seconds=60))

            def open_run(durable: str = durable, opts: OpenOptions = opts) -> Any:
                return open_distributed(durable, "bench", identity=ident, options=opts, timeout=120, save_timeout=120)

            dist.barrier()
            run = open_run()
            ckpt = Checkpointer(RankStore(run), {"part": saved}, handle_signals=False)  # asynchronous saves
            res: dict[str, Any] = {"mode": mode, "round": rnd, "blocked": [], "between": [], "marks": {}}
            for i in range(1, SAVES + 1):
                step = i * EVERY
                dist.barrier()
                t = time.perf_counter()
                ckpt.save(step)  # the loop waits for the state's capture, never for the write or the copies
                res["blocked"].append(time.perf_counter() - t)
                res["marks"][str(step)] = float(state[0][0])
                if i == SAVES and mode == "on":  # the last save's copy, alone: save() returned -> landed both ways
                    res["landed"] = landed(run, step, t + res["blocked"][-1])
                t = time.perf_counter()
                for _ in range(EVERY):
                    train_step()
                res["between"].append(time.perf_counter() - t)
            ckpt.wait()
            t = time.perf_counter()
            res["flushed"] = run.store.flush(120)
            res["flush"] = time.perf_counter() - t
            st = run.store.replication_status()
            res["status"] = st.to_json() if st is not None else None
            last = run.store.latest_complete()  # this rank's part as saved (the tensors, its RNG and state record)
            assert last is not None and last.record.ranks is not None
            res["part"] = sum(last.record.components[n].size for n in last.record.ranks[rank])
            dist.barrier()
            ckpt.close()
            run.close()
            dist.barrier()
            if rank == 1:
                shutil.rmtree(local)  # node 1's disk is lost: its own parts and the copies it held
            dist.barrier()
            t0 = time.monotonic()
            run = open_run()
            t_open = time.monotonic()
            ref = run.resumed_from
            assert ref is not None, "nothing to resume from"
            again = Checkpointer(RankStore(run), {"part": restored}, handle_signals=False)
            again.resume()
            t_read = time.monotonic()
            train_step()
            t_step = time.monotonic()
            assert float(restored.t0[0]) == res["marks"][str(ref.step)], "restored another save's bytes"
            res["recovery"] = {"start": t0, "opened": t_open, "read": t_read, "stepped": t_step,
                               "resumed": ref.step, "tier": ref.tier, "newest": SAVES * EVERY}
            if rank == 0:
                ev = [e["payload"] for e in run.store.events() if e["event"] == "resume-tier"]
                res["resume_tier"] = ev[-1] if ev else None
            dist.barrier()
            again.close()
            run.close()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(base, ignore_errors=True)
            out["rounds"].append(res)
    dist.barrier()
    dist.destroy_process_group()
    return out


def job(rounds: int, part: int, interval: float, base: str, timeout: float = 900.0) -> list[dict[str, Any]]:
    """Run the two rank processes to the end; each rank's result."""
    with scratch(base, "bench-row12-") as d:
        port = free_port()
        specs = [{"rank": r, "world": 2, "port": port, "rounds": rounds, "part": part, "interval": interval,
                  "dir": d} for r in range(2)]
        return run_ranks("bench.rows.peer_copies", specs, timeout, "row 12")


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per mode: per-save spans (the slower rank's), recovery spans (shared clock), bytes and steps lost."""
    out: dict[str, dict[str, list[float]]] = {m: {k: [] for k in (
        "blocked", "between", "landed", "flush", "sent", "part", "k", "recovery", "open", "read_step", "lost", "lost_event",
        "wrote_back")} for m in MODES}
    for i, r0 in enumerate(results[0]["rounds"]):
        per = [r["rounds"][i] for r in results]
        m = out[r0["mode"]]
        for j in range(SAVES):
            m["blocked"].append(max(p["blocked"][j] for p in per))
        for j in range(SAVES - 1):  # the last save's steps run after its copy landed (measured alone)
            m["between"].append(max(p["between"][j] for p in per))
        if all(p.get("landed") is not None for p in per) and r0["mode"] == "on":
            m["landed"].append(max(p["landed"] for p in per))
        m["flush"].append(max(p["flush"] for p in per))
        for p in per:
            sends = [x for x in (p["status"] or {}).get("peers", []) if x["role"] == "sends-to"]
            m["k"].append(float(len(sends)))
            m["part"].append(float(p["part"]))
            m["sent"].extend(x["bytes"] / x["copies"] for x in sends if x["copies"])
        rec = [p["recovery"] for p in per]
        start = max(x["start"] for x in rec)
        m["recovery"].append(max(x["stepped"] for x in rec) - start)
        m["open"].append(max(x["opened"] for x in rec) - start)
        m["read_step"].append(max(x["stepped"] for x in rec) - max(x["opened"] for x in rec))
        m["lost"].append(float(rec[0]["newest"] - rec[0]["resumed"]))
        ev = r0.get("resume_tier") or {}
        if isinstance(ev.get("steps_lost_with_local_tier"), int):
            m["lost_event"].append(float(ev["steps_lost_with_local_tier"]))
        sources = [v.get("source") for v in (ev.get("ranks") or {}).values() if isinstance(v, dict)]
        m["wrote_back"].append(float(sum(1 for s in sources if isinstance(s, dict) and s.get("from") == "peer"
                                         and s.get("ok"))))
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run(cfg: Config) -> list[Row]:
    part = min(max(cfg.size // 8, MiB), 512 * MiB)
    if cfg.quick:
        part = min(part, 4 * MiB)
    part -= part % (TENSORS * 4)
    rounds = 2 if cfg.quick else max(2, min(cfg.repeat, 5))
    interval = max(0.25, part / INTERVAL_RATE)
    t = time.perf_counter()
    results = job(rounds, part, interval, cfg.disk_dir)
    s = summarize(results)
    wall = time.perf_counter() - t
    on, off = s["on"], s["off"]
    params = {"part_bytes": part, "ranks": 2, "nodes": 2, "saves_per_round": SAVES, "every": EVERY, "rounds": rounds,
              "interval_target_s": round(interval, 3), "iterations_per_step": results[0]["iterations"]}
    blocked = Row("12", f"peer copies: loop blocked per save (Checkpointer.save, asynchronous), part {human(part)} per rank",
                  "s", Measure("peer_copies=0", off["blocked"]), [Measure("peer_copies=1", on["blocked"])], params)
    ratio = blocked.ratio(blocked.contenders[0])
    blocked.notes.append(
        f"on/off {ratio:.2f}x (goal <= 1.05x); 2 ranks on 2 simulated nodes (gloo on 127.0.0.1), both tiers on the "
        f"local disk, {rounds} rounds x {SAVES} saves per mode, modes alternating; row wall time {wall:.0f} s; "
        f"{os.cpu_count()} shared cores")
    between = Row("12", f"peer copies: {EVERY} training steps after a save (the copy runs beside them)", "s",
                  Measure("peer_copies=0", off["between"]), [Measure("peer_copies=1", on["between"])], params)
    between.notes.append(f"each step {results[0]['iterations']} MLP iterations, calibrated so that {EVERY} steps take "
                         f"about {interval:.2f} s; flush() after the last save (copies, then replication): "
                         f"on {_med(on['flush']) * 1000:.0f} ms, off {_med(off['flush']) * 1000:.0f} ms")
    copy = Row("12", "peer copies: the last save's copy, save() returned -> landed both ways (alone)", "s",
               Measure(f"{EVERY} training steps (the interval, peer_copies=0)", off["between"]),
               [Measure("copy landed (replication_status().peers)", on["landed"])], params)
    copy.notes.append("ratio < 1: the copy of a save is done before the next save starts; a shorter interval makes "
                      "the next save run beside the copy (and its loop-blocked time grow)")
    k = _med(on["k"]) if on["k"] else float("nan")
    sent = Row("12", "peer copies: bytes sent per save per rank", "MiB", Measure(f"k ({k:g}) x the part",
               [k * p / MiB for p in on["part"]]), [Measure("sent (replication_status().peers)",
                                                            [b / MiB for b in on["sent"]])], params)
    sent.notes.append(f"bytes sent per save {_med(on['sent']):.0f} against a part of {_med(on['part']):.0f} bytes "
                      f"(k = {k:g}); off: {len(off['sent'])} copies sent")
    recovery = Row("12", "peer copies: node 1's disk lost, open to the first useful step", "s",
                   Measure("peer_copies=0: resume from the durable tier", off["recovery"]),
                   [Measure("peer_copies=1: resume from the local tiers (node 1's part written back from the peer)",
                            on["recovery"])], params)
    rec_open = Row("12", "  of which open_distributed (peer: the repair and write-back; durable: the check)", "s",
                   Measure("peer_copies=0", off["open"]), [Measure("peer_copies=1", on["open"])], params)
    rec_read = Row("12", "  of which verified read of the part into its tensors + one training step", "s",
                   Measure("peer_copies=0 (from the durable tier)", off["read_step"]),
                   [Measure("peer_copies=1 (from the local tier)", on["read_step"])], params)
    recovery.notes.append(
        f"the durable tier is on the same local disk (a remote one reads slower); parts written back from a peer "
        f"per recovery: on {_med(on['wrote_back']):g}, off {_med(off['wrote_back']):g}")
    lost = Row("12", f"peer copies: steps lost when node 1's disk is lost (a save every {EVERY} steps)", "steps", None,
               [Measure("peer_copies=1", on["lost"], f"resume-tier says {_med(on['lost_event']):g}"),
                Measure("peer_copies=0", off["lost"], f"resume-tier says {_med(off['lost_event']):g}")], params)
    lost.notes.append(f"replicate_every={SAVES}: the durable tier holds the first of the {SAVES} saves of a run, "
                      "so resuming from it loses the steps of the other saves")
    return [blocked, between, copy, sent, recovery, rec_open, rec_read, lost]


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
