"""A tiered writer that SIGKILLs itself at a chosen point (tests/tiers/test_kill.py).

argv[1]: JSON {"url", "options", "local", "steps", "kill_step", "kill"} with
kill one of: local-commit (before the local commit record is created),
mid-component (replication copied the first component), before-durable-commit,
after-durable-commit (the durable commit record landed; the answer is lost).
Prints "local <step>" after each local commit and "durable <step>" once a
save is acknowledged durable."""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from ckptstore import CheckpointStore, OpenOptions, TierOptions
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.schemes import backend_from_url
from ckptstore.protocol import layout_of
from ckptstore.tiers import replicator


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def step_of_key(key: str) -> int | None:
    if "/commits/" not in key:
        return None
    sa = layout_of(2).parse_commit_name(key.rsplit("/", 1)[1])
    return sa[0] if sa is not None else None


def payload(step: int) -> bytes:
    return bytes((step * 7 + i) % 251 for i in range(3000))


def main() -> None:
    cfg: dict[str, Any] = json.loads(sys.argv[1])
    kill, kill_step = cfg["kill"], cfg["kill_step"]
    durable = backend_from_url(cfg["url"], storage_options=cfg["options"] or None)
    local_root = os.path.realpath(cfg["local"])

    if kill == "local-commit":
        original_create = LocalBackend.create

        def create(self: LocalBackend, key: str, data: bytes) -> bool:
            if os.path.realpath(str(self.root)).startswith(local_root) and step_of_key(key) == kill_step:
                die()
            return original_create(self, key, data)

        LocalBackend.create = create  # type: ignore[method-assign]
    elif kill in ("before-durable-commit", "after-durable-commit"):
        inner_create = durable.create

        def durable_create(key: str, data: bytes) -> bool:
            if step_of_key(key) == kill_step and kill == "before-durable-commit":
                die()
            out = inner_create(key, data)
            if step_of_key(key) == kill_step:
                die()
            return out

        durable.create = durable_create  # type: ignore[method-assign]
    elif kill == "mid-component":
        copy = replicator.copy_save

        def copy_save(local: Any, dur: Any, attempts: Any, ref: Any, on_component: Any = None, **kw: Any) -> bool:
            return copy(local, dur, attempts, ref, (lambda name: die()) if ref.step == kill_step else on_component,
                        **kw)

        replicator.copy_save = copy_save  # type: ignore[assignment]

    store = CheckpointStore.open(durable, "run", identity={"model": "tiny"}, options=OpenOptions(
        tiers=TierOptions(cfg["local"], keep=10), protocol_version=cfg.get("protocol_version")))
    for step in range(cfg["steps"]):
        with store.save(step) as w:
            w.put("a", payload(step))
            w.put("b", payload(step)[::-1])
        print("local", step, flush=True)
        if store.flush(60) and store.is_durable(w.ref):  # type: ignore[arg-type]
            print("durable", step, flush=True)
    store.close()


if __name__ == "__main__":
    main()
