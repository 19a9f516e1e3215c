"""Replay a request trace through the real prefix cache, with no model, to size a cache.

Model of the replay (sequential: one request at a time, in timestamp order, no concurrency,
no decode): for each request, match the leading run of cached blocks (the hits), admit it
(lock the hits, allocate the rest, evicting by the policy as needed), commit all its blocks,
release it. Every hash id of the trace is one cache block: the ids are fed to ``DeviceIndex``
as tokens with ``page_size=1``, so the trace's own hashing decides what is shared (partial
last blocks included). Token hit rates weigh each block by the tokens it holds (see
``TraceRequest.block_tokens``). The clock the policy sees is the trace's arrival time, in
seconds.

Two adaptations keep the real cache's rules from distorting the count:
- ``DeviceIndex.admit`` always leaves a prompt's last token to compute (its logits are
  needed), which would make a request's last block never hit. The replay admits the hash ids
  followed by one sentinel token, and sizes the pool ``device_blocks + 1`` so the sentinel's
  private page never costs a cached block; the sentinel is never committed.
- A request longer than the cache gets its first ``device_blocks`` blocks admitted and
  cached; the rest count as misses.
- Each block is fed to the cache as its interned prefix path id (``intern_block_paths``:
  one int per distinct chain of hash ids, dense from 0), so ids of any size fit the cache's
  int32 tokens and a page's token names its block; sharing is exactly as with the hash ids.

Tiers (``host_blocks``/``disk_blocks`` > 0; bookkeeping in ``kvjax.tools.replay_tiers``, no data
moves): the device tier is the DeviceIndex above with the chosen policy. When it evicts a
block (the trie's ``before_evict`` hook), write-back stores the block on the host tier, which
has its own capacity and eviction (``tier_policy``: LRU, or scan-resistant segmented LRU); a
block the host evicts goes to the disk tier when it has capacity (same policy), and one the
disk evicts is gone. ``write_through=True`` instead writes
every block to the host as it is used on the device. A request's leading run continues past
its device hits through blocks the host or disk holds; each hit counts for the highest tier
holding it (device, then host, then disk). Every block of the request then occupies a device
block again: blocks found below are admitted and committed like misses (so the device tier
behaves exactly as without lower tiers) and, with write-back, leave the lower tier.
Requests longer than the device still count the blocks past ``device_blocks`` as misses.

``replay_report`` adds the yardsticks of ``kvjax.tools.replay_bounds`` at the same capacity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvjax.cache.block_keys import Namespace, chained_block_keys
from kvjax.cache.device_index import DeviceIndex
from kvjax.cache.eviction import EvictionPolicy
from kvjax.cache.policies import DEFAULT_POLICY
from kvjax.tools.replay_bounds import (
    HitCounter,
    HitCounts,
    intern_block_paths,
    offline_replay,
    unlimited_replay,
)
from kvjax.tools.replay_tiers import DEFAULT_TIER_POLICY, LowerTiers
from kvjax.tools.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = ["DEFAULT_POLICY", "ReplayReport", "replay_report", "replay_trace"]

_NAMESPACE = Namespace(tenant="trace-replay")
_SENTINEL = 0  # token admitted after the hash ids; never matched (admit stops before it)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayReport:
    """A policy's replay next to the yardsticks, all at ``device_blocks`` blocks of room."""

    policy: str
    device_blocks: int
    online: HitCounts  # the real DeviceIndex with ``policy`` (and the lower tiers, if any)
    offline: HitCounts  # farthest-next-use (Belady/MIN), prefix-aware
    unlimited: HitCounts  # room for every block
    host_blocks: int = 0
    disk_blocks: int = 0
    write_through: bool = False
    tier_policy: str = DEFAULT_TIER_POLICY

    def as_dict(self) -> dict[str, Any]:
        """Flat summary (rates are fractions in [0, 1]) for ``--json`` and benchmarks."""
        online = self.online
        return {
            "policy": self.policy,
            "device_blocks": self.device_blocks,
            "host_blocks": self.host_blocks,
            "disk_blocks": self.disk_blocks,
            "write": "through" if self.write_through else "back",
            "tier_policy": self.tier_policy,
            "requests": online.requests,
            "blocks": online.blocks,
            "hit_blocks": online.hit_blocks,
            "tokens": online.tokens,
            "hit_tokens": online.hit_tokens,
            "evicted_blocks": online.evicted_blocks,
            "block_hit_rate": online.block_hit_rate,
            "token_hit_rate": online.token_hit_rate,
            **online.tier_rates(),
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
    tier_policy: str = DEFAULT_TIER_POLICY,
    check_every: int = 0,
) -> HitCounts:
    """Replays ``requests`` (in the given order) through a ``DeviceIndex`` of ``device_blocks``
    above host and disk tiers of ``host_blocks`` and ``disk_blocks`` (0: no such tier).

    ``check_every=k > 0`` runs the cache's and tiers' ``check_invariants()`` after every k-th
    request (for tests; it is O(cache size)). Raises ValueError for ``device_blocks < 1``,
    negative tier sizes or an unknown policy name, before replaying anything.
    """
    if device_blocks < 1:
        raise ValueError(f"{device_blocks=} must be >= 1")
    if check_every < 0:
        raise ValueError(f"{check_every=} must be >= 0")
    tiers = LowerTiers(host_blocks, disk_blocks, write_through=write_through, policy=tier_policy)
    now = [0.0]  # seconds of trace time, read by the cache's clock
    cache = DeviceIndex(device_blocks + 1, page_size=1, policy=policy, clock=lambda: now[0])
    # The device's evictions, in order, from its block events: with page_size=1 a page's key
    # names one block id (its token).
    evictions = cache.events.subscribe() if host_blocks or disk_blocks else None
    block_of_key: dict[bytes, int] = {}
    counts = HitCounter(block_tokens)
    paths, _ = intern_block_paths(requests)
    for index, (request, path) in enumerate(zip(requests, paths)):
        now[0] = request.timestamp_ms / 1000.0
        tokens = path[:device_blocks]
        device_hits = cache.match(tokens, _NAMESPACE).num_device_blocks
        lower = tiers.run_tiers(tokens, device_hits)
        _admit_and_commit(cache, tokens, device_hits)
        if evictions is not None:
            cache.events.flush()
            tiers.device_evicted([block_of_key[event.key] for batch in evictions.poll() for event in batch
                                  if event.kind == "removed"])  # fmt: skip
            block_of_key.update(zip(chained_block_keys(tokens, 1, _NAMESPACE), tokens))
        tiers.on_device(tokens)
        counts.add(request, device_hits + len(lower), lower)
        if check_every and (index + 1) % check_every == 0:
            cache.check_invariants()
            tiers.check_invariants()
    return counts.result(evicted_blocks=cache.stats.evicted_blocks)


