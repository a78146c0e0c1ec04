"""Row 8: end to end, CPU only. Train an MLP of ~23 M parameters for K steps
with an asynchronous Checkpointer save every 10 steps and without saving
(interleaved), and restart from the last save in a fresh process.

Reports the throughput overhead of saving (loop time with saves / without)
and the time from a restart (process start) to the first useful step done,
split into interpreter start, import torch, import ckptstore, building
the model, open, resume and the first step, for the recommended
one-pass restart (``resume_verify="cheap"``: sizes at open, every byte
verified once by the restore, which falls back on a mismatch) and for the
default open (``"deep"``: the resume point re-hashed at open, then verified
again by the restore); floor: the verified-restore floor max(raw read, BLAKE3) of the
save's bytes (the files that hold them: its pieces on version 3), measured in
the same round, plus the restarted process's own first training step (what
any restart takes after its state is back: a fresh process's first step pays
torch's allocator and thread-pool warm-up, several times a warm step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.common import IDENTITY, ROOT, Config, Measure, Row, human, interleave, read_file, scratch

EVERY = 10


def build(quick: bool) -> tuple[Any, Any, Any, Any]:
    import torch

    torch.manual_seed(0)
    width, depth = (1024, 3) if quick else (2048, 5)
    layers: list[torch.nn.Module] = [torch.nn.Linear(1024, width), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 1024, generator=g)  # a small batch: 2 shared CPU cores
    y = torch.randint(0, 10, (16,), generator=g)
    return model, opt, x, y


def train_step(model: Any, opt: Any, x: Any, y: Any) -> float:
    import torch

    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return float(loss)


def train(url: str | None, run_id: str, steps: int, quick: bool) -> float:
    """Loop time of ``steps`` steps (the last in-flight save awaited after the clock stops)."""
    from ckptstore import CheckpointStore
    from ckptstore.torch import Checkpointer

    model, opt, x, y = build(quick)
    ck = None
    if url is not None:
        st = CheckpointStore.open(url, run_id, identity=IDENTITY)
        ck = Checkpointer(st, {"model": model, "optimizer": opt}, every_steps=EVERY, handle_signals=False)
        ck.resume()
    train_step(model, opt, x, y)  # warm-up (allocations), not timed
    t = time.perf_counter()
    for step in range(steps):
        train_step(model, opt, x, y)
        if ck is not None:
            ck.step_end(step)
    dt = time.perf_counter() - t
    if ck is not None:
        ck.close()
    return dt


def restart_child(url: str, run_id: str, quick: bool, verify: str = "cheap") -> dict[str, float]:
    """A restarted process: the clock started in the parent just before spawning."""
    t_import = time.time()
    import torch

    t_torch = time.time()
    from ckptstore import CheckpointStore, OpenOptions
    from ckptstore.torch import Checkpointer

    t_imported = time.time()
    model, opt, x, y = build(quick)
    t_built = time.time()
    st = CheckpointStore.open(url, run_id, identity=IDENTITY, options=OpenOptions(resume_verify=verify))  # type: ignore[arg-type]
    t_opened = time.time()
    ck = Checkpointer(st, {"model": model, "optimizer": opt}, every_steps=EVERY, handle_signals=False)
    start = ck.resume()
    t_resumed = time.time()
    with torch.enable_grad():
        train_step(model, opt, x, y)
    ck.step_end(start)
    t_step = time.time()
    ck.close()
    assert start > 0
    return {"start": t_import, "torch": t_torch, "imported": t_imported, "built": t_built, "opened": t_opened, "resumed": t_resumed,
            "stepped": t_step, "resumed_at": start}


def run(cfg: Config) -> list[Row]:
    import blake3

    from ckptstore import CheckpointStore
    from ckptstore.protocol import component_key
    from ckptstore.protocol.layout import piece_key

    steps = 2 * EVERY + 5
    with scratch(cfg.disk_dir, "bench-row8-") as d:
        url = os.path.join(d, "store")
        res = interleave({
            "no saving": lambda r: train(None, "x", steps, cfg.quick),
            f"async save every {EVERY} steps": lambda r: train(url, f"e2e{r + 1}", steps, cfg.quick),
        }, cfg.repeat, warmup=1)  # the warm-up pair pays the process's first training (allocator, thread pool)
        # the restart: from the newest save of the last run
        last = f"e2e{cfg.repeat}"
        rs: list[dict[str, float]] = []
        rs_deep: list[dict[str, float]] = []
        floors: list[float] = []
        ro = CheckpointStore.open(url, last, mode="r")
        ref = ro.latest_complete()
        assert ref is not None
        nbytes = ref.total_bytes
        # the files the save's bytes are in: its pieces (version 3, the default) or its component files
        comps = ref.record.components.values()
        files = sorted({os.path.join(url, piece_key(last, p.holder, p.digest)) for c in comps for p in c.pieces or ()}
                       | {os.path.join(url, component_key(last, ref.save_id, c.name)) for c in comps if c.pieces is None})
        assert files, "the floor reads the files that hold the save"
        model, opt, x, y = build(cfg.quick)
        for _ in range(max(2, cfg.repeat // 3)):
            for verify, out in (("cheap", rs), ("deep", rs_deep)):
                t0 = time.time()
                p = subprocess.run(
                    [sys.executable, "-W", "ignore", "-m", "bench.rows.restart", url, last, str(int(cfg.quick)), verify],
                    cwd=ROOT, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(ROOT)},
                )
                t_end = time.time()
                if p.returncode != 0:
                    raise RuntimeError(p.stderr[-3000:])
                r = json.loads(p.stdout.strip().splitlines()[-1])
                r["spawn"], r["end"] = t0, t_end
                out.append(r)
            # floor in the same round: read every byte of the save, hash every byte, and the restarted
            # process's own first step (the step any restart takes, whatever restored the state: a fresh
            # process's first step pays torch's allocator and thread-pool warm-up, which no restore avoids)
            t = time.perf_counter()
            for f in files:
                read_file(f)
            rd = time.perf_counter() - t
            blobs = [open(f, "rb").read() for f in files]  # noqa: SIM115
            t = time.perf_counter()
            for b in blobs:
                h = blake3.blake3()
                for i in range(0, len(b), 8 << 20):
                    h.update(b[i : i + (8 << 20)])
            hs = time.perf_counter() - t
            del blobs
            floors.append(max(rd, hs) + rs[-1]["stepped"] - rs[-1]["resumed"])
    n_params = sum(p.numel() for p in model.parameters())
    no, yes = res["no saving"], res[f"async save every {EVERY} steps"]
    over = [100 * (b / a - 1) for a, b in zip(no, yes, strict=True)]

    def part(a: str, b: str, runs: list[dict[str, float]] = rs) -> list[float]:
        return [r[b] - r[a] for r in runs]

    return [
        Row("8", f"e2e CPU: {steps} steps, MLP {n_params / 1e6:.1f} M params, state {human(nbytes)}", "s",
            Measure("no saving", no), [Measure(f"async save every {EVERY} steps", yes)],
            {"steps": steps, "params": n_params, "save_bytes": nbytes},
            [f"throughput overhead per pair: {', '.join(f'{o:.1f} %' for o in over)}; CPU only, 2 shared cores"]),
        Row("8b", "e2e CPU: restart to first useful step", "s",
            Measure("max(raw read, BLAKE3) + the restart's first step", floors), [
            Measure("process start to first step done", [r["stepped"] - r["spawn"] for r in rs]),
            Measure("  of which interpreter start", [r["start"] - r["spawn"] for r in rs]),
            Measure("  of which import torch", part("start", "torch")),
            Measure("  of which import ckptstore, ckptstore.torch", part("torch", "imported")),
            Measure("  of which building the model", part("imported", "built")),
            Measure("  of which open (resume_verify=cheap: sizes)", part("built", "opened")),
            Measure("  of which Checkpointer.resume (one verified pass)", part("opened", "resumed")),
            Measure("  of which first step", part("resumed", "stepped")),
            Measure("open + resume + first step (resume_verify=cheap)", part("built", "stepped")),
            Measure("open + resume + first step (default deep open)", part("built", "stepped", rs_deep)),
        ], {"save_bytes": nbytes}),
    ]


if __name__ == "__main__":
    print(json.dumps(restart_child(sys.argv[1], sys.argv[2], sys.argv[3] == "1", *sys.argv[4:5])))
