"""Eviction policies: which unlocked, unpinned leaf of the prefix trie goes first.

A policy is a tiny class with one method, ``priority(node, now) -> float``: lower priorities
are evicted first; ties go to the node whose last access is older, then to the node that
became evictable first. Policies are chosen by name through ``make_policy``; add one by
subclassing ``EvictionPolicy`` and registering it in ``POLICIES``.

``time_invariant = True`` promises that the ORDER of two nodes' priorities does not change
while neither node is touched (the value may drift with ``now``), which lets the trie keep
evictable leaves in a heap keyed once at the moment they become evictable. Policies without
that property are re-ranked from scratch on every reclaim (correct, O(n log n) per reclaim).

A node exposes ``hits`` (admissions that used it), ``last_access`` (clock seconds),
``first_page`` (depth of its first page, in pages from the start of the sequence),
``num_pages`` and ``tail_tiers`` (Tier bits of its last page, the next one to go).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from typing import Any, ClassVar

__all__ = [
    "CostAwarePolicy",
    "CostModel",
    "EvictionPolicy",
    "EvictionQueue",
    "LFUPolicy",
    "LRUPolicy",
    "POLICIES",
    "make_policy",
]


class EvictionPolicy:
    """Base class: rank evictable nodes; lower ``priority`` is evicted first."""

    name: ClassVar[str] = ""
    time_invariant: ClassVar[bool] = True

    def bind(self, page_size: int) -> None:
        """Called once by the cache with its page size (tokens per page)."""

    def priority(self, node: Any, now: float) -> float:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used first (``last_access``, seconds)."""

    name = "lru"

    def priority(self, node: Any, now: float) -> float:
        return node.last_access


class LFUPolicy(EvictionPolicy):
    """Fewest hits first; equal hit counts fall back to least recently used."""

    name = "lfu"

    def priority(self, node: Any, now: float) -> float:
        return float(node.hits)


@dataclasses.dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds to recompute one page of KV, or to fetch it back from a lower tier.

    Recomputing page ``p`` (tokens ``p*page_size .. (p+1)*page_size - 1``) costs the dense
    FLOPs of its tokens (2 * params_per_token) plus attention over every earlier position
    (4 * hidden * position per layer: QK^T and PV), so deep pages cost more than shallow
    ones. Defaults describe a 7B-class model (32 layers, hidden 4096, 8 KV heads, bf16) on an
    accelerator sustaining 300 TFLOP/s with a 20 GB/s host link.
    """

    num_layers: int = 32
    hidden_size: int = 4096
    params_per_layer: float = 2.0e8
    kv_bytes_per_token: int = 2 * 32 * 8 * 128 * 2
    flops_per_second: float = 3.0e14
    transfer_bytes_per_second: float = 2.0e10

    def recompute_seconds(self, page_index: int, page_size: int, num_pages: int = 1) -> float:
        """Seconds to recompute ``num_pages`` pages starting at page ``page_index``."""
        tokens = num_pages * page_size
        first = page_index * page_size
        positions = tokens * first + tokens * (tokens - 1) / 2  # sum of the tokens' positions
        dense = 2.0 * self.params_per_layer * tokens
        attention = 4.0 * self.hidden_size * positions
        return self.num_layers * (dense + attention) / self.flops_per_second

    def transfer_seconds(self, page_size: int) -> float:
        return page_size * self.kv_bytes_per_token / self.transfer_bytes_per_second


class CostAwarePolicy(EvictionPolicy):
    """Evict the page whose expected loss is smallest.

    value = reuse likelihood x cost of a miss on that page, where
      reuse likelihood = (hits + 1) * 2 ** -((now - last_access) / half_life_s)
      cost of a miss   = recompute seconds of the page (grows with its depth), or, if a copy
                         survives on host or disk, the cheaper of recomputing and fetching it.
    Priority is log2(value); the ``now`` term is common to all nodes, so it is dropped and
    the ordering is time-invariant (the heap stays valid as time passes).
    """

    name = "cost_aware"

    def __init__(self, *, half_life_s: float = 60.0, cost_model: CostModel | None = None):
        if half_life_s <= 0:
            raise ValueError(f"{half_life_s=} must be > 0 seconds")
        self.half_life_s = half_life_s
        self.cost_model = cost_model or CostModel()
        self._page_size = 16

    def bind(self, page_size: int) -> None:
        self._page_size = page_size

    def priority(self, node: Any, now: float) -> float:
        tail_page = node.first_page + node.num_pages - 1
        loss = self.cost_model.recompute_seconds(tail_page, self._page_size)
        if node.tail_tiers & _LOWER_TIERS:
            loss = min(loss, self.cost_model.transfer_seconds(self._page_size))
        return math.log2(node.hits + 1) + node.last_access / self.half_life_s + math.log2(loss)


POLICIES: dict[str, type[EvictionPolicy]] = {
    policy.name: policy for policy in (LRUPolicy, LFUPolicy, CostAwarePolicy)
}


def make_policy(name: str | EvictionPolicy, **kwargs: Any) -> EvictionPolicy:
    """Build the policy registered as ``name`` (an instance is returned unchanged)."""
    if isinstance(name, EvictionPolicy):
        return name
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; valid policies: {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)


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

    def has_live_entry(self, node: Any) -> bool:
        return node.heap_version >= 0

    def rebuild(self, nodes: list[Any], now: float) -> None:
        """Drop every entry and re-rank ``nodes`` (compaction, or re-ranking by ``now``)."""
        self._heap = []
        for node in nodes:
            order = next(self._tiebreak)
            node.heap_version = order
            self._heap.append((self.policy.priority(node, now), node.last_access, order, node))
        heapq.heapify(self._heap)


_LOWER_TIERS = 2 | 4  # Tier.HOST | Tier.DISK, spelled out to keep this module import-free


# Policies in their own modules register themselves in POLICIES when imported; importing them
# here lets every make_policy caller (and config validation) see them. Kept last: circular.
from kvjax.cache import eviction_adaptive as _eviction_adaptive  # noqa: E402,F401
