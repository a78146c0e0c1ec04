"""``ckptstore demo``: a save / crash / resume cycle on a local directory.

A writer process saves checkpoints of a toy state; it is killed with SIGKILL
while a save's components are being written. A fresh process then opens the
store, shows that the partial save is skipped (and why), resumes from the last
complete save, and commits the interrupted step again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from ..store import CheckpointStore

IDENTITY = {"data_digest": "demo-data-1", "code_digest": "demo-code-1", "optimizer_revision": "sgd-r1"}
RUN = "demo-run"


def _state(step: int, size: int = 1 << 20) -> bytes:
    return (step.to_bytes(8, "little") * (size // 8))[:size]


def _writer(url: str, upto: int, hang_at: int) -> None:
    store = CheckpointStore.open(url, RUN, identity=IDENTITY)
    start = store.resumed_from.step + 1 if store.resumed_from else 1
    for step in range(start, upto + 1):
        with store.save(step, metadata={"loss": 1.0 / step}) as s:
            s.put("model.bin", _state(step))
            if step == hang_at:
                print(f"READY {step}", flush=True)
                time.sleep(60)  # killed here: optimizer.bin never written, no commit
            s.put("optimizer.bin", _state(step, 1 << 19))
        print(f"committed step {step}", flush=True)


def run_demo(url: str | None = None) -> int:
    url = url or tempfile.mkdtemp(prefix="ckptstore-demo-")
    print(f"store: {url}   run: {RUN}")
    print("1. a writer saves steps 1-3, then is SIGKILLed while writing step 4")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptstore.ops.demo", "writer", url, "4", "4"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        print("   writer:", line.rstrip())
        if line.startswith("READY"):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    print(f"   writer killed (exit {proc.returncode})")
    store = CheckpointStore.open(url, RUN, mode="r")
    sel = store.latest_complete(deep=True, explain=True)
    assert sel.latest is not None
    print(f"2. a fresh process selects step {sel.latest.step} (verified byte for byte)")
    for s in sel.skipped:
        print(f"   skipped step {s.step}: {s.reason.value} ({s.detail})")
    print("3. the run resumes and commits step 4 again, then step 5")
    out = subprocess.run(
        [sys.executable, "-m", "ckptstore.ops.demo", "writer", url, "5", "-1"], capture_output=True, text=True, check=True
    )
    for line in out.stdout.splitlines():
        print("   writer:", line)
    latest = store.latest_complete(deep=True)
    assert latest is not None and latest.step == 5
    print(f"4. latest complete: step {latest.step}, attempt {latest.attempt}; "
          f"inspect with: ckptstore ls {url} {RUN}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "writer":
        _writer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(run_demo(sys.argv[1] if len(sys.argv) > 1 else None))
