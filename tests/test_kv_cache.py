"""KVCache: the pool, the trie and the tiers as one cache (targeted scenarios).

Round trips through every tier for every pool dtype, the write policies, the cost model's
choice, prefetch, failures (an injected failed fetch, a corrupt disk block), a warm restart
from the disk directory, bad input; and the scheduler's own scenarios run on a KVCache.
"""

import gc
import glob
import os
import weakref

import numpy as np
import pytest
from kv_cache_cases import (
    ManualTransfer,
    MemoryDisk,
    page_content,
    serve_from_each_tier,
)
from scheduler_cases import Clock
from tier_cases import DTYPES, random_blocks, same_bits

from kvjax.cache.cost_model import CostModel
from kvjax.cache.trie_node import Tier
from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig
from kvjax.tiers.page_pool import PoolConfig
from kvjax.tiers.transfer import Link, Priority

POOL = PoolConfig(num_blocks=8, num_layers=1, num_kv_heads=1, page_size=4, head_dim=8, dtype="float32")
ALWAYS_FETCH = CostModel(recompute_seconds_per_token=1.0)
NEVER_FETCH = CostModel(fetch_latency_seconds=1.0)
TIMEOUT = 30.0


def prompt(n, start=0):
    return np.arange(start, start + n, dtype=np.int32)


def make(pool=POOL, *, host_blocks=8, disk_dir=None, cost=ALWAYS_FETCH, **kwargs):
    config_keys = {"write_policy", "selective_min_hits", "vocab_size", "high_watermark", "low_watermark", "policy",
                   "model_id"}
    config = KVCacheConfig(pool=pool, host_bytes=host_blocks * pool.bytes_per_block, cost_model=cost,
                           disk_dir=None if disk_dir is None else str(disk_dir),
                           disk_bytes=0 if disk_dir is None else 1 << 26,
                           **{k: v for k, v in kwargs.items() if k in config_keys})  # fmt: skip
    return KVCache(config, **{k: v for k, v in kwargs.items() if k not in config_keys})


def compute(cache, tokens, namespace=None, blocks=None, *, release=True):
    """Admit ``tokens``, wait for fetches, write ``blocks`` (the model's KV, one per page) into
    the pages that did not hit, commit; returns the handle."""
    handle = cache.admit(tokens, namespace)
    assert handle is not None and cache.wait_ready(handle, TIMEOUT)
    first = handle.num_hit_tokens // cache.page_size
    if blocks is not None and first < len(handle.block_ids):
        cache.pool.scatter(handle.block_ids[first:], blocks[first : len(handle.block_ids)])
    cache.commit(handle, tokens)
    if release:
        cache.release(handle)
    return handle


def hit_pages(cache, tokens, namespace=None):
    """(hit pages, their KV) of a fresh admission; the handle is released."""
    num_hit, kv, _ = hit_pages_and_tiers(cache, tokens, namespace)
    return num_hit, kv


def hit_pages_and_tiers(cache, tokens, namespace=None):
    """(hit pages, their KV, hit tokens by tier) of a fresh admission; the handle is released."""
    handle = cache.admit(tokens, namespace)
    assert cache.wait_ready(handle, TIMEOUT)
    num_hit = handle.num_hit_tokens // cache.page_size
    kv = np.asarray(cache.pool.gather(handle.block_ids[:num_hit])) if num_hit else None
    tiers = cache.admission_report(handle).hit_tokens
    cache.release(handle)
    return num_hit, kv, tiers


# --- tiers: round trips, write policies, restart ----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_device_host_disk_device_is_bit_exact(tmp_path, dtype):
    pool = PoolConfig(num_blocks=8, num_layers=2, num_kv_heads=1, page_size=4, head_dim=8, dtype=dtype)
    tokens = prompt(9)  # two full pages and one token: the last page is always computed
    blocks = random_blocks(3, pool.block_shape, dtype, seed=1)  # NaN and inf patterns included
    with make(pool, disk_dir=tmp_path) as cache:
        compute(cache, tokens, blocks=blocks)
        served = serve_from_each_tier(cache, tokens, hit_pages_and_tiers, timeout=TIMEOUT)
    for tier, (num_hit, kv, by_tier) in served.items():
        assert num_hit == 2 and same_bits(kv, blocks[:2]), tier
        assert by_tier == {"device": 0, "host": 0, "disk": 0} | {tier: 8}, tier


def test_hit_tokens_by_tier_names_where_each_hit_page_came_from():
    tokens = prompt(13)
    with make() as cache:
        compute(cache, tokens[:9], blocks=random_blocks(3, POOL.block_shape))  # pages 0, 1
        cache.evict(8)  # ... now on host
        compute(cache, tokens[:5], blocks=random_blocks(2, POOL.block_shape))  # page 0 on device again
        handle = cache.admit(tokens)
        assert cache.wait_ready(handle, TIMEOUT)
        assert cache.admission_report(handle).hit_tokens == {"device": 4, "host": 4, "disk": 0}


def test_warm_restart_serves_what_the_last_process_spilled(tmp_path):
    blocks = random_blocks(4, POOL.block_shape, seed=2)
    tokens = prompt(13)
    with make(disk_dir=tmp_path, write_policy="write_through") as cache:
        compute(cache, tokens, blocks=blocks)
        assert cache.flush(TIMEOUT)
    with make(disk_dir=tmp_path) as reopened:
        assert reopened.match(tokens).tiers.tolist() == [Tier.DISK] * 3  # found by key
        num_hit, kv = hit_pages(reopened, tokens)
        assert num_hit == 3 and same_bits(kv, blocks[:3])
        assert reopened.match(tokens, "someone-else").num_hit_blocks == 0
        reopened.check_invariants()


@pytest.mark.parametrize("policy, copies_after_commit, copies_after_two_hits",
                         [("write_through", 2, 2), ("write_back", 0, 0), ("selective", 0, 2)])  # fmt: skip
