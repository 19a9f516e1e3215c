"""Prefix trie and DeviceIndex behaviour: matching, splitting, locks, pins, tiers, namespaces, errors."""

import numpy as np
import pytest

from kvjax.cache.block_keys import Namespace, as_namespace, chained_block_keys
from kvjax.cache.device_index import DeviceIndex
from kvjax.cache.prefix_trie import Tier


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def cache():
    return DeviceIndex(16, 2, vocab_size=100, clock=Clock())


def cached(cache, tokens, namespace=None):
    handle = cache.admit(tokens, namespace)
    cache.commit(handle, tokens)
    cache.release(handle)
    return handle


def state(cache):
    """Everything observable about the cache's bookkeeping, for 'nothing changed' checks."""
    nodes = sorted((n.first_page, bytes(n.label), n.blocks.tolist(), n.lock, n.hard_pins)
                   for n in cache.trie.nodes())  # fmt: skip
    return (cache.allocator.refcounts().tolist(), cache.allocator.free_queue().tolist(), nodes,
            cache.trie.num_evictable, cache.num_sequences)  # fmt: skip


def test_match_after_commit_returns_exactly_the_committed_blocks(cache):
    tokens = [1, 2, 3, 4, 5, 6, 7]
    handle = cache.admit(tokens)
    cache.commit(handle, tokens)
    result = cache.match(tokens)
    assert result.blocks.tolist() == handle.block_table[:3]  # 3 full pages; the partial 4th is private
    assert (result.hit_tokens, result.num_hit_blocks, result.num_device_blocks) == (6, 3, 3)
    assert result.tiers.tolist() == [Tier.DEVICE] * 3
    cache.check_invariants()


def test_a_second_request_maps_the_shared_prefix_and_allocates_the_rest(cache):
    first = cached(cache, [1, 2, 3, 4, 5, 6])
    second = cache.admit([1, 2, 3, 4, 9, 9, 9])
    assert second.num_hit_tokens == 4
    assert second.block_table[:2] == first.block_table[:2]
    assert len(second.block_table) == 4 and not set(second.block_table[2:]) & set(first.block_table)
    assert [cache.allocator.refcount(b) for b in second.block_table[:2]] == [1, 1]
    cache.check_invariants()


def test_the_last_token_is_always_computed(cache):
    cached(cache, [1, 2, 3, 4])
    handle = cache.admit([1, 2, 3, 4])
    assert handle.num_hit_tokens == 2  # page [3, 4] holds the final token: recomputed
    cache.commit(handle, [1, 2, 3, 4])  # a duplicate page: the cached copy is held as well
    assert cache.stats.duplicate_blocks == 1
    cache.check_invariants()
    cache.release(handle)
    cache.check_invariants()


def test_partial_pages_never_enter_the_trie(cache):
    handle = cache.admit([1, 2, 3])
    cache.commit(handle, [1, 2, 3])
    assert cache.match([1, 2, 3]).num_hit_blocks == 1
    assert cache.match([1, 2, 3, 4]).num_hit_blocks == 1
    assert cache.extend(handle, 1)
    assert cache.commit(handle, [1, 2, 3, 4]) == 1  # incremental: only the newly full page
    assert cache.match([1, 2, 3, 4]).blocks.tolist() == handle.block_table
    cache.check_invariants()


def test_partial_match_splits_a_node_and_both_halves_stay_correct(cache):
    first = cached(cache, [1, 1, 2, 2, 3, 3, 4, 4])
    assert cache.trie.num_nodes == 1
    second = cached(cache, [1, 1, 2, 2, 7, 7])
    assert cache.trie.num_nodes == 3
    assert cache.match([1, 1, 2, 2, 3, 3, 4, 4]).blocks.tolist() == first.block_table
    assert cache.match([1, 1, 2, 2, 7, 7]).blocks.tolist() == first.block_table[:2] + second.block_table[2:]
    cache.check_invariants()


def test_decode_commits_grow_the_sequence_own_leaf_in_place(cache):
    handle = cache.admit([1, 2, 3])
    tokens = [1, 2, 3]
    for token in (4, 5, 6, 7):
        assert cache.extend(handle, 1)
        tokens.append(token)
        cache.commit(handle, tokens)
    assert cache.trie.num_nodes == 1
    assert cache.match(tokens).blocks.tolist() == handle.block_table[:3]  # 7 tokens: 3 full pages
    cache.check_invariants()



