"""KVCache with transfers completing and failing in a chosen order (ManualTransfer): each test
is an interleaving a stateful review machine found serving wrong KV, leaking a hold, crashing an
admission or leaving a stale tier bit; every hit is checked against the KV written for it."""
import numpy as np
from kv_cache_cases import ManualTransfer, MemoryDisk, page_content

from kvjax.cache.cost_model import CostModel
from kvjax.cache.trie_node import Tier
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig
from kvjax.tiers.page_pool import PoolConfig

PAGE = 2
POOL = PoolConfig(num_blocks=8, num_layers=1, num_kv_heads=1, page_size=PAGE, head_dim=2, dtype="float32")
ALWAYS = CostModel(recompute_seconds_per_token=1.0)


def make(write_policy="write_back", host_blocks=4, disk_blocks=5, policy="lru", **kw):
    disk = MemoryDisk(POOL.block_shape, np.float32, capacity_blocks=disk_blocks)
    config = KVCacheConfig(pool=POOL, host_bytes=host_blocks * POOL.bytes_per_block, vocab_size=64,
                           write_policy=write_policy, cost_model=ALWAYS, policy=policy, **kw)
    return KVCache(config, disk_tier=disk if disk_blocks else None, transfer_factory=ManualTransfer), disk


def write(cache, handle, ns, tokens, first):
    n = len(handle.block_ids)
    blocks = np.stack([page_content(ns, tokens[: (p + 1) * PAGE], POOL.block_shape) for p in range(first, n)])
    cache.pool.scatter(handle.block_ids[first:], blocks)


def serve(cache, tokens, ns="a"):
    h = cache.admit(tokens, ns)
    while not cache.is_ready(h):
        cache.transfer.complete_all()
        cache.poll()
    first = h.num_hit_tokens // PAGE
    got = np.asarray(cache.pool.gather(h.block_ids[:first])) if first else np.zeros((0,))
    for p in range(first):
        np.testing.assert_array_equal(got[p], page_content(ns, tokens[: (p + 1) * PAGE], POOL.block_shape))
    write(cache, h, ns, tokens, first)
    cache.commit(h, tokens)
    cache.release(h)
    return h


def test_export_of_a_corrupt_disk_block_leaves_a_stale_disk_bit():
    cache, disk = make()
    tokens = [1, 2, 3, 4, 5]
    serve(cache, tokens)
    cache.evict(8)
    cache.transfer.complete_all(); cache.poll()
    cache._mover.spill_host(everything=True)
    cache.transfer.complete_all(); cache.poll()
    assert cache.evict_host(4) == 2
    assert cache.match(tokens, "a").tiers.tolist() == [Tier.DISK] * 2
    cache.check_invariants()
    key = cache.trie.page_keys(cache.lookup(tokens, "a").matched[0][0])[0]
    disk.corrupt(key, as_digest("a"))
    cache.export_pages(tokens, "a", 0, 2)
    broken = None
    try:
        cache.check_invariants()
    except RuntimeError as err:
        broken = err
    cache.admit(tokens, "a")
    settle(cache)
    assert broken is None, broken


def as_digest(ns):
    from kvjax.cache.block_keys import as_namespace
    return as_namespace(ns).digest()


def pending(cache):
    return [(i, str(p.link)) for i, p in enumerate(cache.transfer.pending)]


def complete_link(cache, link_name, ok=True, which=0):
    idx = [i for i, p in enumerate(cache.transfer.pending) if link_name in str(p.link)]
    cache.transfer.complete(idx[which], ok)
    cache.poll()


def settle(cache):
    while cache.transfer.pending or cache._mover.busy:
        cache.transfer.complete_all()
        cache.poll()


def served_to_disk_only(cache, tokens, ns="a") -> int:
    """Serve ``tokens``, copy its pages to host and disk, then drop them from device and host:
    returns how many pages left host memory (they are on disk only now)."""
    serve(cache, tokens, ns)
    settle(cache)
    cache._mover.spill_host(everything=True)
    settle(cache)
    cache.evict(8)
    return cache.evict_host(8)