def test_write_policies_decide_when_pages_get_host_copies(policy, copies_after_commit, copies_after_two_hits):
    tokens = prompt(9)
    with make(write_policy=policy, selective_min_hits=2) as cache:
        compute(cache, tokens, blocks=random_blocks(3, POOL.block_shape))
        assert cache.flush(TIMEOUT)
        assert cache.stats.host_blocks == copies_after_commit
        hit_pages(cache, tokens)
        assert cache.flush(TIMEOUT) and cache.stats.host_blocks == copies_after_commit
        hit_pages(cache, tokens)  # the second hit makes the pages hot
        assert cache.flush(TIMEOUT) and cache.stats.host_blocks == copies_after_two_hits
        assert cache.match(tokens).num_device_blocks == 2  # copies never move the device pages
        cache.evict(8)  # write_back copies now; the others keep what they have or drop
        expected = {"write_back": [Tier.HOST] * 2}.get(policy, [Tier.HOST] * copies_after_two_hits)
        assert cache.match(tokens).tiers.tolist() == expected
        cache.check_invariants()


def test_selective_copies_only_pages_hit_often_enough_not_pages_added_below_a_hit():
    blocks = random_blocks(6, POOL.block_shape, seed=5)
    with make(write_policy="selective", selective_min_hits=2) as cache:
        compute(cache, prompt(9), blocks=blocks)  # pages 0, 1
        compute(cache, prompt(17), blocks=blocks)  # hits 0, 1 (once); adds pages 2, 3 below them
        hit_pages(cache, prompt(21))  # hits 0-3: pages 0, 1 a second time, pages 2, 3 a first
        assert cache.flush(TIMEOUT)
        assert cache.match(prompt(21)).tiers.tolist() == [Tier.DEVICE | Tier.HOST] * 2 + [Tier.DEVICE] * 2
        assert cache.stats.host_blocks == 2
        cache.check_invariants()


def _fetched_chain_with_two_leaves(cache):
    """Pages 1-2 are evicted to host and fetched back (their host copies stay: 2 of the host's
    4 slots), then grown into 1-2-3-4 and 1-2-3-4' (3, 4 and 4' on device only). Returns the
    two sequences."""
    longer, other = prompt(17), np.concatenate([prompt(12), prompt(5, start=50)])
    compute(cache, prompt(9))
    cache.evict(8)
    assert cache.flush(TIMEOUT) and cache.stats.host_blocks == 2
    compute(cache, longer)
    compute(cache, other)
    assert cache.match(longer).tiers.tolist() == [Tier.DEVICE | Tier.HOST] * 2 + [Tier.DEVICE] * 2
    return longer, other


def test_write_back_counts_no_host_copy_the_same_eviction_keeps_as_room():
    """Evicting all five pages copies 3, 4 and 4' (1 and 2 have copies) into a host with two
    free slots. Its budget counted the copies of 1 and 2 as room (they may be evicted in
    general), but the write-back keeps them (1 and 2 are only on host now), so it kept three
    pages and the copies had room for two, given to the leaves, evicted first: 3 had none and
    left the trie with both leaves, two slots stayed free. Counted without those copies, the
    budget is two, and it goes to 3 and one leaf (a leaf is found only through 3)."""
    with make(host_blocks=4, write_policy="write_back") as cache:
        longer, other = _fetched_chain_with_two_leaves(cache)
        dropped = cache.trie.dropped_pages
        cache.evict(8)
        assert cache.flush(TIMEOUT)
        assert cache.trie.dropped_pages - dropped == 1  # one leaf, not 3 and both leaves
        assert cache.stats.host_blocks == 4  # every slot used
        assert cache.match(prompt(13)).tiers.tolist() == [Tier.HOST] * 3  # 1-2-3 all kept
        assert sorted([cache.match(longer).num_hit_blocks, cache.match(other).num_hit_blocks]) == [3, 4]
        cache.check_invariants()


def test_a_write_back_eviction_keeps_only_the_pages_the_host_has_room_to_copy():
    """``Eviction.kept`` is what write-back copies, each before its block is reused: the budget
    is counted once the victims are known, without the host copies they already had (with
    them, the eviction above kept three pages, and write-back, with room for two, cut one)."""
    with make(host_blocks=4, write_policy="write_back") as cache:
        _fetched_chain_with_two_leaves(cache)
        eviction = cache._reclaim(8)  # what evict does: the eviction, then its copies
        assert len(eviction.blocks) == 5 and len(eviction.kept) == 2
        cache._write_back(eviction)
        cache._forget_dropped()
        assert cache.flush(TIMEOUT) and cache.stats.host_blocks == 4
        assert all(cache.trie.locate(key) is not None for key, _ in eviction.kept)  # each one copied
        cache.check_invariants()


def test_write_back_short_of_room_lets_the_deepest_pages_go():
    """An admission fetching a1-a2 from host evicts b2-b3 and b2-b3' of another prompt (b1
    stays on device) into a host with one free slot. Its budget counts the host slots of a1
    and a2, which write-back takes over once the fetch has read them; but a spill to disk
    reads them too, so write-back may not: room for one of the three pages kept. It must go
    to b2: in eviction order the leaves come first, and b2, cut, took the copied leaf along
    (a slot spent on an unreachable page, and nothing kept)."""
    disk = MemoryDisk(POOL.block_shape, POOL.dtype, 8)
    with make(host_blocks=3, write_policy="write_back", disk_tier=disk, transfer_factory=ManualTransfer,
              high_watermark=0.5, low_watermark=0.0) as cache:  # fmt: skip
        compute(cache, prompt(9))
        cache.evict(8)
        _complete_offloads(cache.transfer)
        cache.poll()  # a1-a2 on host (2 of 3 slots), their spill to disk starts and stays in flight
        chain, branch = prompt(13, start=100), np.concatenate([prompt(8, start=100), prompt(5, start=200)])
        compute(cache, chain)
        compute(cache, branch)  # b1-b2-b3 and b1-b2-b3' on device: 4 of 8 blocks
        handle = cache.admit(np.concatenate([prompt(8), prompt(19, start=300)]))  # 7 blocks: evicts 3
        assert handle is not None and handle.num_hit_tokens == 8
        assert cache.match(chain).tiers.tolist() == [Tier.DEVICE, Tier.HOST]  # b2 kept, on host
        assert cache.match(branch).tiers.tolist() == [Tier.DEVICE, Tier.HOST]
        cache.transfer.complete_all()
        assert cache.wait_ready(handle, TIMEOUT)
        cache.release(handle)
        cache.check_invariants()


