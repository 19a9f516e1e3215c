"""Eviction policies: exact victim order per policy, only unlocked unpinned leaves, registry."""

import pytest

from kvjax.cache.cost_model import CostModel
from kvjax.cache.device_index import DeviceIndex
from kvjax.cache.eviction import EvictionPolicy
from kvjax.cache.policies import POLICIES, CostAwarePolicy, LRUPolicy, make_policy
from kvjax.cache.prefix_trie import Tier


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_cache(policy, num_blocks=16, page_size=2, **kwargs):
    clock = Clock()
    return DeviceIndex(num_blocks, page_size, policy=make_policy(policy, **kwargs), clock=clock), clock


def run(cache, clock, tokens, at):
    """One request at clock time ``at``: admit, commit, release. Returns the handle."""
    clock.now = at
    handle = cache.admit(tokens)
    cache.commit(handle, tokens)
    cache.release(handle)
    return handle


def block_of(cache, tokens, page=-1):
    return int(cache.match(tokens).blocks[page])


def evict_all_one_by_one(cache):
    order = []
    while True:
        victims = cache.evict(1)
        if not victims:
            return order
        order.extend(victims)


def three_branches(cache, clock):
    """Pages A, B, C (one page each) cached at t=1, 2, 3; A hit at t=4, 5; B hit at t=6."""
    a, b, c = [0, 0], [1, 1], [2, 2]
    for at, tokens in ((1, a), (2, b), (3, c)):
        run(cache, clock, tokens, at)
    for at, tokens in ((4, a), (5, a), (6, b)):
        run(cache, clock, tokens + [9], at)  # one more token: the full page hits
    return [block_of(cache, t) for t in (a, b, c)]


def test_lru_evicts_least_recently_used_leaf_first():
    cache, clock = make_cache("lru")
    a, b, c = three_branches(cache, clock)
    assert evict_all_one_by_one(cache) == [c, a, b]


def test_lfu_evicts_fewest_hits_first():
    cache, clock = make_cache("lfu")
    a, b, c = three_branches(cache, clock)
    assert evict_all_one_by_one(cache) == [c, b, a]


def test_lfu_breaks_ties_by_last_access():
    cache, clock = make_cache("lfu")
    run(cache, clock, [1, 1], at=2)
    run(cache, clock, [0, 0], at=1)  # fewer hits: none; older
    expected = [block_of(cache, [0, 0]), block_of(cache, [1, 1])]
    assert evict_all_one_by_one(cache) == expected


def test_equal_priorities_evict_in_the_order_blocks_became_evictable():
    cache, clock = make_cache("lru")
    clock.now = 1.0
    first, second = cache.admit([5, 5]), cache.admit([6, 6])
    cache.commit(first, [5, 5])
    cache.commit(second, [6, 6])
    cache.release(second)
    cache.release(first)
    expected = [block_of(cache, [6, 6]), block_of(cache, [5, 5])]
    assert evict_all_one_by_one(cache) == expected


def test_leaves_go_before_their_parents_and_a_node_loses_its_deepest_page_first():
    cache, clock = make_cache("lru")
    run(cache, clock, [1, 1, 2, 2, 3, 3], at=1)
    run(cache, clock, [1, 1, 4, 4], at=2)  # shares the first page, newer
    deep = cache.match([1, 1, 2, 2, 3, 3]).blocks.tolist()
    other = block_of(cache, [1, 1, 4, 4])
    assert evict_all_one_by_one(cache) == [deep[2], deep[1], other, deep[0]]


def deep_and_shallow(policy, **kwargs):
    """A shallow leaf (1 page) and a deep leaf (tail at page 3), the deep one slightly older."""
    cache, clock = make_cache(policy, page_size=4, **kwargs)
    deep = list(range(16))
    run(cache, clock, deep, at=1.0)
    run(cache, clock, [20, 21, 22, 23], at=1.01)
    return cache, block_of(cache, deep), block_of(cache, [20, 21, 22, 23])


ATTENTION_BOUND = CostModel(recompute_seconds_per_token=0.0)  # cost grows with position only