def replay_report(
    requests: Sequence[TraceRequest],
    device_blocks: int,
    *,
    policy: str = DEFAULT_POLICY,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    host_blocks: int = 0,
    disk_blocks: int = 0,
    write_through: bool = False,
    tier_policy: str = DEFAULT_TIER_POLICY,
) -> ReplayReport:
    """The policy's replay (with the lower tiers) plus the offline policy at ``device_blocks``
    and unlimited capacity on the same requests."""
    tiers = dict(host_blocks=host_blocks, disk_blocks=disk_blocks, write_through=write_through,
                 tier_policy=tier_policy)  # fmt: skip
    online = replay_trace(requests, device_blocks, policy=policy, block_tokens=block_tokens, **tiers)
    return ReplayReport(
        policy=policy,
        device_blocks=device_blocks,
        online=online,
        offline=offline_replay(requests, device_blocks, block_tokens=block_tokens),
        unlimited=unlimited_replay(requests, block_tokens=block_tokens),
        **tiers,
    )


def _admit_and_commit(cache: DeviceIndex, blocks: Sequence[int], device_hits: int) -> None:
    """Admit, commit and release one request whose first ``device_hits`` blocks are cached."""
    handle = cache.admit([*blocks, _SENTINEL], _NAMESPACE)
    if handle is None:  # nothing else is running, so the pool (device_blocks + 1) must fit it
        raise RuntimeError(f"admission of {len(blocks)} blocks failed in a sequential replay")
    if handle.num_hit_tokens != device_hits:
        raise RuntimeError(f"match found {device_hits} blocks but admit hit {handle.num_hit_tokens}")
    cache.commit(handle, blocks)
    cache.release(handle)