def test_without_lower_tiers_eviction_drops_pages():
    with KVCache(KVCacheConfig(pool=POOL)) as cache:
        tokens = prompt(9)
        compute(cache, tokens, blocks=random_blocks(3, POOL.block_shape))
        assert cache.match(tokens).num_hit_blocks == 2
        assert len(cache.evict(8)) == 2 and cache.match(tokens).num_hit_blocks == 0
        assert cache.evict_host(4) == 0 and cache.flush() and cache.is_ready(cache.admit(tokens))


def _complete_offloads(transfer):
    """Finish the pending device -> host copies; spills stay pending (a writer behind)."""
    for index in reversed(range(len(transfer.pending))):
        if transfer.pending[index].link.value == "device_to_host":
            transfer.complete(index)


@pytest.mark.parametrize("disk", ["keeps up", "none", "refuses"])
def test_host_evictions_lose_only_what_no_lower_tier_takes(disk):
    """30 sequences of 3 pages stream through a 6-block host tier while the background spill
    never finishes. With a disk tier every page leaves host only once on disk (written on the
    spot, as back-pressure): all stay findable and none counts as lost. Without one, or with a
    disk that stores nothing, ``lost_host_blocks`` counts exactly the pages no tier holds."""
    disk_tier = {"keeps up": MemoryDisk(POOL.block_shape, POOL.dtype, 1000), "none": None,
                 "refuses": MemoryDisk(POOL.block_shape, POOL.dtype, 0)}[disk]  # fmt: skip
    sequences = [prompt(13, start=100 * i) for i in range(30)]
    with make(host_blocks=6, disk_tier=disk_tier, transfer_factory=ManualTransfer) as cache:
        for tokens in sequences:
            compute(cache, tokens)
            cache.evict(8)  # write-back: the pages' host copies are made now
            _complete_offloads(cache.transfer)
            cache.poll()  # may start a background spill, which never finishes here
            cache.check_invariants()
        findable = sum(cache.match(tokens).num_hit_blocks for tokens in sequences)
        stats = cache.stats
        assert stats.offloaded_blocks == 3 * len(sequences)
        assert stats.lost_host_blocks == 3 * len(sequences) - findable
        if disk == "keeps up":
            assert findable == 3 * len(sequences) and stats.pressure_spilled_blocks > 60
            assert len(disk_tier) + len(cache.tiers.undisked) == findable  # on disk, or still on host
        else:
            assert findable <= 6 and stats.pressure_spilled_blocks == 0


def _write_back_over_a_memory_disk(disk_blocks, *, host_blocks=2, high_watermark=1.0, low_watermark=1.0):
    """(clock, disk, cache): write-back, LRU, over a ``MemoryDisk`` of ``disk_blocks``;
    transfers run when the test completes them (at the watermarks 1.0, no background spill)."""
    clock = Clock()
    disk = MemoryDisk(POOL.block_shape, POOL.dtype, disk_blocks)
    cache = make(host_blocks=host_blocks, write_policy="write_back", policy="lru", disk_tier=disk, clock=clock,
                 transfer_factory=ManualTransfer, high_watermark=high_watermark, low_watermark=low_watermark)
    return clock, disk, cache


def _cache_over_a_two_block_disk(tmp_path, clock):
    """A write-back cache over a real disk tier with room for two one-block segments; LRU on
    device and host, no background spill (transfers run when ``_settle`` completes them)."""
    one_block = DiskTier(str(tmp_path / "probe"), POOL.block_shape, POOL.dtype, 1 << 24,
                         segment_bytes=POOL.bytes_per_block, use_ocdbt=False)  # fmt: skip
    one_block.put([b"k" * 16], random_blocks(1, POOL.block_shape), b"n" * 16, [b"p" * 16])
    segment_bytes = one_block.bytes_used
    one_block.close()
    disk = DiskTier(str(tmp_path / "disk"), POOL.block_shape, POOL.dtype, 5 * segment_bytes // 2,
                    segment_bytes=POOL.bytes_per_block, use_ocdbt=False)  # fmt: skip
    return make(host_blocks=4, write_policy="write_back", policy="lru", disk_tier=disk, clock=clock,
                transfer_factory=ManualTransfer, high_watermark=1.0, low_watermark=1.0)  # fmt: skip


def _settle(cache):
    while cache.transfer.pending:
        cache.transfer.complete_all()
        cache.poll()


def _serve(cache, clock, tokens):
    """Serve ``tokens``, fetching its cached prefix; its pages stay on device."""
    clock.now += 1.0
    handle = cache.admit(tokens)
    _settle(cache)
    cache.commit(handle, tokens)
    cache.release(handle)


def _serve_and_evict(cache, clock, tokens, *, spill=False):
    """Serve ``tokens``, then evict it (write-back copies the pages without a copy to host);
    ``spill``: then copy every host page without a disk copy to disk."""
    _serve(cache, clock, tokens)
    clock.now += 1.0
    cache.evict(8)
    _settle(cache)
    if spill:
        cache._mover.spill_host(everything=True)
        _settle(cache)


def test_a_full_disk_evicts_a_page_nothing_depends_on_not_the_prefix_of_the_page_it_writes(tmp_path):
    """a is on disk only; write-back gave b (after a) a host copy; e, another prompt's page, is
    on disk too, written after a. Host room for i sends b to disk (back-pressure), into a full
    disk. It evicted its least recently used segment, a's: a left the trie and took b along
    (its new disk copy unreachable, its host copy dropped), two pages lost for the one block
    evicted, while e, which nothing depends on, stayed. A page is found only through its
    prefix: the disk now evicts e (b's parent counts b as a dependent while it is written)."""
    clock = Clock()
    with _cache_over_a_two_block_disk(tmp_path, clock) as cache:
        _serve_and_evict(cache, clock, prompt(5), spill=True)  # a: host and disk
        _serve_and_evict(cache, clock, prompt(5, start=100), spill=True)  # e: host and disk; the disk is full
        _serve_and_evict(cache, clock, prompt(9))  # a from host (its disk segment unread); b: host
        _serve_and_evict(cache, clock, prompt(13, start=200))  # f-g-h: host, in the slots of a's and e's copies
        # i: its host room sends b, the oldest, to disk
        _only_e_leaves_when_serving(cache, clock, prompt(5, start=300))
        assert cache.match(prompt(9)).tiers.tolist() == [Tier.DISK, Tier.DISK]


