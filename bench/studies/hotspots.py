"""Where the time goes in the suite's worst rows: cProfile of one call.

    ./dev bench study hotspots resume [--size 256M] [--verify deep|cheap]   # row 4: open + Checkpointer.resume
    ./dev bench study hotspots list_saves [--history 10000]                 # row 6 (tmpfs)
    ./dev bench study hotspots latest [--history 10000]                     # row 5 (tmpfs)
    ./dev bench study hotspots save [--size 256M]                           # row 2: Checkpointer.save (sync)

Prints the top functions by cumulative and by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import IDENTITY, parse_size, scratch


def report(fn: Callable[[], object], top: int) -> str:
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    out = io.StringIO()
    st = pstats.Stats(pr, stream=out)
    st.sort_stats("cumulative").print_stats(top)
    st.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["resume", "list_saves", "latest", "save"])
    ap.add_argument("--size", default="256M")
    ap.add_argument("--history", type=int, default=10000)
    ap.add_argument("--verify", default="deep")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    from ckptstore import CheckpointStore

    if a.what in ("list_saves", "latest"):
        from bench.rows.history import RUN, make_history

        with scratch("/dev/shm", "bench-prof-") as d:
            url = make_history(d, a.history)
            st = CheckpointStore.open(url, RUN, mode="r")
            st.latest_complete()  # warm
            print(report(st.list_saves if a.what == "list_saves" else st.latest_complete, a.top))
        return
    import torch

    from bench import torchstate as ts
    from ckptstore.torch import Checkpointer

    model, opt = ts.build(parse_size(a.size))
    with scratch(a.dir or os.environ.get("TMPDIR", "/tmp"), "bench-prof-") as d, torch.no_grad():
        st = CheckpointStore.open(d, "prof", identity=IDENTITY)
        ck = Checkpointer(st, {"model": model, "optimizer": opt}, async_save=False, handle_signals=False)
        if a.what == "save":
            ck.save(1)  # warm
            print(report(lambda: ck.save(2), a.top))
            return
        ck.save(1)
        ck.close()

        def resume() -> None:
            s = CheckpointStore.open(d, "prof", identity=IDENTITY, resume_verify=a.verify)
            Checkpointer(s, {"model": model, "optimizer": opt}, async_save=False, handle_signals=False).resume()

        resume()  # warm page cache
        print(report(resume, a.top))


if __name__ == "__main__":
    main()
