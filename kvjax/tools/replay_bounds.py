"""Yardsticks for a trace replay: the offline (Belady/MIN) policy, a reuse-oracle LRU and
unlimited capacity.

Both run the same sequential model as ``kvjax.tools.replay`` (requests one after another in
timestamp order; no concurrency) over the same block identity as the prefix trie: a block is
the chain of hash ids that leads to it (``intern_block_paths``), so two requests share a block
only if they share every id up to and including it. A block counts as a hit only inside the
request's leading run of cached blocks, as in a prefix cache.

Offline policy, at a capacity of ``num_blocks`` blocks: to make room for a missing block,
evict the cached block (not one of the current request's) whose next use is farthest in the
future; among blocks with the same next use, the deepest goes first. A block's next use is
never earlier than its parent's (every request that uses a block uses its whole prefix), so
this only ever evicts leaves: the yardstick is reachable by a trie. A request longer than
the cache gets its first ``num_blocks`` blocks cached, the rest counted as misses.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from kvjax.cache.trie_node import Tier
from kvjax.tools.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = [
    "HitCounter",
    "HitCounts",
    "intern_block_paths",
    "offline_replay",
    "reuse_oracle_lru_replay",
    "unlimited_replay",
]

_NEVER = float("inf")


@dataclasses.dataclass(frozen=True, slots=True)
class HitCounts:
    """What a replay saw, summed over every request (blocks and tokens of prompts only)."""

    requests: int
    blocks: int  # blocks of all prompts, each request counted in full
    hit_blocks: int  # blocks served from the cache (leading runs)
    tokens: int  # prompt tokens
    hit_tokens: int  # prompt tokens inside hit blocks
    evicted_blocks: int  # blocks that lost their place in the cache
    host_hit_blocks: int = 0  # hit blocks found on the host tier only (part of hit_blocks)
    host_hit_tokens: int = 0
    disk_hit_blocks: int = 0  # hit blocks found on the disk tier only (part of hit_blocks)
    disk_hit_tokens: int = 0

    @property
    def device_hit_blocks(self) -> int:
        """Hit blocks that were on the device (every hit of a replay without lower tiers)."""
        return self.hit_blocks - self.host_hit_blocks - self.disk_hit_blocks

    @property
    def device_hit_tokens(self) -> int:
        return self.hit_tokens - self.host_hit_tokens - self.disk_hit_tokens

    def tier_rates(self) -> dict[str, float]:
        """``{device,host,disk}_{block,token}_hit_rate``: fractions of all blocks / tokens."""
        rates = {}
        for tier in ("device", "host", "disk"):
            blocks, tokens = getattr(self, f"{tier}_hit_blocks"), getattr(self, f"{tier}_hit_tokens")
            rates[f"{tier}_block_hit_rate"] = blocks / self.blocks if self.blocks else 0.0
            rates[f"{tier}_token_hit_rate"] = tokens / self.tokens if self.tokens else 0.0
        return rates

    @property
    def block_hit_rate(self) -> float:
        """Fraction of blocks that were hits (0.0 for an empty trace)."""
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        """Fraction of prompt tokens inside hit blocks (0.0 for an empty trace)."""
        return self.hit_tokens / self.tokens if self.tokens else 0.0


def intern_block_paths(requests: Sequence[TraceRequest]) -> tuple[list[list[int]], list[int]]:
    """Numbers every distinct block chain: returns (node ids per request, depth of each node).

    Node ids are dense ints from 0 in first-appearance order; ``depth[node]`` is its position
    (0 for a first block). Equal node ids mean equal hash ids all the way from the start.
    """
    node_of: dict[tuple[int, int], int] = {}
    depth: list[int] = []
    paths = []
    for request in requests:
        parent, path = -1, []
        for position, hash_id in enumerate(request.hash_ids):
            node = node_of.setdefault((parent, hash_id), len(depth))
            if node == len(depth):
                depth.append(position)
            path.append(node)
            parent = node
        paths.append(path)
    return paths, depth


def unlimited_replay(
    requests: Sequence[TraceRequest], *, block_tokens: int = MOONCAKE_BLOCK_TOKENS, warmup_requests: int = 0
) -> HitCounts:
    """Hits with room for every block: a block hits if any earlier request used its chain."""
    counter = HitCounter(block_tokens, warmup_requests)
    paths, _ = intern_block_paths(requests)
    seen: set[int] = set()
    for request, path in zip(requests, paths):
        counter.add(request, _leading_run(path, seen))
        seen.update(path)
    return counter.result(evicted_blocks=0)


def offline_replay(
    requests: Sequence[TraceRequest],
    num_blocks: int,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    warmup_requests: int = 0,
    kept_blocks: int | None = None,
) -> HitCounts:
    """Hits of the offline farthest-next-use policy with room for ``num_blocks`` blocks.

    ``kept_blocks``: how many leading blocks of each request the cache keeps (default all
    that fit): a tiered or cluster replay computes only a request's first ``device_blocks``
    (one node's device) though its tiers hold more, and a bound that had to keep longer
    prefixes than the policies it bounds evicted what they kept (a replay beat it).

    O(total blocks x log) time: next uses are precomputed in one backward pass, and the
    eviction heap drops stale entries lazily (an entry is live while it matches the block's
    current priority).
    """
    return _keyed_replay(requests, num_blocks, block_tokens, warmup_requests,
                         lambda next_use, index, depth: (-next_use, -depth), kept_blocks)  # fmt: skip


def reuse_oracle_lru_replay(
    requests: Sequence[TraceRequest],
    num_blocks: int,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    warmup_requests: int = 0,
) -> HitCounts:
    """Hits of LRU told which blocks will never be used again, with room for ``num_blocks``.

    Evicts blocks with no future use first, then the others; least recently used first in
    each group, the deepest first among blocks last used by the same request (so a reused
    block is always a leaf when it goes). It knows the future only as "used again or not",
    not when: the gap to ``offline_replay`` is what knowing the time of reuse is worth.
    """
    return _keyed_replay(requests, num_blocks, block_tokens, warmup_requests,
                         lambda next_use, index, depth: (next_use != _NEVER, index, -depth))  # fmt: skip


def _keyed_replay(requests: Sequence[TraceRequest], num_blocks: int, block_tokens: int, warmup_requests: int,
                  priority, kept_blocks: int | None = None) -> HitCounts:  # fmt: skip
    """Sequential replay evicting the cached block of least ``priority(next use, index of the
    request that last used it, depth)`` (a tuple; lowest goes first) that the current request
    does not use; each request's first ``kept_blocks`` (default ``num_blocks``) are cached."""
    if num_blocks < 1:
        raise ValueError(f"{num_blocks=} must be >= 1")
    if kept_blocks is not None and not 1 <= kept_blocks:
        raise ValueError(f"{kept_blocks=} must be None or >= 1")
    kept_blocks = num_blocks if kept_blocks is None else min(kept_blocks, num_blocks)
    counter = HitCounter(block_tokens, warmup_requests)
    paths, depth = intern_block_paths(requests)
    next_uses = _next_uses(paths)
    cached: dict[int, tuple] = {}  # node -> its priority, as last pushed
    heap: list[tuple[tuple, int]] = []  # (priority, node): lowest goes first
    evicted = 0
    for index, (request, path, path_next) in enumerate(zip(requests, paths, next_uses)):
        counter.add(request, _leading_run(path, cached))
        kept = path[:kept_blocks]
        made_room = _make_room(cached, heap, kept, num_blocks)
        evicted += made_room if index >= warmup_requests else 0  # the warm-up's evictions are not counted
        for node, next_use in zip(kept, path_next):
            key = priority(next_use, index, depth[node])
            cached[node] = key
            heapq.heappush(heap, (key, node))
    return counter.result(evicted_blocks=evicted)


def _make_room(cached: dict[int, tuple], heap: list[tuple[tuple, int]], path: list[int],
               num_blocks: int) -> int:  # fmt: skip
    """Evicts until ``path``'s missing blocks fit; returns how many blocks were evicted."""
    missing = sum(1 for node in path if node not in cached)
    excess = len(cached) + missing - num_blocks
    if excess <= 0:
        return 0
    in_use = set(path)
    held_back = []  # live entries of the current request's own blocks: locked, not evictable
    evicted = 0
    while evicted < excess:
        entry = heapq.heappop(heap)
        key, node = entry
        if cached.get(node) != key:
            continue  # stale: the block was used again (or evicted) since this entry
        if node in in_use:
            held_back.append(entry)
            continue
        del cached[node]
        evicted += 1
    for entry in held_back:
        heapq.heappush(heap, entry)
    return evicted


def _next_uses(paths: list[list[int]]) -> list[list[float]]:
    """For each block of each request: index of the next request using it, or infinity."""
    upcoming: dict[int, float] = {}
    next_uses: list[list[float]] = [[] for _ in paths]
    for index in range(len(paths) - 1, -1, -1):
        next_uses[index] = [upcoming.get(node, _NEVER) for node in paths[index]]
        for node in paths[index]:
            upcoming[node] = index
    return next_uses


def _leading_run(path: list[int], cached) -> int:
    """Number of leading blocks of ``path`` present in ``cached`` (a set or dict)."""
    run = 0
    for node in path:
        if node not in cached:
            break
        run += 1
    return run


class HitCounter:
    """Accumulates block and token hits request by request (shared by every replay); the first
    ``warmup_requests`` requests added are left out (see the module docstring). ValueError
    naming the value for a warm-up that is not an int >= 0."""

    def __init__(self, block_tokens: int, warmup_requests: int = 0):
        if isinstance(warmup_requests, bool) or not isinstance(warmup_requests, int) or warmup_requests < 0:
            raise ValueError(f"warmup_requests={warmup_requests!r} must be an int >= 0 (requests replayed "
                             "before any is counted)")  # fmt: skip
        self.block_tokens = block_tokens
        self.warmup_requests = warmup_requests
        self.added = 0  # requests added, the warm-up included
        self.requests = self.blocks = self.hit_blocks = self.tokens = self.hit_tokens = 0
        self.lower = {Tier.HOST: [0, 0], Tier.DISK: [0, 0]}  # tier -> [hit blocks, hit tokens]

    def add(self, request: TraceRequest, hit_blocks: int, lower_tiers: Sequence[Tier] = ()) -> None:
        """Counts a request whose first ``hit_blocks`` blocks hit; the last
        ``len(lower_tiers)`` of those came from the named lower tiers, in order (once the
        warm-up is over)."""
        self.added += 1
        if self.added <= self.warmup_requests:
            return
        per_block = request.block_tokens(self.block_tokens)
        self.requests += 1
        self.blocks += len(per_block)
        self.hit_blocks += hit_blocks
        self.tokens += sum(per_block)
        self.hit_tokens += sum(per_block[:hit_blocks])
        first = hit_blocks - len(lower_tiers)
        for tokens, tier in zip(per_block[first:hit_blocks], lower_tiers):
            self.lower[tier][0] += 1
            self.lower[tier][1] += tokens

    def result(self, *, evicted_blocks: int) -> HitCounts:
        (host_blocks, host_tokens), (disk_blocks, disk_tokens) = self.lower[Tier.HOST], self.lower[Tier.DISK]
        return HitCounts(self.requests, self.blocks, self.hit_blocks, self.tokens, self.hit_tokens,
                         evicted_blocks, host_blocks, host_tokens, disk_blocks, disk_tokens)  # fmt: skip
