"""SIGKILL of a tiered writer at every point of a save's two publications;
the next open resumes from the newest save complete in either tier, its
bytes equal to what was written, and nothing acknowledged durable is lost."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from tests.workers.dist_launch import ROOT

WORKER = str(ROOT / "tests" / "workers" / "tier_worker.py")
backend_kinds = ("local", "seaweedfs")

#: kill point -> (resumed step, its tier, durable after the restart's flush)
CASES = {
    "local-commit": (1, "both"),
    "mid-component": (2, "local"),
    "before-durable-commit": (2, "local"),
    "after-durable-commit": (2, "both"),
}


def payload(step: int) -> bytes:
    return bytes((step * 7 + i) % 251 for i in range(3000))


def durable_location(backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict]:  # type: ignore[type-arg]
    if backend_kind == "local":
        return str(tmp_path / "durable"), {}
    servers = request.getfixturevalue("object_servers")
    url, opts = servers.url_and_options(backend_kind, f"t-{uuid.uuid4().hex[:12]}")
    return url, dict(opts)


def open_durable(url: str, opts: dict) -> Backend:  # type: ignore[type-arg]
    from ckptstore.backends.schemes import backend_from_url
    return backend_from_url(url, storage_options=opts or None)


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("kill", sorted(CASES))
def test_sigkill_during_either_publication(backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest,
                                           kill: str, version: int) -> None:
    """Version 3: the same with saves stored as pieces (replication uploads pieces)."""
    url, opts = durable_location(backend_kind, tmp_path, request)
    local = tmp_path / "nvme"
    cfg = {"url": url, "options": opts, "local": str(local), "steps": 4, "kill_step": 2, "kill": kill,
           "protocol_version": version}
    p = subprocess.run([sys.executable, WORKER, json.dumps(cfg)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == -9, p.stderr[-3000:]
    acked = [int(ln.split()[1]) for ln in p.stdout.splitlines() if ln.startswith("durable")]
    assert acked == [0, 1], p.stdout
    want_step, want_tier = CASES[kill]
    s = CheckpointStore.open(open_durable(url, opts), "run", identity={"model": "tiny"}, local_tier=local)
    ref = s.resumed_from
    assert ref is not None and (ref.step, ref.tier) == (want_step, want_tier)
    assert s.read(ref, "a") == payload(want_step) and s.read(ref, "b") == payload(want_step)[::-1]
    assert s.flush(60)
    s.close()
    r = CheckpointStore.open(open_durable(url, opts), "run", mode="r")
    durable = {i.step: i for i in r.list_saves() if i.state.value == "committed"}
    assert set(acked) <= set(durable)  # nothing acknowledged durable is lost
    for step in acked + [want_step]:
        ref2 = durable[step].ref
        assert ref2 is not None and r.read(ref2, "a") == payload(step)
    # the VM is replaced: no local tier; every resume reads the durable copy
    shutil.rmtree(local)
    s3 = CheckpointStore.open(open_durable(url, opts), "run", identity={"model": "tiny"}, local_tier=local)
    assert s3.resumed_from is not None and s3.resumed_from.tier == "durable" and s3.resumed_from.step == want_step
    s3.close()
