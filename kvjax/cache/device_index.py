"""The device index: block allocator + prefix trie + eviction policy, the cache's device side.

A block is in exactly one state (see allocator): referenced by running sequences,
cached-unreferenced (in the trie, evictable, still hittable), or empty-free. A block's
refcount is the number of live ``SeqHandle``s holding it; trie membership is separate.

The request's path through this module (``KVCache`` drives it; used alone it is a cache of
device pages only)::

    handle = index.admit(tokens, namespace)   # longest device match, lock it, allocate the rest
    index.extend(handle, num_new_tokens)      # decode grows: more blocks, all-or-nothing
    index.commit(handle, tokens)              # new full pages enter the trie (never a partial page)
    index.release(handle)                     # refcounts drop; committed blocks stay cached

An admission is two steps, so the tier layer can act between them: ``begin_admission``
checks the fit and locks the device hits, ``complete_admission`` evicts what is still
missing and allocates. Eviction (``reclaim``) takes leaves in policy order; with a write-back
budget it keeps leaving pages indexed with a HOST bit and returns them, for the tier layer to
copy. Pages with host/disk copies that leave the trie are queued in ``dropped`` for the tier
layer that owns those copies (``take_dropped``). Every device page stored or removed is a
block event when an ``EventLog`` subscriber listens.

Running out of blocks is a normal result (None / False, state unchanged); bad input raises
ValueError and changes nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvjax.cache.allocator import BLOCK_DTYPE, BlockAllocator, fragmentation
from kvjax.cache.block_events import EventLog
from kvjax.cache.block_keys import Namespace, as_namespace
from kvjax.cache.cost_model import CostModel
from kvjax.cache.eviction import EvictionPolicy
from kvjax.cache.policies import make_policy
from kvjax.cache.prefix_trie import DroppedNode, Node, PrefixTrie, Tier
from kvjax.cache.records import CacheStats, MatchResult, SeqHandle
from kvjax.config.checks import int_arg
from kvjax.text.tokens import TOKEN_DTYPE, token_bytes, validate_tokens

__all__ = ["Admission", "CacheStats", "DeviceIndex", "Eviction", "MatchResult", "SeqHandle", "device_pages",
           "hit_pages", "reclaimable_hit_pages"]

TokensLike = Sequence[int] | np.ndarray
NamespaceLike = Namespace | str | None
_NO_BLOCKS = np.zeros(0, BLOCK_DTYPE)


def hit_pages(path: list[tuple[Node, int]]) -> int:
    """Pages a trie walk matched, in any tier (``MatchResult.num_hit_blocks``)."""
    return sum(k for _, k in path)


def device_pages(path: list[tuple[Node, int]]) -> int:
    """Leading pages of a trie walk with a device copy (``MatchResult.num_device_blocks``)."""
    count = 0
    for node, k in path:
        if not node.on_device:
            break
        count += k
    return count


def reclaimable_hit_pages(path: list[tuple[Node, int]], num_pages: int) -> int:
    """Of a trie walk's first ``num_pages`` device pages, those eviction could free now (no
    sequence holds them, no pin): mapping them for an admission takes them from what eviction
    can free, as allocating would."""
    count = 0
    for node, k in path:
        if num_pages <= 0 or not node.on_device:
            break
        k = min(k, num_pages)
        num_pages -= k
        count += k if PrefixTrie.is_candidate(node) else 0
    return count


@dataclasses.dataclass(slots=True)
class Admission:
    """An admission between ``begin_admission`` and ``complete_admission``: its device hits
    are locked; ``short`` blocks must still be evicted before it can allocate."""

    namespace: Namespace
    buf: bytes  # the prompt's token bytes
    path: list[tuple[Node, int]]  # the device hits, locked
    tail: Node  # deepest locked node (the namespace's root if no hit)
    num_new: int  # blocks to allocate
    lower_pages: int  # matched pages past the device hits (host/disk), for the counters
    short: int  # blocks the free queue lacks for num_new


@dataclasses.dataclass(slots=True)
class Eviction:
    """What ``evict`` did: block ids freed into the free queue; the pages a write-back
    budget kept indexed with a HOST bit, as ``(key, old block id)``: the caller copies each
    block's KV to host before anything writes the block again; and the keys of every evicted
    page that stayed indexed off device (kept ones included)."""

    blocks: np.ndarray
    kept: list[tuple[bytes, int]]
    offloaded_keys: list[bytes]


class DeviceIndex:
    """Refcounted device blocks indexed by a prefix trie, evicted by a named policy.

    ``page_size`` tokens per block; ``vocab_size`` bounds token ids (None: any int32 >= 0);
    ``clock`` returns seconds (monotonic); ``cost_model`` and ``block_nbytes`` (bytes a block
    moves between tiers) are what a cost-aware eviction policy weighs; ``events`` receives a
    block event for every device page stored or removed. See the module docstring for the request path.
    """

    def __init__(
        self,
        num_blocks: int,
        page_size: int,
        *,
        policy: str | EvictionPolicy = "lru",
        vocab_size: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        high_watermark: float = 0.9,
        low_watermark: float = 0.7,
        cost_model: CostModel | None = None,
        block_nbytes: int = 0,
        events: EventLog | None = None,
    ):
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size <= 0:
            raise ValueError(f"{page_size=} must be a positive number of tokens (an int)")
        int_arg(block_nbytes, "block_nbytes")
        if vocab_size is not None and not 0 < vocab_size <= 2**31:
            raise ValueError(f"{vocab_size=} must be in [1, 2**31]")
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.clock = clock
        self.allocator = BlockAllocator(num_blocks, high_watermark=high_watermark, low_watermark=low_watermark)
        self.cost_model = cost_model or CostModel()
        self.block_nbytes = block_nbytes
        policy = make_policy(policy)
        policy.bind(page_size, block_nbytes, self.cost_model)
        self.trie = PrefixTrie(page_size, policy, clock)
        self.events = events if events is not None else EventLog()
        self.dropped: list[DroppedNode] = []  # pages with host/disk copies that left the trie
        self._stats = CacheStats()
        self._handles: dict[int, SeqHandle] = {}
        # tokens and blocks of the live handles, kept as they change (admit, extend, release):
        # fragmentation() is O(1), so a gauge refresh after each cancellation is too
        self._live_tokens = self._live_blocks = 0
        self._pins: dict[tuple[Namespace, bytes], list[Node]] = {}  # -> deepest node of each pin
        self._seq_ids = itertools.count()

    # --- lookup ----------------------------------------------------------------------------

    def match(self, tokens: TokensLike, namespace: NamespaceLike = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` in whole pages, any tier (see MatchResult).

        Read-only: no heat, no locks, no split. Unlike ``admit`` it does not hold back the
        page of the last token, so it can report every page of ``tokens`` as cached.
        """
        buf = token_bytes(tokens, self.vocab_size)
        return self.match_result(self.walk(as_namespace(namespace), buf, self._full_bytes(len(buf))))

    def match_result(self, path: list[tuple[Node, int]]) -> MatchResult:
        """The MatchResult of a trie walk (``PrefixTrie.walk`` from a namespace's root)."""
        blocks = [node.blocks[:k] for node, k in path]
        tiers = [node.page_tiers()[:k] for node, k in path]
        lossy = [node.page_lossy()[:k] for node, k in path]
        num_hit = hit_pages(path)
        return MatchResult(
            blocks=np.concatenate(blocks) if blocks else _NO_BLOCKS.copy(),
            tiers=np.concatenate(tiers) if tiers else np.zeros(0, np.uint8),
            hit_tokens=num_hit * self.page_size,
            num_hit_blocks=num_hit,
            num_device_blocks=device_pages(path),
            lossy=np.concatenate(lossy) if lossy else np.zeros(0, bool),
        )

    # --- the request path ------------------------------------------------------------------

    def admit(self, tokens: TokensLike, namespace: NamespaceLike = None) -> SeqHandle | None:
        """Map the longest device-cached prefix and allocate blocks for the rest.

        The sequence gets ``ceil(len(tokens) / page_size)`` blocks; at least its last token is
        always left to compute (its logits are needed), so a prompt's final page never hits.
        Returns None, changing nothing, when the blocks do not fit even after eviction.
        """
        ns = as_namespace(namespace)
        buf = token_bytes(tokens, self.vocab_size)
        self.check_fits(len(buf) // 4)
        now = self.clock()
        self.trie.expire_soft_pins(now)
        matched = self.walk(ns, buf, self.admit_limit(len(buf)))
        admission = self.begin_admission(ns, buf, matched, now)
        return None if admission is None else self.complete_admission(admission)

    def walk(self, ns: Namespace, buf: bytes, end: int) -> list[tuple[Node, int]]:
        """The trie walk of ``buf[:end]`` (token bytes) from ``ns``'s root (see PrefixTrie.walk)."""
        root = self.trie.root(ns, create=False)
        return [] if root is None else self.trie.walk(root, buf, 0, end)

    def admit_limit(self, num_bytes: int) -> int:
        """Token bytes ``admit`` may match: the whole pages before the last token's page."""
        return max(num_bytes // 4 - 1, 0) // self.page_size * self.trie.page_bytes

    def check_fits(self, num_tokens: int) -> None:
        """ValueError unless a sequence of ``num_tokens`` tokens fits in the pool at all (and
        has a token: an empty prompt has no last token to compute logits for)."""
        if num_tokens < 1:
            raise ValueError(f"tokens is empty (num_tokens={num_tokens}); admit expects a prompt of >= 1 token")
        num_pages = -(-num_tokens // self.page_size)
        if num_pages > self.allocator.num_blocks:
            raise ValueError(f"sequence of {num_tokens} tokens needs {num_pages} blocks; "
                             f"the pool has {self.allocator.num_blocks}")  # fmt: skip

    def begin_admission(self, ns: Namespace, buf: bytes, matched: list[tuple[Node, int]],
                        now: float) -> Admission | None:  # fmt: skip
        """Check that ``buf`` fits and lock its device hits; None (nothing changed) if not.

        ``matched`` is a trie walk of ``buf`` from ``ns``'s root (what the caller decided may
        hit, within ``admit_limit``); its leading device pages are mapped, the rest allocated.
        """
        num_pages = -(-len(buf) // self.trie.page_bytes)
        path = list(itertools.takewhile(lambda p: p[0].on_device, matched))
        num_hit = hit_pages(path)
        locked_away = reclaimable_hit_pages(path, num_hit)
        available = self.allocator.num_free + self.trie.num_evictable - locked_away
        if available < num_pages - num_hit:
            self._stats.admit_failures += 1
            return None
        tail = self._lock_hit_path(path, now) if path else self.trie.root(ns, create=True)
        num_new = num_pages - num_hit
        return Admission(ns, buf, path, tail, num_new, hit_pages(matched) - num_hit,
                         max(0, num_new - self.allocator.num_free))  # fmt: skip

    def complete_admission(self, admission: Admission, *, count: bool = True) -> SeqHandle:
        """Evict what the free queue still lacks, allocate, map the hits: the sequence's handle.
        ``count=False`` leaves the admission counters alone (a prefetch's own hold)."""
        self._evict_for(admission.num_new)
        new_blocks = self.allocator.allocate(admission.num_new)
        if new_blocks is None:
            raise RuntimeError("allocation failed after the admission check said it fits")
        path = admission.path
        table = np.concatenate([_NO_BLOCKS] + [node.blocks[:k] for node, k in path] + [new_blocks])
        num_hit = len(table) - admission.num_new
        if num_hit:
            self.allocator.incref(table[:num_hit], check=False)
        handle = SeqHandle(next(self._seq_ids), admission.namespace, len(admission.buf) // 4, num_hit,
                           self.page_size, table, admission.buf, admission.tail)  # fmt: skip
        self._handles[handle.seq_id] = handle
        self._live_tokens += handle.num_tokens
        self._live_blocks += len(table)
        if count:
            self._count_admission(handle, admission.lower_pages)
        return handle

    def extend(self, handle: SeqHandle, num_new_tokens: int, *, evict: bool = True) -> bool:
        """Make room for ``num_new_tokens`` more tokens; False (nothing changed) if it cannot.
        ``evict=False``: only free blocks may serve; False, counting no failure, if too few
        are free (a tiered cache then evicts its own way and calls again)."""
        self._require_alive(handle)
        num_tokens = handle.num_tokens + int_arg(num_new_tokens, "num_new_tokens")
        missing = -(-num_tokens // self.page_size) - len(handle.block_ids)
        if missing > 0:
            allocator = self.allocator
            self.trie.expire_soft_pins(self.clock())
            free = allocator.num_free
            if missing > free:
                if not evict:
                    return False
                if missing > free + self.trie.num_evictable:
                    self._stats.extend_failures += 1
                    return False
                self.reclaim(missing - free)
            handle.block_ids = np.concatenate((handle.block_ids, allocator.allocate(missing)))
            self._live_blocks += missing
        self._live_tokens += num_tokens - handle.num_tokens
        handle.num_tokens = num_tokens
        return True

    def blocks_missing(self, handle: SeqHandle, num_new_tokens: int) -> int:
        """Blocks ``extend(handle, num_new_tokens)`` would allocate (0 if its last block has room)."""
        return -(-(handle.num_tokens + num_new_tokens) // self.page_size) - len(handle.block_ids)

    def commit(self, handle: SeqHandle, tokens: TokensLike, *, lossy: bool = False) -> int:
        """Insert the sequence's new full pages into the trie; return how many entered.

        ``tokens`` is the sequence so far (prompt + decoded), at most ``handle.num_tokens``
        long and consistent with every token given before. Incremental: pages already
        committed are skipped; the partial last page never enters. ``lossy``: the new pages'
        blocks hold KV fetched from a lossy copy (the trie marks them).
        """
        self._require_alive(handle)
        buf, num_tokens = self._commit_bytes(handle, tokens)
        handle._tokens = buf
        end = self._full_bytes(4 * num_tokens)
        start = handle._committed * self.trie.page_bytes
        if end <= start:
            return 0
        self._insert_pages(handle, buf, start, end, self.clock(), lossy)
        return (end - start) // self.trie.page_bytes

    def release(self, handle: SeqHandle) -> None:
        """Drop the sequence's references. Committed blocks stay cached (and hittable)."""
        self._require_alive(handle)
        table, committed = handle.block_ids, handle._committed
        # table[:committed] are trie blocks except at duplicate pages, where the sequence's
        # own block is decremented here and freed just below (free_held overwrites it).
        self.allocator.decref(table[:committed], check=False)
        if handle._dup_trie:
            self.allocator.decref(np.concatenate(handle._dup_trie), check=False)
        self.allocator.free_held(self._private_blocks(handle))
        if handle._tail.parent is not None:
            self.trie.unlock(handle._tail, self.clock())
        handle._alive = False
        del self._handles[handle.seq_id]
        self._live_tokens -= handle.num_tokens
        self._live_blocks -= len(table)

    # --- eviction and pins ------------------------------------------------------------------

    @property
    def num_reclaimable(self) -> int:
        """Cached blocks that eviction can free now (unreferenced, unpinned)."""
        return self.trie.num_evictable

    def evict(self, num_blocks: int) -> list[int]:
        """Evict up to ``num_blocks`` cached blocks into the free queue; return their ids."""
        return self.reclaim(num_blocks).blocks.tolist()

    def reclaim(self, num_blocks: int, *,
                keep_without_copy: int | Callable[[list[bytes]], int] = 0) -> Eviction:  # fmt: skip
        """Evict up to ``num_blocks`` cached blocks, in policy order, into the free queue.

        ``keep_without_copy`` (write-back): up to that many evicted pages without a host/disk
        copy get a HOST bit and stay indexed off device; ``Eviction.kept`` lists them for the
        caller to copy. Pages with copies that leave the trie go to ``dropped``.

        It may be a function of the keys of the evicted pages that stay indexed with copies
        they already had, called once the victims are known: host room depends on them (the
        caller keeps their host copies, so they make no room for the pages it copies).
        """
        num_blocks = int_arg(num_blocks, "num_blocks")
        if not callable(keep_without_copy):
            keep_without_copy = int_arg(keep_without_copy, "keep_without_copy")
        now = self.clock()
        self.trie.expire_soft_pins(now)
        num_blocks = min(num_blocks, self.trie.num_evictable)
        self.trie.prepare_eviction(now)
        runs, kept, offloaded, listening = [_NO_BLOCKS], [], [], self.events.active
        # A short budget goes to the pages nearest the root: every leaving page is kept for
        # now, then the deepest are let go until the rest fit (see ``_trim_kept``).
        budget = keep_without_copy
        keep_without_copy = num_blocks if budget else 0
        while num_blocks:
            node = self.trie.pop_victim()
            if node is None:
                raise RuntimeError(f"eviction queue is empty with num_evictable={self.trie.num_evictable}")
            take = min(num_blocks, node.num_pages)
            if listening:
                self._record_pages(node, node.num_pages - take, node.num_pages, "removed")
            blocks, node_kept, dropped = self.trie.evict_tail(
                node, take, now, keep_without_copy=keep_without_copy - len(kept), offloaded_keys=offloaded)
            runs.append(blocks)
            kept += node_kept
            self.dropped += dropped
            num_blocks -= take
        if callable(budget):
            to_copy = {key for key, _ in kept}
            budget = budget([key for key in offloaded if key not in to_copy])
        if len(kept) > budget:
            kept, offloaded = self._trim_kept(kept, offloaded, budget)
        blocks = runs[1] if len(runs) == 2 else np.concatenate(runs)
        self.allocator.free(blocks, check=False)
        self._stats.evicted_blocks += len(blocks)
        return Eviction(blocks, kept, offloaded)

    def _trim_kept(self, kept: list[tuple[bytes, int]], offloaded: list[bytes],
                   budget: int) -> tuple[list[tuple[bytes, int]], list[bytes]]:  # fmt: skip
        """Let the deepest kept pages go until at most ``budget`` remain (a page lets go
        of everything after it: a page is found only through its prefix, so a copy of a
        page whose parent left would be wasted). Returns the kept pages and offloaded keys
        still indexed."""
        trie = self.trie
        order = sorted(((trie.page_depth(key), row) for row, (key, _) in enumerate(kept)), reverse=True)
        alive = {key for key, _ in kept}
        for _, row in order:
            if len(alive) <= budget:
                break
            key = kept[row][0]
            if key not in alive:
                continue  # left with a page before it
            alive.discard(key)
            dropped = trie.clear_tier(*trie.locate(key), Tier.HOST)
            for record in dropped:
                alive.difference_update(record.keys)
            self.dropped += dropped
        kept = [item for item in kept if item[0] in alive]
        return kept, [key for key in offloaded if trie.locate(key) is not None]

    def take_dropped(self) -> list[DroppedNode]:
        """The pages with host/disk copies that left the trie since the last call."""
        dropped, self.dropped = self.dropped, []
        return dropped

    def pin(self, tokens: TokensLike, namespace: NamespaceLike = None, ttl: float | None = None) -> int:
        """Keep the device-cached prefix of ``tokens`` from eviction; return its token count.

        ``ttl=None``: a hard pin, held until ``unpin`` with the same tokens and namespace.
        ``ttl`` seconds: a soft pin that expires by itself (hot system prompts).
        """
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float, np.integer, np.floating))
                                or not 0 < ttl < math.inf):  # fmt: skip
            raise ValueError(f"{ttl=} must be a positive finite number of seconds (or None: hard pin)")
        ns = as_namespace(namespace)
        buf = token_bytes(tokens, self.vocab_size)
        now = self.clock()
        self.trie.expire_soft_pins(now)
        root = self.trie.root(ns, create=False)
        path = [] if root is None else self.trie.walk(root, buf, 0, self._full_bytes(len(buf)))
        path = list(itertools.takewhile(lambda p: p[0].on_device, path))
        if not path:
            return 0
        node, k = path[-1]
        if k < node.num_pages:
            node = self.trie.split(node, k)
        if ttl is None:
            self.trie.hard_pin(node)
            self._pins.setdefault((ns, buf[: self._full_bytes(len(buf))]), []).append(node)
        else:
            self.trie.soft_pin(node, now + ttl)
        return sum(k for _, k in path) * self.page_size

    def unpin(self, tokens: TokensLike, namespace: NamespaceLike = None) -> None:
        """Undo the most recent hard ``pin`` made with the same full pages and namespace."""
        ns = as_namespace(namespace)
        buf = token_bytes(tokens, self.vocab_size)
        key = (ns, buf[: self._full_bytes(len(buf))])
        pinned = self._pins.get(key)
        if not pinned:
            raise ValueError(f"no hard pin on these {len(buf) // 4} tokens in namespace {ns}")
        self.trie.hard_unpin(pinned[-1], self.clock())
        pinned.pop()
        if not pinned:
            del self._pins[key]

    # --- tiers, figures and checks ----------------------------------------------------------

    def set_tier(self, tokens: TokensLike, namespace: NamespaceLike, page: int, tier: Tier) -> None:
        """Record that cached page ``page`` of ``tokens`` also has a ``tier`` (HOST/DISK) copy."""
        node, index = self._locate_page(tokens, namespace, page, tier)
        self.trie.set_tier(node, index, tier)

    def clear_tier(self, tokens: TokensLike, namespace: NamespaceLike, page: int, tier: Tier) -> None:
        """Forget a HOST/DISK copy; an off-device page left without copies leaves the trie."""
        node, index = self._locate_page(tokens, namespace, page, tier)
        self.dropped += self.trie.clear_tier(node, index, tier)

    @property
    def stats(self) -> CacheStats:
        self._sync_trie_stats()
        return self._stats

    def fragmentation(self) -> float:
        """Fraction of live sequences' token slots that hold no token (partial last pages);
        O(1), from totals kept as sequences change (``check_invariants`` recounts them)."""
        slots = self._live_blocks * self.page_size
        return 0.0 if slots == 0 else float(slots - self._live_tokens) / slots

    @property
    def num_sequences(self) -> int:
        return len(self._handles)

    def check_invariants(self) -> None:
        """Raise RuntimeError unless every documented invariant holds. Changes nothing.

        Every block is in exactly one state (referenced / cached-unreferenced / empty-free);
        refcounts equal the holds of live handles, and the running totals of their tokens and
        blocks their sums; each node's lock count equals the live handles whose path crosses it
        and its hard pins the pins whose path does; every trie page's block is owned by the
        trie (not free, not private to a sequence); locked and pinned nodes are still on device
        (the trie's own checks cover structure and counters).
        """
        self.allocator.check_invariants()
        trie_blocks = self.trie.check_invariants()
        size = max(self.allocator.num_used_ids, int(trie_blocks.max(initial=-1)) + 1)
        free = np.zeros(size, bool)
        free[: self.allocator.num_used_ids] = self.allocator.free_mask()
        free[self.allocator.num_used_ids :] = True
        in_trie = np.zeros(size, bool)
        in_trie[trie_blocks] = True
        _fail_if(free & in_trie, "is free but still indexed by the trie")
        expected = np.zeros(size, np.int64)
        locks: dict[int, int] = {}
        for handle in self._handles.values():
            np.add.at(expected, self._check_handle(handle, in_trie), 1)
            _count_path(handle._tail, locks)
        refcounts = self.allocator.refcounts(size)
        _fail_if(refcounts != expected, "has a refcount unequal to the live sequences holding it")
        _fail_if((refcounts == 0) & ~free & ~in_trie, "is unreferenced, uncached and not free (leaked)")
        pins: dict[int, int] = {}
        for nodes in self._pins.values():
            for node in nodes:
                _count_path(node, pins)
        handles = list(self._handles.values())
        tokens, blocks = sum(h.num_tokens for h in handles), sum(len(h.block_ids) for h in handles)
        if (self._live_tokens, self._live_blocks) != (tokens, blocks):
            raise RuntimeError(f"live sequences hold {tokens} tokens in {blocks} blocks; the running totals "
                               f"say {self._live_tokens} in {self._live_blocks}")  # fmt: skip
        if self.fragmentation() != fragmentation([h.num_tokens for h in handles],
                                                 [len(h.block_ids) for h in handles], self.page_size):
            raise RuntimeError("fragmentation() disagrees with the live sequences")
        for node in self.trie.nodes():
            if (node.lock, node.hard_pins) != (locks.get(id(node), 0), pins.get(id(node), 0)):
                raise RuntimeError(f"node at page {node.first_page} has lock={node.lock}, "
                                   f"hard_pins={node.hard_pins}; handles and pins say "
                                   f"{locks.get(id(node), 0)}, {pins.get(id(node), 0)}")  # fmt: skip

    # --- helpers ---------------------------------------------------------------------------

    def _check_handle(self, handle: SeqHandle, in_trie: np.ndarray) -> np.ndarray:
        """Consistency of one live handle; returns every block it holds."""
        held = _path_blocks(handle._tail)
        private = self._private_blocks(handle)
        table = handle.block_ids
        if len(table) != -(-handle.num_tokens // self.page_size) or len(np.unique(table)) != len(table):
            raise RuntimeError(f"sequence {handle.seq_id} has {len(table)} blocks for {handle.num_tokens} tokens")
        mapped = np.concatenate([table[: handle._committed]] + handle._dup_trie)
        expected = np.setdiff1d(mapped, np.concatenate([np.zeros(0, BLOCK_DTYPE)] + handle._dup_own))
        if not np.array_equal(np.sort(held), expected) or in_trie[private].any():
            raise RuntimeError(f"sequence {handle.seq_id} disagrees with the trie about its committed pages")
        return np.concatenate((held, private))

    def _evict_for(self, num_new: int) -> None:
        """Evict (no write-back) what the free queue lacks for ``num_new`` blocks."""
        if num_new > self.allocator.num_free:
            self.reclaim(num_new - self.allocator.num_free)

    def _record_pages(self, node: Node, start: int, end: int, kind: str) -> None:
        """Device events for pages ``start .. end - 1`` of ``node``."""
        keys = self.trie.page_keys(node)
        parent = self.trie.parent_key(node, start)
        namespace = self.trie.namespace_of(node).digest()
        for key in keys[start:end]:
            self.events.record(namespace, key, parent, "device", kind)
            parent = key

    def _full_bytes(self, num_bytes: int) -> int:
        return num_bytes - num_bytes % self.trie.page_bytes

    def _require_alive(self, handle: SeqHandle) -> None:
        if not isinstance(handle, SeqHandle) or self._handles.get(handle.seq_id) is not handle:
            raise ValueError(f"{handle!r} is not a live sequence of this cache (released already?)")

    def _lock_hit_path(self, path: list[tuple[Node, int]], now: float) -> Node:
        node, k = path[-1]
        if k < node.num_pages:
            node = self.trie.split(node, k)
            path[-1] = (node, k)
        self.trie.lock(node, now)
        return node

    def _count_admission(self, handle: SeqHandle, num_lower_tier_pages: int) -> None:
        stats = self._stats
        stats.admitted += 1
        stats.prompt_tokens += handle.num_tokens
        stats.hit_tokens += handle.num_hit_tokens
        stats.lower_tier_hit_tokens += num_lower_tier_pages * self.page_size

    def _insert_pages(self, handle: SeqHandle, buf: bytes, start: int, end: int, now: float,
                      lossy: bool) -> None:  # fmt: skip
        trie, page_bytes = self.trie, self.trie.page_bytes
        node = handle._tail
        for child, num_pages in trie.walk(node, buf, start, end):
            if num_pages < child.num_pages:
                child = trie.split(child, num_pages)
            first = start // page_bytes
            own = handle.block_ids[first : first + num_pages]
            if child.on_device and self._replaces_lossy(handle, child, lossy):
                # pages below it were computed over its lossy KV (or fetched lossy): flagged
                # lossy now, so a refusing request recomputes them too (the next ones on this
                # path, unlocked, are replaced by this recompute in turn)
                trie.mark_descendants_lossy(child)
                self.allocator.free(trie.replace(child, own, now), check=False)
                self._stats.inserted_blocks += num_pages
            elif child.on_device:  # cached meanwhile by another sequence: hold that copy too
                trie.lock(child, whole_path=False)
                self.allocator.incref(child.blocks, check=False)
                handle._dup_own.append(own)
                handle._dup_trie.append(child.blocks)
                self._stats.duplicate_blocks += num_pages
            else:  # only a host/disk copy was indexed: our fresh blocks become its device copy
                trie.attach(child, own, now, lossy=lossy)
                self._stats.inserted_blocks += num_pages
                if self.events.active:
                    self._record_pages(child, 0, num_pages, "stored")
            node = child
            handle._own_tail = False
            start += num_pages * page_bytes
        if start < end:
            own = handle.block_ids[start // page_bytes : end // page_bytes]
            label = memoryview(buf)[start:end]  # zero-copy: the trie keeps a view of buf
            # pages joining a node this sequence hit would inherit its hits and age: eviction
            # policies (and the selective write policy) would see them as reused before they were
            if handle._own_tail and not node.hits and trie.can_extend(node):  # hits: another one used it
                trie.extend(node, label, own, now, lossy=lossy)
            else:
                node = trie.insert(node, label, own, now, lossy=lossy)
                handle._own_tail = True
            self._stats.inserted_blocks += len(own)
            if self.events.active:
                self._record_pages(node, node.num_pages - len(own), node.num_pages, "stored")
        handle._tail = node
        handle._committed = end // page_bytes

    @staticmethod
    def _replaces_lossy(handle: SeqHandle, child: Node, lossy: bool) -> bool:
        """Whether ``handle``'s own blocks should replace ``child``'s device copy at commit.

        Yes when a page of ``child`` is lossy, the handle's pages are exact (computed, not
        fetched: ``lossy`` False, on top of an exact path, so every page it replaces gets KV
        at least as exact) and no sequence holds ``child`` (lock 0: no handle maps or holds
        its blocks, so the trie's were its only reference and they can be freed). Otherwise a
        refusing request's recompute would leave the lossy copy in place for the next one.
        """
        if lossy or child.lock or child.lossy is None or not child.lossy.any():
            return False
        node = handle._tail
        while node.parent is not None:
            if node.lossy is not None and node.lossy.any():
                return False
            node = node.parent
        return True

    def _locate_page(self, tokens: TokensLike, namespace: NamespaceLike, page: int, tier: Tier):
        if not int(tier) & (Tier.HOST | Tier.DISK) or int(tier) & ~(Tier.HOST | Tier.DISK):
            raise ValueError(f"{tier=} must be Tier.HOST and/or Tier.DISK (device copies change by admit/evict)")
        buf = token_bytes(tokens, self.vocab_size)
        root = self.trie.root(as_namespace(namespace), create=False)
        end = (page + 1) * self.trie.page_bytes
        path = [] if root is None or page < 0 or end > len(buf) else self.trie.walk(root, buf, 0, end)
        if sum(k for _, k in path) != page + 1:
            raise ValueError(f"{page=} of these tokens is not cached in namespace {namespace!r}")
        node, k = path[-1]
        return node, k - 1

    def _sync_trie_stats(self) -> None:
        stats = self._stats
        stats.offloaded_pages = self.trie.offloaded_pages
        stats.dropped_pages = self.trie.dropped_pages

    def _private_blocks(self, handle: SeqHandle) -> np.ndarray:
        """The handle's blocks that the trie does not own (uncommitted or duplicate pages)."""
        uncommitted = handle.block_ids[handle._committed :]
        if not handle._dup_own:
            return uncommitted
        return np.concatenate(handle._dup_own + [uncommitted])

    def _commit_bytes(self, handle: SeqHandle, tokens: TokensLike) -> tuple[bytes, int]:
        """(bytes holding the tokens, token count) for commit; checks them against what the
        handle saw before and validates only when new tokens appear."""
        array = np.asarray(tokens)
        if array.dtype != TOKEN_DTYPE or array.ndim != 1:
            array = validate_tokens(array, self.vocab_size)  # before any narrowing cast
        if len(array) > handle.num_tokens:
            raise ValueError(f"{len(array)} tokens committed; the sequence has room for "
                             f"{handle.num_tokens} (call extend first)")  # fmt: skip
        known = handle._tokens
        if len(array) <= len(known) // 4:  # usual case: no copy, the known bytes serve
            if not known.startswith(memoryview(np.ascontiguousarray(array)).cast("B")):  # memcmp
                raise ValueError("tokens disagree with the tokens this sequence was given before")
            return known, len(array)
        buf = array.tobytes()
        if not buf.startswith(known):
            raise ValueError("tokens disagree with the tokens this sequence was given before")
        validate_tokens(array, self.vocab_size)  # whole array: errors name the true index
        return buf, len(array)


# --- helpers of check_invariants ------------------------------------------------------


def _path_blocks(node: Node) -> np.ndarray:
    """Device blocks of the pages from the root down to ``node``, in order."""
    runs = []
    while node.parent is not None:
        runs.append(node.blocks)
        node = node.parent
    return np.concatenate(runs[::-1]) if runs else np.zeros(0, BLOCK_DTYPE)


def _fail_if(bad: np.ndarray, problem: str) -> None:
    if bad.any():
        raise RuntimeError(f"block {int(np.flatnonzero(bad)[0])} {problem}")


def _count_path(node: Node, counts: dict[int, int]) -> None:
    while node.parent is not None:
        counts[id(node)] = counts.get(id(node), 0) + 1
        node = node.parent