def _only_e_leaves_when_serving(cache, clock, tokens):
    """With a-b on disk and host (a on disk only) and e on disk only, serving ``tokens`` makes
    host room that spills one page into the full disk: the disk evicts e's block, and only e
    leaves the trie (before the fix: a, and b with it)."""
    disk = cache.disk_tier
    assert cache.match(prompt(9)).tiers.tolist() == [Tier.DISK, Tier.HOST]
    assert cache.match(prompt(5, start=100)).tiers.tolist() == [Tier.DISK]
    dropped, evicted = cache.trie.dropped_pages, disk.stats().evicted_blocks
    _serve_and_evict(cache, clock, tokens)
    assert disk.stats().evicted_blocks - evicted == 1
    assert cache.trie.dropped_pages - dropped == 1
    assert cache.match(prompt(5, start=100)).num_hit_blocks == 0
    cache.check_invariants()


def test_room_for_a_spill_never_takes_the_disk_copy_of_a_host_page_that_room_evicts():
    """r is on host and disk (its disk block the oldest), z on disk only, x on host only; the
    host is full. Write-back copies of y1-y2 need both host slots: r's copy goes (it is on
    disk) and x's too, written to disk first (back-pressure). The disk, full, made room by
    evicting its oldest block, r's: r was then on host only, and the room evicted that copy
    too, never written anywhere: r was lost (``lost_host_blocks``), though the disk had z to
    give up. A host copy the room evicts keeps its disk copy while the spill makes room."""
    clock, disk, cache = _write_back_over_a_memory_disk(2)
    with cache:
        r, z, x, y = prompt(5), prompt(5, start=100), prompt(5, start=200), prompt(9, start=300)
        _serve_and_evict(cache, clock, r, spill=True)  # r: host and disk
        _serve_and_evict(cache, clock, z, spill=True)  # z: host and disk; the disk is full
        _serve(cache, clock, r)  # r fetched from host (its disk block unread): used after z
        assert cache.evict_host(1) == 1  # z's copy, the older
        clock.now += 1.0
        cache.evict(8)  # r: host and disk
        _serve_and_evict(cache, clock, x)  # x: host only; the host is full
        assert [cache.match(t).tiers.tolist() for t in (r, z, x)] == [[Tier.HOST | Tier.DISK], [Tier.DISK],
                                                                      [Tier.HOST]]  # fmt: skip
        _serve_and_evict(cache, clock, y)  # y1-y2 take both host slots
        assert cache.stats.lost_host_blocks == 0
        assert [cache.match(t).tiers.tolist() for t in (r, z, x, y)] == [[Tier.DISK], [], [Tier.DISK],
                                                                         [Tier.HOST] * 2]  # fmt: skip
        cache.check_invariants()


def test_host_room_writes_a_victim_whose_disk_copy_a_background_spill_took_before_its_bit_cleared():
    """r is on host and disk, z on disk only (its disk block the more recently used), x on
    host only; the host is full. A background spill of x, finished before the next poll,
    makes room on the full disk by evicting r's block, and r's DISK bit stays until that
    poll. Write-back room for y then took r's host copy as one on disk too, wrote nothing,
    and r left the trie at the poll. The disk's word is asked (a victim whose disk copy
    cannot be locked is written first)."""
    clock, disk, cache = _write_back_over_a_memory_disk(2)
    with cache:
        r, z, x, y = prompt(5), prompt(5, start=100), prompt(5, start=200), prompt(5, start=300)
        _serve_and_evict(cache, clock, z, spill=True)  # z: host and disk
        _serve_and_evict(cache, clock, r, spill=True)  # r: host and disk; the disk is full
        assert cache.evict_host(1) == 1  # z's copy, the older
        z_block = disk.held_blocks()[0]
        assert disk.get([z_block[1]], z_block[0]).hits.all()  # r's disk block is the least recently used
        _serve_and_evict(cache, clock, x)  # x: host only; the host is full
        _serve(cache, clock, y)  # y on device
        cache._mover.spill_host(everything=True)
        cache.transfer.complete(0)  # x written, r's block evicted; no poll yet
        clock.now += 1.0
        cache.evict(8)  # y's write-back copy needs r's slot
        _settle(cache)
        # r is written (before the fix it left the trie); z, the disk's least recently used
        # block then, made the room: a drop by the disk's policy
        assert [cache.match(t).tiers.tolist() for t in (r, y, z)] == [[Tier.DISK], [Tier.HOST], []]
        cache.check_invariants()


def test_an_idle_cache_over_a_full_disk_stops_spilling():
    """Six one-page prompts through a host of four blocks (spill above two, down to one) over a
    disk of three. Once the transfers settle and nothing is served, polls must stop writing.
    (A disk that evicted first the blocks whose page had a host copy made each background
    spill into the full disk evict one, whose page then lacked a disk copy again: the next
    poll wrote it back, evicting another, one block per poll, forever.)"""
    clock, disk, cache = _write_back_over_a_memory_disk(3, host_blocks=4, high_watermark=0.5, low_watermark=0.25)
    with cache:
        for i in range(6):
            tokens = prompt(5, start=100 * i)
            clock.now += 1.0
            handle = cache.admit(tokens)
            cache.transfer.complete_all()
            cache.poll()
            cache.commit(handle, tokens)
            cache.release(handle)
            clock.now += 1.0
            cache.evict(8)
            for _ in range(3):
                cache.transfer.complete_all()
                cache.poll()
        evicted = disk.stats().evicted_blocks
        for _ in range(5):
            cache.transfer.complete_all()
            cache.poll()
        assert disk.stats().evicted_blocks == evicted and not cache.transfer.pending


