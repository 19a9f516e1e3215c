"""Replay a request trace through the real KVCache, with no model and no bytes, to size a cache.

Model of the replay (sequential: one request at a time, in timestamp order, no concurrency,
no decode): for each request, admit it (the longest cached run of blocks hits, on device or
fetched from host or disk; the rest is allocated, evicting by the policy as needed), commit
all its blocks, release it. The cache is the product's own ``KVCache``, its eviction policy,
write policy, host tier and disk tier with their capacities and eviction orders, built with
``move_bytes=False``: no pool or host array, an in-memory disk index, transfers done at
submit. So every figure is one the product would get, and memory and time grow with the
trace, not with the capacity asked for.

Every hash id of the trace is one cache block: the ids are fed to the cache as tokens with
``page_size=1``, so the trace's own hashing decides what is shared (partial last blocks
included). Token hit rates weigh each block by the tokens it holds (see
``TraceRequest.block_tokens``). The clock the policy sees is the trace's arrival time, in
seconds. Lower-tier hits are always fetched (the replay counts what the tiers hold, not
what a cost model would decide for some model).

Adaptations that keep the real cache's rules from distorting the count:
- ``KVCache.admit`` always leaves a prompt's last token to compute (its logits are needed),
  which would make a request's last block never hit. The replay admits the hash ids followed
  by one sentinel token, and sizes the pool ``device_blocks + 1`` so the sentinel's private
  page never costs a cached block; the sentinel is never committed.
- A request longer than the cache gets its first ``device_blocks`` blocks admitted and
  cached; the rest count as misses.
- Each block is fed to the cache as its interned prefix path id (``intern_block_paths``:
  one int per distinct chain of hash ids, dense from 0), so ids of any size fit the cache's
  int32 tokens and a page's token names its block; sharing is exactly as with the hash ids.
- The disk tier is written in segments of ``disk_segment_blocks`` blocks (1 by default: a
  trace block is 512 tokens, 64 MiB of a Llama-3-8B-like model in bf16, a segment's worth).

``replay_report`` adds the yardsticks of ``kvjax.tools.replay_bounds`` at the same capacity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvjax.cache.block_keys import Namespace
from kvjax.cache.cost_model import CostModel
from kvjax.cache.eviction import EvictionPolicy
from kvjax.cache.policies import DEFAULT_POLICY
from kvjax.cache.trie_node import Tier
from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig
from kvjax.tiers.page_pool import PoolConfig
from kvjax.tools.replay_bounds import HitCounter, HitCounts, intern_block_paths, offline_replay, unlimited_replay
from kvjax.tools.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = ["DEFAULT_POLICY", "MAX_BLOCKS", "REPLAY_NAMESPACE", "ReplayReport", "matched_blocks", "replay_cache", "replay_report",
           "replay_trace", "serve_request"]

REPLAY_NAMESPACE = Namespace(tenant="trace-replay")
"""The namespace of every block a replay's caches hold (one interned block id per page)."""

