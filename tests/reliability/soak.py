"""Soak: SIGKILL a saving writer at random moments, many times, and judge the
store after every kill from a fresh client.

    python -m tests.reliability.soak --backend local --kills 1000
    python -m tests.reliability.soak --backend moto --kills 1000       # starts moto on loopback
    python -m tests.reliability.soak --backend fakegcs --kills 1000    # starts fake-gcs-server on loopback
    python -m tests.reliability.soak --backend seaweedfs --kills 200

Each round forks a writer (the harness has already imported everything, so a
round costs no interpreter start) that opens the run (resuming from the newest
complete save), then saves multi-component checkpoints in a loop, writing
``B step`` before a save and ``A step`` after its commit was acknowledged to a
pipe. The harness kills it with SIGKILL a uniformly random 0-``--max-delay``
seconds after the writer opened the run (a fraction ``--early`` of the kills is
timed from the fork instead, so they land in the open and the attempt
registration); kills land in component writes, the inventory, around the
commit and between saves. Then it judges the store with a
**new backend client and a new store object**:

* invariant 1, raw: no commit record without all its bytes (size and BLAKE3;
  a commit judged complete is not re-read until the next gc, the only thing
  that deletes components while no writer runs);
* the selection (deep) is a complete save whose bytes are exactly what the
  writer wrote for that step;
* every acknowledged save is still selected or superseded by a newer one: the
  selected step is >= the newest acknowledged step, and <= the newest begun one.

Every ``--gc-every`` kills it runs gc (grace 0, nothing alive) and judges again.
Every ``--rotate`` kills it moves to a new run ID, so one run's attempt list stays
short (each kill registers an attempt; a fresh reader reads each record once).
Prints progress, the counts and a one-line verdict; exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import os
import random
import select
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.backends.schemes import backend_from_url
from ckptstore.testing.invariants import invariant_1_violations

ROOT = Path(__file__).resolve().parents[2]

IDENT = {"data_digest": "soak", "code_digest": "soak"}
SIZES = {"model": 200_000, "optim": 400_000, "extra/rng": 3_000}
MAX_VIOLATIONS = 20


def blob(step: int, name: str) -> bytes:
    seed = f"<{step}:{name}>".encode()
    n = SIZES[name]
    return (seed * (n // len(seed) + 1))[:n]


# ------------------------------------------------------------------ writer


def writer(url: str, opts: dict[str, Any], run: str, fd: int) -> None:
    """The forked child: never returns (os._exit), normally dies by SIGKILL."""
    try:
        store = CheckpointStore.open(url, run, identity=IDENT, storage_options=opts or None)
        step = store.resumed_from.step + 1 if store.resumed_from else 0
        os.write(fd, f"O {store.attempt.number if store.attempt else -1}\n".encode())
        for _ in range(1_000_000):
            os.write(fd, f"B {step}\n".encode())
            with store.save(step) as s:
                for name in SIZES:
                    s.put(name, blob(step, name))
            os.write(fd, f"A {step}\n".encode())
            step += 1
    except BaseException as exc:  # noqa: BLE001 - reported to the harness
        os.write(fd, f"E {type(exc).__name__}: {str(exc)[:200]}\n".encode())
    os._exit(0)


def drain(fd: int) -> str:
    chunks = []
    for _ in range(100_000):
        r, _, _ = select.select([fd], [], [], 0.0)
        if not r:
            break
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def wait_opened(fd: int, timeout: float = 60.0) -> str:
    """Read the writer's output until it says it opened the run (bounded)."""
    got = b""
    deadline = time.monotonic() + timeout
    while b"O " not in got and b"E " not in got and time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.5)
        if r:
            data = os.read(fd, 65536)
            if not data:
                break
            got += data
    return got.decode(errors="replace")


# ------------------------------------------------------------------ judge


@dataclass
class Counts:
    kills: int = 0
    acked: int = 0
    killed_mid_save: int = 0  # a save had begun and was not acknowledged
    landed_unacked: int = 0  # ... and its commit is selected anyway
    killed_in_open: int = 0
    gcs: int = 0
    writer_errors: int = 0
    violations: list[str] = field(default_factory=list)


def judge(backend: Backend, run: str, acked: int, begun: int, context: str, c: Counts,
          known_good: set[str]) -> int | None:
    bad = [f"{context}: invariant 1: {b}" for b in invariant_1_violations(backend, run, known_good=known_good)]
    latest_step: int | None = None
    try:
        reader = CheckpointStore.open(backend, run, mode="r")
        latest = reader.latest_complete(deep=True)
    except Exception as exc:  # noqa: BLE001
        if acked >= 0 or "does not exist" not in str(exc):
            bad.append(f"{context}: selection failed: {type(exc).__name__}: {exc}")
        latest = None
    if latest is None:
        if acked >= 0:
            bad.append(f"{context}: acknowledged step {acked} lost: nothing selectable")
    else:
        latest_step = latest.step
        if latest.step < acked:
            bad.append(f"{context}: acknowledged step {acked} lost: selected {latest.step}")
        if latest.step > max(begun, acked):
            bad.append(f"{context}: selected step {latest.step} was never begun (newest begun {begun})")
        for name in SIZES:
            if reader.read(latest, name) != blob(latest.step, name):
                bad.append(f"{context}: selected step {latest.step}: component {name} has other bytes")
    for b in bad:
        print("VIOLATION", b, file=sys.stderr, flush=True)
    c.violations.extend(bad)
    return latest_step


