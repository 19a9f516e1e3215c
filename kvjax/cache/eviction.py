"""Eviction order of the prefix trie's evictable leaves: the policy interface and the queue.

A policy is a tiny class with one method, ``priority(node, now) -> float``: lower priorities
are evicted first; ties go to the node whose last access is older, then to the node that
became evictable first. The policies themselves, and the registry that picks one by name,
are in ``kvjax.cache.policies``.

``time_invariant = True`` promises that the ORDER of two nodes' priorities does not change
while neither node is touched (the value may drift with ``now``), which lets the trie keep
evictable leaves in a heap keyed once at the moment they become evictable. Policies without
that property are re-ranked from scratch on every reclaim (correct, O(n log n) per reclaim).

A node exposes ``hits`` (admissions that used it), ``last_access`` (clock seconds),
``first_page`` (depth of its first page, in pages from the start of the sequence),
``num_pages``, ``label`` (its pages' token bytes) and ``tail_tiers`` (Tier bits of its last
page, the next one to go).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, ClassVar

from kvjax.cache.cost_model import CostModel

__all__ = ["EvictionPolicy", "EvictionQueue"]


class EvictionPolicy:
    """Base class: rank evictable nodes; lower ``priority`` is evicted first."""

    name: ClassVar[str] = ""
    time_invariant: ClassVar[bool] = True

    def bind(self, page_size: int, block_nbytes: int, cost_model: CostModel) -> None:
        """Called once by the cache: tokens per page, bytes a block moves between tiers, and
        the cache's cost model (see ``kvjax.cache.cost_model``)."""

    def priority(self, node: Any, now: float) -> float:
        raise NotImplementedError


class EvictionQueue:
    """Evictable leaves ordered by policy, a heap with lazy invalidation.

    ``push(node)`` stamps the node with a fresh ``heap_version``; older entries of that node
    become stale and are skipped on pop. The caller decides validity with ``is_evictable``.
    """

    def __init__(self, policy: EvictionPolicy):
        self.policy = policy
        self._heap: list[tuple[float, float, int, Any]] = []  # (priority, last_access, order, node)
        self._tiebreak = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: Any, now: float) -> None:
        order = next(self._tiebreak)
        node.heap_version = order
        heapq.heappush(self._heap, (self.policy.priority(node, now), node.last_access, order, node))

    def pop(self, is_evictable: Any) -> Any | None:
        """Remove and return the best node for which ``is_evictable(node)`` holds, or None."""
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
        self._heap = []
        for node in nodes:
            order = next(self._tiebreak)
            node.heap_version = order
            self._heap.append((self.policy.priority(node, now), node.last_access, order, node))
        heapq.heapify(self._heap)