def test_cost_aware_keeps_expensive_deep_pages_that_lru_would_evict():
    cache, deep_tail, shallow = deep_and_shallow("cost_aware", cost_model=ATTENTION_BOUND)
    assert cache.evict(1) == [shallow]
    cache, deep_tail, shallow = deep_and_shallow("lru")
    assert cache.evict(1) == [deep_tail]


def test_cost_aware_evicts_pages_with_a_host_copy_first():
    fast_link = CostModel(recompute_seconds_per_token=0.0, fetch_latency_seconds=0.0, host_bytes_per_second=1e18)
    cache, deep_tail, shallow = deep_and_shallow("cost_aware", cost_model=fast_link)
    cache.set_tier(list(range(16)), None, 3, Tier.HOST)  # a miss now costs only a fetch
    assert cache.evict(1) == [deep_tail]
    assert cache.match(list(range(16))).tiers.tolist() == [1, 1, 1, int(Tier.HOST)]


def test_cost_aware_prefers_recent_and_frequently_hit_pages():
    cache, clock = make_cache("cost_aware", half_life_s=10.0)
    run(cache, clock, [0, 0], at=0.0)
    run(cache, clock, [1, 1], at=10.0)  # one half-life newer: worth twice as much
    older = block_of(cache, [0, 0])
    assert cache.evict(1) == [older]
    cache, clock = make_cache("cost_aware", half_life_s=10.0)
    run(cache, clock, [0, 0], at=0.0)
    run(cache, clock, [0, 0, 9], at=0.0)  # one hit doubles the reuse estimate...
    run(cache, clock, [1, 1], at=5.0)  # ...which beats half a half-life of recency
    newer = block_of(cache, [1, 1])
    assert cache.evict(1) == [newer]


def test_cost_model_grows_with_depth_and_counts_attention():
    model = CostModel()
    costs = [model.recompute_seconds(page * 16, 16) for page in (0, 10, 1000)]
    assert costs[0] < costs[1] < costs[2]
    # Page 1000 starts at token 16000: each of its tokens attends to every earlier position.
    positions = 16 * 16000 + 16 * 15 / 2
    expected = 16 * model.recompute_seconds_per_token + positions * model.recompute_seconds_per_token_position
    assert costs[2] == pytest.approx(expected)
    # A miss on a page with a host copy costs at most its fetch.
    fetch = model.fetch_latency_seconds + 4096 / model.host_bytes_per_second
    assert model.miss_seconds(1000, 16, 4096, lower_copy=True) == pytest.approx(min(costs[2], fetch))
    assert model.miss_seconds(1000, 16, 4096, lower_copy=False) == pytest.approx(costs[2])
    assert model.swap_seconds(3, 4096) == pytest.approx(2 * 3 * 4096 / model.host_bytes_per_second)


def test_cost_aware_ordering_does_not_depend_on_now():
    policy = CostAwarePolicy(half_life_s=3.0)

    class FakeNode:
        def __init__(self, hits, last_access, first_page):
            self.hits, self.last_access, self.first_page = hits, last_access, first_page
            self.num_pages, self.tail_tiers = 1, 1

    nodes = [FakeNode(0, 5.0, 0), FakeNode(3, 1.0, 2), FakeNode(1, 4.0, 40)]
    orders = {tuple(sorted(range(3), key=lambda i: policy.priority(nodes[i], now))) for now in (5, 50, 5000)}
    assert len(orders) == 1
    # value = (hits + 1) * 2 ** -(age / half_life) * loss, compared at now=6.
    loss = [policy.cost_model.recompute_seconds(n.first_page * 16, 16) for n in nodes]
    value = [(n.hits + 1) * 2 ** (-(6 - n.last_access) / 3.0) * l for n, l in zip(nodes, loss)]
    assert orders == {tuple(sorted(range(3), key=value.__getitem__))}


def test_locked_and_pinned_blocks_are_never_evicted():
    cache, clock = make_cache("lru")
    run(cache, clock, [0, 0], at=1)
    run(cache, clock, [1, 1], at=2)
    run(cache, clock, [2, 2], at=3)
    clock.now = 4
    held = cache.admit([0, 0, 7])  # locks page [0, 0]
    cache.pin([1, 1])
    blocks = {tokens[0]: block_of(cache, tokens) for tokens in ([0, 0], [1, 1], [2, 2])}
    assert cache.evict(10) == [blocks[2]]
    assert cache.match([0, 0]).num_device_blocks == 1 and cache.match([1, 1]).num_device_blocks == 1
    cache.release(held)
    cache.unpin([1, 1])
    assert sorted(cache.evict(10)) == sorted([blocks[0], blocks[1]])


