"""Bench rows of issue 20 (two tiers), each against a baseline measured in
the same run, on one machine with SeaweedFS on loopback as the durable tier:

1. loop-blocked time of a save (Checkpointer, async) with a local tier + S3,
   S3 alone and local disk alone, against a copy into preallocated buffers;
   end-to-end overhead of saving every 10 steps (loop time minus the loop
   without saves), tiered against local disk alone and against S3 alone;
2. time until committed locally against a raw local write + fsync;
3. time until durable (save + replication) against a plain upload of the
   same bytes with the same client;
4. restart (open + verified read of every component) from the local tier and
   from the durable tier against the verified-restore floor (read + BLAKE3
   of the same bytes from the local disk).

    ./dev bench study tiers [--mib 64] [--repeat 3] [--steps 30]

Self-contained: ckptstore, devservers, torch, blake3 and the standard library.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import blake3  # noqa: E402

from ckptstore import CheckpointStore, OpenOptions, TierOptions  # noqa: E402
from ckptstore.backends.fsspec_base import PART_SIZE  # noqa: E402
from ckptstore.backends.schemes import backend_from_url  # noqa: E402
from ckptstore.protocol import component_key  # noqa: E402
from ckptstore.protocol.layout import piece_key  # noqa: E402
from devservers.servers import BUCKET, SERVERS  # noqa: E402

MiB = 1 << 20
PARTS = 4


#: how repeats are summarised: ``median`` (default) or ``best`` (the minimum, for a shared machine)
STAT = "median"


def med(xs: list[float]) -> float:
    return min(xs) if STAT == "best" else statistics.median(xs)


def fsync_write(path: str, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(0, len(data), 8 * MiB):
            os.write(fd, data[i: i + 8 * MiB])
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def row(name: str, ours: float, base_name: str, base: float, goal: float | None = None) -> None:
    ratio = ours / base if base > 0 else float("inf")
    g = f"  (goal <= {goal:.2f}x: {'met' if ratio <= goal else 'NOT met'})" if goal else ""
    print(f"{name:<44} {ours * 1000:9.1f} ms   vs {base_name:<32} {base * 1000:9.1f} ms   {ratio:6.2f}x{g}")


def main() -> None:  # noqa: PLR0915 - one bench, its rows in order
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--step-ms", type=float, default=50.0, help="simulated compute per training step")
    ap.add_argument("--stat", choices=("median", "best"), default="median",
                    help="summary of the repeats (best: the minimum, for a shared machine)")
    a = ap.parse_args()
    global STAT  # noqa: PLW0603 - one setting for the helpers of this script
    STAT = a.stat
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    parts = [memoryview(bytearray(os.urandom(a.mib * MiB // PARTS))) for _ in range(PARTS)]
    total = sum(len(p) for p in parts)
    srv = SERVERS["seaweedfs"]().start()
    tmp = tempfile.mkdtemp(prefix="bench-tiers-")
    try:
        opts = srv.storage_options()

        def s3() -> tuple[str, object]:
            url = f"s3://{BUCKET}/bench-{uuid.uuid4().hex[:8]}"
            return url, backend_from_url(url, storage_options=opts)

        def local_dir() -> str:
            return tempfile.mkdtemp(dir=tmp)

        def put_all(st: CheckpointStore, step: int) -> None:
            with st.save(step) as w:
                for i, p in enumerate(parts):
                    w.put(f"p{i}", p)

        print(f"# two tiers: {total / MiB:.0f} MiB in {PARTS} components, {a.stat} of {a.repeat}; durable = SeaweedFS")
        # ---- row 2: locally committed vs raw local write + fsync
        raw, local_commit, durable_t, plain_up = [], [], [], []
        early_local: list[float] = []
        early_durable: list[float] = []
        for _ in range(a.repeat):
            d = local_dir()
            t = time.perf_counter()
            for i, p in enumerate(parts):
                fsync_write(os.path.join(d, f"raw{i}.bin"), p)
            raw.append(time.perf_counter() - t)
            # then the same with early_replication: components uploaded as soon as their local write returned
            for early, committed, durable in ((False, local_commit, durable_t), (True, early_local, early_durable)):
                _, b = s3()
                st = CheckpointStore.open(b, "r", identity={"b": 1}, options=OpenOptions(  # type: ignore[arg-type]
                                              tiers=TierOptions(local_dir(), early_replication=early)))
                t = time.perf_counter()
                put_all(st, 1)
                committed.append(time.perf_counter() - t)
                assert st.flush(600)
                durable.append(time.perf_counter() - t)
                st.close()
            # plain upload of the same bytes with the same client
            _, b2 = s3()
            t = time.perf_counter()
            for i, p in enumerate(parts):
                with b2.fs.open(f"{b2.root}/plain{i}.bin", "wb", block_size=PART_SIZE) as f:  # type: ignore[attr-defined]
                    for j in range(0, len(p), 8 * MiB):
                        f.write(p[j: j + 8 * MiB])
            plain_up.append(time.perf_counter() - t)
        plain_local = []
        for _ in range(a.repeat):
            st = CheckpointStore.open(local_dir(), "r", identity={"b": 1})
            t = time.perf_counter()
            put_all(st, 1)
            plain_local.append(time.perf_counter() - t)
        row("2. committed locally (tiered save)", med(local_commit), "raw local write+fsync", med(raw), 1.15)
        row("2b. one-tier local store save (peer)", med(plain_local), "raw local write+fsync", med(raw))
        row("3. durable (save + replication)", med(durable_t), "plain upload, same client", med(plain_up), 1.15)
        row("2c. committed locally, early_replication", med(early_local), "raw local write+fsync", med(raw), 1.15)
        row("3b. durable, early_replication", med(early_durable), "plain upload, same client", med(plain_up), 1.15)

        # ---- row 4: restart from the local tier / durable tier vs the verified-restore floor
        url, b = s3()
        loc = local_dir()
        st = CheckpointStore.open(b, "r", identity={"b": 1}, options=OpenOptions(tiers=TierOptions(loc)))  # type: ignore[arg-type]
        put_all(st, 1)
        assert st.flush(600)
        rec = st.latest_complete().record  # type: ignore[union-attr]
        st.close()
        # the files the local tier holds each component in: its pieces (version 3, the default) or one file
        stored = [[os.path.join(loc, piece_key("r", q.holder, q.digest)) for q in c.pieces] if c.pieces is not None
                  else [os.path.join(loc, component_key("r", rec.save_id, c.name))]
                  for c in (rec.components[f"p{i}"] for i in range(PARTS))]
        floor: list[float] = []
        from_local: list[tuple[float, float]] = []
        from_durable: list[tuple[float, float]] = []
        bufs = [bytearray(len(p)) for p in parts]
        for _ in range(a.repeat):
            t = time.perf_counter()
            for i in range(PARTS):
                mv = memoryview(bufs[i])
                n = 0
                for path in stored[i]:  # each file read, then hashed as a whole (a piece is verified alone)
                    start = n
                    with open(path, "rb", buffering=0) as f:
                        while n < len(mv):
                            k = f.readinto(mv[n:])
                            if not k:
                                break
                            n += k
                    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
                    h.update(mv[start:n])
                    h.hexdigest()
            floor.append(time.perf_counter() - t)

            def restart(local_tier: str | None) -> tuple[float, float]:
                t0 = time.perf_counter()
                s = CheckpointStore.open(backend_from_url(url, storage_options=opts), "r", mode="r", options=OpenOptions(
                                         tiers=TierOptions(local_tier) if local_tier is not None else None))
                ref = s.latest_complete()
                assert ref is not None
                t1 = time.perf_counter()
                for i in range(PARTS):
                    s.read_into(ref, f"p{i}", bufs[i])
                t2 = time.perf_counter()
                s.close()
                return t2 - t1, t2 - t0

            from_local.append(restart(loc))
            from_durable.append(restart(None))
        fl = med(floor)
        row("4a. restart: verified read, local tier", med([x[0] for x in from_local]), "verified-restore floor", fl, 1.2)
        row("4b. restart: verified read, durable tier", med([x[0] for x in from_durable]), "verified-restore floor", fl)
        row("4c. restart incl. open+select, local tier", med([x[1] for x in from_local]), "verified-restore floor", fl)
        row("4d. restart incl. open+select, durable", med([x[1] for x in from_durable]), "verified-restore floor", fl)

        # ---- row 1: the training loop, saving every 10 steps
        import torch

        from ckptstore.torch import Checkpointer

        n = total // 4
        model_t = torch.nn.Module()
        model_t.register_buffer("w", torch.frombuffer(bytearray(os.urandom(n * 4)), dtype=torch.float32))

        def loop(make: Callable[[], CheckpointStore] | None) -> tuple[float, float]:
            st = make() if make is not None else None
            ck = Checkpointer(st, {"model": model_t}, every_steps=10, handle_signals=False) if st else None
            blocked = 0.0
            t = time.perf_counter()
            for step in range(a.steps):
                time.sleep(a.step_ms / 1000)
                if ck is not None:
                    ck.step_end(step)
                    blocked += ck.last_blocking_seconds if (step + 1) % 10 == 0 else 0.0
            if ck is not None:
                ck.wait()
            took = time.perf_counter() - t
            if st is not None:
                st.close()
            return took, blocked / max(1, a.steps // 10)

        base_loop = med([loop(None)[0] for _ in range(a.repeat)])
        # copy into preallocated buffers: the floor of a loop-blocking snapshot
        pre = torch.empty_like(model_t.w)
        copies = []
        for _ in range(a.repeat):
            t = time.perf_counter()
            pre.copy_(model_t.w)
            copies.append(time.perf_counter() - t)
        results = {}
        for name, make in [
            ("tiered", lambda: CheckpointStore.open(s3()[1], "r", identity={"b": 1},
                                                          options=OpenOptions(tiers=TierOptions(local_dir())))),  # type: ignore[arg-type]
            ("s3", lambda: CheckpointStore.open(s3()[1], "r", identity={"b": 1})),  # type: ignore[arg-type]
            ("local", lambda: CheckpointStore.open(local_dir(), "r", identity={"b": 1})),
        ]:
            runs = [loop(make) for _ in range(a.repeat)]
            results[name] = (med([r[0] for r in runs]) - base_loop, med([r[1] for r in runs]))
        row("1a. loop blocked per save, tiered", results["tiered"][1], "copy into preallocated buffers", med(copies), 1.10)
        row("1b. loop blocked per save, S3 alone", results["s3"][1], "copy into preallocated buffers", med(copies))
        row("1c. e2e overhead every 10 steps, tiered", results["tiered"][0], "local disk alone", results["local"][0],
            1.0)
        row("1d. e2e overhead every 10 steps, tiered", results["tiered"][0], "S3 alone", results["s3"][0])
        print(f"# loop: {a.steps} steps of {a.step_ms:.0f} ms, {n * 4 / MiB:.0f} MiB state; baseline loop "
              f"{base_loop:.2f} s")
    finally:
        srv.stop()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
