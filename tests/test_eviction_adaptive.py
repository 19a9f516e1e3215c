"""Segmented and adaptive eviction: segments, the ghost history, adaptation, and a live cache."""

import math

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvjax.cache.cost_model import CostModel
from kvjax.cache.device_index import DeviceIndex
from kvjax.cache.policies import (
    DEFAULT_POLICY,
    POLICIES,
    AdaptiveSegmentedPolicy,
    SegmentedPolicy,
    make_policy,
)
from kvjax.tools.replay import replay_trace
from kvjax.tools.trace import TraceRequest


class FakeNode:
    """The fields a policy reads; pages are one token each (page_size=1)."""

    def __init__(self, tokens, *, first_page=0, hits=0, last_access=0.0):
        self.label = memoryview(np.asarray(tokens, "<i4").tobytes())
        self.first_page, self.hits, self.last_access = first_page, hits, last_access


def _bound(policy):
    policy.bind(1, 0, CostModel())
    return policy


def test_default_policy_is_registered_and_built_by_name():
    assert DEFAULT_POLICY in POLICIES
    assert isinstance(make_policy("segmented"), SegmentedPolicy)
    assert isinstance(make_policy("adaptive", step=0.5), AdaptiveSegmentedPolicy)


def test_segmented_ranks_probation_by_recency_and_protected_last():
    policy = _bound(SegmentedPolicy())
    assert policy.priority(FakeNode([1, 2], last_access=5.0), 9.0) == 5.0
    assert policy.priority(FakeNode([3], hits=1, last_access=1.0), 9.0) == math.inf


def test_a_page_that_comes_back_after_eviction_is_protected():
    policy = _bound(SegmentedPolicy())
    assert policy.priority(FakeNode([7, 8], first_page=3, last_access=1.0), 1.0) == 1.0
    # Evicted, then inserted again by a later request: a new node, hits 0, newer access.
    assert policy.priority(FakeNode([8, 9], first_page=4, last_access=6.0), 6.0) == math.inf
    # Same tokens at another depth are another page: no ghost hit.
    assert policy.priority(FakeNode([8, 9], first_page=5, last_access=7.0), 7.0) == 7.0


def test_pushing_a_node_again_unchanged_is_not_a_ghost_hit_and_keeps_its_segment():
    policy = _bound(SegmentedPolicy())
    node = FakeNode([1, 2], last_access=2.0)
    assert policy.priority(node, 2.0) == policy.priority(node, 8.0) == 2.0
    policy.priority(FakeNode([1, 2], last_access=4.0), 4.0)  # came back: protected
    head = FakeNode([1], last_access=4.0)  # the head of a split keeps the access time
    assert policy.priority(head, 9.0) == math.inf


def test_the_ghost_forgets_its_oldest_pages_beyond_its_capacity():
    policy = _bound(SegmentedPolicy(ghost_pages=2))
    policy.priority(FakeNode([1], last_access=1.0), 1.0)
    policy.priority(FakeNode([2, 3], first_page=1, last_access=2.0), 2.0)  # pushes out page 0
    assert policy.priority(FakeNode([1], last_access=3.0), 3.0) == 3.0
    policy.check_invariants()


def test_adaptive_learns_the_hit_age_and_protects_for_omega_times_it():
    policy = _bound(AdaptiveSegmentedPolicy(initial_omega=2.0))
    policy.priority(FakeNode([1, 2], last_access=10.0), 10.0)
    assert policy.hit_age is None and policy.protection() == 0.0
    # Hit 4 s after the last use: R = 4, protection = 2 * 4.
    assert policy.priority(FakeNode([1, 2], hits=1, last_access=14.0), 14.0) == 14.0 + 8.0
    policy.priority(FakeNode([1, 2], hits=2, last_access=24.0), 24.0)  # age 10: R += 0.02 * 6
    assert policy.hit_age == pytest.approx(4.12)