def test_a_full_disk_keeps_the_last_copy_of_a_prefix_whose_next_page_is_on_host(tmp_path):
    """a and e are on disk only, a's segment the least recently used; b (after a) has a host
    copy, f (another prompt) too, older. Host room for i sends f to disk (back-pressure), into
    a full disk. It evicted a's segment, as if a were a leaf: a left the trie and took b, which
    had just been given its host copy, along: two pages lost for the one block evicted. The
    disk counts b's host copy as a dependent of a (``DiskTier.add_dependents``), and evicts e."""
    clock = Clock()
    with _cache_over_a_two_block_disk(tmp_path, clock) as cache:
        _serve_and_evict(cache, clock, prompt(5), spill=True)  # a: host and disk
        _serve_and_evict(cache, clock, prompt(5, start=100), spill=True)  # e: host and disk; the disk is full
        assert cache.evict_host(8) == 2  # a and e: disk only
        _serve_and_evict(cache, clock, prompt(5, start=200))  # f: host
        _serve_and_evict(cache, clock, prompt(9))  # a read from disk (keeps a host copy); b: host
        _serve_and_evict(cache, clock, prompt(5, start=100))  # e read from disk, after a
        assert cache.evict_host(2) == 2  # the copies of a and e (on disk too)
        # i: its host room sends f, the oldest, to disk
        _only_e_leaves_when_serving(cache, clock, prompt(13, start=300))
        assert cache.match(prompt(9)).tiers.tolist() == [Tier.DISK, Tier.HOST]
        assert cache.match(prompt(5, start=200)).tiers.tolist() == [Tier.DISK]


def test_a_full_disk_keeps_the_prefix_of_the_pages_write_back_is_copying(tmp_path):
    """a-b leaves the device: a stays on disk only, b gets a host copy from write-back. The host
    is full of f-g-h-j, so its room sends j to disk (back-pressure), into a full disk whose
    least recently used segment is a's. b's copy is not made yet (its HOST bit is write-back's
    promise), so only the promise can tell the disk that b depends on a: without it the disk
    evicted a, and a and b left the trie. It evicts e (on device too: nothing is lost)."""
    clock = Clock()
    with _cache_over_a_two_block_disk(tmp_path, clock) as cache:
        disk = cache.disk_tier
        _serve_and_evict(cache, clock, prompt(5), spill=True)  # a: host and disk
        _serve_and_evict(cache, clock, prompt(5, start=100), spill=True)  # e: host and disk; the disk is full
        assert cache.evict_host(8) == 2
        _serve(cache, clock, prompt(9))  # a read from disk; b computed
        _serve(cache, clock, prompt(5, start=100))  # e read from disk, after a
        assert cache.evict_host(2) == 2  # the copies those reads left on host
        cache.pin(prompt(9))
        cache.pin(prompt(5, start=100))
        _serve_and_evict(cache, clock, prompt(17, start=200))  # f-g-h-j: host, which is full
        cache.unpin(prompt(9))
        cache.unpin(prompt(5, start=100))
        assert cache.match(prompt(9)).tiers.tolist() == [Tier.DEVICE | Tier.DISK, Tier.DEVICE]
        dropped, evicted = cache.trie.dropped_pages, disk.stats().evicted_blocks
        clock.now += 1.0
        assert len(cache.evict(2)) == 2  # a-b, the least recently used
        _settle(cache)
        assert disk.stats().evicted_blocks - evicted == 1
        assert cache.trie.dropped_pages == dropped  # before the fix: a and b
        assert cache.match(prompt(9)).tiers.tolist() == [Tier.DISK, Tier.HOST]
        assert cache.match(prompt(5, start=100)).tiers.tolist() == [Tier.DEVICE]
        cache.check_invariants()


def test_host_room_leaves_the_disk_copy_of_a_page_on_device_free_for_a_spill():
    """a-b-c leaves the device: a stays on disk only, b and c get host copies from write-back.
    The host is full of r (on device too, pinned, and on disk) and x (on host only), so its
    room evicts both copies, sending x to disk first (back-pressure), into a full disk of a's
    and r's blocks. It locked r's disk block, as that of a victim whose page keeps it, though
    r stays on device: the disk could only evict a, the prefix of the pages being copied, and
    a, b and c left the trie (the two slots made for them stayed free). r's block goes now."""
    clock, disk, cache = _write_back_over_a_memory_disk(2)
    with cache:
        abc, r, x = prompt(13), prompt(5, start=100), prompt(5, start=200)
        _serve_and_evict(cache, clock, prompt(5), spill=True)  # a: host and disk
        assert cache.evict_host(1) == 1  # a: disk only
        _serve(cache, clock, abc)  # a read from disk; b and c computed
        assert cache.evict_host(1) == 1  # the copy that read left on host
        cache.pin(abc)
        _serve_and_evict(cache, clock, r, spill=True)  # r: host and disk; the disk is full
        _serve(cache, clock, r)  # r back on device, its host copy kept
        cache.pin(r)
        _serve_and_evict(cache, clock, x)  # x: host only; the host is full
        cache.unpin(abc)
        assert cache.match(abc).tiers.tolist() == [Tier.DEVICE | Tier.DISK, Tier.DEVICE, Tier.DEVICE]
        assert cache.match(r).tiers.tolist() == [Tier.DEVICE | Tier.HOST | Tier.DISK]
        assert cache.match(x).tiers.tolist() == [Tier.HOST]
        dropped = cache.trie.dropped_pages
        clock.now += 1.0
        assert len(cache.evict(3)) == 3  # a-b-c
        _settle(cache)
        assert cache.trie.dropped_pages == dropped  # before the fix: a, b and c
        assert cache.stats.lost_host_blocks == 0
        assert [cache.match(t).tiers.tolist() for t in (abc, r, x)] == [[Tier.DISK, Tier.HOST, Tier.HOST],
                                                                        [Tier.DEVICE], [Tier.DISK]]  # fmt: skip
        cache.check_invariants()


# --- fetch or recompute ----------------------------------------------------------------------


def test_a_finished_fetch_frees_its_blocks_without_the_garbage_collector():
    # a fetch job kept its transfers' futures (their results: the fetched blocks, device memory
    # on an accelerator) past the scatter, in a cycle with its waiters: freed only by the collector
    tokens = prompt(9)
    with make() as cache:
        compute(cache, tokens, blocks=random_blocks(3, POOL.block_shape))
        cache.evict(8)
        fetches, fetch = [], cache.transfer.fetch
        cache.transfer.fetch = lambda *args, **kwargs: fetches.append(fetch(*args, **kwargs)) or fetches[-1]
        gc.collect()
        gc.disable()
        try:
            handle = compute(cache, tokens)
            assert handle.num_hit_tokens == 8 and len(fetches) == 1
            cache.poll()
            result = weakref.ref(fetches.pop())
            assert result() is None
        finally:
            gc.enable()