def test_restore_into_a_slot_a_failed_copy_frees():
    cache, disk = make(write_policy="write_through", host_blocks=4)
    T = [1, 2, 3, 4, 5]
    assert served_to_disk_only(cache, T) == 2
    assert cache.match(T, "a").tiers.tolist() == [Tier.DISK] * 2
    # recompute P1 on top of P0 (fetched): its write-through copy C1 stays in flight
    h = cache.admit([1, 2, 3, 4], "a")
    while not cache.is_ready(h):
        restoring = any("DISK_TO_HOST" in link for _, link in pending(cache))
        complete_link(cache, "DISK_TO_HOST" if restoring else "HOST_TO_DEVICE")
    assert h.num_hit_tokens == 2
    write(cache, h, "a", [1, 2, 3, 4], 1)
    cache.commit(h, [1, 2, 3, 4])
    cache.release(h)
    # P0 leaves: its device copy evicted, host copy evicted (on disk), disk copy corrupt and read
    cache.evict(8)
    cache.evict_host(1)
    cache.check_invariants()
    matched = cache.lookup(T, "a").matched
    k0 = (cache.trie.page_keys(matched[0][0]) + cache.trie.page_keys(matched[1][0]))[0]
    disk.corrupt(k0, as_digest("a"))
    h = cache.admit([1, 2, 3], "a")  # matches P0 only: its restore finds it corrupt
    complete_link(cache, "DISK_TO_HOST")
    while not cache.is_ready(h):
        settle(cache)
    write(cache, h, "a", [1, 2, 3], 0)
    cache.commit(h, [1, 2, 3])
    cache.release(h)
    # P1 (dropped, its copy C1 still in flight) is found again on disk by key, fetched
    h2 = cache.admit(T, "a")
    # C1 fails: the slot is freed while the restore will still write it
    first_d2h = [i for i, p in enumerate(cache.transfer.pending) if "DEVICE_TO_HOST" in str(p.link)][0]
    cache.transfer.complete(first_d2h, ok=False)
    cache.poll()
    cache.check_invariants()
    # another prompt's write-through copy takes the freed slot
    U = [7, 8, 9, 10, 11]
    serve(cache, U, "a")
    settle(cache)  # the restore of P1 completes now, into the slot
    cache.check_invariants()
    cache.release(h2)
    cache.evict(8)
    h3 = cache.admit(U, "a")
    while not cache.is_ready(h3):
        settle(cache)
    got = np.asarray(cache.pool.gather(h3.block_ids[:1]))[0]
    np.testing.assert_array_equal(got, page_content("a", U[:2], POOL.block_shape), err_msg="U page 0 served")


def vars_of(entry):
    return None if entry is None else {s: getattr(entry, s) for s in entry.__slots__}


def test_prefetch_counted_though_it_started_nothing():
    cache, disk = make(write_policy="write_back", host_blocks=4)
    T = [1, 2, 3, 4, 5]
    serve(cache, T)
    cache.evict(8)
    settle(cache)
    assert cache.match(T, "a").tiers.tolist() == [Tier.HOST] * 2
    cache.admit(list(range(16)), "b")  # every device block held: no room to fetch into
    assert cache.allocator.num_free == 0
    cache.prefetch(T, "a")
    assert cache.stats.prefetches == 0


def keys_of(cache, tokens, ns):
    return [cache.trie.page_keys(n)[i] for n, k in cache.lookup(tokens, ns).matched for i in range(k)]