def test_pages_after_a_hit_form_a_fresh_child_with_their_own_history(cache):
    cached(cache, [1, 2, 3, 4, 5])  # pages [1, 2], [3, 4]: one node
    tokens = [1, 2, 3, 4, 5, 6, 7]
    handle = cache.admit(tokens)  # hits both pages: the node, locked by this sequence alone
    assert handle.num_hit_tokens == 4
    cache.commit(handle, tokens)  # page [5, 6]
    for token in (8, 9):  # decoded: page [7, 8] joins the sequence's own new node in place
        assert cache.extend(handle, 1)
        tokens.append(token)
        cache.commit(handle, tokens)
    (hit,) = cache.trie.root(as_namespace(None), create=False).children.values()
    (fresh,) = hit.children.values()
    assert (hit.num_pages, hit.hits) == (2, 1)
    assert (fresh.num_pages, fresh.hits) == (2, 0)  # not counted as reused: they never were
    assert cache.trie.num_nodes == 2
    cache.release(handle)
    assert cache.match(tokens).blocks.tolist() == handle.block_table[:4]
    cache.check_invariants()

def test_pages_never_join_a_node_another_sequence_hit(cache):
    tokens = [1, 2, 3, 4, 5]
    handle = cache.admit(tokens)
    cache.commit(handle, tokens)  # pages [1, 2], [3, 4]: this sequence's own node
    cache.release(cache.admit(tokens + [9]))  # another sequence hits both pages (and leaves)
    for token in (6, 7, 8):  # pages [5, 6], [7, 8]: a child, not the node that was hit
        assert cache.extend(handle, 1)
        tokens.append(token)
        cache.commit(handle, tokens)
    shape = sorted((node.first_page, node.num_pages, node.hits) for node in cache.trie.nodes())
    assert shape == [(0, 2, 1), (2, 2, 0)]
    cache.check_invariants()


def test_extend_fails_cleanly_when_the_pool_is_full():
    cache = DeviceIndex(2, 2, clock=Clock())
    handle = cache.admit([1, 2, 3, 4])
    before = state(cache)
    assert not cache.extend(handle, 1)
    assert state(cache) == before and handle.num_tokens == 4
    assert cache.stats.extend_failures == 1


def test_extend_without_eviction_uses_free_blocks_only_and_counts_no_failure():
    """``evict=False`` (a tiered cache evicting its own way first): free blocks serve; short of
    them it answers False with nothing evicted and no failure counted, where ``evict=True``
    reclaims the cached page."""
    cache = DeviceIndex(3, 2, clock=Clock())
    cached(cache, [5, 5])  # one cached, evictable page
    handle = cache.admit([1, 2, 3])  # two blocks; the pool has none free now
    assert cache.extend(handle, 1, evict=False)  # room in its last page: no block needed
    before = state(cache)
    assert not cache.extend(handle, 1, evict=False)
    assert state(cache) == before and handle.num_tokens == 4
    assert cache.stats.extend_failures == 0 and cache.stats.evicted_blocks == 0
    assert cache.extend(handle, 1)  # evicting the cached page
    assert cache.stats.evicted_blocks == 1 and len(handle.block_ids) == 3
    cache.check_invariants()


def test_admit_returns_none_and_changes_nothing_when_it_cannot_fit():
    cache = DeviceIndex(5, 2, clock=Clock())
    holder = cache.admit([1, 2, 3, 4, 5, 6])
    cached(cache, [8, 8, 9])  # two blocks: one cached page, one freed
    before = state(cache)
    assert cache.admit([8, 8, 7, 7, 7]) is None  # hit 1 page, needs 2 more; only 1 reclaimable
    assert state(cache) == before
    assert cache.stats.admit_failures == 1
    cache.release(holder)
    assert cache.admit([8, 8, 7, 7, 7]) is not None


def test_admission_evicts_cached_blocks_when_free_ones_run_out():
    cache = DeviceIndex(4, 2, clock=Clock())
    cached(cache, [1, 1, 2, 2, 3, 3, 4, 4])
    assert cache.allocator.num_free == 0 and cache.num_reclaimable == 4
    handle = cache.admit([5, 5, 6, 6])
    assert handle is not None and cache.stats.evicted_blocks == 2
    assert cache.match([1, 1, 2, 2, 3, 3, 4, 4]).num_hit_blocks == 2  # deepest pages went first
    cache.check_invariants()


def test_released_blocks_stay_hittable_until_reused(cache):
    first = cached(cache, [1, 2, 3, 4, 5])
    assert cache.allocator.refcount(first.block_table[0]) == 0
    assert not cache.allocator.is_free(first.block_table[0])
    assert cache.admit([1, 2, 3, 4, 5]).block_table[:2] == first.block_table[:2]


def test_namespaces_never_share_blocks(cache):
    tokens = [1, 2, 3, 4, 5]
    cached(cache, tokens, Namespace("a"))
    for other in (Namespace("b"), Namespace("a", model="m"), Namespace("a", adapter="x"), Namespace("a", salt="s")):
        assert cache.match(tokens, other).num_hit_blocks == 0
        assert cache.admit(tokens, other).num_hit_tokens == 0
    assert cache.match(tokens, "a").num_hit_blocks == 2
    cache.check_invariants()


