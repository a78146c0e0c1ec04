"""Running the trainer as a real process, and killing it at a chosen moment.

Storage options (which may hold secret keys) never travel on the command line,
where ``ps`` and ``/proc/<pid>/cmdline`` show them to every user of the host:
:func:`run_trainer` writes them as JSON into a pipe whose read end the child
inherits, and the child is told only the descriptor number
(``--storage-options-fd N``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...util.redact import redact_text
from ...util.terminal import escape

#: The trainer's option naming the inherited descriptor that carries the storage options.
OPTIONS_FD_FLAG = "--storage-options-fd"


@dataclass
class ProcResult:
    returncode: int
    lines: list[str]
    killed: bool
    seconds: float

    def first(self, prefix: str) -> str | None:
        return next((ln for ln in self.lines if ln.startswith(prefix)), None)


def trainer_cmd(store: str, run: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ckptstore.ops.drill.trainer", "--store", store, "--run", run, *extra]


def run_trainer(
    cmd: Sequence[str],
    *,
    kill_on: str | None = None,
    delay: float = 0.0,
    sig: int = signal.SIGKILL,
    timeout: float = 300.0,
    echo: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> ProcResult:
    """Run ``cmd``; if ``kill_on`` is given, send ``sig`` ``delay`` seconds after
    the first stdout line that starts with it. ``storage_options`` reach the
    child through a pipe (see the module docstring), never its argv."""
    t0 = time.monotonic()
    argv = list(cmd)
    read_fd = write_fd = -1
    if storage_options:
        payload = json.dumps(dict(storage_options)).encode()
        read_fd, write_fd = os.pipe()
        argv += [OPTIONS_FD_FLAG, str(read_fd)]
    try:
        p = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, pass_fds=(read_fd,) if read_fd >= 0 else (),
        )
    finally:
        if read_fd >= 0:
            os.close(read_fd)
    if write_fd >= 0:
        # a thread: options larger than the pipe buffer must not block reading the child's output
        threading.Thread(target=_send, args=(write_fd, payload), daemon=True).start()
    lines: list[str] = []
    killed = False
    assert p.stdout is not None
    for line in p.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        if echo:
            print("    |", redact_text(escape(line)), flush=True)
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
    if p.returncode not in (0, 3, 4, 75, -signal.SIGKILL, -signal.SIGTERM) and err:
        lines += ["STDERR " + ln for ln in err.splitlines()[-20:]]
    return ProcResult(p.returncode, lines, killed, time.monotonic() - t0)


def _send(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass  # the child died before reading; its exit status tells
    finally:
        os.close(fd)


def read_options_fd(fd: int) -> dict[str, Any]:
    """The child's side: the storage options from an inherited descriptor."""
    with os.fdopen(fd, "rb") as f:
        obj = json.loads(f.read().decode())
    if not isinstance(obj, dict):
        raise TypeError("storage options must be a JSON object")
    return obj