def test_import_writes_a_handed_slot_before_the_fetch_read_it():
    cache, disk = make(write_policy="write_back", host_blocks=4, disk_blocks=0)
    A, B0, B, Z = [1, 2, 3, 4, 5], [11, 12, 13], [11, 12, 13, 14, 15, 16, 17], [21, 22, 23]
    for tokens, ns in ((A, "a"), (B0, "b"), (Z, "c")):
        serve(cache, tokens, ns)
        cache.evict(8)
        settle(cache)
    assert cache.tiers.host_used == 4  # a0 a1 b0 z0, all ready
    serve(cache, B, "b")  # b0 fetched back, b1 b2 computed: one device node [b0 b1 b2]
    settle(cache)
    cache.admit(list(range(9)), "x")  # holds the 5 free blocks
    assert cache.allocator.num_free == 0
    h = cache.admit(A, "a")  # fetches a0 a1; evicting b0..b2 hands their slots to b1 b2's copies
    assert cache.tiers.num_handed == 2 and not cache.is_ready(h)
    cache.evict_host(2)  # b0 and z0 go; b0's node leaves the trie with b1 b2 (copies pending)
    blocks = np.stack([page_content("b", B[: (p + 1) * PAGE], POOL.block_shape) for p in range(3)])
    cache.import_pages(B, "b", 0, blocks)
    settle(cache)  # the fetch of a0 a1 reads its slots now
    got = np.asarray(cache.pool.gather(h.block_ids[:2]))
    for p in range(h.num_hit_tokens // PAGE):
        np.testing.assert_array_equal(got[p], page_content("a", A[: (p + 1) * PAGE], POOL.block_shape),
                                      err_msg=f"page {p} of A served")


def test_failed_restore_discards_a_held_entry_and_the_job_later_unholds_a_new_one():
    cache, disk = make(write_policy="write_through", host_blocks=2)
    T = [1, 2, 3, 4, 5]
    blocks = np.stack([page_content("a", T[: (p + 1) * PAGE], POOL.block_shape) for p in range(2)])
    assert served_to_disk_only(cache, T) == 2
    k0, k1 = keys_of(cache, T, "a")
    disk.corrupt(k1, as_digest("a"))
    h = cache.admit(T, "a")                      # job [p0 p1], both restored from disk
    complete_link(cache, "DISK_TO_HOST")         # p1 is corrupt: its entry goes while the job holds it
    # another node's p1 arrives: no room until the job lets go of the failed entry (it gave that
    # entry's slot away at once, and the job's release later went to this new one: busy -1)
    assert cache.import_pages(T, "a", 0, blocks) == 0
    complete_link(cache, "HOST_TO_DEVICE")       # the job ends and releases its holds, p1's too
    cache.release(h)
    # consequence: the next fetch of p1 holds it at busy 0, so eviction takes its slot mid-read
    h2 = cache.admit(T, "a")
    serve(cache, [9, 9, 9, 9, 9], "z")          # write-through copies take the freed slots
    settle(cache)
    got = np.asarray(cache.pool.gather(h2.block_ids[:2]))
    for p in range(h2.num_hit_tokens // PAGE):
        np.testing.assert_array_equal(got[p], blocks[p], err_msg=f"page {p} of T served")
    cache.check_invariants()


def test_a_lookup_stays_fresh_across_a_poll_that_split_and_dropped_its_node():
    cache, disk = make(write_policy="write_back", host_blocks=4, disk_blocks=0)
    T = [1, 2, 3, 4, 5, 6, 7]
    serve(cache, T[:3])
    cache.evict(8)
    settle(cache)                     # p0 on host
    serve(cache, T)                   # p0 fetched back, p1 p2 computed: one node [p0 p1 p2]
    settle(cache)
    cache.evict(8)                    # p1 p2 kept for write-back: their copy is in flight
    lookup = cache.lookup(T, "a")     # a scheduler ranks by it and admits it later
    cache.transfer.complete(0, ok=False)
    cache.poll()                      # p1 p2 leave the trie; p0's node was split off
    assert cache.admit(lookup) is not None  # an IndexError: the stale lookup's node had been split off
