"""Row 9: the coordinator's own cost against world size (issue 23, item 4).

For each world size (``--world-sizes``, default 2,4,8,16) the row starts that
many rank processes (gloo over 127.0.0.1, the rendezvous TCPStore hosted by
rank 0, ``OMP_NUM_THREADS=1``), each holding a tiny state (one 4 KiB
component per rank, so the protocol's own cost shows, not the bytes), and
measures, on one shared clock (``time.monotonic``, system-wide on Linux):

* ``open_distributed``: from the barrier before it to the last rank holding
  its :class:`~ckptstore.distributed.DistributedRun`;
* per ``run.save``: *begin* (the barrier before it to the last rank holding
  the save ID), *last stage done -> commit record created* (the last rank's
  ``put`` returned to the coordinator's ``after_publish`` phase), and *last
  stage done -> every rank returned* (its SaveRef in hand); the coordination
  overhead of a save is begin + that last span;
* the rendezvous store traffic per save, summed over the ranks: requests
  (set/get/check/wait/delete, heartbeats excluded), messages (values set) and
  bytes (values set + got), from :attr:`Channel.counters`;
* ``dcp.save`` of the same tiny state (4 tensors per rank) through the
  project's ``StoreWriter`` against DCP's ``FileSystemWriter(sync_files=True)``
  made durable like every peer of the suite (rank 0 then fsyncs the
  checkpoint's files and directories, ``.metadata`` included), rank 0's
  wall clock between barriers, alternating which goes first.

Medians over ``--repeat`` saves after one warm-up save. The rows' floor is the
smallest world size (the ratio says how the cost grows); a note gives the
least-squares slope in ms per rank. On a 2-core machine 16 ranks means 8
processes per core: the spans include the scheduler's latency.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from bench.common import Config, Measure, Row, free_port, fsync_dir, fsync_tree, run_ranks, scratch

STATE_BYTES = 4096


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: open, ``rounds + 1`` saves, ``rounds + 1`` pairs of dcp.save; its own clock readings."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from ckptstore.distributed import coordinator, open_distributed
    from ckptstore.distributed.dcp import StoreWriter

    warnings.simplefilter("ignore")
    rank, world, rounds = int(spec["rank"]), int(spec["world"]), int(spec["rounds"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    out: dict[str, Any] = {"rank": rank}
    dist.barrier()
    t = time.monotonic()
    run = open_distributed(os.path.join(spec["dir"], "store"), "coord",
                           identity={"bench": "coordination", "world_size": world}, timeout=120, save_timeout=120)
    out["open"] = [t, time.monotonic()]
    phases: dict[str, float] = {}
    def mark(phase: str) -> Callable[[], None]:
        return lambda: phases.__setitem__(phase, time.monotonic())

    if rank == 0:
        for ph in ("before_gather", "before_publish", "after_publish"):
            coordinator.at_phase(ph, mark(ph))
    blob = bytes([rank % 251]) * STATE_BYTES
    saves: list[dict[str, Any]] = []
    for step in range(1, rounds + 2):
        dist.barrier()
        c0 = run.channel.counters
        t_enter = time.monotonic()
        with run.save(step) as s:
            t_begun = time.monotonic()
            s.put(f"rank{rank}/state", blob)
            t_staged = time.monotonic()
        t_done = time.monotonic()
        c = run.channel.counters - c0
        saves.append({"enter": t_enter, "begun": t_begun, "staged": t_staged, "done": t_done, **dict(phases),
                      "requests": c.requests, "messages": c.messages, "bytes": c.bytes_sent + c.bytes_received})
        phases.clear()
    out["saves"] = saves
    g = torch.Generator().manual_seed(rank)
    state = {f"r{rank}.t{i}": torch.randn(256, generator=g) for i in range(4)}
    dcp_times: dict[str, list[float]] = {"fs": [], "store": []}
    step = 1000
    for rnd in range(rounds + 1):
        for kind in (("fs", "store") if rnd % 2 == 0 else ("store", "fs")):
            step += 1
            writer = (FileSystemWriter(os.path.join(spec["dir"], f"fs-{step}"), sync_files=True) if kind == "fs"
                      else StoreWriter(run, step=step))
            dist.barrier()
            t = time.monotonic()
            dcp_save(state, storage_writer=writer)
            if kind == "fs" and rank == 0:  # durable like ours: .metadata and the directory entries too
                fsync_tree(os.path.join(spec["dir"], f"fs-{step}"))
                fsync_dir(spec["dir"])
            dist.barrier()
            if rnd > 0:
                dcp_times[kind].append(time.monotonic() - t)
    out["dcp"] = dcp_times
    dist.barrier()
    run.close()
    dist.destroy_process_group()
    return out


def job(world: int, rounds: int, base: str, timeout: float = 170.0) -> list[dict[str, Any]]:
    """Run ``world`` rank processes to the end; every rank's result."""
    with scratch(base, f"bench-row9-{world}-") as d:
        port = free_port()
        specs = [{"rank": r, "world": world, "port": port, "rounds": rounds, "dir": d} for r in range(world)]
        return run_ranks("bench.rows.coordination", specs, timeout, f"row 9 ({world} ranks)")


