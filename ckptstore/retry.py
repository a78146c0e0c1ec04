"""Bounded exponential backoff for transient backend failures (above the backends)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import TransientError

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6
    base_delay: float = 0.05
    max_delay: float = 2.0

    def call(self, fn: Callable[[], T], *, on_retry: Callable[[int, Exception], None] | None = None) -> T:
        """Run ``fn``; retry on :class:`TransientError` up to ``attempts`` times
        in all, with jittered exponential backoff. The last error propagates."""
        for i in range(self.attempts):
            try:
                return fn()
            except TransientError as exc:
                if i == self.attempts - 1:
                    raise
                if on_retry is not None:
                    on_retry(i + 1, exc)
                delay = min(self.max_delay, self.base_delay * (2**i))
                time.sleep(delay * (0.5 + random.random() / 2))
        raise AssertionError("unreachable")


NO_RETRY = RetryPolicy(attempts=1)
