"""Work that must run at interpreter exit while worker threads can still start work.

:func:`atexit.register` runs too late for a store: by then
``concurrent.futures`` has marked the interpreter as shutting down, and every
``ThreadPoolExecutor.submit`` (a replication copy, a save's parallel upload)
raises ``RuntimeError: cannot schedule new futures after interpreter
shutdown``. :func:`before_pools_stop` registers ``fn`` with the same hook the
executors use (``threading._register_atexit``, CPython 3.9+), after them, so
``fn`` runs first (the hooks run newest first); where the hook is missing it
falls back to :func:`atexit.register`. Hooks registered later run earlier:
the Checkpointer's in-flight saves (registered when ``ckptstore.torch`` is
imported) settle before the tiers flush (registered with ``ckptstore``).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook first, so ours runs before it)
import threading
from collections.abc import Callable


def before_pools_stop(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit, before thread pools refuse new work."""
    hook = getattr(threading, "_register_atexit", None)
    if hook is None:  # pragma: no cover - other interpreters
        atexit.register(fn)
        return
    hook(fn)
