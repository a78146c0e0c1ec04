"""A parent with torch already imported, from which the suite forks its rank processes.

    python tests/workers/zygote.py        (started by tests/workers/dist_launch.py, never by hand)

A rank worker spends ~2 s of CPU importing torch and ckptstore before it does
anything the test is about, and the suite starts a few hundred of them. This
process imports those modules once and then forks one child per request: the
child is the worker as ``python WORKER ARGS...`` would run it (its own
``sys.argv``, ``sys.path[0]``, ``os.environ``, working directory, stdin from
/dev/null, stdout and stderr, the script run as ``__main__``), and it ends the
way an interpreter ends: the non-daemon threads joined, every ``atexit``
handler run (the script's, then the preloaded modules'), buffers flushed, the
exit status of ``SystemExit`` or 1 with the traceback on stderr; only the
teardown of the modules is skipped. A SIGKILL is a real SIGKILL of that
process. What a fork cannot give is a fresh interpreter start: the flags read
at start-up (``PYTHONHASHSEED``, ``PYTHONUNBUFFERED``, ``PYTHONPATH``) are the
zygote's, so the launcher starts one zygote per rank index (the ranks of one
job differ in hash seed, as fresh processes do) and a new set whenever the
environment it launches with changes. tests/distributed/test_rank_launch.py
holds a child to these promises against ``python SCRIPT``.
Tests about launching itself (torchrun) do not come here.

Control protocol: one message per request or reply on the ``AF_UNIX``
``SOCK_SEQPACKET`` socket whose fd is ``argv[1]``, each a JSON object. Requests:
``{"op": "spawn", "id": N, "script": PATH, "args": [...], "env": {...}, "cwd": DIR,
"new_session": BOOL}`` with two fds attached (the child's stdout and stderr) and
``{"op": "kill", "pid": P}`` (SIGKILL, only while P is a child not yet reaped).
Replies: ``{"ready": true}`` once the modules are imported, ``{"id": N, "pid": P}``
per spawn, ``{"exit": P, "code": C}`` per child that ended (C as ``subprocess``
reports it: negative for a signal). The socket's end ends the zygote (children
already started run on).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import random
import runpy
import select
import signal
import socket
import sys
from typing import Any

#: what nearly every rank worker imports; a module a worker needs beyond these is imported by the child
PRELOAD = (
    "torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.checkpoint", "torch.distributed.tensor",
    "ckptstore", "ckptstore.distributed", "ckptstore.distributed.ranked", "ckptstore.torch", "ckptstore.tiers",
)


def serve(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The zygote's loop; returns a spawn request and its fds in the forked child, None in the zygote at EOF."""
    live: set[int] = set()

    def send(**kw: Any) -> None:
        sock.send(json.dumps(kw).encode())

    send(ready=True)
    while True:
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                live.clear()
                break
            if pid == 0:
                break
            live.discard(pid)
            send(exit=pid, code=os.waitstatus_to_exitcode(status))
        ready, _, _ = select.select([sock], [], [], 0.01 if live else 1.0)
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        if not data:
            return None
        req = json.loads(data)
        if req["op"] == "kill":
            if req["pid"] in live:
                os.kill(req["pid"], signal.SIGKILL)
            continue
        pid = os.fork()
        if pid == 0:
            sock.close()
            return req, fds
        for fd in fds:
            os.close(fd)
        live.add(pid)
        send(id=req["id"], pid=pid)


def become(req: dict[str, Any], fds: list[int]) -> None:
    """In the child: set up the process as ``python SCRIPT ARGS`` would and run the script as ``__main__``."""
    if req.get("new_session"):
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for target, fd in zip((1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    _fresh_random_state()
    script = os.path.abspath(req["script"])
    sys.argv = [script, *req["args"]]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        _status[0] = _exit_status(exc.code)
    except BaseException:  # noqa: BLE001 - printed and exit 1, as the interpreter does
        sys.excepthook(*sys.exc_info())
        _status[0] = 1


def _fresh_random_state() -> None:
    """Seed the random generators afresh, as a new interpreter's start does:
    a child would otherwise inherit the zygote's state, and every worker would
    draw the same "random" numbers (torch's default generator seeds
    DataLoader workers, so two runs would augment alike by accident)."""
    random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


_status = [0]


def _exit_status(code: object) -> int:
    """The status ``python SCRIPT`` exits with on ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _end() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(_status[0])


def main() -> None:
    # registered before anything is imported, so it runs last: in a child, after the interpreter joined
    # the non-daemon threads and ran every other atexit handler (the script's, then those of the modules
    # the zygote imported: logging, multiprocessing, weakref finalizers), the process ends with the
    # script's exit status, skipping only the teardown of the modules (which writes to every page the
    # child shares with the zygote: ~1 s of copy-on-write per child)
    atexit.register(_end)
    sock = socket.socket(fileno=int(sys.argv[1]))
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # the children get theirs from the request; the zygote itself prints nothing
        os.dup2(null, fd)
    os.close(null)
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # what the zygote made stays out of the children's collections (fewer pages copied)
    got = serve(sock)
    if got is not None:
        become(*got)  # then the interpreter's exit: threads joined, atexit handlers, last of them _end


if __name__ == "__main__":
    main()