def test_page_keys_match_chained_block_keys(cache):
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    cached(cache, tokens, "tenant")
    cached(cache, [1, 2, 3, 4, 9, 9], "tenant")  # splits the first node
    keys = [key for node in sorted(cache.trie.nodes(), key=lambda n: n.first_page)
            if bytes(node.label[:2 * 4]) != bytes(np.array([9, 9], "<i4"))
            for key in cache.trie.page_keys(node)]  # fmt: skip
    assert keys == chained_block_keys(tokens, 2, "tenant")


def test_unlocking_an_unlocked_node_raises_and_changes_nothing(cache):
    handle = cached(cache, [1, 2, 3, 4, 5])
    node = handle._tail
    before = state(cache)
    with pytest.raises(ValueError, match=r"node at page 0 is not locked"):
        cache.trie.unlock(node, 0.0)
    assert state(cache) == before


def test_bad_requests_raise_clear_errors_and_change_nothing(cache):
    handle = cache.admit([1, 2, 3])
    before = state(cache)
    cases = [
        (lambda: cache.admit([1, 100]), r"token id 100 at index 1 is out of range; expected 0 <= id < 100"),
        (lambda: cache.admit([1] * 40), r"sequence of 40 tokens needs 20 blocks; the pool has 16"),
        (lambda: cache.admit([]), r"tokens is empty \(num_tokens=0\); admit expects a prompt of >= 1 token"),
        (lambda: cache.commit(handle, [1, 2, 9]), r"tokens disagree with the tokens this sequence was given"),
        (lambda: cache.commit(handle, [1, 2, 3, 4]), r"4 tokens committed; the sequence has room for 3"),
        (lambda: cache.extend(handle, -1), r"num_new_tokens=-1 must be an int >= 0"),
        (lambda: cache.unpin([1, 2]), r"no hard pin on these 2 tokens"),
        (lambda: cache.pin([1, 2], ttl=0), r"ttl=0 must be a positive finite number of seconds"),
        (lambda: cache.pin([1, 2], ttl="5"), r"ttl='5' must be a positive finite number of seconds"),
        (lambda: cache.pin([1, 2], ttl=True), r"ttl=True must be a positive finite number of seconds"),
        (lambda: cache.pin([1, 2], ttl=float("nan")), r"ttl=nan must be a positive finite number of seconds"),
        (lambda: cache.evict(-1), r"num_blocks=-1 must be an int >= 0"),
        (lambda: cache.set_tier([1, 2], None, 0, Tier.DEVICE), r"must be Tier.HOST and/or Tier.DISK"),
        (lambda: cache.set_tier([1, 2], None, 0, 8), r"tier=8 must be Tier.HOST and/or Tier.DISK"),
        (lambda: cache.set_tier([1, 2, 3, 4], None, 1, Tier.HOST), r"page=1 of these tokens is not cached"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert state(cache) == before
    cache.release(handle)
    after_release = state(cache)
    with pytest.raises(ValueError, match=r"is not a live sequence of this cache \(released already\?\)"):
        cache.release(handle)
    assert state(cache) == after_release
    with pytest.raises(ValueError, match=r"page_size=0 must be a positive number of tokens"):
        DeviceIndex(4, 0)


def test_commit_validates_new_tokens_and_never_narrows_wide_ids(cache):
    handle = cache.admit([1, 2, 3])
    cache.extend(handle, 2)
    with pytest.raises(ValueError, match=r"token id 100 at index 4 is out of range"):
        cache.commit(handle, np.array([1, 2, 3, 4, 100], np.int32))
    with pytest.raises(ValueError, match=r"token id 4294967297 at index 3 is out of range"):
        cache.commit(handle, np.array([1, 2, 3, 2**32 + 1], np.int64))  # would wrap to 1 in int32
    assert cache.commit(handle, [1, 2, 3, 4, 5]) == 2


def test_hard_pins_nest_and_unpin_by_the_same_tokens(cache):
    cached(cache, [1, 2, 3, 4, 5, 6])
    assert cache.pin([1, 2, 3, 4]) == 4
    assert cache.pin([1, 2, 3, 4, 5, 6]) == 6
    cache.check_invariants()
    assert cache.evict(10) == []
    cache.unpin([1, 2, 3, 4, 5, 6])
    assert len(cache.evict(10)) == 1  # page [5, 6] only; [1..4] still pinned
    cache.unpin([1, 2, 3, 4])
    assert len(cache.evict(10)) == 2
    cache.check_invariants()


def test_pin_of_an_uncached_prefix_pins_nothing(cache):
    assert cache.pin([7, 7, 7]) == 0
    cached(cache, [1, 2])
    assert cache.pin([1, 2, 3, 4, 5]) == 2  # only what is cached


def test_soft_pin_ttl_extends_and_expires(cache):
    cached(cache, [1, 2, 3, 4])
    cache.pin([1, 2, 3, 4], ttl=10.0)
    cache.clock.now = 8.0
    cache.pin([1, 2], ttl=10.0)  # extends page [1, 2] to t=18
    cache.clock.now = 12.0
    assert len(cache.evict(10)) == 1  # [3, 4] expired at t=10
    assert cache.evict(10) == []
    cache.clock.now = 18.0
    assert len(cache.evict(10)) == 1
    cache.check_invariants()


@pytest.mark.parametrize("start", [100.0, -50.0], ids=["clock_steps_back", "negative_clock"])
def test_a_pin_made_after_an_earlier_one_expired_expires_too(cache, start):
    # an expired pin kept its time: a new pin ending earlier (the clock stepped back, or a
    # replay clock below 0) queued no expiry, and its pages stayed pinned for good
    cache.clock.now = start
    cached(cache, [1, 2, 3, 4, 5])
    cache.pin([1, 2, 3, 4], ttl=10.0)
    cache.clock.now = start + 20.0
    assert cache.evict(0) == []  # the pin expires (lazily)
    cache.clock.now = start - 50.0
    cache.pin([1, 2], ttl=10.0)  # until start - 40: before the first pin's time
    cache.check_invariants()
    cache.clock.now = start - 30.0
    cache.evict(16)
    assert cache.match([1, 2, 3, 4, 5]).num_hit_blocks == 0  # every page went: nothing stayed pinned
    cache.check_invariants()


def test_host_copy_survives_device_eviction_and_is_reattached_on_commit(cache):
    tokens = [1, 2, 3, 4, 5, 6]
    cached(cache, tokens)
    cache.set_tier(tokens, None, 2, Tier.HOST)
    cache.set_tier(tokens, None, 1, Tier.HOST | Tier.DISK)
    evicted = cache.evict(2)
    result = cache.match(tokens)
    assert result.num_hit_blocks == 3 and result.num_device_blocks == 1
    assert result.blocks.tolist()[1:] == [-1, -1]
    assert result.tiers.tolist() == [Tier.DEVICE, Tier.HOST | Tier.DISK, Tier.HOST]
    assert cache.stats.offloaded_pages == 2
    handle = cache.admit(tokens + [7])
    assert handle.num_hit_tokens == 2  # only device pages are mapped; host pages recomputed
    assert cache.stats.lower_tier_hit_tokens == 4
    cache.commit(handle, tokens + [7])
    result = cache.match(tokens)
    assert result.blocks.tolist() == handle.block_table[:3]
    assert result.tiers.tolist() == [Tier.DEVICE, Tier.DEVICE | Tier.HOST | Tier.DISK, Tier.DEVICE | Tier.HOST]
    assert set(evicted).isdisjoint(result.blocks.tolist()[:1])
    cache.check_invariants()


def test_clearing_the_last_copy_of_an_offloaded_page_drops_it_and_what_follows(cache):
    tokens = [1, 2, 3, 4, 5, 6]
    cached(cache, tokens)
    keys = chained_block_keys(tokens, 2, None)
    for page in (1, 2):
        cache.set_tier(tokens, None, page, Tier.HOST)
    cache.evict(2)
    assert cache.take_dropped() == []
    cache.clear_tier(tokens, None, 1, Tier.HOST)
    assert cache.match(tokens).num_hit_blocks == 1
    [dropped] = cache.take_dropped()  # the tier layer drops the host copies these had
    assert dropped.keys == keys[1:] and dropped.tiers.tolist() == [0, Tier.HOST]
    assert cache.trie.locate(keys[2]) is None and cache.take_dropped() == []
    cache.check_invariants()


def test_evicting_a_device_only_page_drops_host_pages_below_it(cache):
    tokens = [1, 2, 3, 4]
    cached(cache, tokens)
    cache.set_tier(tokens, None, 1, Tier.HOST)
    assert len(cache.evict(2)) == 2
    assert cache.match(tokens).num_hit_blocks == 0
    assert cache.stats.dropped_pages == 2
    [dropped] = cache.take_dropped()
    assert dropped.keys == chained_block_keys(tokens, 2, None)  # the whole node left
    assert dropped.tiers.tolist() == [Tier.DEVICE, Tier.DEVICE | Tier.HOST]
    cache.check_invariants()


def test_fragmentation_counts_partial_last_pages(cache):
    cache.admit([1, 2, 3])  # 1 of 4 slots unused
    cache.admit([4, 5, 6, 7])
    assert cache.fragmentation() == pytest.approx(1 / 8)
