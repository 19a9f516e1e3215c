"""Waiting queue: hit-first order with aging, in O(log n) per operation.

A request's priority at time ``now`` is ``hit_rank + (now - arrival_time) / aging_seconds``
(higher first). Every waiting request ages at the same rate, so the order between two of
them never changes with time, only with their ranks; the queue therefore keys each request
once by ``arrival_time - hit_rank * aging_seconds`` (seconds; smaller first), ties broken by
the order they were queued. Read: a hit rank of ``r`` lets a request go ahead of requests
that arrived up to ``r * aging_seconds`` earlier and no more, so nobody waits behind an
unbounded stream of hits. ``aging_seconds=0`` is first-come first-served.

Preempted requests (``urgent``) go before every other request: they already hold generated
tokens (and a swapped one holds host swap slots).

The heap is lazy: re-keying or removing a request leaves its old entry behind, skipped when
it surfaces; the heap is rebuilt when dead entries outnumber live ones.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from kvjax.serving.request import Request

__all__ = ["WaitQueue", "hit_rank"]


def hit_rank(hit_pages: int) -> int:
    """Rank of a cached prefix of ``hit_pages`` pages: 0 for a miss, else 1 + floor(log2(pages)).

    Logarithmic so that aging has a bounded job: 1,000 cached pages outrank a miss by 10.
    """
    return int(hit_pages).bit_length()


class WaitQueue:
    """Requests waiting for admission, best first (see the module docstring)."""

    def __init__(self, aging_seconds: float):
        self.aging_seconds = aging_seconds
        self._heap: list[tuple[int, float, int, Request]] = []  # (urgency, key s, order, request)
        self._live: dict[str, tuple[int, float, int, Request]] = {}  # request id -> its live entry
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def key(self, request: Request, urgent: bool) -> tuple[int, float]:
        """(urgency class, seconds): the sort key for ``request`` with its current rank."""
        return (0 if urgent else 1, request.arrival_time - request.hit_rank * self.aging_seconds)

    def push(self, request: Request, *, urgent: bool = False) -> None:
        """Queue ``request`` (or re-key it if queued) with its current ``hit_rank``."""
        old = self._live.get(request.request_id)
        order = next(self._order) if old is None else old[2]  # a re-key keeps its tie order
        entry = (*self.key(request, urgent), order, request)
        self._live[request.request_id] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def is_urgent(self, request_id: str) -> bool:
        return self._live[request_id][0] == 0

    def peek(self) -> Request | None:
        """The best waiting request, or None."""
        self._drop_dead()
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Request | None:
        """Remove and return the best waiting request, or None."""
        self._drop_dead()
        if not self._heap:
            return None
        entry = heapq.heappop(self._heap)
        del self._live[entry[3].request_id]
        return entry[3]

    def remove(self, request_id: str) -> Request | None:
        """Take ``request_id`` out of the queue; None if it was not queued."""
        entry = self._live.pop(request_id, None)
        return None if entry is None else entry[3]

    def best(self, count: int) -> list[Request]:
        """The ``count`` best waiting requests, best first (O(n log count); leaves them queued)."""
        return [entry[3] for entry in heapq.nsmallest(count, self._live.values())]

    def __iter__(self) -> Iterator[Request]:
        """Waiting requests in no particular order."""
        return (entry[3] for entry in self._live.values())

    def check_invariants(self) -> None:
        """Raise RuntimeError unless every live entry is in the heap with its request's current key."""
        in_heap = {id(entry) for entry in self._heap}
        for request_id, entry in self._live.items():
            request = entry[3]
            if id(entry) not in in_heap or request.request_id != request_id:
                raise RuntimeError(f"queued request {request_id!r} has no heap entry")
            if entry[:2] != self.key(request, entry[0] == 0):
                raise RuntimeError(f"request {request_id!r} is queued under key {entry[:2]}; "
                                   f"its rank {request.hit_rank} gives {self.key(request, entry[0] == 0)}")  # fmt: skip
        for index in range(1, len(self._heap)):
            if self._heap[index][:3] < self._heap[(index - 1) // 2][:3]:
                raise RuntimeError(f"heap order broken at entry {index}")

    def _drop_dead(self) -> None:
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][3].request_id) is not heap[0]:
            heapq.heappop(heap)
