"""Real processes killed with SIGKILL at random moments, and a storage server
stopped in the middle of a save."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from ckptstore import CheckpointStore, CkptStoreError
from ckptstore.retry import RetryPolicy
from tests.workers.kill_writer import IDENT, SIZES, blob

WRITER = str(Path(__file__).parents[1] / "workers" / "kill_writer.py")
RUNS = {"local": 12, "seaweedfs": 4, "moto": 4, "fakegcs": 4}


def url_for(backend_kind: str, tmp_path: Path, object_servers) -> tuple[str, dict]:  # type: ignore[no-untyped-def,type-arg]
    if backend_kind == "local":
        return str(tmp_path / "store"), {}
    return object_servers.url_and_options(backend_kind, f"kill-{uuid.uuid4().hex[:8]}")


def kill_at_random(url: str, run: str, opts: dict, delay: float) -> tuple[int, int]:  # type: ignore[type-arg]
    """Start a writer, SIGKILL it ``delay`` s after its first save began.
    Returns (last acknowledged step, last begun step)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    p = subprocess.Popen([sys.executable, WRITER, url, run, json.dumps(opts)], stdout=subprocess.PIPE, text=True,
                         env=env)
    acked, begun = -1, -1
    lines: list[str] = []
    t_kill: list[float] = []

    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line.strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not any(ln.startswith("BEGIN") for ln in lines) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.01)
    time.sleep(delay)
    t_kill.append(time.monotonic())
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    reader.join(timeout=10)
    for ln in lines:
        kind, step = ln.split()
        if kind == "ACK":
            acked = max(acked, int(step))
        elif kind == "BEGIN":
            begun = max(begun, int(step))
    return acked, begun


@pytest.mark.backends("local", "seaweedfs", "moto", "fakegcs")
def test_sigkill_at_random_moments(backend_kind, tmp_path, request) -> None:  # type: ignore[no-untyped-def]
    servers = request.getfixturevalue("object_servers") if backend_kind != "local" else None
    url, opts = url_for(backend_kind, tmp_path, servers)
    rng = random.Random(f"kill-{backend_kind}")
    run = "run"
    for i in range(RUNS[backend_kind]):
        acked, begun = kill_at_random(url, run, opts, delay=rng.uniform(0.0, 0.6))
        reader = CheckpointStore.open(url, run, mode="r", storage_options=opts or None)
        latest = reader.latest_complete(deep=True)
        if acked >= 0:
            assert latest is not None, f"run {i}: acknowledged step {acked} lost"
        if latest is None:
            continue
        # what is selected was acknowledged, or was being committed when the writer died
        assert acked <= latest.step <= begun, (i, acked, latest.step, begun)
        for name in SIZES:
            assert reader.read(latest, name) == blob(latest.step, name)


def test_server_stopped_mid_save_and_restarted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SeaweedFS keeps its data on disk, so it can be stopped and started again."""
    from devservers.servers import BUCKET, SeaweedFS

    srv = SeaweedFS().start()
    try:
        url = f"s3://{BUCKET}/outage-{uuid.uuid4().hex[:8]}"
        opts = srv.storage_options()
        opts["config_kwargs"] = {"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}}
        st = CheckpointStore.open(url, "run", identity=IDENT, storage_options=opts,
                                  retry=RetryPolicy(attempts=2, base_delay=0.1, max_delay=0.2))
        with st.save(1) as s:
            for name in SIZES:
                s.put(name, blob(1, name))
        failed: list[BaseException] = []

        def save_during_outage() -> None:
            try:
                with st.save(2) as s:
                    s.put("model", blob(2, "model"))
                    time.sleep(1.5)  # the server goes away here
                    for name in ("optimizer", "extra/rng"):
                        s.put(name, blob(2, name))
            except CkptStoreError as exc:
                failed.append(exc)

        t = threading.Thread(target=save_during_outage)
        t.start()
        time.sleep(0.5)
        srv.stop(grace=3.0, keep_data=True)
        t.join(timeout=120)
        assert failed, "the save did not fail while the server was down"
        srv.restart()
        reader = CheckpointStore.open(url, "run", mode="r", storage_options=srv.storage_options())
        latest = reader.latest_complete(deep=True)
        assert latest is not None and latest.step == 1
        st2 = CheckpointStore.open(url, "run", identity=IDENT, storage_options=srv.storage_options())
        assert st2.resumed_from.step == 1
        with st2.save(2) as s:
            for name in SIZES:
                s.put(name, blob(2, name))
        assert reader.latest_complete(deep=True).step == 2
    finally:
        srv.stop()
