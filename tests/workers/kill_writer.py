"""A writer process for the SIGKILL tests: saves multi-component checkpoints in a
loop and says what it began and what was acknowledged.

    python tests/workers/kill_writer.py URL RUN STORAGE_OPTIONS_JSON

Prints ``BEGIN <step>`` before a save and ``ACK <step>`` after its commit was
acknowledged. Component bytes are a pure function of (step, name), so a reader
can verify them byte for byte.
"""

from __future__ import annotations

import json
import sys

from ckptstore import CheckpointStore

IDENT = {"data_digest": "kill-test", "code_digest": "kill-test"}
SIZES = {"model": 300_000, "optimizer": 600_000, "extra/rng": 5_000}


def blob(step: int, name: str) -> bytes:
    seed = f"<{step}:{name}>".encode()
    n = SIZES[name]
    return (seed * (n // len(seed) + 1))[:n]


def main() -> None:
    url, run, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    store = CheckpointStore.open(url, run, identity=IDENT, storage_options=opts or None)
    step = store.resumed_from.step + 1 if store.resumed_from else 0
    while True:
        print(f"BEGIN {step}", flush=True)
        with store.save(step) as s:
            for name in SIZES:
                s.put(name, blob(step, name))
        print(f"ACK {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