_SENTINEL = 0  # token admitted after the hash ids; never matched (admit stops before it)
MAX_BLOCKS = 2**31 - 2  # device blocks: the pool has one more (the sentinel's), ids are int32
_ALWAYS_FETCH = CostModel(recompute_seconds_per_token=1.0)  # a lower-tier hit is always fetched


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayReport:
    """A policy's replay next to the yardsticks: the offline policy with the room of every
    tier together (``offline_blocks``: device + host + disk, the most they can hold), and
    unlimited room."""

    policy: str
    device_blocks: int
    online: HitCounts  # the real KVCache with ``policy`` (and the lower tiers, if any)
    offline: HitCounts  # farthest-next-use (Belady/MIN), prefix-aware: a bound on block hits (not on
    #                     token hits: it maximises blocks, and a partial last block holds fewer tokens)
    unlimited: HitCounts  # room for every block
    host_blocks: int = 0
    disk_blocks: int = 0
    write_through: bool = False

    @property
    def offline_blocks(self) -> int:
        """The offline yardstick's room: every tier's blocks (a tiered cache holds no more)."""
        return self.device_blocks + self.host_blocks + self.disk_blocks

    def as_dict(self) -> dict[str, Any]:
        """Flat summary (rates are fractions in [0, 1]) for ``--json`` and benchmarks."""
        online = self.online
        return {
            "policy": self.policy,
            "device_blocks": self.device_blocks,
            "host_blocks": self.host_blocks,
            "disk_blocks": self.disk_blocks,
            "write": "through" if self.write_through else "back",
            "requests": online.requests,
            "blocks": online.blocks,
            "hit_blocks": online.hit_blocks,
            "tokens": online.tokens,
            "hit_tokens": online.hit_tokens,
            "evicted_blocks": online.evicted_blocks,
            "block_hit_rate": online.block_hit_rate,
            "token_hit_rate": online.token_hit_rate,
            **online.tier_rates(),
            "offline_blocks": self.offline_blocks,
            "offline_block_hit_rate": self.offline.block_hit_rate,
            "offline_token_hit_rate": self.offline.token_hit_rate,
            "unlimited_block_hit_rate": self.unlimited.block_hit_rate,
            "unlimited_token_hit_rate": self.unlimited.token_hit_rate,
        }


def replay_trace(
    requests: Sequence[TraceRequest],
    device_blocks: int,
    *,
    policy: str | EvictionPolicy = DEFAULT_POLICY,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    host_blocks: int = 0,
    disk_blocks: int = 0,
    write_through: bool = False,
    disk_segment_blocks: int = 1,
    check_every: int = 0,
    warmup_requests: int = 0,
) -> HitCounts:
    """Replays ``requests`` (in the given order) through a ``KVCache`` of ``device_blocks``
    device blocks above host and disk tiers of ``host_blocks`` and ``disk_blocks`` (0: no such
    tier; a disk tier needs a host tier). ``write_through``: every block gets its host copy
    when committed, else when evicted from the device (write-back).

    ``check_every=k > 0`` runs the cache's ``check_invariants()`` after every k-th request (for
    tests; it is O(cache size)). ``warmup_requests``: the first that many requests warm the
    cache and are not counted, nor their evictions (``kvjax.tools.replay_bounds``). Raises
    ValueError naming the value for a capacity or warm-up out of range or an unknown policy
    name, before replaying anything.
    """
    if check_every < 0:
        raise ValueError(f"{check_every=} must be >= 0")
    counts = HitCounter(block_tokens, warmup_requests)
    cache, now = replay_cache(device_blocks, policy=policy, host_blocks=host_blocks, disk_blocks=disk_blocks,
                              write_through=write_through, disk_segment_blocks=disk_segment_blocks)  # fmt: skip
    paths, _ = intern_block_paths(requests)
    warm_evictions = 0  # evictions of the warm-up, left out of the count
    with cache:
        for index, (request, path) in enumerate(zip(requests, paths)):
            now[0] = request.timestamp_ms / 1000.0
            counts.add(request, *serve_request(cache, path[:device_blocks]))
            if index < warmup_requests:
                warm_evictions = cache.trie.dropped_pages
            if check_every and (index + 1) % check_every == 0:
                cache.check_invariants()
    # blocks that left every tier, as the yardsticks count theirs (a move to a lower tier is not one)
    return counts.result(evicted_blocks=cache.trie.dropped_pages - warm_evictions)


