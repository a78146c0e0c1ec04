"""Spawning multi-rank test jobs as real processes (gloo over loopback)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[2]
WORKER = str(Path(__file__).with_name("dist_worker.py"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    returncode: int
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    stderr: str = ""

    @property
    def killed(self) -> bool:
        return self.returncode == -9


def run_job(
    world: int, url: str, scenario: str, *, opts: dict[str, Any] | None = None, args: dict[str, Any] | None = None,
    timeout: float = 120.0, worker: str = WORKER,
) -> list[RankResult]:
    """Start ``world`` rank processes and wait for all (killing them at ``timeout``)."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = []
    for r in range(world):
        spec = {"rank": r, "world": world, "port": port, "url": url, "opts": opts or {}, "scenario": scenario,
                "args": args or {}}
        procs.append(subprocess.Popen([sys.executable, worker, json.dumps(spec)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    out: list[RankResult] = []
    for r, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            so, se = p.communicate()
            raise AssertionError(f"rank {r} did not finish within {timeout}s:\n{se[-3000:]}") from None
        res = RankResult(r, p.returncode, stderr=se)
        for line in so.splitlines():
            if line.startswith("RESULT "):
                d = json.loads(line[7:])
                res.results[d.pop("event")] = d
        out.append(res)
    return out
