"""Invariant checks of the prefix trie and the prefix cache, written down once.

``PrefixTrie.check_invariants`` and ``PrefixCache.check_invariants`` delegate here. Each
check is O(size of the cache) and raises RuntimeError naming the first broken invariant; none
changes any state. The checks read the structures' private fields on purpose: they verify the
bookkeeping itself, not the public view of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvjax.cache.allocator import BLOCK_DTYPE
from kvjax.cache.prefix_trie import Node, PrefixTrie, Tier

if TYPE_CHECKING:
    from kvjax.cache.device_index import PrefixCache, SeqHandle

__all__ = ["check_cache", "check_trie"]


def check_trie(trie: PrefixTrie) -> np.ndarray:
    """Structure, counters and queue of ``trie``; returns every device block it indexes.

    Checks per node: linked under its first page, label length, page offsets, DEVICE bits vs
    block ids, no page without a copy, a lossy flag per page (every page off device lossy
    when the trie's lower-tier copies are), device-children count, device pages only below
    device pages, locked/pinned nodes still on device, locks and pins never above the parent's.
    Then: node count, ``num_evictable`` equal to the unlocked unpinned device pages, every
    evictable leaf findable in the eviction queue, no block backing two pages.
    """
    blocks, evictable, count = [], 0, 0
    for node in trie.nodes():
        count += 1
        _check_node(trie, node)
        evictable += len(node.blocks) if trie.is_candidate(node) else 0
        if node.on_device:
            blocks.append(node.blocks)
        if trie.is_evictable_leaf(node) and node.heap_version < 0:
            raise RuntimeError(f"evictable leaf at page {node.first_page} is not in the queue")
    if (count, evictable) != (trie.num_nodes, trie.num_evictable):
        raise RuntimeError(f"counted {count} nodes, {evictable} evictable pages; "
                           f"trie says {trie.num_nodes}, {trie.num_evictable}")  # fmt: skip
    device_blocks = np.concatenate(blocks) if blocks else np.zeros(0, BLOCK_DTYPE)
    if len(np.unique(device_blocks)) != len(device_blocks):
        raise RuntimeError("a device block backs two trie pages")
    return device_blocks


def check_cache(cache: PrefixCache) -> None:
    """Allocator, trie and live sequences of ``cache`` agree (see PrefixCache.check_invariants)."""
    cache.allocator.check_invariants()
    trie_blocks = check_trie(cache.trie)
    size = cache.allocator.num_blocks
    free = np.zeros(size, bool)
    free[cache.allocator.free_queue()] = True
    in_trie = np.zeros(size, bool)
    in_trie[trie_blocks] = True
    _fail_if(free & in_trie, "is free but still indexed by the trie")
    expected = np.zeros(size, np.int64)
    locks: dict[int, int] = {}
    for handle in cache._handles.values():
        np.add.at(expected, _check_handle(cache, handle, in_trie), 1)
        _count_path(handle._tail, locks)
    refcounts = cache.allocator.refcounts()
    _fail_if(refcounts != expected, "has a refcount unequal to the live sequences holding it")
    _fail_if((refcounts == 0) & ~free & ~in_trie, "is unreferenced, uncached and not free (leaked)")
    pins: dict[int, int] = {}
    for nodes in cache._pins.values():
        for node in nodes:
            _count_path(node, pins)
    for node in cache.trie.nodes():
        if (node.lock, node.hard_pins) != (locks.get(id(node), 0), pins.get(id(node), 0)):
            raise RuntimeError(f"node at page {node.first_page} has lock={node.lock}, "
                               f"hard_pins={node.hard_pins}; handles and pins say "
                               f"{locks.get(id(node), 0)}, {pins.get(id(node), 0)}")  # fmt: skip


# --- helpers -------------------------------------------------------------------------------


def _check_node(trie: PrefixTrie, node: Node) -> None:
    parent = node.parent
    where = f"node at page {node.first_page}"
    if parent.children.get(node.key) is not node or node.key != bytes(node.label[: trie.page_bytes]):
        raise RuntimeError(f"{where} is not linked under its first page")
    if len(node.blocks) == 0 or len(node.label) != len(node.blocks) * trie.page_bytes:
        raise RuntimeError(f"{where} has {len(node.blocks)} blocks for {len(node.label)} label bytes")
    if node.first_page != parent.first_page + len(parent.blocks):
        raise RuntimeError(f"{where} follows a parent ending at page {parent.first_page + len(parent.blocks)}")
    tiers = node.page_tiers()
    on_device = (tiers & Tier.DEVICE) != 0
    if not (on_device == node.on_device).all() or not ((node.blocks >= 0) == node.on_device).all():
        raise RuntimeError(f"{where}: blocks and DEVICE bits disagree with {node.on_device=}")
    if not node.on_device and (tiers == 0).any():
        raise RuntimeError(f"{where} keeps a page with no copy in any tier")
    if node.lossy is not None and (node.lossy.dtype != bool or len(node.lossy) != len(node.blocks)):
        raise RuntimeError(f"{where} has {len(node.lossy)} lossy flags for {len(node.blocks)} pages")
    if trie.lossy_offload and not node.on_device and not node.page_lossy().all():
        raise RuntimeError(f"{where} is off device, where every copy is lossy, but a page is marked exact")
    if node.num_device_children != sum(c.on_device for c in node.children.values()):
        raise RuntimeError(f"{where} miscounts its device children")
    if node.on_device and not parent.on_device:
        raise RuntimeError(f"{where} is on device below an off-device parent")
    if (node.lock or node.hard_pins or node.soft_pinned) and not node.on_device:
        raise RuntimeError(f"{where} is locked or pinned but was evicted from device")
    if parent.parent is not None and (
        node.lock > parent.lock or node.hard_pins > parent.hard_pins
        or node.soft_pinned > parent.soft_pinned or node.soft_until > parent.soft_until
    ):  # fmt: skip
        raise RuntimeError(f"{where} is locked or pinned more than its parent")


def _check_handle(cache: PrefixCache, handle: SeqHandle, in_trie: np.ndarray) -> np.ndarray:
    """Consistency of one live handle; returns every block it holds."""
    held = _path_blocks(handle._tail)
    private = cache._private_blocks(handle)
    table = handle.block_ids
    if len(table) != -(-handle.num_tokens // cache.page_size) or len(np.unique(table)) != len(table):
        raise RuntimeError(f"sequence {handle.seq_id} has {len(table)} blocks for {handle.num_tokens} tokens")
    mapped = np.concatenate([table[: handle._committed]] + handle._dup_trie)
    expected = np.setdiff1d(mapped, np.concatenate([np.zeros(0, BLOCK_DTYPE)] + handle._dup_own))
    if not np.array_equal(np.sort(held), expected) or in_trie[private].any():
        raise RuntimeError(f"sequence {handle.seq_id} disagrees with the trie about its committed pages")
    return np.concatenate((held, private))


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
