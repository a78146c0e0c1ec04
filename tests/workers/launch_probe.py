"""What a launched process sees and how it ends (tests/distributed/test_rank_launch.py).

    python tests/workers/launch_probe.py SPEC_JSON      (SPEC: {"end": "return" | "exit3" | "message" | "raise" | "kill"})
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time


def _draws() -> str:
    """The first draw of torch's default generator and its seed (each fresh process its own; Python's
    ``random`` is reseeded at every fork by Python itself)."""
    import torch

    return f"{torch.rand(1).item():.8f},{torch.initial_seed()}"


spec = json.loads(sys.argv[1])
here = os.path.dirname(os.path.abspath(__file__))
print("argv0", os.path.basename(sys.argv[0]), "path0", sys.path[0] == here, "cwd", os.getcwd(),
      "env", os.environ.get("PROBE"), "name", __name__, "stdin", repr(sys.stdin.read()), "hash", hash("probe"),
      "draws", _draws(), flush=True)
atexit.register(lambda: print("atexit ran", flush=True))


def late() -> None:
    time.sleep(0.2)
    print("thread joined", flush=True)


threading.Thread(target=late).start()
sys.stdout.write("unflushed at the end\n" if spec["end"] != "kill" else "")
print("to stderr", file=sys.stderr)
end = spec["end"]
if end == "exit3":
    sys.exit(3)
if end == "message":
    sys.exit("bye")
if end == "raise":
    raise ValueError("probe failed on purpose")
if end == "kill":
    time.sleep(0.3)  # the thread's line is out, then a real SIGKILL
    os.kill(os.getpid(), signal.SIGKILL)
