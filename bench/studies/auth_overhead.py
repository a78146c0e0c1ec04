"""Overhead of authenticated records: save+commit and latest_complete() with
auth_policy="require" against "off", interleaved in one run, on the local
disk (default /dev/shm, so the disk does not hide the difference).

    ./dev bench study auth_overhead [--dir /dev/shm] [--saves 200] [--size 65536]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckptstore import AuthOptions, CheckpointStore, OpenOptions
from ckptstore.protocol.auth import Keyring

KEYS = Keyring({"bench": os.urandom(32)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--saves", type=int, default=200)
    ap.add_argument("--size", type=int, default=64 * 1024)
    a = ap.parse_args()
    payload = os.urandom(a.size)
    root = tempfile.mkdtemp(dir=a.dir)
    stores = {
        "off": CheckpointStore.open(root, "off", identity={"d": 1}),
        "require": CheckpointStore.open(root, "req", identity={"d": 1},
                                        options=OpenOptions(auth=AuthOptions("require", KEYS))),
    }
    save_t: dict[str, list[float]] = {k: [] for k in stores}
    for i in range(a.saves):
        for name, st in (stores.items() if i % 2 else reversed(list(stores.items()))):
            t = time.perf_counter()
            with st.save(i) as s:
                s.put("model", payload)
                s.put("optim", payload)
            save_t[name].append(time.perf_counter() - t)
    readers = {
        "off": CheckpointStore.open(root, "off", mode="r"),
        "require": CheckpointStore.open(root, "req", mode="r",
                                        options=OpenOptions(auth=AuthOptions("require", KEYS))),
    }
    sel_t: dict[str, list[float]] = {k: [] for k in readers}
    for i in range(300):
        for name, r in (readers.items() if i % 2 else reversed(list(readers.items()))):
            t = time.perf_counter()
            assert r.latest_complete() is not None
            sel_t[name].append(time.perf_counter() - t)
    for what, d in (("save+commit", save_t), (f"latest_complete ({a.saves} saves)", sel_t)):
        off, req = statistics.median(d["off"]), statistics.median(d["require"])
        print(f"{what:34s} off {off * 1e3:8.2f} ms   require {req * 1e3:8.2f} ms   ratio {req / off:5.2f}x")


if __name__ == "__main__":
    main()
