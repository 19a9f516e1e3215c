"""Byte budget of one transfer link: a token bucket with an injectable clock."""

from __future__ import annotations

import threading
import time
from typing import Callable

__all__ = ["TokenBucket"]


class TokenBucket:
    """Refills at `rate_bytes_per_s` up to `burst_bytes`; background transfers wait for tokens.

    A demand transfer calls `take`, which never waits and may leave the bucket in debt, so the
    background transfers behind it wait longer: the link's average rate stays within budget
    while a demand fetch is never held back by it. A transfer larger than the burst is let
    through when the bucket is full (it would never fit otherwise).

    >>> now = [0.0]
    >>> bucket = TokenBucket(100.0, 200, clock=lambda: now[0])
    >>> bucket.try_take(150), bucket.try_take(100)
    (0.0, 0.5)
    >>> now[0] = 0.5
    >>> bucket.try_take(100)
    0.0
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int,
                 clock: Callable[[], float] = time.monotonic):
        """Args: rate in bytes per second (> 0); burst in bytes (> 0); clock in seconds."""
        if not rate_bytes_per_s > 0 or burst_bytes <= 0:
            raise ValueError(f"{rate_bytes_per_s=} and {burst_bytes=} must be > 0")
        self.rate_bytes_per_s = float(rate_bytes_per_s)
        self.burst_bytes = int(burst_bytes)
        self._clock = clock
        self._tokens = float(burst_bytes)  # bytes; negative is debt
        self._last = clock()
        self._lock = threading.Lock()

    @property
    def tokens(self) -> float:
        """Bytes available now (negative while in debt)."""
        with self._lock:
            self._refill()
            return self._tokens

    def try_take(self, nbytes: int) -> float:
        """Takes `nbytes` and returns 0.0, or takes nothing and returns seconds to wait."""
        with self._lock:
            self._refill()
            needed = min(float(nbytes), float(self.burst_bytes))
            if self._tokens >= needed:
                self._tokens -= nbytes
                return 0.0
            return (needed - self._tokens) / self.rate_bytes_per_s

    def take(self, nbytes: int) -> None:
        """Takes `nbytes` now, going into debt when short."""
        with self._lock:
            self._refill()
            self._tokens -= nbytes

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._last)
        self._last = now
        self._tokens = min(float(self.burst_bytes), self._tokens + elapsed * self.rate_bytes_per_s)