# ------------------------------------------------------------------ servers


def location(kind: str, tmp: str) -> tuple[str, dict[str, Any], Any]:
    if kind == "local":
        return os.path.join(tmp, "store"), {}, None
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from devservers.servers import BUCKET, SERVERS

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    srv = SERVERS[kind]().start()
    scheme = "gs" if kind == "fakegcs" else "s3"
    opts: dict[str, Any] = srv.storage_options()  # type: ignore[attr-defined]
    return f"{scheme}://{BUCKET}/soak-{uuid.uuid4().hex[:8]}", opts, srv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="local", choices=["local", "moto", "fakegcs", "seaweedfs"])
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--max-delay", type=float, default=0.8,
                    help="kill 0..this many seconds after the writer opened the run")
    ap.add_argument("--early", type=float, default=0.15,
                    help="fraction of kills timed from the fork instead (they land in the open)")
    ap.add_argument("--gc-every", type=int, default=10)
    ap.add_argument("--rotate", type=int, default=50, help="new run ID every this many kills")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--max-minutes", type=float, default=60.0, help="stop early (reported) after this long")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    c = Counts()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ckpt-soak-") as tmp:
        url, opts, srv = location(args.backend, tmp)
        try:
            print(f"soak {args.backend}: {url}, {args.kills} kills, seed {seed}", flush=True)
            run, acked, begun = "", -1, -1
            for i in range(args.kills):
                if time.monotonic() - t0 > args.max_minutes * 60:
                    print(f"stopping early after {args.max_minutes} minutes", flush=True)
                    break
                if i % args.rotate == 0:
                    run, acked, begun = f"soak-{i // args.rotate:04d}", -1, -1
                    known_good: set[str] = set()  # commits of this run already judged complete
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:  # the writer
                    os.close(r)
                    writer(url, opts, run, w)
                os.close(w)
                early = rng.random() < args.early
                out = "" if early else wait_opened(r)
                time.sleep(rng.uniform(0.0, args.max_delay))
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                out += drain(r)
                os.close(r)
                c.kills += 1
                opened = False
                this_begun, this_acked = -1, -1
                for ln in out.splitlines():
                    kind, _, val = ln.partition(" ")
                    if kind == "O":
                        opened = True
                    elif kind == "B":
                        this_begun = int(val)
                    elif kind == "A":
                        this_acked = int(val)
                        c.acked += 1
                    elif kind == "E":
                        c.writer_errors += 1
                        c.violations.append(f"kill {i}: the writer failed on its own: {val}")
                        print("VIOLATION", c.violations[-1], file=sys.stderr, flush=True)
                if not opened:
                    c.killed_in_open += 1
                mid_save = this_begun >= 0 and this_begun > this_acked
                c.killed_mid_save += mid_save
                acked = max(acked, this_acked)
                begun = max(begun, this_begun)
                backend = backend_from_url(url, storage_options=opts or None)  # a fresh client
                try:
                    sel = judge(backend, run, acked, begun, f"kill {i} ({run})", c, known_good)
                    if mid_save and sel == this_begun:
                        c.landed_unacked += 1
                    if (i + 1) % args.gc_every == 0 and sel is not None:
                        CheckpointStore.open(backend, run, mode="r").gc(keep_last=2, grace_seconds=0)
                        c.gcs += 1
                        known_good.clear()  # gc deletes: judge every commit again
                        judge(backend, run, acked, begun, f"after gc at kill {i} ({run})", c, known_good)
                finally:
                    backend.close()
                if len(c.violations) >= MAX_VIOLATIONS:
                    print("too many violations; stopping", flush=True)
                    break
                if (i + 1) % 50 == 0:
                    print(f"  {i + 1} kills, {c.acked} saves acknowledged, {c.killed_mid_save} kills mid-save, "
                          f"{len(c.violations)} violations, {time.monotonic() - t0:.0f}s", flush=True)
        finally:
            if srv is not None:
                srv.stop()
    wall = time.monotonic() - t0
    verdict = "PASS" if not c.violations and c.kills == args.kills else ("FAIL" if c.violations else "INCOMPLETE")
    print(f"kills {c.kills}; saves acknowledged {c.acked}; kills mid-save {c.killed_mid_save} "
          f"(commit landed unacknowledged and selected: {c.landed_unacked}); kills during open {c.killed_in_open}; "
          f"gc runs {c.gcs}; violations {len(c.violations)}; wall {wall:.0f}s")
    print(f"SOAK {args.backend}: {verdict}: {c.kills} SIGKILLs, {len(c.violations)} violations, "
          f"{wall / max(1, c.kills):.2f}s per kill (seed {seed})")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
