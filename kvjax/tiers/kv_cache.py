"""KVCache: the device page pool, the prefix trie and the host/disk tiers as one cache.

The request's path through it::

    lookup = cache.lookup(tokens, namespace)  # one trie walk: lookup.match says what is cached
    handle = cache.admit(lookup)              # (or admit(tokens, namespace)) device pages mapped,
                                              # host/disk pages fetched (if cheaper than
                                              # recomputing them), the rest allocated
    cache.wait_ready(handle)                  # (or is_ready/poll) fetched KV is in the pool
    ... prefill tokens handle.num_hit_tokens.., decode; cache.extend(handle, n) as it grows
    cache.commit(handle, tokens)              # full pages enter the trie (+ write-through)
    cache.release(handle)                     # refcounts drop; pages stay cached
    cache.poll()                              # every step: finished transfers take effect

A cache without ``host_bytes`` is the same cache with empty lower tiers: every path above
runs, nothing is ever found below the device.

Tiers. A trie page records which tiers hold a copy (``kvjax.tiers.tier_index``). Evicting a
page from the device keeps it indexed when a host or disk copy exists; the write policy
(``KVCacheConfig.write_policy``) decides when device pages get host copies; host copies go
first where one cache of the device's and the host's blocks together would have evicted
their pages (``kvjax.tiers.shadow_cache``, fed every admission). Host pages spill
to disk above the host watermark; a disk directory reopened by a new process is found again
by key (a lookup that runs past the trie probes the disk for the next pages' chained keys).
The layers below report, this one acts: an eviction returns the pages write-back kept (this
cache copies them) and the pages that left the trie (this cache drops their host copies);
the mover returns finished fetches (this cache commits them).

Codec. Blocks cross the device <-> host boundary through a ``kvjax.tiers.block_codec`` codec:
as they are (float pool), packed with their scales (quantized pool; bit-exact), or quantized
on offload (``KVCacheConfig.offload_quant``; lossy). Pages whose KV went through a lossy codec
are marked lossy in the trie; ``admit(..., accept_lossy=False)`` stops the match before the
first one and recomputes from there.

Fetches. ``admit`` maps device hits at once; lower-tier pages are fetched into the sequence's
own blocks only when the cost model (``KVCacheConfig.cost_model``) says fetching beats
recomputing. ``handle.num_hit_tokens`` counts the tokens whose KV will be valid once the
handle is ready; a fetch that fails lowers it to the pages that did arrive (the caller
recomputes the rest). A fetched page is used only after its copy completed; its source
copies are held against eviction while it runs. ``prefetch`` starts the same transfers for
a request still waiting in the queue.

Reports, not metrics. The cache writes no metrics: ``admission_report(handle)`` says where a
sequence's pages came from and ``poll()`` returns what the transfers did (``TierReport``);
the serving observer records both. ``subscribe()`` gives the block events of every tier.

Invariants (``check_invariants``): those of ``DeviceIndex``, plus: every HOST/DISK bit in
the trie matches a block the tier holds (or a copy in flight) in the page's namespace and
vice versa; no transfer reads a block that can be evicted; a waiting sequence's fetch
targets are its own private blocks; no page is lossy unless the codec is.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from kvjax.cache.allocator import BlockAllocator
from kvjax.cache.block_events import BlockIndex, EventLog, Subscription
from kvjax.cache.block_keys import Namespace, as_namespace, chained_block_keys
from kvjax.cache.cost_model import CostModel
from kvjax.cache.device_index import (
    DeviceIndex,
    Eviction,
    NamespaceLike,
    TokensLike,
    device_pages,
    hit_pages,
    reclaimable_hit_pages,
)
from kvjax.cache.records import KVCacheStats, MatchResult, SeqHandle
from kvjax.cache.trie_node import Node, Tier
from kvjax.config.checks import int_arg
from kvjax.text.tokens import token_bytes
from kvjax.tiers.block_codec import make_codec
from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.fetch_jobs import Waiter
from kvjax.tiers.fetch_plan import AdmissionReport, FetchPlan, HitSources, plan_fetch
from kvjax.tiers.host_pool import HostPool
from kvjax.tiers.kv_cache_config import KVCacheConfig
from kvjax.tiers.kv_cache_remote import ExportedPages, export_pages, import_pages
from kvjax.tiers.mover import TierMover, TierReport
from kvjax.tiers.page_pool import PagePool
from kvjax.tiers.shadow_cache import ShadowCache
from kvjax.tiers.tier_index import TierIndex
from kvjax.tiers.transfer import Priority, TransferEngine

_log = logging.getLogger(__name__)

__all__ = ["AdmissionReport", "ExportedPages", "KVCache", "KVCacheConfig", "KVCacheStats", "Lookup", "TierReport"]

_OTHER_NAMESPACES_CHECKED = 8  # a miss checks this many other namespaces' disk blocks at most

_HOST = int(Tier.HOST)
_NOTHING_FETCHED = np.zeros(0, bool)  # from_disk of an admission that fetches nothing
_NOTHING_FETCHED.flags.writeable = False


class Lookup:
    """One trie walk of a prompt (full pages, every tier), reusable by ``admit`` while the
    cache has not changed since (``version``). ``match`` says what is cached (built on first
    use: an admission that needs no MatchResult never pays for one)."""

    __slots__ = ("namespace", "buf", "matched", "version", "_index", "_match")

    def __init__(self, namespace: Namespace, buf: bytes, matched: list[tuple[Node, int]], version: int,
                 index: DeviceIndex):  # fmt: skip
        self.namespace = namespace
        self.buf = buf  # the prompt's token bytes
        self.matched = matched  # the walk: (node, pages matched in it)
        self.version = version
        self._index = index
        self._match: MatchResult | None = None

    @property
    def match(self) -> MatchResult:
        if self._match is None:
            self._match = self._index.match_result(self.matched)
        return self._match

    # The counts a scheduler ranks and admits by, read off the walk without building the
    # MatchResult's arrays (most lookups of a queued request need nothing else).

    @property
    def num_hit_blocks(self) -> int:
        """Pages cached in any tier (``MatchResult.num_hit_blocks``)."""
        return hit_pages(self.matched)

    @property
    def num_device_blocks(self) -> int:
        """Leading pages with a device copy (``MatchResult.num_device_blocks``)."""
        return device_pages(self.matched)

    def num_reclaimable_hits(self, num_pages: int) -> int:
        """Of the first ``num_pages`` device hits, those no sequence holds (nor a pin): an
        admission that maps them takes them from what eviction could free, like new blocks."""
        return reclaimable_hit_pages(self.matched, num_pages)

    @property
    def tiers(self) -> np.ndarray:
        """Tier bits of each hit page (``MatchResult.tiers``)."""
        return self.match.tiers


class KVCache:
    """The tiered cache; see the module docstring. Use as a context manager or call close().

    ``impl`` picks the pool's kernels (see ``pallas_kernels.backend``); ``clock`` (seconds)
    drives eviction heat. ``disk_tier`` / ``transfer_factory`` replace the tiers' defaults
    (tests inject fakes); the factory is called like ``TransferEngine(host_pool, disk_tier,
    gather_blocks=..., buckets=..., synchronous=...)``, with a gather that returns encoded
    blocks (see ``codec``), and a given disk tier must store the codec's blocks.
    ``move_bytes=False`` keeps every piece of bookkeeping and no bytes: no pool array, no
    host array, transfers done at submit (a trace replay; give it an in-memory disk tier).
    """

    def __init__(self, config: KVCacheConfig, *, impl: str | None = None,
                 clock: Callable[[], float] = time.monotonic, disk_tier: DiskTier | None = None,
                 transfer_factory: Callable[..., TransferEngine] | None = None,
                 move_bytes: bool = True):  # fmt: skip
        pool = config.pool
        self.config = config
        self.codec = make_codec(pool, config.offload_quant, config.offload_scale)
        self.events = EventLog()
        self.move_bytes = move_bytes
        self.pool = PagePool(pool, impl=impl, allocate=move_bytes)
        self.index = DeviceIndex(pool.num_blocks, pool.page_size, policy=config.policy,
                                 vocab_size=config.vocab_size, clock=clock,
                                 high_watermark=config.high_watermark, low_watermark=config.low_watermark,
                                 cost_model=config.cost_model, block_nbytes=self.codec.block_nbytes,
                                 events=self.events)  # fmt: skip
        self.trie = self.index.trie
        self.trie.lossy_offload = self.codec.lossy
        self.host_pool: HostPool | None = None
        self.disk_tier: DiskTier | None = disk_tier
        self.transfer: TransferEngine | None = None
        self._gather = _codec_gather(self.codec, impl)
        self._owns_disk_tier = False  # opened from config.disk_dir: closed with the cache
        self._write_through = config.write_policy == "write_through" and config.tiered
        if config.tiered:
            self._open_lower_tiers(impl, transfer_factory)
        self.tiers = TierIndex(self.trie, 0 if self.host_pool is None else self.host_pool.num_slots,
                               self.disk_tier, self.events)  # fmt: skip
        if self.host_pool is not None and config.policy != "lru":  # under LRU the tiers hold what one cache would
            self.tiers.shadow = ShadowCache(min(pool.num_blocks + self.host_pool.num_slots, 2**31 - 1),
                                            pool.page_size, config.policy,
                                            clock, vocab_size=config.vocab_size, cost_model=config.cost_model,
                                            block_nbytes=self.codec.block_nbytes)  # fmt: skip
        self._mover = TierMover(self.trie, self.pool, self.tiers, self.transfer, config.high_watermark,
                                config.low_watermark, self.codec)  # fmt: skip
        self._version = 0  # bumped by everything that may change what a lookup finds
        self._closed = False
        self._hit_sources = HitSources(pool.page_size, self.codec.lossy)
        self._counts = dict(recompute_chosen=0, prefetches=0, lossy_device_hits=0, refused_lossy=0,
                            fetched_host=0, fetched_disk=0, fetched_lossy=0)  # fmt: skip

    # --- what the scheduler and the engine read ---------------------------------------------

    @property
    def page_size(self) -> int:
        return self.index.page_size

    @property
    def vocab_size(self) -> int | None:
        return self.index.vocab_size

    @property
    def clock(self) -> Callable[[], float]:
        return self.index.clock

    @property
    def cost_model(self) -> CostModel:
        return self.index.cost_model

    @property
    def page_identity(self) -> str:
        """What another cache's pages must match for this one to read their bytes (a peer's
        offer): the codec's identity (name, stored dtype and shape) and, when named, the
        model's (``config.model_id``: the same shapes from other weights are other KV)."""
        model_id = self.config.model_id
        return f"{self.codec.identity}/model={model_id}" if model_id else self.codec.identity

    @property
    def block_nbytes(self) -> int:
        """Bytes one block moves between tiers (the codec's)."""
        return self.codec.block_nbytes

    @property
    def allocator(self) -> BlockAllocator:
        """The device blocks: pool size, free blocks, watermarks, occupancy."""
        return self.index.allocator

    @property
    def num_reclaimable(self) -> int:
        """Cached device blocks that eviction can free now (unreferenced, unpinned)."""
        return self.index.num_reclaimable

    @property
    def num_prefetching_blocks(self) -> int:
        """Device blocks prefetches hold until their fetches land (then they are cached pages,
        reclaimable like any): neither free nor reclaimable now, but not held for long."""
        return sum(len(w.handle.block_ids) for w in self._mover.waiters.values() if w.prefetch)

    @property
    def num_sequences(self) -> int:
        """Live sequences admitted by the caller (a prefetch's own hold is not one)."""
        return self.index.num_sequences - sum(w.prefetch for w in self._mover.waiters.values())

    def fragmentation(self) -> float:
        return self.index.fragmentation()

    def occupancy(self) -> dict[str, float]:
        """Fraction of each tier in use: device blocks, host blocks, disk bytes (tiers present)."""
        figures = {"device": self.allocator.occupancy}
        if self.tiers.host_capacity:
            figures["host"] = min(1.0, self.tiers.host_used / self.tiers.host_capacity)
        disk = self.disk_tier
        if disk is not None and disk.capacity_bytes:
            figures["disk"] = min(1.0, disk.bytes_used / disk.capacity_bytes)
        return figures

    # --- lookup ----------------------------------------------------------------------------

    def lookup(self, tokens: TokensLike, namespace: NamespaceLike = None) -> Lookup:
        """Walk the trie once for ``tokens``' cached prefix (whole pages, any tier).

        Read-only but for indexing disk pages a previous process left (see the module
        docstring). ``Lookup.match`` says what is cached; ``admit(lookup)`` admits without a
        second walk if nothing changed in between.
        """
        ns = as_namespace(namespace)
        buf = token_bytes(tokens, self.vocab_size)
        matched = self._walk(ns, buf, len(buf) - len(buf) % self.trie.page_bytes)
        return Lookup(ns, buf, matched, self._version, self.index)

    def match(self, tokens: TokensLike, namespace: NamespaceLike = None) -> MatchResult:
        """Longest cached prefix in whole pages, with the tiers of each page (see ``lookup``)."""
        return self.lookup(tokens, namespace).match

    # --- the request path ------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    def admit(self, tokens: TokensLike | Lookup, namespace: NamespaceLike = None, *,
              accept_lossy: bool | None = None) -> SeqHandle | None:  # fmt: skip
        """Map device hits, start fetches of host/disk hits worth fetching, allocate the rest.

        ``tokens``: the prompt's token ids (with ``namespace``), or a ``Lookup`` of it.
        Returns None (nothing changed) when the blocks do not fit even after eviction. The
        handle is ready at once unless it fetches (``is_ready`` / ``wait_ready``).
        ``accept_lossy`` (default ``config.accept_lossy``): whether lossy pages may hit; if
        not, the match stops before the first one (it and what follows are recomputed and
        counted in ``AdmissionReport.refused_lossy_pages``; exact pages after the cut count
        too, they are cut with it). At commit the recomputed exact pages replace the lossy
        copy: its device blocks too when no other live sequence holds them (they are freed; a
        lossy host/disk copy stays, still lossy), so later refusing requests hit the exact
        copy; while another sequence holds them, the lossy device copy stays until it is
        evicted or a later commit replaces it. Pages computed on top of lossy hits are
        recorded as exact: only KV that itself went through the codec is flagged.
        """
        if self._closed:  # its events said "cleared": hits now would be blocks no subscriber knows of
            raise ValueError("this KVCache is closed (close() was called); admit needs an open cache")
        _check_accept_lossy(accept_lossy)
        lookup = self._fresh_lookup(tokens, namespace)
        ns, buf = lookup.namespace, lookup.buf
        self.index.check_fits(len(buf) // 4)
        now = self.clock()
        self.trie.expire_soft_pins(now)
        self._version += 1
        plan = self._plan(_truncate(lookup.matched, self.index.admit_limit(len(buf)) // self.trie.page_bytes),
                          accept_lossy)  # fmt: skip
        first = plan.first
        pages = [self.trie.page_keys(node)[i] for node, i in plan.lower[: plan.num_fetch]]
        held = self._mover.hold(pages) if pages else pages  # allocating may evict host copies: not these
        admission = self.index.begin_admission(ns, buf, plan.matched, now)
        # from_disk of the pages to fetch; the common case fetches none and skips the numpy
        # slice and sum (a few microseconds of every admission)
        on_disk = plan.on_disk[: plan.num_fetch] if plan.num_fetch else _NOTHING_FETCHED
        handle, fetched, from_disk = None, 0, _NOTHING_FETCHED
        if admission is not None:
            if self.tiers.shadow is not None:  # first: the host victims this admission makes follow it
                self.tiers.shadow.observe(ns, buf)
            # Host slots the disk pages of this admission will be restored into come first:
            # write-back copies of the blocks it evicts take what is left, and the slots of
            # the host pages it fetches once they are read (they are on device then).
            eviction = self._reclaim(admission.short, host_reserve=int(on_disk.sum()) if pages else 0,
                                     fetching=held)  # fmt: skip
            handle = self.index.complete_admission(admission)
            if pages:
                waiter = Waiter(handle, first, on_disk, prefetch=False)
                fetched = self._mover.start_fetch(waiter, pages, ns.digest(), Priority.DEMAND)
                handle.num_hit_tokens = (first + fetched) * self.page_size
                from_disk = waiter.from_disk
            self._write_back(eviction, fetching=held)
        if held:
            self._mover.unhold(held)
        self._forget_dropped()
        if handle is None:
            return None
        self._hit_sources.record(handle.seq_id, first, from_disk, plan.device_lossy, plan.refused, len(plan.lower))
        counts = self._counts
        counts["lossy_device_hits"] += 0 if plan.device_lossy is None else int(plan.device_lossy.sum())
        counts["recompute_chosen"] += len(plan.lower) - plan.num_fetch
        counts["refused_lossy"] += plan.refused
        if self.config.write_policy == "selective":
            self._copy_hot_path(handle)
        return handle

    def pages_in_other_namespaces(self, tokens: TokensLike, namespace: NamespaceLike, num_pages: int) -> np.ndarray:
        """Which of the first ``num_pages`` full pages of ``tokens`` the disk tier holds under
        another namespace (the same tokens, another tenant, model, adapter or salt): a miss
        isolation forced, even for blocks a previous process wrote. ``bool[num_pages]``; the
        ``_OTHER_NAMESPACES_CHECKED`` namespaces holding most blocks are checked."""
        num_pages = int_arg(num_pages, "num_pages")
        held = np.zeros(num_pages, bool)
        disk = self.disk_tier
        if disk is None or num_pages == 0:
            return held
        own = as_namespace(namespace).digest()
        prefix = np.asarray(tokens)[: num_pages * self.page_size]
        for digest in [d for d in disk.namespaces() if d != own][:_OTHER_NAMESPACES_CHECKED]:
            keys = chained_block_keys(prefix, self.page_size, digest)
            held[: len(keys)] |= [disk.contains(key, digest) for key in keys]
        return held

    def admission_report(self, handle: SeqHandle) -> AdmissionReport:
        """Where ``handle``'s prompt pages came from (final once the handle is ready)."""
        return self._hit_sources.report(handle.seq_id, handle.num_hit_tokens)

    def is_ready(self, handle: SeqHandle) -> bool:
        """Whether every fetch of ``handle`` finished (its hit KV is in the pool); transfers
        that finished take effect first, so ``handle.num_hit_tokens`` is final once True."""
        _check_handle(handle)
        if handle.seq_id in self._mover.waiters:
            self._apply_transfers()
        return handle.seq_id not in self._mover.waiters

    def wait_any(self, timeout: float) -> bool:
        """Block until some transfer finishes or ``timeout`` seconds pass, then apply what
        finished; False when nothing was in flight (nothing to wait for)."""
        if not self._mover.busy:
            return False
        self._mover.wait_any(timeout)
        self._apply_transfers()
        return True

    def wait_ready(self, handle: SeqHandle, timeout: float | None = None) -> bool:
        """Apply finished transfers until ``handle`` is ready; False if ``timeout`` seconds
        (wall clock) pass first. ``handle.num_hit_tokens`` is final once this returns True."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.is_ready(handle):
                return True
            remaining = 60.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return False
            if not self._mover.busy:
                raise RuntimeError(f"sequence {handle.seq_id} waits for fetches but no transfer is in flight")
            self._mover.wait_any(remaining)

    def poll(self) -> TierReport:
        """Apply finished transfers, start host -> disk spills above the host watermark, and
        close this step's batch of block events; return what the transfers did since the last
        call."""
        self._apply_transfers()
        self._mover.spill_host()
        self._apply_transfers()  # what finished meanwhile (at once, for a synchronous engine)
        self.events.flush()
        report, self._mover.report = self._mover.report, TierReport()
        return report

    def extend(self, handle: SeqHandle, num_new_tokens: int) -> bool:
        """Room for ``num_new_tokens`` more tokens; False (nothing changed) if it cannot."""
        index = self.index
        if index.extend(handle, num_new_tokens, evict=False):  # the usual case: free blocks serve
            return True  # (a bad handle or count raised its error there, nothing changed)
        missing = index.blocks_missing(handle, num_new_tokens)
        free = index.allocator.num_free
        if missing <= free + index.num_reclaimable:  # evict with write-back, not the index's way
            self._version += 1
            self._make_device_room(missing - free)
            self._forget_dropped()
        return index.extend(handle, num_new_tokens)

    def commit(self, handle: SeqHandle, tokens: TokensLike) -> int:
        """Insert the sequence's new full pages into the trie; return how many entered.

        ValueError while the handle is not ready (its fetched pages are not in the pool yet).
        With ``write_through`` the new pages start their host copies.
        """
        _check_handle(handle)
        if handle.seq_id in self._mover.waiters and not self.is_ready(handle):
            raise ValueError(f"sequence {handle.seq_id} is waiting for fetches; call wait_ready before commit")
        first = handle._committed
        num_new = self.index.commit(handle, tokens)
        if num_new:
            self._version += 1
            if self._write_through:
                self._copy_path(handle._tail, first, 0)
        return num_new

    def release(self, handle: SeqHandle) -> None:
        """Drop the sequence's references (fetches in flight for it are discarded)."""
        self.index.release(handle)
        self._version += 1
        self._hit_sources.forget(handle.seq_id)

    def evict(self, num_blocks: int) -> list[int]:
        """Evict up to ``num_blocks`` cached device blocks; with write_back, pages without a
        lower copy get one first (their gather is issued before the blocks are freed)."""
        if num_blocks < 0:
            raise ValueError(f"{num_blocks=} must be >= 0")
        self._version += 1
        blocks = self._make_device_room(num_blocks)
        self._forget_dropped()
        return blocks.tolist()

    def evict_host(self, num_blocks: int) -> int:
        """Drop up to ``num_blocks`` unheld host copies, in ``TierIndex.make_host_room``'s
        order; return how many. Pages left with no copy in any tier leave the trie."""
        if num_blocks < 0:
            raise ValueError(f"{num_blocks=} must be >= 0")
        self._version += 1
        tiers = self.tiers
        before = tiers.host_used
        tiers.make_host_room(tiers.host_capacity - tiers.host_used + num_blocks)
        return before - tiers.host_used

    def pin(self, tokens: TokensLike, namespace: NamespaceLike = None, ttl: float | None = None) -> int:
        """Keep the device-cached prefix of ``tokens`` on device (see ``DeviceIndex.pin``)."""
        self._version += 1
        return self.index.pin(tokens, namespace, ttl)

    def unpin(self, tokens: TokensLike, namespace: NamespaceLike = None) -> None:
        self._version += 1
        self.index.unpin(tokens, namespace)

    def prefetch(self, tokens: TokensLike, namespace: NamespaceLike = None, *,
                 accept_lossy: bool | None = None) -> None:  # fmt: skip
        """Start moving the host/disk pages of ``tokens``' cached prefix up (PREFETCH priority).

        Pages go to the device when free blocks allow (no eviction for a guess) and the cost
        model favours fetching; otherwise disk pages are restored to host. A later ``admit``
        of the same prefix maps them, or joins the transfer still in flight. Lossy pages are
        left where they are unless ``accept_lossy`` (as in ``admit``).
        """
        _check_accept_lossy(accept_lossy)
        if not self.config.tiered:
            return
        lookup = self.lookup(tokens, namespace)
        ns, buf, page_bytes = lookup.namespace, lookup.buf, self.trie.page_bytes
        plan, pages = self._prefetch_plan(lookup.matched, accept_lossy)
        first, on_disk = plan.first, plan.on_disk
        if not pages:
            return
        self._version += 1
        if self.allocator.num_free < len(pages):
            jobs = len(self._mover.live_jobs)
            self._mover.restore_only([key for key, disk in zip(pages, on_disk) if disk], ns.digest())
            self._counts["prefetches"] += len(self._mover.live_jobs) > jobs  # only if it started one
            return
        held = self._mover.hold(pages)
        try:
            prefix = buf[: (first + len(pages)) * page_bytes]
            admission = self.index.begin_admission(ns, prefix, plan.matched, self.clock())
            if admission is not None:  # it allocates len(pages) <= num_free blocks: no eviction
                hold = self.index.complete_admission(admission, count=False)
                waiter = Waiter(hold, first, on_disk[: len(pages)], prefetch=True)
                self._mover.start_fetch(waiter, pages, ns.digest(), Priority.PREFETCH)
                self._counts["prefetches"] += waiter.outstanding > 0  # calls that started a transfer
                if not waiter.outstanding:  # no job took it (no host room): nothing will release it
                    self.index.release(hold)
                # else the fetch's commit releases it (``_commit_fetched``), however soon it ends
        finally:
            self._mover.unhold(held)

    def num_prefetch_pages(self, tokens: TokensLike | Lookup, namespace: NamespaceLike = None, *,
                           num_pages: int | None = None, accept_lossy: bool | None = None) -> int:  # fmt: skip
        """How many pages ``prefetch`` of ``tokens`` (cut to its first ``num_pages`` pages,
        when given) would start moving now: its host/disk pages worth fetching, up to the first
        one already on its way to the device, when free blocks take them all; else the disk
        pages among them that no transfer restores to host yet. 0: a prefetch would start
        nothing (its pages are on the device or on their way, not worth fetching, or host
        pages waiting for free blocks). Changes nothing but what a lookup may (``lookup``)."""
        _check_accept_lossy(accept_lossy)
        if not self.config.tiered:
            return 0
        matched = self._fresh_lookup(tokens, namespace).matched
        if num_pages is not None:
            matched = _truncate(matched, int_arg(num_pages, "num_pages"))
        plan, pages = self._prefetch_plan(matched, accept_lossy)
        if self.allocator.num_free >= len(pages):
            return len(pages)
        return sum(1 for key, disk in zip(pages, plan.on_disk) if disk and key not in self._mover.jobs)

    # --- pages between nodes ----------------------------------------------------------------

    def export_pages(self, tokens: TokensLike, namespace: NamespaceLike, first_page: int,
                     num_pages: int) -> ExportedPages:  # fmt: skip
        """Pages ``first_page ..`` (at most ``num_pages``) of ``tokens``' cached prefix, read
        from their tiers for another node (``kvjax.tiers.kv_cache_remote``)."""
        return export_pages(self, tokens, namespace, first_page, num_pages)

    def import_pages(self, tokens: TokensLike, namespace: NamespaceLike, first_page: int, blocks: np.ndarray) -> int:
        """Another node's verified pages ``first_page ..`` of ``tokens`` join this cache as
        host pages; returns how many (``kvjax.tiers.kv_cache_remote``)."""
        return import_pages(self, tokens, namespace, first_page, blocks)

    def warmup(self) -> None:
        """Build the device side of every tier move now, once per transfer bucket: an
        offload's or an export's gather (and encode), a fetch's copy up, decode and scatter,
        each run on no block. Moves of any number of blocks then compile nothing while
        serving. A cache without lower tiers builds the gather alone: it still exports its
        device pages to other nodes (``export_pages``)."""
        if not self.move_bytes:
            return
        no_slots = np.zeros(0, np.intp)
        for rows in self.config.transfer_buckets:
            no_blocks = np.full(rows, -1, np.int32)
            jax.block_until_ready(self._gather(self.pool.kv_pages, jnp.asarray(no_blocks)))
            if self.config.tiered:
                self.pool.scatter(no_blocks, self.codec.decode(self.host_pool.to_device(no_slots, rows)))

    def flush(self, timeout: float = 30.0) -> bool:
        """Finish every copy in flight, then copy every host page without a disk copy to
        disk and wait for that too. True only when every host page that lacked a disk copy
        then was written to disk; False if a write failed or was dropped (a disk error, a
        write back-off, a full or read-only disk tier) or ``timeout`` seconds passed first."""
        deadline = time.monotonic() + timeout
        for spill in (False, True):
            if spill:
                to_disk = len(self.tiers.undisked) if self.disk_tier is not None else 0
                spilled_before = self._mover.counts["spilled"]  # spills report the blocks written
                self._mover.spill_host(everything=True)
            while self._mover.busy:
                self._apply_transfers()
                if time.monotonic() >= deadline:
                    return False
                self._mover.wait_any(max(0.0, deadline - time.monotonic()))
        self._apply_transfers()
        return self._mover.counts["spilled"] - spilled_before >= to_disk

    # --- block events ----------------------------------------------------------------------

    def end_step(self) -> None:
        """Close this step's batch of block events (``poll`` also does, at its end): what the
        step stored and dropped reaches subscribers now, not at the next step's poll."""
        self.events.flush()

    def subscribe(self, max_batches: int = 4096) -> Subscription:
        """A subscription to the block events of every tier, from now on (see
        ``kvjax.cache.block_events``); its ``initial`` is the ``BlockIndex`` of what the tiers
        held when it started, the holdings its events apply to."""
        with self._disk_index_lock():
            self.events.flush()  # earlier events belong to earlier subscribers only
            initial = self._holdings()
            subscription = self.events.subscribe(max_batches)
        subscription.initial = initial
        return subscription

    def block_index(self) -> BlockIndex:
        """What every tier holds now, as (namespace digest, key, tier). Closes the current
        batch of events first, so the events delivered so far, applied in order to a
        subscription's ``initial``, give exactly this."""
        with self._disk_index_lock():
            self.events.flush()
            return self._holdings()

    def _holdings(self) -> BlockIndex:
        entries = []
        for node in self.trie.nodes():
            if node.on_device:
                namespace = self.trie.namespace_of(node).digest()
                entries += [(namespace, key, "device") for key in self.trie.page_keys(node)]
        entries += [(entry.namespace, key, "host") for key, entry in self.tiers.host_entries.items()
                    if not entry.dropped]  # fmt: skip
        if self.disk_tier is not None:
            entries += [(namespace, key, "disk") for namespace, key in self.disk_tier.held_blocks()]
        return BlockIndex(entries)

    def _disk_index_lock(self):
        """The disk tier's index lock (its writes record events from a worker thread), or none."""
        return contextlib.nullcontext() if self.disk_tier is None else self.disk_tier.index_lock

    # --- figures, checks and lifetime ---------------------------------------------------------

    @property
    def stats(self) -> KVCacheStats:
        counts, moved = self._counts, self._mover.counts
        return KVCacheStats(
            self.index.stats, host_blocks=self.tiers.host_used,
            disk_blocks=0 if self.disk_tier is None else len(self.disk_tier),
            offloaded_blocks=moved["offloaded"], spilled_blocks=moved["spilled"],
            fetched_host_blocks=counts["fetched_host"], fetched_disk_blocks=counts["fetched_disk"],
            recompute_chosen_blocks=counts["recompute_chosen"], fetch_failures=moved["fetch_failures"],
            disk_errors=moved["disk_errors"], lost_host_blocks=self.tiers.lost_blocks,
            pressure_spilled_blocks=moved["pressure_spilled"],
            lossy_hit_blocks=counts["lossy_device_hits"] + counts["fetched_lossy"],
            refused_lossy_blocks=counts["refused_lossy"], prefetches=counts["prefetches"])  # fmt: skip

    def check_invariants(self) -> None:
        """Raise RuntimeError unless every invariant in the module docstring holds."""
        self.index.check_invariants()
        self.pool.check_invariants()
        if self.trie.lossy_offload != self.codec.lossy:
            raise RuntimeError(f"trie.lossy_offload={self.trie.lossy_offload} but codec {self.codec.name}")
        if not self.codec.lossy and any(node.lossy is not None and node.lossy.any() for node in self.trie.nodes()):
            raise RuntimeError(f"a page is marked lossy but codec {self.codec.name} is lossless")
        self.tiers.check_invariants(disk_exact=not self._mover.spills and not self._mover.copies)
        self._mover.check_invariants(self.index._handles)

    def close(self) -> None:
        """Stop the transfer workers (queued transfers fail; the disk keeps what it wrote) and
        close the disk tier this cache opened (a given one stays open). The device and host
        tiers go with the cache: a "cleared" event each (and the disk no longer counts host
        copies as dependents of its blocks). ``admit`` refuses afterwards (ValueError)."""
        if self.transfer is not None:
            self.transfer.close()
        closing, self._closed = not self._closed, True
        if closing:
            self.tiers.release_dependents()
        if self._owns_disk_tier:
            self.disk_tier.close()
        if closing:
            for tier in ("device", "host") if self.config.tiered else ("device",):
                self.events.record(None, None, None, tier, "cleared")
            self.events.flush()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- helpers ---------------------------------------------------------------------------

    def _open_lower_tiers(self, impl: str | None, transfer_factory) -> None:
        config, codec = self.config, self.codec
        self.host_pool = HostPool(codec.block_shape, codec.dtype, config.host_bytes // codec.block_nbytes,
                                  store_bytes=self.move_bytes)  # fmt: skip
        self._owns_disk_tier = self.disk_tier is None and config.disk_dir is not None
        if self._owns_disk_tier:
            self.disk_tier = DiskTier(config.disk_dir, codec.block_shape, codec.dtype, config.disk_bytes,
                                      segment_bytes=config.disk_segment_bytes, codec=codec.name,
                                      model_id=config.model_id, events=self.events)  # fmt: skip
        elif self.disk_tier is not None:
            codec.check_stored_by(self.disk_tier, "disk_tier")
            model_id = getattr(self.disk_tier, "model_id", config.model_id)
            if model_id != config.model_id:
                raise ValueError(f"disk_tier holds KV of model_id={model_id!r}; this cache's is "
                                 f"{config.model_id!r}")
            self.disk_tier.events = self.events
        directory = getattr(self.disk_tier, "directory", None)  # one a restart reopens (not an in-memory stand-in)
        if directory is not None and not config.model_id:  # a restart with other weights would read this KV
            _log.warning("disk tier %s keyed by no model_id: KV that other weights of the same shapes wrote there "
                         "would be served as this model's; set KVCacheConfig(model_id=...) to name the weights "
                         "(kvjax.serving.model.model_digest(model) does; Engine.from_preset sets it)", directory)
        self.transfer = (transfer_factory or TransferEngine)(
            self.host_pool, self.disk_tier, gather_blocks=self._gather, buckets=config.transfer_buckets,
            synchronous=not self.move_bytes, direct_cpu_reads=codec.stores_as_is and impl is None)  # fmt: skip

    def _fresh_lookup(self, tokens: TokensLike | Lookup, namespace: NamespaceLike) -> Lookup:
        if not isinstance(tokens, Lookup):
            return self.lookup(tokens, namespace)
        if namespace is not None and as_namespace(namespace) != tokens.namespace:
            raise ValueError(f"namespace={namespace!r} differs from the lookup's {tokens.namespace}")
        if tokens.version == self._version:
            return tokens
        return self.lookup(np.frombuffer(tokens.buf, "<i4"), tokens.namespace)

    def _walk(self, ns: Namespace, buf: bytes, end: int) -> list[tuple[Node, int]]:
        """Trie walk of ``buf[:end]``; past its end, disk pages found by key join the trie."""
        matched = self.index.walk(ns, buf, end)
        if self.tiers.has_unindexed_disk_blocks():
            probed = self.tiers.probe_disk(ns, buf, end, matched, self.clock())
            if len(probed) != len(matched):  # a node joined (and one may have split)
                self._version += 1
            matched = probed
        return matched

    def _plan(self, matched: list[tuple[Node, int]], accept_lossy: bool | None) -> FetchPlan:
        accept = self.config.accept_lossy if accept_lossy is None else accept_lossy
        return plan_fetch(matched, cost_model=self.config.cost_model, page_size=self.page_size,
                          block_nbytes=self.codec.block_nbytes, lossy_codec=self.codec.lossy,
                          accept_lossy=accept)  # fmt: skip

    def _prefetch_plan(self, matched: list[tuple[Node, int]],
                       accept_lossy: bool | None) -> tuple[FetchPlan, list[bytes]]:  # fmt: skip
        """The fetch plan of ``matched`` and the keys of the pages a prefetch moves: the lower
        pages worth fetching, up to the first one already on its way to the device."""
        plan = self._plan(matched, accept_lossy)
        pages = []
        for node, i in plan.lower[: plan.num_fetch]:
            key = self.trie.page_keys(node)[i]
            if self._mover.device_job(key) is not None:
                break
            pages.append(key)
        return plan, pages

    def _make_device_room(self, num_blocks: int, host_reserve: int = 0) -> np.ndarray:
        """Evict ``num_blocks`` device blocks by policy; with write-back, leaving pages without
        a lower copy keep one (as host room beyond ``host_reserve`` slots allows), copied
        before their blocks are reused."""
        eviction = self._reclaim(num_blocks, host_reserve)
        self._write_back(eviction)
        return np.zeros(0, np.intp) if eviction is None else eviction.blocks

    def _reclaim(self, num_blocks: int, host_reserve: int = 0, fetching: list[bytes] = ()) -> Eviction | None:
        """The eviction of ``_make_device_room``, its copies not started yet (``_write_back``
        must follow before anything writes the freed blocks). ``fetching``: host pages about to
        be fetched to the device, whose slots the copies may take (``TierMover.write_back``)."""
        if num_blocks <= 0:
            return None
        keep = 0
        # The copies write-back makes may displace other host copies, but not those of the pages
        # this eviction offloads (``_write_back`` keeps them): the budget is known once the
        # victims are. Counting those copies as room kept more pages than fit, and the pages cut
        # then were the last kept, nearest the root: each took every page after it along.
        if self.config.write_policy == "write_back" and self.config.tiered:
            if self._host_budget(num_blocks, host_reserve, fetching):  # else none even with those copies
                keep = functools.partial(self._host_budget, num_blocks, host_reserve, fetching)
        return self.index.reclaim(num_blocks, keep_without_copy=keep)

    def _host_budget(self, num_blocks: int, host_reserve: int, fetching: list[bytes],
                     exclude: list[bytes] = ()) -> int:  # fmt: skip
        """How many of ``num_blocks`` evicted pages write-back can copy to host: the room
        ``make_host_room`` can make without the copies in ``exclude``, less ``host_reserve``,
        plus the slots of pages being fetched (``TierMover.write_back``) if that is short."""
        budget = max(0, self.tiers.host_room(num_blocks + host_reserve, exclude) - host_reserve)
        if budget < num_blocks and fetching:
            budget += sum(1 for key in fetching if self.tiers.host_state(key) is not None)
        return min(budget, num_blocks)

    def _write_back(self, eviction: Eviction | None, fetching: list[bytes] = ()) -> None:
        if eviction is not None and eviction.kept:
            self._mover.write_back(eviction.kept, exclude=eviction.offloaded_keys, fetching=fetching)

    def _forget_dropped(self) -> None:
        """Host copies of pages that left the trie go (see ``TierIndex.forget_dropped``)."""
        dropped = self.index.take_dropped()
        if dropped:
            self.tiers.forget_dropped(dropped)

    def _apply_transfers(self) -> None:
        """Finished transfers take effect; fetched pages of finished waiters are committed."""
        applied = self._mover.applied
        finished = self._mover.poll()
        if self._mover.applied != applied:  # a failed copy or restore may have split or dropped nodes
            self._version += 1  # a Lookup taken before is stale (its nodes may be gone)
        for waiter in finished:
            self._commit_fetched(waiter)
        self.tiers.settle_handed()  # after the commits: fetched pages are on device now
        self._forget_dropped()

    def _commit_fetched(self, waiter: Waiter) -> None:
        """The pages a finished waiter received enter the trie (its hits are final)."""
        handle = waiter.handle
        valid = waiter.valid_pages()
        handle.num_hit_tokens = (waiter.first + valid) * self.page_size
        if valid:
            tokens = np.frombuffer(handle._tokens, "<i4", (waiter.first + valid) * self.page_size)
            self.index.commit(handle, tokens, lossy=self.codec.lossy)
        from_disk = int(waiter.from_disk[:valid].sum())
        self._counts["fetched_disk"] += from_disk
        self._counts["fetched_host"] += valid - from_disk
        if waiter.prefetch:
            self.index.release(handle)
        else:
            self._counts["fetched_lossy"] += valid if self.codec.lossy else 0

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
        self._forget_dropped()

    def _copy_hot_path(self, handle: SeqHandle) -> None:
        if handle._committed and self.config.tiered:
            self._copy_path(handle._tail, 0, self.config.selective_min_hits)


def _codec_gather(codec, impl: str | None) -> Callable:
    """``(kv_pages, block_ids) -> stored blocks``: the pool gather, then the codec's encode."""
    return codec.gather(functools.partial(pallas_kernels.gather_blocks, impl=impl))


def _truncate(matched: list[tuple[Node, int]], num_pages: int) -> list[tuple[Node, int]]:
    """The first ``num_pages`` pages of a trie walk."""
    out = []
    for node, k in matched:
        if num_pages <= 0:
            break
        out.append((node, min(k, num_pages)))
        num_pages -= k
    return out


def _check_handle(handle) -> None:
    """A handle ``admit`` returned, before its fields are read (None was an AttributeError)."""
    if not isinstance(handle, SeqHandle):
        raise ValueError(f"handle={handle!r} must be the SeqHandle admit returned")


def _check_accept_lossy(accept_lossy) -> None:
    if accept_lossy is not None and not isinstance(accept_lossy, bool):
        raise ValueError(f"accept_lossy={accept_lossy!r} must be True, False or None (the config's)")
