"""Prefetch intents: host/disk hits of queued requests, announced before they are admitted.

A waiting request whose longest cached prefix continues past its device pages onto pages
held only on host or disk is worth warming: the transfer engine can copy those pages up
while the request waits, so its admission maps them instead of recomputing. Only the best
``window`` waiting requests are announced (prefetching for a request far back in the queue
would spend the link and the device pages on KV that may be evicted again before it runs).

An extent is announced once while its prefetch is on its way or done; the scheduler
announces it again when the cache says a prefetch of it would start something now (it did
not start: no free blocks, the step failed before its moves; or it was dropped: its fetch
failed). An intent may cover only the leading pages of its extent (the device room the
scheduler grants it); the rest is announced once those have landed.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvjax.cache.records import MatchResult
from kvjax.serving.request import Request
from kvjax.serving.step_plan import PrefetchIntent
from kvjax.tiers.kv_cache import Lookup

__all__ = ["PrefetchPlanner"]


class PrefetchPlanner:
    """Tracks each waiting request's lower-tier hit extent and which extents were announced."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._pending: dict[str, tuple[int, int, np.ndarray]] = {}  # id -> (first page, pages, tiers)
        self._announced: dict[str, tuple[int, int]] = {}  # id -> (first page, pages) emitted

    def __bool__(self) -> bool:
        """Whether any waiting request has host/disk hits (the common no-tier case is False)."""
        return bool(self._pending)

    def note(self, request_id: str, match: Lookup | MatchResult, num_tokens: int) -> None:
        """Record the host/disk-only pages after the device prefix of a fresh match of a
        request of ``num_tokens`` tokens (its ``tiers`` are read only when there are such
        pages). Admission maps at most ``(num_tokens - 1) // page_size`` pages (the last token
        is always computed), so a page past those is not worth a fetch."""
        first = match.num_device_blocks
        num_lower = min(match.num_hit_blocks, (num_tokens - 1) // self.page_size) - first
        if num_lower > 0:
            self._pending[request_id] = (first, num_lower, match.tiers[first : first + num_lower])
        else:
            self._pending.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request left the queue (admitted, cancelled, rejected)."""
        self._pending.pop(request_id, None)
        self._announced.pop(request_id, None)

    def noted(self, best_waiting: Iterable[Request]) -> list[Request]:
        """Those of the given (best) waiting requests with a noted extent, in the same order."""
        return [request for request in best_waiting if request.request_id in self._pending]

    def extent(self, request_id: str) -> tuple[int, int] | None:
        """(first page, pages) of the request's noted extent, or None."""
        pending = self._pending.get(request_id)
        return None if pending is None else pending[:2]

    def announced(self, request_id: str) -> bool:
        """Whether the request's current extent was announced."""
        pending = self._pending.get(request_id)
        return pending is not None and self._announced.get(request_id) == pending[:2]

    def intent(self, request: Request, num_pages: int) -> PrefetchIntent:
        """The intent for the first ``num_pages`` (>= 1) pages of the request's noted extent;
        the whole extent counts as announced."""
        first, count, tiers = self._pending[request.request_id]
        if not 1 <= num_pages <= count:
            raise ValueError(f"{num_pages=} must be in [1, {count}] for request {request.request_id!r}")
        self._announced[request.request_id] = (first, count)
        prefix = request.token_ids[: (first + num_pages) * self.page_size]
        return PrefetchIntent(request.request_id, request.namespace, prefix, first, num_pages, tiers[:num_pages])

    def check_invariants(self, waiting_ids: set[str]) -> None:
        """Raise RuntimeError if a request that is not waiting still has prefetch state."""
        stray = (self._pending.keys() | self._announced.keys()) - waiting_ids
        if stray:
            raise RuntimeError(f"prefetch state kept for requests not waiting: {sorted(stray)}")
