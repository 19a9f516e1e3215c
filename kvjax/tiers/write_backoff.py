"""Back-off of a tier's writes after a failure, with an injectable clock.

A directory that refuses writes (read-only, full, gone) usually keeps refusing for a while;
trying again on every batch costs a failed write (and a log line) per batch and gains nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

__all__ = ["WriteBackoff"]


@dataclasses.dataclass(slots=True)
class WriteBackoff:
    """After a failed write, no write is tried for ``period_s`` seconds; the period starts at
    ``initial_s``, doubles on every failure in a row up to ``max_s``, and a successful write
    resets it. Not thread-safe: the caller holds its own lock.

    >>> now = [0.0]
    >>> backoff = WriteBackoff(1.0, 4.0, clock=lambda: now[0])
    >>> backoff.failed(), backoff.allows()
    (1.0, False)
    >>> backoff.drop(3); now[0] = 1.0
    >>> backoff.allows(), backoff.failed(), backoff.dropped  # tried again: failed again
    (True, 2.0, 0)
    >>> backoff.succeeded(); backoff.period_s
    0.0
    """

    initial_s: float = 1.0
    max_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    period_s: float = dataclasses.field(default=0.0, init=False)  # current back-off; 0: writes allowed
    failures: int = dataclasses.field(default=0, init=False)  # failed writes in a row
    dropped: int = dataclasses.field(default=0, init=False)  # blocks dropped untried this period
    last_dropped: int = dataclasses.field(default=0, init=False)  # ... in the period that ended last
    _resume_at: float = dataclasses.field(default=0.0, init=False, repr=False)

    def __post_init__(self):
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"back-off must satisfy 0 < initial_s={self.initial_s} <= max_s={self.max_s}")

    def allows(self) -> bool:
        """Whether a write may be tried now."""
        return self.failures == 0 or self.clock() >= self._resume_at

    def remaining_s(self) -> float:
        """Seconds until a write may be tried again (0 if it may now)."""
        return 0.0 if self.failures == 0 else max(0.0, self._resume_at - self.clock())

    def drop(self, num_blocks: int) -> None:
        """Counts blocks dropped without a try because writes are backing off."""
        self.dropped += num_blocks

    def failed(self) -> float:
        """A write failed: starts the next period; returns its length in seconds."""
        self.period_s = min(self.max_s, self.initial_s * 2.0 ** min(self.failures, 60))
        self.failures += 1
        self._resume_at = self.clock() + self.period_s
        self._end_period()
        return self.period_s

    def succeeded(self) -> None:
        """A write succeeded: writes are allowed again, the next failure starts at initial_s."""
        self.period_s, self.failures = 0.0, 0
        self._end_period()

    def _end_period(self) -> None:
        self.last_dropped, self.dropped = self.dropped, 0
