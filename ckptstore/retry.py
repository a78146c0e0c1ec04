"""The one retry policy: bounded, jittered exponential backoff for transient
backend failures. Every retry loop in ckptstore goes through it."""

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
    """``attempts`` tries in all; before try ``i+1`` wait ``base_delay * 2**i``
    (capped at ``max_delay``), scaled by a random factor in [0.5, 1)."""

    attempts: int = 6
    base_delay: float = 0.05
    max_delay: float = 2.0

    def backoff(self, i: int) -> None:
        """Sleep before retry number ``i + 1`` (``i`` counts failures so far, from 0)."""
        delay = min(self.max_delay, self.base_delay * (2**i))
        time.sleep(delay * (0.5 + random.random() / 2))

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn``; retry on :class:`TransientError`. The last error propagates."""
        for i in range(self.attempts):
            try:
                return fn()
            except TransientError:
                if i == self.attempts - 1:
                    raise
                self.backoff(i)
        raise AssertionError("unreachable")