def summarize(results: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per-save spans (seconds) and counts across ranks, the warm-up save dropped."""
    n = len(results[0]["saves"])
    coord = results[0]
    out: dict[str, list[float]] = {k: [] for k in ("begin", "to_commit", "to_all", "overhead", "gather", "publish",
                                                   "tell", "requests", "messages", "bytes")}
    for i in range(1, n):
        s = [r["saves"][i] for r in results]
        enter, begun = max(x["enter"] for x in s), max(x["begun"] for x in s)
        staged, done = max(x["staged"] for x in s), max(x["done"] for x in s)
        c = coord["saves"][i]
        out["begin"].append(begun - enter)
        out["to_commit"].append(c["after_publish"] - staged)
        out["to_all"].append(done - staged)
        out["overhead"].append(begun - enter + done - staged)
        out["gather"].append(c["before_publish"] - staged)
        out["publish"].append(c["after_publish"] - c["before_publish"])
        out["tell"].append(done - c["after_publish"])
        for k in ("requests", "messages", "bytes"):
            out[k].append(float(sum(x[k] for x in s)))
    out["open"] = [max(r["open"][1] for r in results) - max(r["open"][0] for r in results)]
    out["dcp_fs"] = list(coord["dcp"]["fs"])
    out["dcp_store"] = list(coord["dcp"]["store"])
    return out


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")


def run(cfg: Config) -> list[Row]:
    sizes = list(cfg.world_sizes)
    rounds = max(2, min(cfg.repeat, 5)) if not cfg.quick else 2
    per: dict[int, dict[str, list[float]]] = {}
    wall: dict[int, float] = {}
    for w in sizes:
        t = time.perf_counter()
        per[w] = summarize(job(w, rounds, cfg.disk_dir))
        wall[w] = time.perf_counter() - t
        print(f"suite: row 9: {w} ranks in {wall[w]:.0f} s", file=sys.stderr, flush=True)
    base = sizes[0]

    def row(item: str, title: str, key: str, unit: str = "s") -> Row:
        ms = [Measure(f"{w} ranks", per[w][key]) for w in sizes]
        r = Row(item, title, unit, Measure(f"{base} ranks", per[base][key]), ms, {"world_sizes": sizes})
        if len(sizes) > 1:
            k = 1000.0 if unit == "s" else 1.0
            med = [statistics.median(per[w][key]) * k for w in sizes]
            r.notes.append(f"least-squares slope {slope(sizes, med):.3g} {'ms' if unit == 's' else unit} per rank "
                           f"(medians {', '.join(f'{m:.3g}' for m in med)} at {', '.join(map(str, sizes))} ranks)")
        return r

    rows = [
        row("9", "coordination per save: begin + last stage done -> every rank returned", "overhead"),
        row("9", "  last stage done -> commit record created", "to_commit"),
        row("9", "  last stage done -> every rank returned", "to_all"),
        row("9", "  begin (save ID to every rank)", "begin"),
        row("9", "  of which gather of the inventories", "gather"),
        row("9", "  of which publish (commit record)", "publish"),
        row("9", "  of which outcome to every rank + acks", "tell"),
        row("9", "rendezvous store requests per save (all ranks, heartbeats excluded)", "requests", "requests"),
        row("9", "rendezvous store messages per save (values set, all ranks)", "messages", "messages"),
        row("9", "rendezvous store bytes per save (set + got, all ranks)", "bytes", "bytes"),
        row("9", "open_distributed (barrier -> last rank open)", "open"),
    ]
    rows[0].notes.append(f"tiny state ({STATE_BYTES} B per rank), gloo on 127.0.0.1, {rounds} saves after one warm-up; "
                         f"wall time per world size: {', '.join(f'{w}: {wall[w]:.0f} s' for w in sizes)}")
    rows[-1].notes.append("one open per world size (a fresh run): no median")
    for w in sizes:
        rows.append(Row("9b", f"dcp.save, tiny state, {w} ranks", "s", Measure("FileSystemWriter(sync_files=True) + fsync of the tree",
                        per[w]["dcp_fs"]), [Measure("ckptstore StoreWriter (published)", per[w]["dcp_store"])],
                        {"world_size": w}))
    return rows


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