def replay_cache(device_blocks: int, *, policy: str | EvictionPolicy = DEFAULT_POLICY, host_blocks: int = 0,
                 disk_blocks: int = 0, write_through: bool = False,
                 disk_segment_blocks: int = 1) -> tuple[KVCache, list[float]]:  # fmt: skip
    """The replay's cache (one block per page, no bytes) and the one-element list its clock
    reads (seconds). ValueError naming the value for a capacity out of range."""
    for name, value, low in (("device_blocks", device_blocks, 1), ("host_blocks", host_blocks, 0),
                             ("disk_blocks", disk_blocks, 0), ("disk_segment_blocks", disk_segment_blocks, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_BLOCKS:
            raise ValueError(f"{name}={value!r} must be an int in [{low}, {MAX_BLOCKS}] (blocks)")
    if disk_blocks and not host_blocks:
        raise ValueError(f"disk_blocks={disk_blocks} needs host_blocks > 0 (disk blocks are staged through host)")
    pool = PoolConfig(num_blocks=device_blocks + 1, num_layers=1, num_kv_heads=1, page_size=1, head_dim=1,
                      dtype="float32")  # fmt: skip
    block = pool.bytes_per_block
    config = KVCacheConfig(pool=pool, host_bytes=host_blocks * block, policy=policy if isinstance(policy, str)
                           else policy.name, cost_model=_ALWAYS_FETCH,
                           write_policy="write_through" if write_through else "write_back")  # fmt: skip
    disk = None
    if disk_blocks:
        disk = DiskTier(None, pool.block_shape, pool.dtype, disk_blocks * block, segment_bytes=disk_segment_blocks * block)
    now = [0.0]
    cache = KVCache(config, clock=lambda: now[0], disk_tier=disk, move_bytes=False)
    if not isinstance(policy, str):  # a policy instance (tests, benchmarks): the cache uses it as is
        policy.bind(1, block, config.cost_model)
        cache.trie.policy = cache.trie.queue.policy = policy
    return cache, now


def replay_report(
    requests: Sequence[TraceRequest],
    device_blocks: int,
    *,
    policy: str = DEFAULT_POLICY,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    host_blocks: int = 0,
    disk_blocks: int = 0,
    write_through: bool = False,
) -> ReplayReport:
    """The policy's replay (with the lower tiers) plus the offline policy with every tier's
    room (device + host + disk blocks: at the device's alone a tiered cache beat its 'bound')
    and unlimited capacity, on the same requests."""
    tiers = dict(host_blocks=host_blocks, disk_blocks=disk_blocks, write_through=write_through)
    online = replay_trace(requests, device_blocks, policy=policy, block_tokens=block_tokens, **tiers)
    return ReplayReport(
        policy=policy,
        device_blocks=device_blocks,
        online=online,
        offline=offline_replay(requests, device_blocks + host_blocks + disk_blocks, block_tokens=block_tokens,
                               kept_blocks=device_blocks),  # fmt: skip
        unlimited=unlimited_replay(requests, block_tokens=block_tokens),
        **tiers,
    )


def matched_blocks(cache: KVCache, blocks: list[int], namespace: Namespace = REPLAY_NAMESPACE) -> int:
    """How many leading blocks of a request (its interned block ids) ``cache`` holds in
    ``namespace``, any tier, without changing anything: what a node would tell the cluster's
    directory."""
    return cache.match(blocks, namespace).num_hit_blocks


def serve_request(cache: KVCache, blocks: list[int],
                  namespace: Namespace = REPLAY_NAMESPACE) -> tuple[int, list[Tier]]:  # fmt: skip
    """Admit, commit and release one request (its interned block ids, at most the device
    capacity) in ``namespace``; (hit blocks, the tier of each lower-tier hit)."""
    handle = cache.admit([*blocks, _SENTINEL], namespace)
    if handle is None:  # nothing else is running, so the pool (device_blocks + 1) must fit it
        raise RuntimeError(f"admission of {len(blocks)} blocks failed in a sequential replay")
    cache.wait_ready(handle)
    sources = cache.admission_report(handle).sources  # the tier of each hit block, in order
    cache.commit(handle, blocks)
    cache.release(handle)
    cache.poll()  # spills to disk, as a serving step would
    return len(sources), [Tier(int(tier)) for tier in sources if tier != Tier.DEVICE]
