"""A process for the open race (tests/store/test_injected_faults.py): opens one
run for writing at the same moment as its siblings, then saves one step.

    python tests/workers/race_opener.py URL RUN STORAGE_OPTIONS_JSON SYNC_DIR INDEX STEP

Protocol with the parent, through files in SYNC_DIR (every wait bounded):
``ready-INDEX`` is created when imports are done; the process waits for ``go``,
opens the run (its first listing of ``attempts/`` is held for 0.3 s so that
every sibling lists before any registers: the window a check-then-write
registration would lose), prints ``OPENED {json}``, creates ``opened-INDEX``,
waits for ``save``, tries to save STEP and prints ``OUTCOME {json}``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from ckptstore import CheckpointStore, CkptStoreError, OpenOptions, SupersededError
from ckptstore.backends.faults import FaultyBackend
from ckptstore.backends.schemes import backend_from_url
from ckptstore.retry import RetryPolicy

IDENT = {"data_digest": "race", "code_digest": "race"}
WAIT_S = 90.0


def wait_for(path: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.005)


def touch(path: str) -> None:
    with open(path, "w"):
        pass


def main() -> None:
    url, run, opts, sync, index, step = (
        sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])
    )
    inner = backend_from_url(url, storage_options=opts or None)
    fb = FaultyBackend(inner)
    held = threading.Event()

    def first_attempt_listing(op: str, key: str) -> bool:
        if op == "list" and "/attempts/" in key and not held.is_set():
            held.set()
            return True
        return False

    fb.slow(None, 0.3, when=first_attempt_listing)
    touch(os.path.join(sync, f"ready-{index}"))
    wait_for(os.path.join(sync, "go"))
    store = CheckpointStore.open(fb, run, identity=IDENT, options=OpenOptions(
        retry=RetryPolicy(attempts=8, base_delay=0.01, max_delay=0.1)))
    assert store.attempt is not None
    print("OPENED " + json.dumps({"index": index, "attempt": store.attempt.number, "writer_id": store.writer_id,
                                  "resumed_from": store.resumed_from.step if store.resumed_from else None}),
          flush=True)
    touch(os.path.join(sync, f"opened-{index}"))
    wait_for(os.path.join(sync, "save"))
    outcome: dict[str, object] = {"index": index}
    try:
        with store.save(step) as s:
            s.put("model", f"model of step {step} by writer {index}".encode() * 100)
            s.put("optim", f"optim of step {step} by writer {index}".encode() * 50)
        outcome["result"] = "ack"
    except SupersededError as exc:
        outcome["result"] = "superseded"
        outcome["committed"] = exc.committed
    except CkptStoreError as exc:
        outcome["result"] = type(exc).__name__
        outcome["detail"] = str(exc)[:300]
    print("OUTCOME " + json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
