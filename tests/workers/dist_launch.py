"""Spawning multi-rank test jobs as real processes (gloo over loopback).

Each rank is its own process. By default it is forked from a zygote that has
torch and ckptstore imported already (tests/workers/zygote.py, one per rank
index, those of ranks 0 and 1 kept for the pytest process's life while the
environment stays the same): these jobs test
the rank protocol, not the launch, and a fresh interpreter's ~2 s of imports
per rank was most of their time. ``CKPT_FRESH_RANKS=1`` starts every rank as
``python WORKER SPEC`` instead; the torchrun tests (tests/distributed/test_torchrun.py)
always launch as users do.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).parents[2]
WORKER = str(Path(__file__).with_name("dist_worker.py"))
ZYGOTE = str(Path(__file__).with_name("zygote.py"))


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


class Zygote:
    """The client end of one tests/workers/zygote.py process."""

    def __init__(self, env: dict[str, str]) -> None:
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the zygote
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen([sys.executable, ZYGOTE, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log,
                                         env=env, cwd=ROOT)
        self.ready = False
        self.exits: dict[int, int] = {}
        self.spawned: dict[int, int] = {}
        self.next_id = 0

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def _pump(self, deadline: float) -> bool:
        """Take one reply that arrives before ``deadline``; False at the deadline."""
        left = deadline - time.monotonic()
        if not select.select([self.sock], [], [], max(0.0, left))[0]:
            return False
        data = self.sock.recv(1 << 16)
        if not data:
            raise AssertionError(f"the rank zygote ended (rc {self.proc.wait()}):\n{self._log_tail()}")
        msg = json.loads(data)
        if "ready" in msg:
            self.ready = True
        elif "exit" in msg:
            self.exits[msg["exit"]] = msg["code"]
        else:
            self.spawned[msg["id"]] = msg["pid"]
        return True

    def spawn(self, script: str, args: list[str], env: dict[str, str], stdout: int, stderr: int, *,
              new_session: bool = False) -> int:
        """Fork ``python script *args`` with these fds as its stdout and stderr; its pid."""
        deadline = time.monotonic() + 120
        while not self.ready:
            if not self._pump(deadline):
                raise AssertionError(f"the rank zygote did not start within 120 s:\n{self._log_tail()}")
        self.next_id += 1
        rid = self.next_id
        req = {"op": "spawn", "id": rid, "script": script, "args": args, "env": env, "cwd": os.getcwd(),
               "new_session": new_session}
        socket.send_fds(self.sock, [json.dumps(req).encode()], [stdout, stderr])
        while rid not in self.spawned:
            if not self._pump(deadline):
                raise AssertionError(f"the rank zygote did not fork within 120 s:\n{self._log_tail()}")
        return self.spawned.pop(rid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """The exit code of ``pid`` (negative: the signal), None if it is still running after ``timeout``."""
        deadline = time.monotonic() + (1e9 if timeout is None else timeout)
        while pid not in self.exits:
            if not self._pump(deadline):
                return None
        return self.exits.pop(pid)

    def kill(self, pid: int) -> None:
        self.sock.send(json.dumps({"op": "kill", "pid": pid}).encode())

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


#: zygotes by the environment they started with (as JSON) and index: one environment at a time, and
#: indices 2 and up (~200 MB each) only until a job with fewer ranks starts
_pools: dict[str, dict[int, Zygote]] = {}
KEPT = 2
#: set by pytest for each test: the child gets it (in the request), the zygote's start does not depend on it
_PER_TEST = ("PYTEST_CURRENT_TEST",)


def _close_zygotes() -> None:
    while _pools:
        for z in _pools.popitem()[1].values():
            z.close()


atexit.register(_close_zygotes)


def zygote(index: int, env: dict[str, str]) -> Zygote:
    """Zygote ``index`` (one per rank of a job) for ``env``, started on first use; a zygote reads the
    environment at start, so another environment gets other zygotes (the former ones end)."""
    key_env = {k: v for k, v in env.items() if k not in _PER_TEST}
    key = json.dumps(key_env, sort_keys=True)
    pool = _pools.pop(key, None)
    if pool is None:
        while _pools:
            for old in _pools.pop(next(iter(_pools))).values():
                old.close()
        pool = {}
    _pools[key] = pool  # the most recent last
    z = pool.get(index)
    if z is None or z.proc.poll() is not None:
        z = pool[index] = Zygote(key_env)
    return z


class Forked:
    """A script run in a process forked from a zygote, with the parts of ``subprocess.Popen`` the tests use:
    ``pid``, ``stdout`` (a text pipe), ``poll``, ``wait``, ``communicate`` (the rest of stdout; stderr) and
    ``returncode`` (negative: the signal)."""

    def __init__(self, script: str, args: list[str], env: dict[str, str], *, new_session: bool = False) -> None:
        self._z = zygote(0, env)
        self._err: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed by communicate
        r, w = os.pipe()
        try:
            self.pid = self._z.spawn(script, args, env, w, self._err.fileno(), new_session=new_session)
        finally:
            os.close(w)
        self.stdout: IO[str] = open(r, encoding="utf-8", errors="replace")  # noqa: SIM115
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._z.wait(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._z.wait(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"{self.pid}", timeout or 0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        deadline = time.monotonic() + (1e9 if timeout is None else timeout)
        rest = []
        fd = self.stdout.fileno()
        while True:  # the rest of stdout, up to its end (the process and every child that holds it gone)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise subprocess.TimeoutExpired(f"{self.pid}", timeout or 0)
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            rest.append(chunk)
        self.wait(max(0.0, deadline - time.monotonic()))
        self.stdout.close()
        self._err.seek(0)
        err = self._err.read().decode(errors="replace")
        self._err.close()
        return b"".join(rest).decode(errors="replace"), err


def _results(r: int, returncode: int, so: str, se: str) -> RankResult:
    res = RankResult(r, returncode, stderr=se)
    for line in so.splitlines():
        if line.startswith("RESULT "):
            d = json.loads(line[7:])
            res.results[d.pop("event")] = d
    return res


def run_job(
    world: int, url: str, scenario: str, *, opts: dict[str, Any] | None = None, args: dict[str, Any] | None = None,
    timeout: float = 120.0, worker: str = WORKER,
) -> list[RankResult]:
    """Start ``world`` rank processes and wait for all (killing them at ``timeout``)."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    specs = [json.dumps({"rank": r, "world": world, "port": port, "url": url, "opts": opts or {},
                         "scenario": scenario, "args": args or {}}) for r in range(world)]
    if os.environ.get("CKPT_FRESH_RANKS") == "1":
        return _run_fresh(specs, env, timeout, worker)
    for pool in _pools.values():  # a 3- or 4-rank job's extra zygotes serve the next such jobs, no others
        for r in [r for r in pool if r >= max(KEPT, world)]:
            pool.pop(r).close()
    return _run_forked(specs, env, timeout, worker)


