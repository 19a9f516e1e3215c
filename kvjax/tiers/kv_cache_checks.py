"""Invariant checks of ``KVCache`` (its docstring lists them), written down once.

O(size of the cache); raises RuntimeError naming the first broken invariant; changes nothing
(page keys computed for the check are cached on their nodes, as lookups cache them).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from kvjax.cache.trie_node import Tier

if TYPE_CHECKING:
    from kvjax.tiers.kv_cache import KVCache

__all__ = ["check_kv_cache"]

_HOST, _DISK = int(Tier.HOST), int(Tier.DISK)


def check_kv_cache(cache: KVCache) -> None:
    cache.prefix.check_invariants()
    cache.pool.check_invariants()
    if cache._index is None:
        return
    index, mover = cache._index, cache._mover
    cache.host_tier.check_invariants()
    if cache.disk_tier is not None:
        cache.disk_tier.check_invariants()
    if cache.trie.lossy_offload != cache.codec.lossy:
        raise RuntimeError(f"trie.lossy_offload={cache.trie.lossy_offload} but codec {cache.codec.name}")
    if not cache.codec.lossy and any(node.lossy is not None and node.lossy.any() for node in cache.trie.nodes()):
        raise RuntimeError(f"a page is marked lossy but codec {cache.codec.name} is lossless")
    host_pages, disk_pages = _check_page_tiers(cache)
    live = {key for key, entry in index.host_entries.items() if not entry.dropped}
    if host_pages != live:
        raise RuntimeError(f"{len(host_pages ^ live)} host entries and HOST bits disagree")
    undisked = {key for key in live if not _page_bits(index.host_entries[key]) & _DISK}
    if set(index.undisked) != undisked:
        raise RuntimeError(f"{len(set(index.undisked) ^ undisked)} host blocks are misfiled as with/without a disk copy")
    if disk_pages != set(index.disk_entries):
        raise RuntimeError(f"{len(disk_pages ^ set(index.disk_entries))} disk entries and DISK bits disagree")
    if index.host_used > index.host_capacity:
        raise RuntimeError(f"host holds {index.host_used} blocks; capacity {index.host_capacity}")
    ready = sum(entry.ready for entry in index.host_entries.values())
    if not ready <= len(cache.host_tier) <= index.host_used:  # pending copies may have landed
        raise RuntimeError(f"host tier holds {len(cache.host_tier)} blocks; the index knows "
                           f"{ready} ready of {index.host_used}")  # fmt: skip
    _check_transfers(cache)


def _page_bits(entry) -> int:
    node, index = entry.ref.resolve()
    return int(node.tiers[index])


def _check_page_tiers(cache: KVCache) -> tuple[set, set]:
    """Every HOST/DISK bit is backed by an index entry for that very page and, once ready,
    by the tier itself in the page's namespace. Returns (host keys, disk (ns, key)s) seen."""
    index, trie = cache._index, cache.trie
    disk_exact = not cache._mover.spills and not cache._mover.copies
    host_pages, disk_pages = set(), set()
    for node in trie.nodes():
        if node.tiers is None:
            continue
        digest = trie.namespace_of(node).digest()
        keys = trie.page_keys(node)
        for i, bits in enumerate(node.tiers.tolist()):
            where = f"page {node.first_page + i} ({keys[i].hex()[:8]})"
            if bits & _HOST:
                entry = index.host_state(keys[i])
                if entry is None or entry.ref.resolve() != (node, i):
                    raise RuntimeError(f"{where} has the HOST bit but no host entry of its own")
                if entry.ready and cache.host_tier.namespace_of(keys[i]) != digest:
                    raise RuntimeError(f"{where}: host holds it under another namespace (or not at all)")
                host_pages.add(keys[i])
            if bits & _DISK:
                ref = index.disk_entries.get((digest, keys[i]))
                if ref is None or ref.resolve() != (node, i):
                    raise RuntimeError(f"{where} has the DISK bit but no disk entry of its own")
                if disk_exact and not cache.disk_tier.contains(keys[i], digest):
                    raise RuntimeError(f"{where} has the DISK bit; the disk tier lost it")
                disk_pages.add((digest, keys[i]))
    return host_pages, disk_pages


def _check_transfers(cache: KVCache) -> None:
    """Holds on host blocks equal the transfers reading them; fetch targets are private."""
    index, mover, prefix = cache._index, cache._mover, cache.prefix
    holds = collections.Counter()
    for job in mover.live_jobs.values():
        holds.update(job.held)
    for keys in mover.spills.values():
        holds.update(keys)
    for key, entry in index.host_entries.items():
        if entry.busy != holds[key]:
            raise RuntimeError(f"host block {key.hex()[:8]} is read by {holds[key]} transfers "
                               f"but held {entry.busy} times")  # fmt: skip
        if entry.dropped and not (entry.busy or not entry.ready):
            raise RuntimeError(f"host block {key.hex()[:8]} left the trie but was not discarded")
    for waiter in mover.waiters.values():
        handle = waiter.handle
        if handle.alive and (handle._committed != waiter.first or prefix._handles.get(handle.seq_id) is not handle):
            raise RuntimeError(f"sequence {handle.seq_id} committed pages it is still fetching")
        if any(job.valid is None and id(job) not in mover.live_jobs for job, *_ in waiter.segments):
            raise RuntimeError(f"sequence {handle.seq_id} waits for a job that is gone")