def test_cost_model_chooses_recompute_for_cheap_prefixes():
    with make(cost=NEVER_FETCH) as cache:
        tokens = prompt(9)
        compute(cache, tokens, blocks=random_blocks(3, POOL.block_shape))
        cache.evict(8)
        handle = cache.admit(tokens)
        assert cache.is_ready(handle) and handle.num_hit_tokens == 0
        assert cache.stats.recompute_chosen_blocks == 2 and cache.stats.fetched_host_blocks == 0


def test_cost_model_fetches_the_prefix_that_saves_most():
    model = CostModel(recompute_seconds_per_token=1e-3, recompute_seconds_per_token_position=0.0, fetch_latency_seconds=5e-3,
                           host_bytes_per_second=1e9, disk_latency_seconds=1.0)  # fmt: skip
    host_only = np.zeros(4, bool)
    assert model.pages_to_fetch(0, 4, host_only, 4096) == 4  # 16 ms of recompute vs ~5 ms
    assert model.pages_to_fetch(0, 1, host_only[:3], 4096) == 0  # 3 ms of recompute vs ~5 ms
    # a disk page costs a second: fetch only the host pages before it
    assert model.pages_to_fetch(0, 4, np.array([False, False, True, True]), 4096) == 2
    assert model.break_even_tokens(1, 4096) == 6  # smallest k with k ms > 5 ms + k * 4 us
    assert model.break_even_tokens(1, 4096, from_disk=True, max_pages=100) is None


def test_failed_fetch_turns_into_recompute_not_an_error():
    with make(transfer_factory=ManualTransfer) as cache:
        tokens = prompt(9)
        blocks = random_blocks(3, POOL.block_shape, seed=3)
        handle = cache.admit(tokens)
        cache.pool.scatter(handle.block_ids, blocks)
        cache.commit(handle, tokens)
        cache.release(handle)
        cache.evict(8)
        cache.transfer.complete_all()  # the write-back copies
        cache.poll()
        waiting = cache.admit(tokens)
        assert waiting.num_hit_tokens == 8 and not cache.is_ready(waiting)
        with pytest.raises(ValueError, match="waiting for fetches; call wait_ready"):
            cache.commit(waiting, tokens)
        assert not cache.wait_ready(waiting, timeout=0.01)  # nothing completes it
        cache.transfer.complete(0, ok=False)
        assert cache.wait_ready(waiting, timeout=0)
        assert waiting.num_hit_tokens == 0 and cache.stats.fetch_failures == 1
        assert cache.admission_report(waiting).hit_tokens == {"device": 0, "host": 0, "disk": 0}
        cache.pool.scatter(waiting.block_ids, blocks)  # recomputed
        assert cache.commit(waiting, tokens) == 2
        cache.check_invariants()