def _adaptive_with_ghost(evicted_hits):
    """Policy with R = 5 s and one ghost page (page 0, token 9) seen last at t=20."""
    policy = _bound(AdaptiveSegmentedPolicy(initial_omega=1.0, step=0.25))
    policy.priority(FakeNode([5], first_page=7, last_access=0.0), 0.0)
    policy.priority(FakeNode([5], first_page=7, hits=1, last_access=5.0), 5.0)  # R = 5
    policy.priority(FakeNode([9], hits=evicted_hits, last_access=20.0), 20.0)
    return policy


def test_a_near_miss_on_a_protected_page_raises_omega():
    policy = _adaptive_with_ghost(evicted_hits=1)
    # Ghost: page 7 and page 0 both protected -> weight max(1, 0 / 2) = 1.
    policy.priority(FakeNode([9], last_access=29.0), 29.0)  # gap 9 <= 2 * R
    assert policy.omega == pytest.approx(1.25)


def test_a_near_miss_on_a_probation_page_lowers_omega_weighted_by_the_ghost():
    policy = _adaptive_with_ghost(evicted_hits=0)
    # Ghost: 1 protected page, 1 probation page -> weight 1.
    policy.priority(FakeNode([9], last_access=30.0), 30.0)  # gap 10 == 2 * R: still near
    assert policy.omega == pytest.approx(0.75)


def test_a_late_comeback_leaves_omega_alone():
    policy = _adaptive_with_ghost(evicted_hits=0)
    assert policy.priority(FakeNode([9], last_access=31.0), 31.0) == 31.0 + 1.0 * 5.0
    assert policy.omega == 1.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ghost_pages": -1}, r"ghost_pages=-1 must be an int >= 0"),
        ({"initial_omega": 5.0, "max_omega": 4.0}, r"need 0 <= initial_omega=5.0 <= max_omega=4.0"),
        ({"initial_omega": -1.0}, r"need 0 <= initial_omega=-1.0"),
        ({"step": 0.0}, r"step=0.0 must be a finite number > 0"),
        ({"near_miss": -1.0}, r"near_miss=-1.0 must be a finite number > 0"),
        ({"smoothing": 0.0}, r"smoothing=0.0 must be a finite number > 0"),
        ({"smoothing": 1.5}, r"smoothing=1.5 must be in \(0, 1\]"),
    ],
)
def test_bad_parameters_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveSegmentedPolicy(**kwargs)


def test_segmented_keeps_a_reused_prefix_through_a_one_off_request():
    # Room for 4: [1, 2] is used twice, then the one-off [3, 4] and [5, 6] need room.
    # LRU evicts [1, 2] (oldest) for [5, 6] and misses it at the end: 2 hits in all.
    # Segmented evicts the probation [3, 4] instead and hits [1, 2] again: 4 hits.
    paths = [[1, 2], [1, 2], [3, 4], [5, 6], [1, 2]]
    requests = [TraceRequest(1000.0 * i, 8, 1, tuple(p)) for i, p in enumerate(paths)]
    assert replay_trace(requests, 4, policy="lru", block_tokens=4).hit_blocks == 2
    assert replay_trace(requests, 4, policy="segmented", block_tokens=4, check_every=1).hit_blocks == 4


class AdaptiveCacheMachine(RuleBasedStateMachine):
    """A small DeviceIndex under the adaptive policy: random admits, commits, releases."""

    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.policy = AdaptiveSegmentedPolicy(ghost_pages=24)
        self.cache = DeviceIndex(12, 2, policy=self.policy, clock=lambda: self.now)
        self.running = []

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=9), commit=st.booleans())
    def admit(self, tokens, commit):
        self.now += 1.0
        handle = self.cache.admit(tokens)
        if handle is not None:
            if commit:
                self.cache.commit(handle, tokens)
            self.running.append(handle)

    @rule(index=st.integers(0, 7))
    def release(self, index):
        if self.running:
            self.now += 1.0
            self.cache.release(self.running.pop(index % len(self.running)))

    @rule(num_blocks=st.integers(0, 6))
    def evict(self, num_blocks):
        self.cache.evict(num_blocks)

    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        self.policy.check_invariants()


TestAdaptiveCacheMachine = AdaptiveCacheMachine.TestCase
TestAdaptiveCacheMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
