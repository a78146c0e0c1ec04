"""Where the time goes in the suite's worst rows: cProfile of one call.

    ./dev bench study hotspots resume [--size 256M] [--verify deep|cheap]   # row 4: open + Checkpointer.resume
    ./dev bench study hotspots list_saves [--history 10000]                 # row 6 (tmpfs)
    ./dev bench study hotspots latest [--history 10000]                     # row 5 (tmpfs)
    ./dev bench study hotspots save [--size 256M]                           # row 2: Checkpointer.save (sync)
    ./dev bench study hotspots resume_parts [--size 256M]                   # row 4 in parts, next to torch.load

``resume_parts`` times, in one process and interleaved over ``--rounds``, the
default resume's parts (the cheap open, the verified read of every component
into fresh memory, the fit check, ``load_state_dict``) next to what they are
made of (faulting in fresh memory of the same size, a raw read, BLAKE3 in
memory) and torch.load with and without ``load_state_dict``: cProfile sees
only the calling thread, while the read and the hash run in helper threads.

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
from typing import Any

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
    ap.add_argument("what", choices=["resume", "resume_parts", "list_saves", "latest", "save"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", default="256M")
    ap.add_argument("--history", type=int, default=10000)
    ap.add_argument("--verify", default="deep")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    from ckptstore import CheckpointStore, OpenOptions

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
        if a.what == "resume_parts":
            print(resume_parts(d, model, opt, a.rounds))
            return

        def resume() -> None:
            s = CheckpointStore.open(d, "prof", identity=IDENTITY, options=OpenOptions(resume_verify=a.verify))
            Checkpointer(s, {"model": model, "optimizer": opt}, async_save=False, handle_signals=False).resume()

        resume()  # warm page cache
        print(report(resume, a.top))


def resume_parts(d: str, model: Any, opt: Any, rounds: int) -> str:
    """Median milliseconds of each part of the default resume and of its peers' (see the module docstring)."""
    import statistics
    import time

    import blake3
    import torch

    from bench import torchstate as ts
    from bench.common import read_file
    from ckptstore import CheckpointStore, OpenOptions
    from ckptstore.torch.restore import apply_state, check_fit, read_with_fallback
    from ckptstore.torch.tensor_read import fresh_buffer

    objs = {"model": model, "optimizer": opt}
    tpath = os.path.join(d, "t.pt")
    ts.torch_save(tpath, model, opt)
    # the run's one save: its component files (version 2) or its pieces (version 3, the default)
    files = [os.path.join(top, f) for sub in ("saves", "pieces") for top, _, fs in os.walk(os.path.join(d, "prof", sub))
             for f in fs]
    total = sum(os.path.getsize(f) for f in files)
    data = ts.buffers(model, opt)
    out: dict[str, list[float]] = {}

    def note(k: str, t: float) -> float:
        now = time.perf_counter()
        out.setdefault(k, []).append((now - t) * 1000)
        return now

    def ours() -> None:
        t = time.perf_counter()
        st = CheckpointStore.open(d, "prof", identity=IDENTITY, options=OpenOptions(resume_verify="cheap"))
        t = note("ours: open (cheap)", t)
        assert st.resumed_from is not None
        saved, ref = read_with_fallback(st, st.resumed_from, None, objs)
        t = note("ours: verified read into fresh memory", t)
        check_fit(objs, saved, ref)
        t = note("ours: fit check", t)
        apply_state(objs, saved.trees)
        note("ours: load_state_dict", t)
        st.close()

    def fault() -> None:
        t = time.perf_counter()
        b = fresh_buffer(total)
        b.numpy()[::4096] = 1
        note("floor part: fault in fresh memory of the save's size", t)

    def raw() -> None:
        t = time.perf_counter()
        for f in files:
            read_file(f)
        note("floor part: raw read (a reused 8 MiB buffer)", t)

    def hashed() -> None:
        t = time.perf_counter()
        for mv in data:
            blake3.blake3(mv).digest()
        note("floor part: BLAKE3 in memory", t)

    def tload() -> None:
        t = time.perf_counter()
        sd = torch.load(tpath, weights_only=True)
        t = note("torch.load", t)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        note("torch.load: load_state_dict", t)

    parts = [ours, fault, raw, hashed, tload]
    with torch.no_grad():
        for r in range(rounds):
            for fn in parts[r % len(parts):] + parts[: r % len(parts)]:
                fn()
    return "\n".join(f"{k:58s} {statistics.median(v):8.1f} ms" for k, v in out.items())


if __name__ == "__main__":
    main()
