"""What the caches hand back: match results, sequence handles, counters."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.cache.block_keys import Namespace
from kvjax.cache.trie_node import Node

__all__ = ["CacheStats", "KVCacheStats", "MatchResult", "SeqHandle"]


@dataclasses.dataclass(slots=True)
class MatchResult:
    """Longest cached prefix of a token sequence, in whole pages, any tier."""

    blocks: np.ndarray  # BLOCK_DTYPE [num_hit_blocks]: device block id, -1 where not on device
    tiers: np.ndarray  # uint8 [num_hit_blocks]: Tier bits of each page
    hit_tokens: int  # num_hit_blocks * page_size
    num_hit_blocks: int
    num_device_blocks: int  # leading pages with a device copy (what admit can map)
    lossy: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))
    # bool [num_hit_blocks]: a hit on the page gets KV that went through a lossy codec


@dataclasses.dataclass(slots=True)
class CacheStats:
    """Counters since construction. Tokens are prompt tokens; blocks are device blocks."""

    admitted: int = 0
    admit_failures: int = 0  # did not fit even after eviction
    extend_failures: int = 0
    prompt_tokens: int = 0  # of admitted sequences
    hit_tokens: int = 0  # prompt tokens served from device blocks
    lower_tier_hit_tokens: int = 0  # matched on host/disk only (KVCache may fetch them)
    inserted_blocks: int = 0
    duplicate_blocks: int = 0  # committed pages another sequence had already cached
    evicted_blocks: int = 0
    offloaded_pages: int = 0  # evicted from device, a host/disk copy stays indexed
    dropped_pages: int = 0  # removed from the trie entirely

    @property
    def miss_tokens(self) -> int:
        """Admitted prompt tokens not served from device blocks: computed, or fetched from a
        lower tier (``KVCacheStats.fetched_*_blocks`` count those; this index cannot tell)."""
        return self.prompt_tokens - self.hit_tokens

    @property
    def hit_rate(self) -> float:
        """Fraction of admitted prompt tokens served from device blocks."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclasses.dataclass(slots=True)
class KVCacheStats:
    """Counters since construction: ``prefix`` (device-level, see CacheStats) plus tiers.

    Blocks are pages; ``fetched_*`` count pages that arrived on device for a sequence.
    """

    prefix: CacheStats
    host_blocks: int = 0  # held or being copied in
    disk_blocks: int = 0
    offloaded_blocks: int = 0  # device -> host copies completed
    spilled_blocks: int = 0  # host -> disk copies completed
    fetched_host_blocks: int = 0
    fetched_disk_blocks: int = 0
    recompute_chosen_blocks: int = 0  # lower-tier pages the cost model left to recompute
    fetch_failures: int = 0  # jobs that delivered fewer pages than planned
    disk_errors: int = 0  # write errors, corrupt blocks, unreadable segments
    lost_host_blocks: int = 0  # evicted from host with no disk copy (no disk tier, or the disk refused it)
    pressure_spilled_blocks: int = 0  # host -> disk writes made on the spot: host room was needed first
    lossy_hit_blocks: int = 0  # hit pages whose KV went through a lossy offload codec
    refused_lossy_blocks: int = 0  # lossy pages an admission refused (recomputed instead)
    prefetches: int = 0  # prefetch calls that started a transfer


class SeqHandle:
    """A running sequence's hold on the cache. Block tables are append-only."""

    __slots__ = ("seq_id", "namespace", "num_tokens", "num_hit_tokens", "block_ids",
                 "_tokens", "_tail", "_own_tail", "_committed", "_dup_own", "_dup_trie", "_alive")  # fmt: skip

    def __init__(self, seq_id, namespace, num_tokens, num_hit_pages, page_size, block_ids, tokens, tail):
        self.seq_id: int = seq_id
        self.namespace: Namespace = namespace
        self.num_tokens: int = num_tokens  # tokens the blocks must hold (prompt + decoded)
        self.num_hit_tokens: int = num_hit_pages * page_size  # prompt tokens mapped from cached blocks
        self.block_ids: np.ndarray = block_ids  # BLOCK_DTYPE [ceil(num_tokens / page_size)]
        self._tokens: bytes = tokens  # longest token bytes seen (admit or commit)
        self._tail: Node = tail  # deepest trie node this sequence locks (a root if none)
        # _tail holds only pages this sequence inserted (it may grow in place); a node it hit
        # or found cached keeps its own history, so new pages go to a fresh child of it
        self._own_tail = False
        self._committed: int = num_hit_pages  # pages on the locked trie path
        self._dup_own: list[np.ndarray] = []  # own blocks of pages another sequence cached first
        self._dup_trie: list[np.ndarray] = []  # ... and the trie's blocks we hold for them
        self._alive = True

    @property
    def block_table(self) -> list[int]:
        """Device block ids in sequence order."""
        return self.block_ids.tolist()

    @property
    def alive(self) -> bool:
        return self._alive