def _run_forked(specs: list[str], env: dict[str, str], timeout: float, worker: str) -> list[RankResult]:
    out: list[RankResult] = []
    with tempfile.TemporaryDirectory(prefix="ranks-") as d:
        for r in range(len(specs)):
            zygote(r, env)  # start them all before waiting for the first
        pids = []
        for r, spec in enumerate(specs):
            with open(f"{d}/{r}.out", "wb") as so, open(f"{d}/{r}.err", "wb") as se:
                pids.append(zygote(r, env).spawn(worker, [spec], env, so.fileno(), se.fileno()))

        def read(r: int) -> tuple[str, str]:
            return (Path(f"{d}/{r}.out").read_text(errors="replace"), Path(f"{d}/{r}.err").read_text(errors="replace"))

        for r, pid in enumerate(pids):
            code = zygote(r, env).wait(pid, timeout)
            if code is None:
                for q, qpid in enumerate(pids):
                    zygote(q, env).kill(qpid)
                for q, qpid in enumerate(pids[r:], start=r):
                    zygote(q, env).wait(qpid, None)
                raise AssertionError(f"rank {r} did not finish within {timeout}s:\n{read(r)[1][-3000:]}")
            out.append(_results(r, code, *read(r)))
    return out


def _run_fresh(specs: list[str], env: dict[str, str], timeout: float, worker: str) -> list[RankResult]:
    procs = [subprocess.Popen([sys.executable, worker, spec], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for spec in specs]
    out: list[RankResult] = []
    for r, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            so, se = p.communicate()
            raise AssertionError(f"rank {r} did not finish within {timeout}s:\n{se[-3000:]}") from None
        out.append(_results(r, p.returncode, so, se))
    return out
