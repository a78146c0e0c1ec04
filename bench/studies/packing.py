"""Packing what changes (PROTOCOL.md §9.2), side by side in one process:

    ./dev bench study packing [--mib 64] [--frozen 0.0] [--saves 14]

Three writers of the same model (the incremental study's: square float32
layers of 4 MiB, the first ``--frozen`` share of them frozen, AdamW on the
rest) save in turn, the order rotated each round, after a training step each
(and, with ``--frozen 0``, every parameter nudged, so every tensor changes):
version 2; version 3 as it writes (packing the tensors that changed at the
last probe); version 3 with every save a probe (every buffer cut alone, as
before packing). A 2 s pause after each round stands for the training time
between saves (a version-3 save waits until its intent is ``window`` old).
Reported: median and best seconds of the saves after the first two, and the
pieces (or component files) and bytes each wrote.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.studies.incremental import IDENT, model, touch_all, train
from ckptstore import CheckpointStore, OpenOptions
from ckptstore.core import pieces as core_pieces
from ckptstore.torch import Checkpointer

CONTENDERS = {"version 2": 2, "version 3, packing": 3, "version 3, every save cut alone": 3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--frozen", type=float, default=0.0, help="share of the layers frozen (0: full fine-tuning)")
    ap.add_argument("--saves", type=int, default=14)
    a = ap.parse_args()
    probe_every = core_pieces.PROBE_EVERY
    with tempfile.TemporaryDirectory(prefix="bench-packing-") as d:
        writers = {}
        for name, version in CONTENDERS.items():
            m, o = model(a.mib, a.frozen)
            st = CheckpointStore.open(Path(d) / name.replace(" ", "-").replace(",", ""), "run", identity=IDENT,
                                      options=OpenOptions(protocol_version=version))
            writers[name] = (Checkpointer(st, {"model": m, "optimizer": o}, async_save=False, handle_signals=False),
                             m, o, st)
        seconds: dict[str, list[float]] = {n: [] for n in CONTENDERS}
        files: dict[str, list[int]] = {n: [] for n in CONTENDERS}
        written: dict[str, list[int]] = {n: [] for n in CONTENDERS}
        names = list(CONTENDERS)
        for s in range(1, a.saves + 1):
            for name in names[s % 3:] + names[:s % 3]:
                ck, m, o, _st = writers[name]
                train(m, o)
                if a.frozen == 0:
                    touch_all(m)
                core_pieces.PROBE_EVERY = 1 if name.endswith("cut alone") else probe_every
                try:
                    t = time.perf_counter()
                    ref = ck.save(s, blocking=True)
                    dt = time.perf_counter() - t
                finally:
                    core_pieces.PROBE_EVERY = probe_every
                assert ref is not None
                if s > 2:
                    seconds[name].append(dt)
                    written[name].append(ref.record.bytes_written())
                    files[name].append(sum(sum(p.holder == ref.save_id for p in c.pieces) if c.pieces else 1
                                           for c in ref.record.components.values()))
            time.sleep(2.05)
        for ck, _m, _o, st in writers.values():
            ck.close()
            st.close()
    print(f"model {a.mib} MiB float32, {a.frozen:.0%} frozen, AdamW; {a.saves - 2} saves each, interleaved")
    for name in CONTENDERS:
        v = seconds[name]
        print(f"{name:34s} median {1000 * statistics.median(v):7.1f} ms  best {1000 * min(v):7.1f} ms  "
              f"files per save {statistics.median(files[name]):5.1f}  "
              f"MiB written {statistics.median(written[name]) / 2**20:7.1f}")


if __name__ == "__main__":
    main()
