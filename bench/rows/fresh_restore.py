"""Row 4f: resume in a fresh process, as a restart does it.

Row 4 restores into the same process round after round, so what each
contender allocates depends on what the rounds before it freed (glibc hands
freed heap memory back without page faults, to the thread that freed it).
A restart is a new process: this row starts one per measurement, builds the
live objects there (a Linear+Adam state, as row 4), then times one restore
into them: ``Checkpointer.open`` + ``resume()`` (the default one-pass path,
every byte verified), against torch.load + load_state_dict of the same state
in the same rounds (interleaved, the order rotated). No floor but the peer:
the ratio is ckptstore / torch.load.

    python -m bench.rows.fresh_restore [--size 256M] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import IDENTITY, ROOT, Config, Measure, Row, human, interleave, markdown, parse_size, scratch

RUN = "row4f"
KINDS = ("ckptstore", "torch.load")


def child(kind: str, url: str, tpath: str, size: int) -> float:
    """In the fresh process: build the live objects, then time one restore into them."""
    import torch

    from bench import torchstate as ts

    model, opt = ts.build(size, seed=2)
    from ckptstore.torch import Checkpointer

    with torch.no_grad():
        t = time.perf_counter()
        if kind == "torch.load":
            ts.torch_load(tpath, model, opt)
        else:
            with Checkpointer.open(url, RUN, IDENTITY, {"model": model, "optimizer": opt}, async_save=False,
                                   handle_signals=False) as ck:
                if ck.resume() != 8:
                    raise AssertionError("resumed from another step than the save's")
        return time.perf_counter() - t


def _spawn(kind: str, url: str, tpath: str, size: int) -> float:
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "bench.rows.fresh_restore", "--child", kind, url, tpath,
                        str(size)], cwd=ROOT, capture_output=True, text=True,
                       env=os.environ | {"PYTHONPATH": str(ROOT)})
    if p.returncode:
        raise RuntimeError(f"row 4f child {kind} failed: {p.stderr[-2000:]}")
    return float(p.stdout.strip().splitlines()[-1])


def run(cfg: Config) -> list[Row]:
    from bench import torchstate as ts
    from ckptstore import CheckpointStore
    from ckptstore.torch import Checkpointer

    with scratch(cfg.disk_dir, "bench-row4f-") as d:
        url, tpath = os.path.join(d, "store"), os.path.join(d, "t.pt")
        model, opt = ts.build(cfg.size, seed=1)
        n = ts.state_bytes(model, opt)
        st = CheckpointStore.open(url, RUN, identity=IDENTITY)
        with Checkpointer(st, {"model": model, "optimizer": opt}, async_save=False, handle_signals=False) as ck:
            ck.save(7)
        st.close()
        ts.torch_save(tpath, model, opt)
        del model, opt
        def contender(kind: str) -> Callable[[int], float]:
            return lambda r: _spawn(kind, url, tpath, cfg.size)

        res = interleave({k: contender(k) for k in KINDS}, max(3, cfg.repeat))
    return [Row("4f", f"resume {human(n)} in a fresh process (a restart), warm page cache", "s",
                Measure("torch.load+load_state_dict", res["torch.load"]),
                [Measure("ckptstore Checkpointer.open+resume (default, one pass)", res["ckptstore"])], {"bytes": n},
                ["one new process per measurement; the live objects are built there first (their build frees "
                 "memory the restore may reuse, as a training script's does); timed: the restore alone"])]


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--child"]:
        kind, url, tpath, size = argv[1:5]
        print(child(kind, url, tpath, int(size)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256M")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    import tempfile

    cfg = Config(size=parse_size(a.size), repeat=a.repeat, disk_dir=tempfile.gettempdir(), shm_dir="/dev/shm",
                 cold=False)
    t0 = time.perf_counter()
    rows = run(cfg)
    meta = {"started": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "size": cfg.size, "repeat": cfg.repeat,
            "wall_seconds": time.perf_counter() - t0}
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
