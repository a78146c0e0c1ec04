"""Running the trainer as a real process, and killing it at a chosen moment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class ProcResult:
    returncode: int
    lines: list[str]
    killed: bool
    seconds: float

    def first(self, prefix: str) -> str | None:
        return next((ln for ln in self.lines if ln.startswith(prefix)), None)


def trainer_cmd(store: str, run: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ckptstore.runs.drill.trainer", "--store", store, "--run", run, *extra]


def run_trainer(
    cmd: Sequence[str],
    *,
    kill_on: str | None = None,
    delay: float = 0.0,
    sig: int = signal.SIGKILL,
    timeout: float = 300.0,
    echo: bool = False,
) -> ProcResult:
    """Run ``cmd``; if ``kill_on`` is given, send ``sig`` ``delay`` seconds after
    the first stdout line that starts with it."""
    t0 = time.monotonic()
    p = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    killed = False
    assert p.stdout is not None
    for line in p.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        if echo:
            print("    |", line, flush=True)
        if kill_on is not None and not killed and line.startswith(kill_on):
            time.sleep(delay)
            p.send_signal(sig)
            killed = True
            break
        if time.monotonic() - t0 > timeout:
            p.kill()
            killed = True
            break
    rest, err = p.communicate(timeout=60)
    lines += rest.splitlines()
    if p.returncode not in (0, 3, 4, -signal.SIGKILL, -signal.SIGTERM) and err:
        lines += ["STDERR " + ln for ln in err.splitlines()[-20:]]
    return ProcResult(p.returncode, lines, killed, time.monotonic() - t0)
