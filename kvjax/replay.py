"""Replay a request trace through the real prefix cache, with no model, to size a cache.

Model of the replay (sequential: one request at a time, in timestamp order, no concurrency,
no decode): for each request, match the leading run of cached blocks (the hits), admit it
(lock the hits, allocate the rest, evicting by the policy as needed), commit all its blocks,
release it. Every hash id of the trace is one cache block: the ids are fed to ``PrefixCache``
as tokens with ``page_size=1``, so the trace's own hashing decides what is shared (partial
last blocks included). Token hit rates weigh each block by the tokens it holds (see
``TraceRequest.block_tokens``). The clock the policy sees is the trace's arrival time, in
seconds.

Two adaptations keep the real cache's rules from distorting the count:
- ``PrefixCache.admit`` always leaves a prompt's last token to compute (its logits are
  needed), which would make a request's last block never hit. The replay admits the hash ids
  followed by one sentinel token, and sizes the pool ``device_blocks + 1`` so the sentinel's
  private page never costs a cached block; the sentinel is never committed.
- A request longer than the cache gets its first ``device_blocks`` blocks admitted and
  cached; the rest count as misses.
- Hash ids are renumbered densely (first appearance order) so ids of any size fit the
  cache's int32 tokens; equal ids stay equal, so nothing about sharing changes.

``replay_report`` adds the yardsticks of ``kvjax.replay_bounds`` at the same capacity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvjax.block_keys import Namespace
from kvjax.eviction import EvictionPolicy
from kvjax.eviction_adaptive import DEFAULT_POLICY
from kvjax.prefix_cache import PrefixCache
from kvjax.replay_bounds import HitCounter, HitCounts, offline_replay, unlimited_replay
from kvjax.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = ["DEFAULT_POLICY", "ReplayReport", "add_subcommand", "replay_report", "replay_trace"]

_NAMESPACE = Namespace(tenant="trace-replay")
_SENTINEL = 0  # token admitted after the hash ids; never matched (admit stops before it)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayReport:
    """A policy's replay next to the yardsticks, all at ``device_blocks`` blocks of room."""

    policy: str
    device_blocks: int
    online: HitCounts  # the real PrefixCache with ``policy``
    offline: HitCounts  # farthest-next-use (Belady/MIN), prefix-aware
    unlimited: HitCounts  # room for every block

    def as_dict(self) -> dict[str, Any]:
        """Flat summary (rates are fractions in [0, 1]) for ``--json`` and benchmarks."""
        online = self.online
        return {
            "policy": self.policy,
            "device_blocks": self.device_blocks,
            "requests": online.requests,
            "blocks": online.blocks,
            "hit_blocks": online.hit_blocks,
            "tokens": online.tokens,
            "hit_tokens": online.hit_tokens,
            "evicted_blocks": online.evicted_blocks,
            "block_hit_rate": online.block_hit_rate,
            "token_hit_rate": online.token_hit_rate,
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
    check_every: int = 0,
) -> HitCounts:
    """Replays ``requests`` (in the given order) through a ``PrefixCache`` of ``device_blocks``.

    ``check_every=k > 0`` runs the cache's ``check_invariants()`` after every k-th request
    (for tests; it is O(cache size)). Raises ValueError for ``device_blocks < 1`` or an
    unknown policy name.
    """
    if device_blocks < 1:
        raise ValueError(f"{device_blocks=} must be >= 1")
    if check_every < 0:
        raise ValueError(f"{check_every=} must be >= 0")
    now = [0.0]  # seconds of trace time, read by the cache's clock
    cache = PrefixCache(device_blocks + 1, page_size=1, policy=policy, clock=lambda: now[0])
    counts = HitCounter(block_tokens)
    dense_ids: dict[int, int] = {}  # hash id -> token id < 2**31 (trace ids may be any size)
    for index, request in enumerate(requests):
        now[0] = request.timestamp_ms / 1000.0
        tokens = [dense_ids.setdefault(h, len(dense_ids)) for h in request.hash_ids[:device_blocks]]
        counts.add(request, _replay_request(cache, tokens))
        if check_every and (index + 1) % check_every == 0:
            cache.check_invariants()
    return counts.result(evicted_blocks=cache.stats.evicted_blocks)


def replay_report(
    requests: Sequence[TraceRequest],
    device_blocks: int,
    *,
    policy: str = DEFAULT_POLICY,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> ReplayReport:
    """The policy's replay plus the offline and unlimited yardsticks on the same requests."""
    online = replay_trace(requests, device_blocks, policy=policy, block_tokens=block_tokens)
    return ReplayReport(
        policy=policy,
        device_blocks=device_blocks,
        online=online,
        offline=offline_replay(requests, device_blocks, block_tokens=block_tokens),
        unlimited=unlimited_replay(requests, block_tokens=block_tokens),
    )


def add_subcommand(subparsers) -> None:
    """Registers ``python -m kvjax replay`` (the command line lives in ``kvjax.replay_cli``)."""
    from kvjax.replay_cli import add_replay_subcommand  # late: replay_cli imports this module

    add_replay_subcommand(subparsers)


def _replay_request(cache: PrefixCache, hash_ids: Sequence[int]) -> int:
    """Match, admit, commit and release one request; returns its hit blocks."""
    hit_blocks = cache.match(hash_ids, _NAMESPACE).num_device_blocks
    handle = cache.admit([*hash_ids, _SENTINEL], _NAMESPACE)
    if handle is None:  # nothing else is running, so the pool (device_blocks + 1) must fit it
        raise RuntimeError(f"admission of {len(hash_ids)} blocks failed in a sequential replay")
    if handle.num_hit_tokens != hit_blocks:
        raise RuntimeError(f"match found {hit_blocks} blocks but admit hit {handle.num_hit_tokens}")
    cache.commit(handle, hash_ids)
    cache.release(handle)
    return hit_blocks
