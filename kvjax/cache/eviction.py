"""Eviction order of the prefix trie's evictable leaves: the policy interface and the queue.

A policy is a tiny class with one method, ``priority(node, now) -> float``: lower priorities
are evicted first; ties go to the node whose last access is older, then to the node that
became evictable first. The policies themselves, and the registry that picks one by name,
are in ``kvjax.cache.policies``.

``time_invariant = True`` promises that the ORDER of two nodes' priorities does not change
while neither node is touched (the value may drift with ``now``), which lets the trie keep
evictable leaves in a heap keyed once at the moment they become evictable. Policies without
that property are re-ranked from scratch on every reclaim (correct, O(n log n) per reclaim).

A policy whose priority is ``last_access + offset[lane]``, with a few lanes (kinds of node)
whose offsets change as it learns, sets ``num_lanes`` and gives ``lane(node, now)`` and
``lane_offsets()``: the queue then keeps one heap per lane, ordered by last access (exact
within a lane: its nodes share one offset), and picks the victim among the lane heads with
the offsets of the moment, O(lanes) per pop. A heap keyed once would rank each node with
the offsets of the moment it was pushed: stale by the time it is evicted.

A node exposes ``hits`` (admissions that used it), ``last_access`` (clock seconds),
``first_page`` (depth of its first page, in pages from the start of the sequence),
``num_pages``, ``label`` (its pages' token bytes) and ``tail_tiers`` (Tier bits of its last
page, the next one to go).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any, ClassVar

from kvjax.cache.cost_model import CostModel

__all__ = ["EvictionPolicy", "EvictionQueue"]


class EvictionPolicy:
    """Base class: rank evictable nodes; lower ``priority`` is evicted first."""

    name: ClassVar[str] = ""
    time_invariant: ClassVar[bool] = True
    num_lanes: ClassVar[int] = 0  # > 0: ranked by lane (see the module docstring)

    def bind(self, page_size: int, block_nbytes: int, cost_model: CostModel) -> None:
        """Called once by the cache: tokens per page, bytes a block moves between tiers, and
        the cache's cost model (see ``kvjax.cache.cost_model``)."""

    def priority(self, node: Any, now: float) -> float:
        raise NotImplementedError

    def lane(self, node: Any, now: float) -> int:
        """With ``num_lanes``: the node's lane (0 to ``num_lanes - 1``); its priority is
        ``node.last_access + lane_offsets()[lane]`` until it is pushed again."""
        raise NotImplementedError

    def lane_offsets(self) -> Sequence[float]:
        """With ``num_lanes``: each lane's offset (seconds) now, read at every pop."""
        raise NotImplementedError


class EvictionQueue:
    """Evictable leaves ordered by policy, a heap with lazy invalidation (one per lane for a
    policy with ``num_lanes``).

    ``push(node)`` stamps the node with a fresh ``heap_version``; older entries of that node
    become stale and are skipped on pop. The caller decides validity with ``is_evictable``.
    """

    def __init__(self, policy: EvictionPolicy):
        self.policy = policy
        self._lanes = policy.num_lanes
        self._heap: list[tuple[float, float, int, Any]] = []  # (priority, last_access, order, node)
        # with lanes, one heap per lane of (last_access, order, node), and how many entries they hold
        self._lane_heaps: list[list[tuple[float, int, Any]]] = [[] for _ in range(self._lanes)]
        self._size = 0  # stale entries included, as len(self._heap)
        self._tiebreak = itertools.count()

    def __len__(self) -> int:
        return self._size if self._lanes else len(self._heap)

    def push(self, node: Any, now: float) -> None:
        order = next(self._tiebreak)
        node.heap_version = order
        if self._lanes:
            heapq.heappush(self._lane_heaps[self._lane(node, now)], (node.last_access, order, node))
            self._size += 1
        else:
            heapq.heappush(self._heap, (self.policy.priority(node, now), node.last_access, order, node))

    def pop(self, is_evictable: Any) -> Any | None:
        """Remove and return the best node for which ``is_evictable(node)`` holds, or None."""
        if self._lanes:
            return self._pop_lanes(is_evictable)
        heap = self._heap
        while heap:
            _, _, version, node = heapq.heappop(heap)
            if version == node.heap_version:
                node.heap_version = -1
                if is_evictable(node):
                    return node
        return None

    def rebuild(self, nodes: list[Any], now: float) -> None:
        """Drop every entry and re-rank ``nodes`` (compaction, or re-ranking by ``now``)."""
        if self._lanes:
            self._lane_heaps = [[] for _ in range(self._lanes)]
            for node in nodes:
                order = next(self._tiebreak)
                node.heap_version = order
                self._lane_heaps[self._lane(node, now)].append((node.last_access, order, node))
            for heap in self._lane_heaps:
                heapq.heapify(heap)
            self._size = len(nodes)
            return
        self._heap = []
        for node in nodes:
            order = next(self._tiebreak)
            node.heap_version = order
            self._heap.append((self.policy.priority(node, now), node.last_access, order, node))
        heapq.heapify(self._heap)

    def _lane(self, node: Any, now: float) -> int:
        lane = self.policy.lane(node, now)
        if not 0 <= lane < self._lanes:
            raise ValueError(f"policy {self.policy.name!r} put a node in lane {lane!r}; expected 0 to {self._lanes - 1}")
        return lane

    def _pop_lanes(self, is_evictable: Any) -> Any | None:
        """The lane head with the lowest ``last_access + offset`` now (ties: older last access,
        then pushed first), as one heap of priorities stamped now would give."""
        heaps, offsets = self._lane_heaps, self.policy.lane_offsets()
        while True:
            best, best_key = None, None
            for lane, heap in enumerate(heaps):
                while heap and heap[0][1] != heap[0][2].heap_version:
                    heapq.heappop(heap)  # stale: the node was pushed again or popped
                    self._size -= 1
                if heap:
                    last_access, order, _ = heap[0]
                    key = (last_access + offsets[lane], last_access, order)
                    if best_key is None or key < best_key:
                        best, best_key = heap, key
            if best is None:
                return None
            node = heapq.heappop(best)[2]
            self._size -= 1
            node.heap_version = -1
            if is_evictable(node):
                return node