def test_corrupt_disk_block_is_a_miss_and_a_metric_and_the_rest_recomputes(tmp_path):
    pool = POOL
    disk = DiskTier(str(tmp_path), pool.block_shape, pool.dtype, 1 << 24, use_ocdbt=False)  # a file per block
    tokens = prompt(17)
    blocks = random_blocks(5, pool.block_shape, seed=4)
    with make(disk_tier=disk, write_policy="write_through") as cache:
        compute(cache, tokens, blocks=blocks)
        assert cache.flush(TIMEOUT)
        cache.evict(8)
        assert cache.evict_host(8) == 4
        [segment] = [p for p in glob.glob(os.path.join(tmp_path, "seg-*")) if os.path.isdir(p)]
        chunk = os.path.join(segment, "payload", "c", "2", "0")  # page 2's block
        data = bytearray(open(chunk, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(chunk, "wb").write(bytes(data))
        handle = cache.admit(tokens)
        assert handle.num_hit_tokens == 16 and cache.wait_ready(handle, TIMEOUT)
        assert handle.num_hit_tokens == 8  # pages 0 and 1 arrived; 2 and 3 are recomputed
        report = cache.admission_report(handle)
        assert report.hit_tokens == {"device": 0, "host": 0, "disk": 8} and report.recomputed_pages == 2
        assert same_bits(np.asarray(cache.pool.gather(handle.block_ids[:2])), blocks[:2])
        cache.check_invariants()
        assert cache.poll().disk_errors >= 1 and cache.stats.disk_errors >= 1
        assert cache.match(tokens).num_hit_blocks == 2  # the corrupt page left the index


# --- prefetch -----------------------------------------------------------------------------


def test_prefetch_moves_a_waiting_request_prefix_up_and_admit_joins_it():
    tokens = prompt(13)
    blocks = random_blocks(4, POOL.block_shape, seed=5)
    with make(transfer_factory=ManualTransfer) as cache:
        handle = cache.admit(tokens)
        cache.pool.scatter(handle.block_ids, blocks)
        cache.commit(handle, tokens)
        cache.release(handle)
        cache.evict(8)
        cache.transfer.complete_all()
        cache.poll()
        cache.prefetch(tokens)
        fetches = [p.link.value for p in cache.transfer.pending]
        assert fetches == ["host_to_device"]  # 3 pages move as one batch, padded to the 4-block bucket
        joining = cache.admit(tokens)  # admitted while the prefetch is in flight: no new fetch
        assert len(cache.transfer.pending) == 1 and not cache.is_ready(joining)
        cache.transfer.complete_all()
        cache.poll()
        assert cache.is_ready(joining) and joining.num_hit_tokens == 12
        assert same_bits(np.asarray(cache.pool.gather(joining.block_ids[:3])), blocks[:3])
        cache.release(joining)
        assert cache.match(tokens).num_device_blocks == 3  # the prefetched pages stay cached
        cache.check_invariants()


def _disk_only_and_a_full_pool(cache):
    """Leave every cached page on disk only (a ManualTransfer cache) and admit a filler that
    holds the whole pool; returns the filler's handle."""
    cache._mover.spill_host(everything=True)
    cache.transfer.complete_all()
    cache.poll()
    cache.evict(8)
    cache.evict_host(8)
    return cache.admit(prompt(32, start=100))


def test_an_admission_that_joins_a_prefetch_raises_its_transfers_to_demand():
    # a request that now waits on a prefetch (or on the restore a prefetch started) must not
    # stay queued behind other prefetches and spills on the link, nor wait for their budget
    disk = MemoryDisk(POOL.block_shape, POOL.dtype, capacity_blocks=8)
    tokens, other = prompt(13), prompt(9, start=50)
    with make(transfer_factory=ManualTransfer, disk_tier=disk, write_policy="write_through") as cache:
        for ids in (tokens, other):
            compute(cache, ids)
        cache.transfer.complete_all()
        cache.poll()
        cache.evict(8)
        cache.prefetch(tokens)
        [fetch] = cache.transfer.pending
        assert (fetch.link, fetch.priority) == (Link.HOST_TO_DEVICE, Priority.PREFETCH)
        joining = cache.admit(tokens)
        assert [p.priority for p in cache.transfer.pending] == [Priority.DEMAND]  # the same fetch, raised
        cache.transfer.complete_all()
        cache.poll()
        assert cache.is_ready(joining) and joining.num_hit_tokens == 12
        cache.release(joining)
        filler = _disk_only_and_a_full_pool(cache)
        cache.prefetch(other)  # no device room: restores disk -> host only
        [restore] = cache.transfer.pending
        assert (restore.link, restore.priority) == (Link.DISK_TO_HOST, Priority.PREFETCH)
        cache.release(filler)
        waiting = cache.admit(other)  # its fetch waits for that restore: raised with it
        assert restore.priority == Priority.DEMAND and not cache.is_ready(waiting)
        cache.transfer.complete_all()
        cache.poll()
        cache.transfer.complete_all()
        cache.poll()
        assert cache.is_ready(waiting) and waiting.num_hit_tokens == 8
        cache.release(waiting)
        cache.check_invariants()


def test_prefetch_restores_disk_pages_to_host_when_the_device_is_full():
    disk = MemoryDisk(POOL.block_shape, POOL.dtype, capacity_blocks=8)
    tokens = prompt(9)
    with make(transfer_factory=ManualTransfer, disk_tier=disk, write_policy="write_through") as cache:
        compute_blocks = random_blocks(3, POOL.block_shape, seed=6)
        handle = cache.admit(tokens)
        cache.pool.scatter(handle.block_ids, compute_blocks)
        cache.commit(handle, tokens)
        cache.release(handle)
        cache.transfer.complete_all()
        cache.poll()
        filler = _disk_only_and_a_full_pool(cache)
        cache.prefetch(tokens)
        assert [p.link.value for p in cache.transfer.pending] == ["disk_to_host"]
        cache.transfer.complete_all()
        cache.poll()
        assert cache.match(tokens).tiers.tolist() == [Tier.HOST | Tier.DISK] * 2
        cache.release(filler)
        cache.check_invariants()


def test_a_prefetch_whose_fetch_ends_before_it_returns_releases_its_hold_once():
    # without moving bytes (the trace replay's mode) a fetch ends inside start_fetch: the
    # commit that follows releases the prefetch's hold, which prefetch itself must not release
    # again (that raised, and left the host copies held for good)
    tokens = prompt(9)
    with make(move_bytes=False) as cache:
        compute(cache, tokens)
        cache.evict(8)
        cache.poll()
        assert cache.match(tokens).tiers.tolist() == [Tier.HOST] * 2
        cache.prefetch(tokens)
        cache.poll()
        cache.check_invariants()
        assert cache.match(tokens).num_device_blocks == 2
        assert cache.evict_host(8) == 2  # no transfer holds the host copies any more
        cache.check_invariants()


# --- isolation and bad input ------------------------------------------------------------------


def test_namespaces_never_share_pages_in_any_tier():
    with make() as cache:
        tokens = prompt(9)
        compute(cache, tokens, "tenant-a", random_blocks(3, POOL.block_shape))
        cache.evict(8)
        assert cache.flush(TIMEOUT) and cache.match(tokens, "tenant-a").num_hit_blocks == 2
        assert cache.match(tokens, "tenant-b").num_hit_blocks == 0
        assert hit_pages(cache, tokens, "tenant-b")[0] == 0


@pytest.mark.parametrize("values, message", [
    (dict(write_policy="sometimes"), r"unknown write_policy 'sometimes'; valid: \['write_through'"),
    (dict(policy="random"), r"unknown eviction policy 'random'; valid policies: \[.*'lru'"),
    (dict(host_bytes=-1), r"host_bytes=-1 must be an int >= 0"),
    (dict(disk_dir="/tmp/x", disk_bytes=1 << 20), r"a disk tier \(disk_dir='/tmp/x'\) needs host_bytes > 0"),
    (dict(selective_min_hits=0), r"selective_min_hits=0 must be an int >= 1"),
    (dict(high_watermark=0.5, low_watermark=0.6), r"watermarks must satisfy 0 <= low_watermark=0.6"),
    (dict(cost_model="fast"), r"cost_model='fast' must be a CostModel"),
    # wrong types: a bare TypeError, an unhashable list, or accepted and failing later
    (dict(high_watermark="0.9"), r"high_watermark='0.9' must be a number in \[0, 1\]"),
    (dict(policy=["lru"]), r"unknown eviction policy \['lru'\]"),
    (dict(write_policy=["write_back"]), r"unknown write_policy \['write_back'\]"),
    (dict(offload_quant=["int8"], host_bytes=1 << 20), r"offload_quant=\['int8'\] must be a format name \(str\)"),
    (dict(disk_dir=5, host_bytes=1 << 20, disk_bytes=1 << 20), r"disk_dir=5 must be a directory path"),
    (dict(vocab_size=2.5), r"vocab_size=2.5 must be None or an int in \[1, 2\*\*31\]"),
    (dict(vocab_size="256"), r"vocab_size='256' must be None or an int"),
    (dict(host_bytes=True), r"host_bytes=True must be an int >= 0"),
    (dict(selective_min_hits=True), r"selective_min_hits=True must be an int >= 1"),
    # a host tier of no slots: every page fell through it, the disk tier never used
    (dict(host_bytes=POOL.bytes_per_block - 1), rf"host_bytes={POOL.bytes_per_block - 1} holds no block \(one "
                                                rf"takes {POOL.bytes_per_block} bytes here\)"),
    # a disk tier of no room (disk_bytes=100, meant as MiB): every spill refused, the pages lost
    (dict(host_bytes=1 << 20, disk_dir="/tmp/x", disk_bytes=100),
     rf"^disk_bytes=100 holds no block \(one takes {POOL.bytes_per_block} bytes here, its segment's files aside\)"),
])  # fmt: skip
def test_bad_config_is_rejected_with_a_message(values, message):
    with pytest.raises(ValueError, match=message):
        KVCacheConfig(pool=POOL, **values)


def test_config_from_dict_builds_nested_sections():
    config = KVCacheConfig.from_dict({
        "pool": dict(num_blocks=4, num_layers=1, num_kv_heads=1, page_size=2, head_dim=4, dtype="bfloat16"),
        "host_bytes": 1024, "cost_model": {"fetch_latency_seconds": 0.5}, "write_policy": "selective"})  # fmt: skip
    assert config.pool.dtype == "bfloat16" and config.cost_model.fetch_latency_seconds == 0.5 and config.tiered
    with pytest.raises(ValueError, match=r"unknown KV cache config keys \['hosts'\]"):
        KVCacheConfig.from_dict({"pool": config.pool, "hosts": 1})
    with pytest.raises(ValueError, match=r"unknown cost model keys \['latency'\]"):
        KVCacheConfig.from_dict({"pool": config.pool, "cost_model": {"latency": 1}})
    with pytest.raises(ValueError, match=r"fetch_latency_seconds=-1 must be a finite number >= 0"):
        CostModel(fetch_latency_seconds=-1)
    with pytest.raises(ValueError, match=r"host_bytes_per_second=0 must be > 0"):
        CostModel(host_bytes_per_second=0)
    with pytest.raises(ValueError, match=r"recompute_seconds_per_token=nan must be a finite number >= 0"):
        CostModel(recompute_seconds_per_token=float("nan"))
    with pytest.raises(ValueError, match=r"disk_bytes_per_second=True must be a finite number >= 0"):
        CostModel(disk_bytes_per_second=True)
    # inf made page 0's cost 0 * inf = NaN: cost_aware evicted the hottest page, fetches chose none
    with pytest.raises(ValueError, match=r"recompute_seconds_per_token_position=inf must be a finite number >= 0"):
        CostModel(recompute_seconds_per_token_position=float("inf"))


def test_bad_requests_raise_and_change_nothing():
    with make() as cache:
        with pytest.raises(ValueError, match=r"token id -1 at index 1 is out of range"):
            cache.admit([0, -1, 2])
        with pytest.raises(ValueError, match=r"sequence of 40 tokens needs 10 blocks; the pool has 8"):
            cache.admit(prompt(40))
        with pytest.raises(ValueError, match=r"tokens is empty \(num_tokens=0\); admit expects a prompt of >= 1 token"):
            cache.admit(np.zeros(0, np.int32))
        with pytest.raises(ValueError, match=r"namespace='b' differs from the lookup's Namespace\(tenant='a'"):
            cache.admit(cache.lookup(prompt(4), "a"), "b")
        with pytest.raises(ValueError, match=r"num_blocks=-1 must be >= 0"):
            cache.evict_host(-1)
        with pytest.raises(ValueError, match=r"num_pages=-1 must be an int >= 0"):
            cache.pages_in_other_namespaces(prompt(8), "a", -1)
        for call in (lambda: cache.commit(None, prompt(4)), lambda: cache.is_ready("seq-1"),
                     lambda: cache.wait_ready(None)):  # fmt: skip
            with pytest.raises(ValueError, match=r"^handle=(None|'seq-1') must be the SeqHandle admit returned$"):
                call()
        assert cache.num_sequences == 0 and cache.allocator.num_free == 8
        cache.check_invariants()


def test_page_content_model_tells_prefixes_and_tenants_apart():
    shape = POOL.block_shape
    assert not np.array_equal(page_content("a", [1, 2], shape), page_content("b", [1, 2], shape))
    assert not np.array_equal(page_content("a", [1, 2], shape), page_content("a", [2, 2], shape))


@pytest.mark.parametrize("rounds", [3])
def test_a_swap_through_a_full_host_moves_the_right_bytes(rounds):
    """Device and host each hold one 3-page prompt. Admitting A while B is on device fetches
    A from the full host and evicts B, whose write-back takes the slots A is read from: they
    must be written only after the fetch read them, from B's blocks as they were before A's
    KV landed in them. Every round both prompts hit in full, bit-exact."""
    pool = PoolConfig(num_blocks=4, num_layers=1, num_kv_heads=1, page_size=4, head_dim=8, dtype="float32")
    a, b = prompt(13), prompt(13, start=100)
    kv_a, kv_b = random_blocks(4, pool.block_shape, seed=3), random_blocks(4, pool.block_shape, seed=4)
    with make(pool, host_blocks=3) as cache:
        compute(cache, a, blocks=kv_a)
        compute(cache, b, blocks=kv_b)  # A goes to host
        for _ in range(rounds):
            for tokens, kv in ((a, kv_a), (b, kv_b)):
                num_hit, got, tiers = hit_pages_and_tiers(cache, tokens)
                assert num_hit == 3 and tiers["host"] == 12 and same_bits(got, kv[:3])
                compute(cache, tokens, blocks=kv)  # on device again (the last page computed)
                cache.check_invariants()


def test_extending_a_released_or_foreign_handle_is_refused_before_anything_is_evicted():
    """With the pool full of cached pages, growing a released handle (or not a handle at all)
    raises a clear error and evicts nothing: every cached page stays hittable."""
    with make(host_blocks=0) as cache:
        first, second = prompt(4 * POOL.page_size), prompt(4 * POOL.page_size, start=100)
        compute(cache, first)
        gone = compute(cache, second)  # committed and released: all 8 blocks cached, none free
        assert cache.allocator.num_free == 0 and cache.num_reclaimable == POOL.num_blocks
        with pytest.raises(ValueError, match="not a live sequence"):
            cache.extend(gone, 3 * POOL.page_size)  # would need room: it evicted first before
        with pytest.raises(ValueError, match="not a live sequence"):
            cache.extend("seq-1", 1)
        assert cache.num_reclaimable == POOL.num_blocks
        assert hit_pages(cache, first)[0] == hit_pages(cache, second)[0] == 3  # never the last page
        cache.check_invariants()