def test_soft_pin_expires_after_its_ttl():
    cache, clock = make_cache("lru")
    run(cache, clock, [0, 0], at=1)
    assert cache.pin([0, 0], ttl=5.0) == 2
    clock.now = 5.9
    assert cache.evict(1) == []
    clock.now = 6.0
    assert cache.evict(1) == [0]


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown eviction policy 'fifo'; valid policies: \[") as err:
        make_policy("fifo")
    for name in ("adaptive", "cost_aware", "lfu", "lru", "segmented"):
        assert f"'{name}'" in str(err.value)
    with pytest.raises(ValueError, match=r"unknown eviction policy 'fifo'"):
        DeviceIndex(8, 2, policy="fifo")
    with pytest.raises(ValueError, match=r"half_life_s=0 must be a finite number of seconds > 0"):
        make_policy("cost_aware", half_life_s=0)


def test_registry_accepts_new_policies_and_instances(monkeypatch):
    class MRUPolicy(EvictionPolicy):
        name = "mru"

        def priority(self, node, now):
            return -node.last_access

    monkeypatch.setitem(POLICIES, "mru", MRUPolicy)
    cache, clock = make_cache("mru")
    run(cache, clock, [0, 0], at=1)
    run(cache, clock, [1, 1], at=2)
    newest = block_of(cache, [1, 1])
    assert cache.evict(1) == [newest]
    lru = LRUPolicy()
    assert make_policy(lru) is lru


def test_time_dependent_policies_are_reranked_at_each_eviction():
    class FlipAt100(EvictionPolicy):
        name = "flip"
        time_invariant = False

        def priority(self, node, now):
            return node.last_access if now < 100 else -node.last_access

    cache, clock = make_cache(FlipAt100())
    run(cache, clock, [0, 0], at=1)
    run(cache, clock, [1, 1], at=2)
    run(cache, clock, [2, 2], at=3)
    oldest, newest = block_of(cache, [0, 0]), block_of(cache, [2, 2])
    clock.now = 50
    assert cache.evict(1) == [oldest]
    clock.now = 200
    assert cache.evict(1) == [newest]


def test_short_write_back_budget_keeps_the_pages_nearest_the_root():
    """A budget too small for every leaving page goes to the shared prefix, not to the leaves
    evicted first: a leaf kept while its parent leaves would be unreachable (wasted copy)."""
    cache, clock = make_cache("lru")
    prefix = [1, 2, 3, 4]
    run(cache, clock, prefix + [5, 6, 7, 8], at=1.0)
    run(cache, clock, prefix + [9, 10, 11, 12], at=2.0)
    eviction = cache.reclaim(6, keep_without_copy=2)
    assert len(eviction.blocks) == 6
    assert len(eviction.kept) == 2
    for key, _ in eviction.kept:
        assert cache.trie.locate(key) is not None  # every kept page is still reachable
    assert cache.match(prefix + [5, 6, 7, 8]).num_hit_blocks == 2  # the prefix, off device
    assert all(cache.trie.locate(key) is not None for key in eviction.offloaded_keys)
    cache.check_invariants()


def test_a_host_copy_set_then_cleared_leaves_cost_aware_ranking_as_before():
    # clear_tier did not re-rank the leaf set_tier had re-ranked: it kept the priority of a
    # page with a host copy (cheaper to lose) and went first
    def victim(touch_tier):
        cache, clock = make_cache("cost_aware", num_blocks=16, page_size=16)
        older, newer = [1] * 33, [2] * 33
        run(cache, clock, older, at=0.0)
        run(cache, clock, newer, at=10.0)
        if touch_tier:
            cache.set_tier(newer, None, 1, Tier.HOST)
            cache.clear_tier(newer, None, 1, Tier.HOST)
        cache.evict(1)
        return "older" if cache.match(older).num_hit_blocks < 2 else "newer"

    assert victim(touch_tier=True) == victim(touch_tier=False) == "older"
