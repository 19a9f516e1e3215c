"""KVCache: the device page pool, the prefix trie and the host/disk tiers as one cache.

The request's path through it::

    handle = cache.admit(tokens, namespace)   # longest match in any tier; device pages mapped,
                                              # host/disk pages fetched (if cheaper than
                                              # recomputing them), the rest allocated
    cache.wait_ready(handle)                  # (or is_ready/poll) fetched KV is in the pool
    ... prefill tokens handle.num_hit_tokens.., decode; cache.extend(handle, n) as it grows
    cache.commit(handle, tokens)              # full pages enter the trie (+ write-through)
    cache.release(handle)                     # refcounts drop; pages stay cached
    cache.poll()                              # every step: finished transfers take effect

Tiers. A trie page records which tiers hold a copy (``kvjax.tiers.tier_index``). Evicting a
page from the device keeps it indexed when a host or disk copy exists; the write policy
(``KVCacheConfig.write_policy``) decides when device pages get host copies. Host pages spill
to disk above the host watermark; a disk directory reopened by a new process is found again
by key (a lookup that runs past the trie probes the disk for the next pages' chained keys).

Codec. Blocks cross the device <-> host boundary through a ``kvjax.tiers.block_codec`` codec: as
they are (float pool), packed with their scales (quantized pool; bit-exact), or quantized on
offload (``KVCacheConfig.offload_quant``; lossy). Pages whose KV went through a lossy codec
are marked lossy in the trie; ``admit(..., accept_lossy=False)`` stops the match before the
first one and recomputes from there, and ``lossy_hit_pages`` says which hits are lossy.

Fetches. ``admit`` maps device hits at once; lower-tier pages are fetched into the sequence's
own blocks only when the cost model (``KVCacheConfig.cost_model``) says fetching beats
recomputing. ``handle.num_hit_tokens`` counts the tokens whose KV will be valid once the
handle is ready; a fetch that fails lowers it to the pages that did arrive (the caller
recomputes the rest). A fetched page is used only after its copy completed; its source
copies are locked against eviction while it runs. ``prefetch`` starts the same transfers for
a request still waiting in the queue.

Invariants (``check_invariants``): those of ``PrefixCache``, plus: every HOST/DISK bit in
the trie matches a block the tier holds (or a copy in flight) in the page's namespace and
vice versa; no transfer reads a block that can be evicted; a waiting sequence's fetch
targets are its own private blocks; no page is lossy unless the codec is.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numpy as np

import pallas_kernels
from kvjax.cache.block_keys import Namespace, as_namespace, token_bytes
from kvjax.cache.device_index import NamespaceLike, PrefixCache, TokensLike
from kvjax.cache.records import KVCacheStats, MatchResult, SeqHandle
from kvjax.cache.trie_node import Node, Tier
from kvjax.metrics.registry import Metrics
from kvjax.tiers.block_codec import make_codec
from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.fetch_jobs import Waiter
from kvjax.tiers.fetch_plan import FetchPlan, HitSources, plan_fetch
from kvjax.tiers.host_tier import HostTier
from kvjax.tiers.kv_cache_config import KVCacheConfig
from kvjax.tiers.kv_cache_metrics import record_admission, record_occupancy
from kvjax.tiers.mover import TierMover
from kvjax.tiers.page_pool import PagePool
from kvjax.tiers.tier_index import TierIndex
from kvjax.tiers.transfer import Priority, TransferEngine

__all__ = ["KVCache", "KVCacheConfig", "KVCacheStats"]

_HOST = int(Tier.HOST)


class KVCache:
    """The tiered cache; see the module docstring. Use as a context manager or call close().

    ``impl`` picks the pool's kernels (see ``pallas_kernels.backend``); ``clock`` (seconds)
    drives eviction heat; ``metrics`` records hits per tier, misses, spills, fetch latency,
    fetch failures and disk errors. ``disk_tier`` / ``transfer_factory`` replace the tiers'
    defaults (tests inject fakes); the factory is called like ``TransferEngine(host_tier,
    disk_tier, gather_blocks=...)``, with a gather that returns encoded blocks (see
    ``codec``), and a given disk tier must store the codec's blocks.
    """

    def __init__(self, config: KVCacheConfig, *, impl: str | None = None,
                 clock: Callable[[], float] = time.monotonic, metrics: Metrics | None = None,
                 disk_tier: DiskTier | None = None,
                 transfer_factory: Callable[..., TransferEngine] | None = None):  # fmt: skip
        pool = config.pool
        self.config = config
        self.codec = make_codec(pool, config.offload_quant, config.offload_scale)
        self.metrics = metrics
        self.pool = PagePool(pool, impl=impl)
        self.prefix = PrefixCache(pool.num_blocks, pool.page_size, policy=config.policy,
                                  vocab_size=config.vocab_size, clock=clock,
                                  high_watermark=config.high_watermark,
                                  low_watermark=config.low_watermark, cost_model=config.cost_model,
                                  block_nbytes=self.codec.block_nbytes)  # fmt: skip
        self.host_tier: HostTier | None = None
        self.disk_tier: DiskTier | None = disk_tier
        self.transfer: TransferEngine | None = None
        self._index: TierIndex | None = None
        self._mover: TierMover | None = None
        self._recompute_chosen = self._prefetches = self._lossy_device_hits = self._refused_lossy = 0
        self._hit_sources = HitSources(pool.page_size)
        if config.tiered:
            self._open_tiers(impl, transfer_factory)

    # --- what the scheduler and the engine read ---------------------------------------------

    @property
    def page_size(self) -> int:
        return self.prefix.page_size

    @property
    def vocab_size(self) -> int | None:
        return self.prefix.vocab_size

    @property
    def clock(self) -> Callable[[], float]:
        return self.prefix.clock

    @property
    def cost_model(self):
        return self.prefix.cost_model

    @property
    def block_nbytes(self) -> int:
        """Bytes one block moves between tiers (the codec's)."""
        return self.codec.block_nbytes

    @property
    def allocator(self):
        return self.prefix.allocator

    @property
    def trie(self):
        return self.prefix.trie

    @property
    def num_reclaimable(self) -> int:
        return self.prefix.num_reclaimable

    @property
    def num_sequences(self) -> int:
        """Live sequences admitted by the caller (a prefetch's own hold is not one)."""
        holds = 0 if self._mover is None else sum(w.prefetch for w in self._mover.waiters.values())
        return self.prefix.num_sequences - holds

    def fragmentation(self) -> float:
        return self.prefix.fragmentation()

    # --- lookup ----------------------------------------------------------------------------

    def match(self, tokens: TokensLike, namespace: NamespaceLike = None) -> MatchResult:
        """Longest cached prefix in whole pages, with the tiers of each page (read-only but
        for indexing disk pages a previous process left, see the module docstring)."""
        if self._index is None:
            return self.prefix.match(tokens, namespace)
        ns = as_namespace(namespace)
        buf = token_bytes(tokens, self.vocab_size)
        page_bytes = self.trie.page_bytes
        return self.prefix.match_result(self._lookup(ns, buf, len(buf) - len(buf) % page_bytes))

    # --- the request path ------------------------------------------------------------------

    def admit(self, tokens: TokensLike, namespace: NamespaceLike = None, *,
              accept_lossy: bool | None = None) -> SeqHandle | None:  # fmt: skip
        """Map device hits, start fetches of host/disk hits worth fetching, allocate the rest.

        Returns None (nothing changed) when the blocks do not fit even after eviction. The
        handle is ready at once unless it fetches (``is_ready`` / ``wait_ready``).
        ``accept_lossy`` (default ``config.accept_lossy``): whether lossy pages may hit; if
        not, the match stops before the first one (it and what follows are recomputed and
        count as "lossy_refused" misses, and in ``stats.refused_lossy_blocks``: exact pages
        after the cut count too, they are cut with it). At commit the recomputed exact pages
        replace the lossy copy: its device blocks too when no other live sequence holds them
        (they are freed; a lossy host/disk copy stays, still lossy), so later refusing requests
        hit the exact copy; while another sequence holds them, the lossy device copy stays
        until it is evicted or a later commit replaces it. Pages computed on top of lossy hits
        are recorded as exact: only KV that itself went through the codec is flagged (they
        never replace a device copy).
        """
        _check_accept_lossy(accept_lossy)
        if self._index is None:
            handle = self.prefix.admit(tokens, namespace)
            if handle is not None:
                record_admission(self.metrics, handle, self.page_size, handle.num_hit_tokens // self.page_size, 0)
            return handle
        ns = as_namespace(namespace)
        buf = token_bytes(tokens, self.vocab_size)
        self.prefix.check_fits(len(buf) // 4)
        now = self.clock()
        self.trie.expire_soft_pins(now)
        plan = self._plan(self._lookup(ns, buf, self.prefix.admit_limit(len(buf))), accept_lossy)
        first = plan.first
        pages = [self.trie.page_keys(node)[i] for node, i in plan.lower[: plan.num_fetch]]
        held = self._mover.hold(pages)  # allocating may evict host copies: not these
        handle = self.prefix.admit_matched(ns, buf, plan.matched, now)
        fetched, from_disk = 0, plan.on_disk[:0]
        if handle is not None and pages:
            waiter = Waiter(handle, first, plan.on_disk[: plan.num_fetch], prefetch=False)
            fetched = self._mover.start_fetch(waiter, pages, ns.digest(), Priority.DEMAND)
            handle.num_hit_tokens = (first + fetched) * self.page_size
            from_disk = waiter.from_disk
        self._mover.unhold(held)
        if handle is None:
            return None
        self._hit_sources.record(handle.seq_id, first, from_disk, plan.device_lossy, plan.refused)
        self._lossy_device_hits += 0 if plan.device_lossy is None else int(plan.device_lossy.sum())
        self._recompute_chosen += len(plan.lower) - plan.num_fetch
        self._refused_lossy += plan.refused
        record_admission(self.metrics, handle, self.page_size, first, len(plan.lower) - fetched, plan.refused)
        if self.config.write_policy == "selective":
            self._copy_hot_path(handle)
        return handle

    def hit_tokens_by_tier(self, handle: SeqHandle) -> dict[str, int]:
        """``handle.num_hit_tokens`` split by the tier each hit page came from ("device",
        "host", "disk"); final once the handle is ready (a failed fetch lowers it)."""
        return self._hit_sources.by_tier(handle.seq_id, handle.num_hit_tokens)

    def refused_lossy_pages(self, handle: SeqHandle) -> int:
        """Pages right after ``handle``'s hits that were cached only lossily and refused
        (``accept_lossy=False``), so recomputed."""
        return self._hit_sources.refused(handle.seq_id)

    def lossy_hit_pages(self, handle: SeqHandle) -> np.ndarray:
        """bool ``[handle.num_hit_tokens // page_size]``: which hit pages hold KV that went
        through a lossy offload codec (final once the handle is ready)."""
        return self._hit_sources.lossy_pages(handle.seq_id, handle.num_hit_tokens, self.codec.lossy)

    def is_ready(self, handle: SeqHandle) -> bool:
        """Whether every fetch of ``handle`` finished (its hit KV is in the pool)."""
        return self._mover is None or handle.seq_id not in self._mover.waiters

    def wait_ready(self, handle: SeqHandle, timeout: float | None = None) -> bool:
        """Apply finished transfers until ``handle`` is ready; False if ``timeout`` seconds
        (wall clock) pass first. ``handle.num_hit_tokens`` is final once this returns True."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.poll()
            if self.is_ready(handle):
                return True
            remaining = 60.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return False
            if not self._mover.busy:
                raise RuntimeError(f"sequence {handle.seq_id} waits for fetches but no transfer is in flight")
            self._mover.wait_any(remaining)

    def poll(self) -> None:
        """Apply finished transfers, start host -> disk spills above the host watermark."""
        if self._mover is None:
            return
        self._mover.poll()
        self._mover.spill_host()
        if self.metrics is not None:
            record_occupancy(self.metrics, self.allocator, self._index)

    def extend(self, handle: SeqHandle, num_new_tokens: int) -> bool:
        """Room for ``num_new_tokens`` more tokens; False (nothing changed) if it cannot."""
        return self.prefix.extend(handle, num_new_tokens)

    def commit(self, handle: SeqHandle, tokens: TokensLike) -> int:
        """Insert the sequence's new full pages into the trie; return how many entered.

        ValueError while the handle is not ready (its fetched pages are not in the pool yet).
        With ``write_through`` the new pages start their host copies.
        """
        if not self.is_ready(handle):
            raise ValueError(f"sequence {handle.seq_id} is waiting for fetches; call wait_ready before commit")
        first = handle._committed
        num_new = self.prefix.commit(handle, tokens)
        if num_new and self.config.write_policy == "write_through" and self._mover is not None:
            self._copy_path(handle._tail, first, 0)
        return num_new

    def release(self, handle: SeqHandle) -> None:
        """Drop the sequence's references (fetches in flight for it are discarded)."""
        self.prefix.release(handle)
        self._hit_sources.forget(handle.seq_id)

    def evict(self, num_blocks: int) -> list[int]:
        """Evict up to ``num_blocks`` cached device blocks; with write_back, pages without a
        lower copy get one first (their gather is issued before the blocks are freed)."""
        return self.prefix.evict(num_blocks)

    def evict_host(self, num_blocks: int) -> int:
        """Drop up to ``num_blocks`` unlocked host copies, LRU first; return how many. Pages
        left with no copy in any tier leave the trie."""
        if num_blocks < 0:
            raise ValueError(f"{num_blocks=} must be >= 0")
        if self._index is None:
            return 0
        before = self._index.host_used
        self._index.make_host_room(self._index.host_capacity - self._index.host_used + num_blocks)
        return before - self._index.host_used

    def pin(self, tokens: TokensLike, namespace: NamespaceLike = None, ttl: float | None = None) -> int:
        """Keep the device-cached prefix of ``tokens`` on device (see ``PrefixCache.pin``)."""
        return self.prefix.pin(tokens, namespace, ttl)

    def unpin(self, tokens: TokensLike, namespace: NamespaceLike = None) -> None:
        self.prefix.unpin(tokens, namespace)

    def set_tier(self, tokens: TokensLike, namespace: NamespaceLike, page: int, tier: Tier) -> None:
        """Record a copy that a store outside this cache holds (a cache without tiers only:
        with tiers, the cache records its own copies)."""
        if self._index is not None:
            raise ValueError("set_tier is for a KVCache without host_bytes; this one tracks its own tier copies")
        self.prefix.set_tier(tokens, namespace, page, tier)

    def prefetch(self, tokens: TokensLike, namespace: NamespaceLike = None, *,
                 accept_lossy: bool | None = None) -> None:  # fmt: skip
        """Start moving the host/disk pages of ``tokens``' cached prefix up (PREFETCH priority).

        Pages go to the device when free blocks allow (no eviction for a guess) and the cost
        model favours fetching; otherwise disk pages are restored to host. A later ``admit``
        of the same prefix maps them, or joins the transfer still in flight. Lossy pages are
        left where they are unless ``accept_lossy`` (as in ``admit``).
        """
        _check_accept_lossy(accept_lossy)
        if self._index is None:
            return
        ns = as_namespace(namespace)
        buf = token_bytes(tokens, self.vocab_size)
        page_bytes = self.trie.page_bytes
        plan = self._plan(self._lookup(ns, buf, len(buf) - len(buf) % page_bytes), accept_lossy)
        first, on_disk = plan.first, plan.on_disk
        pages = []
        for node, i in plan.lower[: plan.num_fetch]:  # up to the first page already on its way
            key = self.trie.page_keys(node)[i]
            if self._mover.device_job(key) is not None:
                break
            pages.append(key)
        if not pages:
            return
        self._prefetches += 1
        if self.allocator.num_free < len(pages):
            self._mover.restore_only([key for key, disk in zip(pages, on_disk) if disk], ns.digest())
            return
        held = self._mover.hold(pages)
        hold = self.prefix.admit_matched(ns, buf[: (first + len(pages)) * page_bytes], plan.matched,
                                         self.clock(), count=False)  # fmt: skip
        if hold is not None:
            waiter = Waiter(hold, first, on_disk[: len(pages)], prefetch=True)
            self._mover.start_fetch(waiter, pages, ns.digest(), Priority.PREFETCH)
            if self.is_ready(hold):  # nothing to wait for after all
                self.prefix.release(hold)
        self._mover.unhold(held)

    def flush(self, timeout: float = 30.0) -> bool:
        """Finish every copy in flight, then copy every host page without a disk copy to
        disk and wait for that too. False if ``timeout`` seconds pass first."""
        if self._mover is None:
            return True
        deadline = time.monotonic() + timeout
        for spill in (False, True):
            if spill:
                self._mover.spill_host(everything=True)
            while self._mover.busy:
                self._mover.poll()
                if time.monotonic() >= deadline:
                    return False
                self._mover.wait_any(max(0.0, deadline - time.monotonic()))
        return True

    # --- figures, checks and lifetime ---------------------------------------------------------

    @property
    def stats(self) -> KVCacheStats:
        stats = KVCacheStats(self.prefix.stats, recompute_chosen_blocks=self._recompute_chosen,
                             prefetches=self._prefetches, lossy_hit_blocks=self._lossy_device_hits,
                             refused_lossy_blocks=self._refused_lossy)  # fmt: skip
        if self._mover is not None:
            counts = self._mover.counts
            stats.host_blocks = self._index.host_used
            stats.disk_blocks = 0 if self.disk_tier is None else len(self.disk_tier)
            stats.offloaded_blocks, stats.spilled_blocks = counts["offloaded"], counts["spilled"]
            stats.fetched_host_blocks = counts["fetched_host"]
            stats.fetched_disk_blocks = counts["fetched_disk"]
            stats.fetch_failures, stats.disk_errors = counts["fetch_failures"], counts["disk_errors"]
            stats.lost_host_blocks = self._index.lost_blocks
            stats.lossy_hit_blocks += counts["fetched_lossy"]
        return stats

    def check_invariants(self) -> None:
        """Raise RuntimeError unless every invariant in the module docstring holds."""
        from kvjax.tiers.kv_cache_checks import check_kv_cache

        check_kv_cache(self)

    def close(self) -> None:
        """Stop the transfer workers (queued transfers fail; the disk keeps what it wrote)."""
        if self.transfer is not None:
            self.transfer.close()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- helpers ---------------------------------------------------------------------------

    def _open_tiers(self, impl: str | None, transfer_factory) -> None:
        config, codec = self.config, self.codec
        self.host_tier = HostTier(codec.block_shape, codec.dtype, config.host_bytes)
        if self.disk_tier is None and config.disk_dir is not None:
            self.disk_tier = DiskTier(config.disk_dir, codec.block_shape, codec.dtype, config.disk_bytes,
                                      segment_bytes=config.disk_segment_bytes, codec=codec.name)  # fmt: skip
        elif self.disk_tier is not None:
            codec.check_stored_by(self.disk_tier, "disk_tier")
        gather = codec.gather(functools.partial(pallas_kernels.gather_blocks, impl=impl))
        self.transfer = (transfer_factory or TransferEngine)(self.host_tier, self.disk_tier, gather_blocks=gather)
        self.trie.lossy_offload = codec.lossy
        self._index = TierIndex(self.trie, self.host_tier, self.disk_tier)
        self._mover = TierMover(self.prefix, self.pool, self._index, self.transfer, self.metrics,
                                config.high_watermark, config.low_watermark, codec)  # fmt: skip
        if config.write_policy == "write_back":
            self.trie.before_evict = self._mover.before_evict

    def _lookup(self, ns: Namespace, buf: bytes, end: int) -> list[tuple[Node, int]]:
        """Trie walk of ``buf[:end]``; past its end, disk pages found by key join the trie."""
        root = self.trie.root(ns, create=False)
        matched = [] if root is None else self.trie.walk(root, buf, 0, end)
        if self._index.has_unindexed_disk_blocks():
            matched = self._index.probe_disk(ns, buf, end, matched, self.clock())
        return matched

    def _plan(self, matched: list[tuple[Node, int]], accept_lossy: bool | None) -> FetchPlan:
        accept = self.config.accept_lossy if accept_lossy is None else accept_lossy
        return plan_fetch(matched, cost_model=self.config.cost_model, page_size=self.page_size,
                          block_nbytes=self.codec.block_nbytes, lossy_codec=self.codec.lossy,
                          accept_lossy=accept)  # fmt: skip

    def _copy_path(self, node: Node, first_page: int, min_hits: int) -> None:
        """Host copies of the pages from ``first_page`` on, on the path ending at ``node``,
        that have none, in nodes hit at least ``min_hits`` times."""
        while node.parent is not None and node.first_page + node.num_pages > first_page:
            if node.hits >= min_hits and node.on_device:
                tiers = node.tiers
                low = max(first_page - node.first_page, 0)
                todo = [i for i in range(low, node.num_pages) if tiers is None or not int(tiers[i]) & _HOST]
                if todo:
                    self._mover.offload(node, todo)
            node = node.parent

    def _copy_hot_path(self, handle: SeqHandle) -> None:
        if handle._committed:
            self._copy_path(handle._tail, 0, self.config.selective_min_hits)


def _check_accept_lossy(accept_lossy) -> None:
    if accept_lossy is not None and not isinstance(accept_lossy, bool):
        raise ValueError(f"accept_lossy={accept_lossy!r} must be True, False or None (the config's)")
