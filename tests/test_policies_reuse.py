"""The predicted-reuse eviction policy: kinds, learned offsets, exact victim order, invariants."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule
from test_eviction_adaptive import AdaptiveCacheMachine

from kvjax.cache.cost_model import CostModel
from kvjax.cache.device_index import DeviceIndex
from kvjax.cache.policies import DEFAULT_POLICY, POLICIES, ReusePolicy, make_policy
from kvjax.tools.replay import replay_trace
from kvjax.tools.trace import TraceRequest

ROOT_FRESH, ROOT_RETURNED, ROOT_HIT_ONCE, ROOT_HIT_MORE = range(4)
DEEP_FRESH, DEEP_RETURNED, DEEP_HIT_ONCE, DEEP_HIT_MORE = range(4, 8)


class FakeNode:
    """The fields ReusePolicy reads."""

    def __init__(self, key, *, first_page=0, hits=0, last_access=0.0, num_pages=1, parent=None):
        self.key, self.first_page, self.hits, self.last_access = key, first_page, hits, last_access
        self.num_pages, self.parent = num_pages, parent


def _bound(policy):
    policy.bind(1, 0, CostModel())
    return policy


def _trained(horizon_s=10.0):
    """A policy that saw 128 one-off root nodes and 64 deeper nodes each hit 1 s after insertion:
    exactly 256 one-page trials, so its offsets were recomputed once, with H = 10 s."""
    policy = _bound(ReusePolicy(initial_horizon_s=horizon_s))
    for i in range(128):
        policy.priority(FakeNode(b"one-off %d" % i, last_access=float(i)), float(i))
    for i in range(64):
        policy.priority(FakeNode(b"turn %d" % i, first_page=1, last_access=float(i)), float(i))
        policy.priority(FakeNode(b"turn %d" % i, first_page=1, hits=1, last_access=i + 1.0), i + 1.0)
    return policy


def test_reuse_is_the_default_and_built_by_name():
    assert DEFAULT_POLICY == "reuse" and POLICIES["reuse"] is ReusePolicy
    assert isinstance(make_policy("reuse", history_nodes=8), ReusePolicy)


def test_before_it_learns_anything_it_ranks_like_lru():
    policy = _bound(ReusePolicy())
    assert policy.offsets() == [0.0] * 8
    for hits, first_page in ((0, 0), (0, 3), (1, 0), (5, 2)):
        node = FakeNode(b"k%d%d" % (hits, first_page), first_page=first_page, hits=hits, last_access=7.5)
        assert policy.priority(node, 100.0) == 7.5


def test_learned_offsets_are_horizon_times_log_reuse_rate():
    policy = _trained()
    assert policy.horizon == 10.0  # every hit came 1 s < H after its use: no boundary event
    rates = policy.reuse_rates()
    # Prior: one trial, half reused. One-offs: 128 trials, none reused.
    assert rates[ROOT_FRESH] == pytest.approx(0.5 / 129)
    assert rates[DEEP_FRESH] == pytest.approx(64.5 / 65)  # each reused 1 s later, within H
    assert rates[DEEP_HIT_ONCE] == pytest.approx(0.5 / 65)  # not (yet) used a third time
    assert rates[ROOT_RETURNED] == 0.5  # kinds never seen keep the prior
    offsets = policy.offsets()
    assert offsets[ROOT_FRESH] == pytest.approx(10.0 * math.log(0.5 / 129))  # -55.6 s
    assert offsets[DEEP_FRESH] == pytest.approx(10.0 * math.log(64.5 / 65))  # -0.08 s
    assert offsets[ROOT_HIT_MORE] == pytest.approx(10.0 * math.log(0.5))


def test_priority_is_last_access_plus_the_offset_of_the_kind():
    policy = _trained()
    offsets = policy.offsets()
    cases = [
        (FakeNode(b"new root", last_access=500.0), ROOT_FRESH),
        (FakeNode(b"new turn", first_page=4, last_access=500.0), DEEP_FRESH),
        (FakeNode(b"hot root", hits=1, last_access=500.0), ROOT_HIT_ONCE),
        (FakeNode(b"hot deep", first_page=2, hits=9, last_access=500.0), DEEP_HIT_MORE),
    ]
    for node, kind in cases:
        assert policy.priority(node, 600.0) == 500.0 + offsets[kind]


def test_a_node_that_comes_back_after_eviction_is_returned_not_fresh():
    policy = _bound(ReusePolicy())
    policy.priority(FakeNode(b"doc", last_access=1.0), 1.0)
    # Evicted, then inserted again by a later request: a new node, hits 0, newer access.
    policy.priority(FakeNode(b"doc", last_access=50.0), 50.0)
    assert policy.reuse_rates()[ROOT_FRESH] == pytest.approx(0.5 / 2)  # used again, but 49 s > H
    assert policy.horizon == 10.0  # a miss older than H says nothing about H
    policy.priority(FakeNode(b"doc", last_access=52.0), 52.0)  # evicted and back again, 2 s later
    assert policy.reuse_rates()[ROOT_RETURNED] == pytest.approx(1.5 / 3)  # two trials, one reused
    assert policy.horizon == pytest.approx(10.0 * math.exp(-0.02))  # a miss 2 s < H: H shrinks


def test_pushing_a_node_again_unchanged_counts_nothing():
    policy = _bound(ReusePolicy())
    node = FakeNode(b"x", first_page=3, last_access=4.0, num_pages=9)
    first = policy.priority(node, 4.0)
    before = (policy.reuse_rates(), policy.horizon)
    node.num_pages = 5  # its tail was evicted: pushed again with the same last access
    assert policy.priority(node, 9.0) == first
    assert (policy.reuse_rates(), policy.horizon) == before


def test_a_hit_older_than_the_horizon_raises_it():
    policy = _bound(ReusePolicy(initial_horizon_s=10.0))
    policy.priority(FakeNode(b"a", last_access=0.0), 0.0)
    policy.priority(FakeNode(b"a", hits=1, last_access=30.0), 30.0)  # kept 30 s > H and hit
    assert policy.horizon == pytest.approx(10.0 * math.exp(0.02))


def test_the_path_of_a_request_is_observed_up_to_the_first_node_already_seen():
    policy = _bound(ReusePolicy())
    root = FakeNode(b"")  # a namespace root: parent None, never observed
    system = FakeNode(b"system", num_pages=4, last_access=1.0, parent=root)
    turn = FakeNode(b"turn 1", first_page=4, last_access=1.0, parent=system)
    policy.priority(turn, 1.0)  # sees turn 1 and, walking up, the system prompt
    system.hits, system.last_access = 1, 5.0
    turn.hits, turn.last_access = 1, 5.0
    reply = FakeNode(b"turn 2", first_page=6, last_access=5.0, parent=turn)
    policy.priority(reply, 5.0)
    rates = policy.reuse_rates()
    assert rates[ROOT_FRESH] == pytest.approx((0.5 + 2.0) / (1 + 2.0))  # system: weight sqrt(4)
    assert rates[DEEP_FRESH] == pytest.approx((0.5 + 1) / (1 + 2))  # turn 1 reused; turn 2 not yet
    assert rates[ROOT_HIT_ONCE] == pytest.approx(0.5 / (1 + 2.0))
    other = FakeNode(b"turn 2b", first_page=6, last_access=5.0, parent=turn)
    policy.priority(other, 5.0)  # a sibling at the same time: the walk stops at turn 1
    assert policy.reuse_rates()[ROOT_HIT_ONCE] == rates[ROOT_HIT_ONCE]


def test_victim_order_in_a_cache_follows_the_learned_kinds():
    # Trained: one-off root sequences are never reused, deeper extensions are reused at once.
    now = [0.0]
    cache = DeviceIndex(6, 1, policy=_trained(), clock=lambda: now[0])

    def run(tokens, at):
        now[0] = at
        handle = cache.admit(tokens)
        cache.commit(handle, tokens)
        cache.release(handle)
        return handle.block_ids.tolist()

    chat = run([1, 2], 990.0)  # a root sequence...
    turn = run([1, 2, 3], 995.0)  # ...extended 5 s later: [1, 2] hit once, [3] deeper and fresh
    one_off = run([7, 8], 1000.0)  # a root sequence used once, the newest of all
    # LRU would take [3] (last used at 995) before [7, 8] (1000). The learned kinds say a fresh
    # root page is 250x less likely to be used again: [7, 8] goes first, its tail page first.
    assert cache.evict(1) == [one_off[1]]
    assert cache.evict(1) == [one_off[0]]
    assert cache.evict(1) == [turn[2]]
    assert cache.evict(2) == chat
    cache.check_invariants()


def test_it_learns_to_keep_a_hot_prefix_through_a_flood_of_one_off_requests():
    # A 4-block prefix asked every 10 s; between, 3-block one-offs every second; room for 8.
    requests = []
    for second in range(1500):
        if second % 10 == 0:
            requests.append(TraceRequest(1000.0 * second, 4 * 4 + 2, 1, (1, 2, 3, 4, 100_000 + second)))
        else:
            requests.append(TraceRequest(1000.0 * second, 3 * 4, 1, (10 * second, 10 * second + 1, 10 * second + 2)))
    lru = replay_trace(requests, 8, policy="lru", block_tokens=4).hit_blocks
    reuse = replay_trace(requests, 8, policy="reuse", block_tokens=4, check_every=97).hit_blocks
    assert lru == 0  # 27 one-off blocks between two uses of the prefix always flush it
    assert reuse > 4 * 100  # it hits the prefix on most of its 150 uses once it has learned


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"history_nodes": 0}, r"history_nodes=0 must be >= 1"),
        ({"horizon_step": 0.0}, r"horizon_step=0.0 must be in \(0, 1\]"),
        ({"horizon_step": 2.0}, r"horizon_step=2.0 must be in \(0, 1\]"),
        ({"memory": 0}, r"memory=0 must be >= 1 trial"),
        ({"initial_horizon_s": 0.0}, r"initial_horizon_s=0.0 must be a positive number of seconds"),
        ({"initial_horizon_s": math.inf}, r"initial_horizon_s=inf must be a positive number"),
    ],
)
def test_bad_parameters_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReusePolicy(**kwargs)


def test_check_invariants_names_a_broken_count():
    policy = _trained()
    policy._reused[3] = policy._trials[3] + 1.0
    with pytest.raises(RuntimeError, match=r"kind 3: reused=.* outside \[0, trials="):
        policy.check_invariants()


_observation = st.tuples(  # key, first_page, hits, num_pages, seconds since the previous one
    st.integers(0, 3), st.integers(0, 2), st.integers(0, 3), st.integers(1, 6), st.floats(0.0, 15.0)
)
_observations = st.lists(_observation, max_size=300)


@settings(max_examples=150, deadline=None)
@given(_observations, st.integers(1, 6), st.integers(1, 40))
def test_any_sequence_of_observations_keeps_the_invariants(observations, history_nodes, memory):
    """Keys, depths, hits, sizes and time steps at random: the history stays bounded, counts
    consistent, offsets finite and <= 0 (a priority is at most the node's last access), and a
    node pushed again unchanged gets the same priority whatever ``now`` is."""
    policy = _bound(ReusePolicy(history_nodes=history_nodes, memory=memory))
    clock = 0.0
    for key, first_page, hits, num_pages, step in observations:
        clock += step
        node = FakeNode(b"%d" % key, first_page=first_page, hits=hits, last_access=clock, num_pages=num_pages)
        priority = policy.priority(node, clock)
        assert clock + min(policy.offsets()) - 1e-9 <= priority <= clock
        assert policy.priority(node, clock + 1e6) == priority
        policy.check_invariants()


class ReuseCacheMachine(AdaptiveCacheMachine):
    """The adaptive policy's cache machine (admits, commits, releases, evictions) under the
    reuse policy, with time also jumping ahead, so hits and returns cross the horizon."""

    def __init__(self):
        super().__init__()
        self.policy = ReusePolicy(history_nodes=16, memory=8)
        self.cache = DeviceIndex(12, 2, policy=self.policy, clock=lambda: self.now)

    @rule(seconds=st.floats(0.0, 60.0))
    def wait(self, seconds):
        self.now += seconds


TestReuseCacheMachine = ReuseCacheMachine.TestCase
TestReuseCacheMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
