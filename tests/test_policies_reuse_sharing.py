"""Reuse statistics shared between cluster nodes: what a policy publishes, how it merges its
peers', bad input, and that merging keeps the policy's invariants."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_policies_reuse import PRIOR_FRESH, PRIOR_SEEN, PRIOR_TRIALS, FakeNode, _bound, _trained

from kvjax.cache.policies import ReusePolicy, ReuseStatistics

ROOT_FRESH, ROOT_RETURNED, ROOT_HIT_ONCE, ROOT_HIT_MORE = range(4)
DEEP_FRESH, DEEP_RETURNED, DEEP_HIT_ONCE, DEEP_HIT_MORE = range(4, 8)
PRIOR_REUSED = [PRIOR_TRIALS * (PRIOR_FRESH if kind % 4 == ROOT_FRESH else PRIOR_SEEN) for kind in range(8)]


def _stats(trials=(0.0,) * 8, reused=(0.0,) * 8, closed=0, horizon=10.0, boundary_events=0):
    return ReuseStatistics(tuple(trials), tuple(reused), closed, horizon, boundary_events)


def test_statistics_are_the_own_trials_without_the_prior():
    """_trained closed 128 one-off roots (never reused), 64 deeper nodes (all reused 1 s
    later) and their 64 hit-once trials (never reused again)."""
    stats = _trained().statistics()
    expected_trials = [0.0] * 8
    expected_trials[ROOT_FRESH], expected_trials[DEEP_FRESH], expected_trials[DEEP_HIT_ONCE] = 128.0, 64.0, 64.0
    expected_reused = [0.0] * 8
    expected_reused[DEEP_FRESH] = 64.0
    assert list(stats.trials) == pytest.approx(expected_trials)
    assert list(stats.reused) == pytest.approx(expected_reused)
    assert (stats.closed, stats.horizon, stats.boundary_events) == (256, 10.0, 0)


def test_merged_counts_add_to_the_own_in_the_rates_the_offsets_and_the_trust():
    policy = _trained(trust_trials=300.0)
    own_trials, own_reused = list(policy._trials), list(policy._reused)
    peer_a = _stats(trials=[10.0] * 8, reused=[5.0] * 8, closed=80)
    peer_b = _stats(trials=[30.0] * 8, reused=[0.0] * 8, closed=20)
    policy.merge_peer_statistics([peer_a, peer_b], horizon=False)
    rates = [(reused + 5.0) / (trials + 40.0) for reused, trials in zip(own_reused, own_trials)]
    expected_trust = (256 + 100) / (256 + 100 + 300)
    assert policy.trust() == pytest.approx(expected_trust)
    assert policy.learned_offsets() == pytest.approx([10.0 * math.log(rate) for rate in rates])
    assert policy.offsets() == pytest.approx([expected_trust * 10.0 * math.log(rate) for rate in rates])
    assert policy.priority(FakeNode(b"new", first_page=2, last_access=2000.0), 2000.0) == pytest.approx(
        2000.0 + policy.offsets()[DEEP_FRESH])
    assert policy.horizon == 10.0  # horizon=False leaves it alone


def test_each_merge_replaces_the_last_and_no_peers_is_the_own_evidence_only():
    alone, policy = _trained(trust_trials=300.0), _trained(trust_trials=300.0)
    peer = _stats(trials=[50.0] * 8, reused=[1.0] * 8, closed=500)
    policy.merge_peer_statistics([peer], horizon=False)
    once = policy.offsets()
    policy.merge_peer_statistics([peer], horizon=False)  # a repeated exchange changes nothing
    assert policy.offsets() == pytest.approx(once) and once != pytest.approx(alone.offsets())
    policy.merge_peer_statistics([])  # every peer gone
    assert policy.offsets() == pytest.approx(alone.offsets()) and policy.trust() == alone.trust()


def test_peers_that_learned_the_same_rates_change_the_rates_not_and_raise_the_trust():
    policy = _trained(trust_trials=300.0)
    rates, stats = policy.reuse_rates(), policy.statistics()
    policy.merge_peer_statistics([stats] * 3)
    # own counts (prior included) plus 3 x the own without prior: the prior weighs less
    expected = [(reused + 3 * (reused - prior)) / (trials + 3 * (trials - PRIOR_TRIALS))
                for reused, trials, prior in zip(policy._reused, policy._trials, PRIOR_REUSED)]  # fmt: skip
    assert [math.exp(offset / policy.horizon) for offset in policy.learned_offsets()] == pytest.approx(
        [max(rate, 1e-3) for rate in expected])
    assert rates[DEEP_FRESH] < expected[DEEP_FRESH]  # nearer the learned 1.0 than the prior's pull
    assert policy.trust() == pytest.approx(4 * 256 / (4 * 256 + 300))


def test_the_horizon_moves_to_the_geometric_mean_weighted_by_boundary_events():
    policy = _bound(ReusePolicy(initial_horizon_s=10.0))  # 0 boundary events: weight 1
    policy.merge_peer_statistics([_stats(horizon=1000.0, boundary_events=2), _stats(horizon=100.0)])
    assert policy.horizon == pytest.approx(math.exp((math.log(10) + 3 * math.log(1000) + math.log(100)) / 5))
    assert policy.learned_offsets()[ROOT_FRESH] == pytest.approx(policy.horizon * math.log(PRIOR_FRESH))
    assert policy.own_horizon == 10.0 and policy.statistics().horizon == 10.0  # peers never change its own
    blended = policy.horizon
    for _ in range(3):  # the same statistics again (a stalled peer's publisher rewrites them): no drift
        policy.merge_peer_statistics([_stats(horizon=1000.0, boundary_events=2), _stats(horizon=100.0)])
        assert policy.horizon == pytest.approx(blended)
    policy.merge_peer_statistics([])  # the peers left: back to its own
    assert policy.horizon == 10.0
    policy.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"trials": (1.0,) * 7}, r"trials=.* must be a tuple of 8 counts"),
        ({"trials": [1.0] * 8}, r"trials=.* must be a tuple of 8 counts"),
        ({"trials": (1.0,) * 7 + (-1.0,)}, r"every count must be a number in \[0, 2\*\*53\], not -1.0"),
        ({"reused": (math.nan,) * 8}, r"every count must be a number in \[0, 2\*\*53\], not nan"),
        ({"trials": (1.0,) * 8, "reused": (0.0,) * 7 + (2.0,)}, r"kind 7: reused=2.0 > trials=1.0"),
        ({"closed": -1}, r"closed=-1 must be an int in \[0, 2\*\*53\]"),
        ({"closed": True}, r"closed=True must be an int in \[0, 2\*\*53\]"),
        ({"boundary_events": 1.5}, r"boundary_events=1.5 must be an int in \[0, 2\*\*53\]"),
        ({"horizon": 0.0}, r"horizon=0.0 must be a positive number of seconds <= 2\*\*53"),
        ({"horizon": math.inf}, r"horizon=inf must be a positive number"),
    ],
)
def test_bad_statistics_raise_value_error_naming_the_value(kwargs, message):
    fields = {"trials": (1.0,) * 8, "reused": (0.0,) * 8, "closed": 1, "horizon": 10.0, "boundary_events": 0}
    with pytest.raises(ValueError, match=message):
        ReuseStatistics(**{**fields, **kwargs})


@pytest.mark.parametrize(
    "fields",
    [
        {"trials": [10**400] * 8},  # was an OverflowError comparing with reused
        {"closed": 10**400},  # was an OverflowError in the merge's trust ramp
        {"boundary_events": 10**400},  # was an OverflowError weighing the horizon
        {"closed": 2**1023},  # accepted, and two such peers overflowed the trust ramp
        {"trials": [1.5e308] * 8, "reused": [1.5e308] * 8},  # two such peers: inf / inf, NaN offsets
        {"horizon": 1.7e308, "boundary_events": 10**6},  # H * ln p = -inf, trust 0: NaN offsets
    ],
)
def test_peer_records_a_merge_cannot_take_are_a_value_error(fields):
    """A peer's record (another version's, a broken node's) out of any real range is rejected
    where the node skips bad records (ValueError), never raised from the merge in the engine
    thread, nor merged into NaN offsets."""
    base = {"trials": [0.0] * 8, "reused": [0.0] * 8, "closed": 0, "horizon": 10.0, "boundary_events": 0}
    with pytest.raises(ValueError, match=r"2\*\*53"):
        ReuseStatistics.from_dict({**base, **fields})
    edge = ReuseStatistics.from_dict({key: [2**53] * 8 if key in ("trials", "reused") else 2**53
                                      for key in base})  # fmt: skip
    policy = _bound(ReusePolicy())
    policy.merge_peer_statistics([edge] * 3)
    policy.check_invariants()


def test_peers_each_within_the_rounding_tolerance_keep_the_invariants():
    """Each record may carry reused a hair above trials (float rounding); summed over three
    peers that once exceeded check_invariants' own tolerance."""
    policy = _bound(ReusePolicy())
    policy.merge_peer_statistics([_stats(trials=(0.0,) * 8, reused=(1e-9,) * 8)] * 3)
    policy.check_invariants()
    assert policy.learned_offsets() == pytest.approx(ReusePolicy().learned_offsets())


def test_statistics_travel_as_json_and_bad_records_are_named():
    stats = _trained().statistics()
    assert ReuseStatistics.from_dict(json.loads(json.dumps(stats.as_dict()))) == stats
    with pytest.raises(ValueError, match=r"lack \['horizon'\]"):
        ReuseStatistics.from_dict({key: value for key, value in stats.as_dict().items() if key != "horizon"})
    with pytest.raises(ValueError, match=r"trials='x' must be a list of 8 counts"):
        ReuseStatistics.from_dict({**stats.as_dict(), "trials": "x"})
    with pytest.raises(ValueError, match=r"must be a mapping, not list"):
        ReuseStatistics.from_dict([1, 2])
    with pytest.raises(TypeError, match=r"must be ReuseStatistics, not dict"):
        _trained().merge_peer_statistics([stats.as_dict()])


_observation = st.tuples(  # key, first_page, hits, num_pages, seconds since the previous one
    st.integers(0, 3), st.integers(0, 2), st.integers(0, 3), st.integers(1, 6), st.floats(0.0, 15.0)
)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), _observation), max_size=200), st.integers(1, 40),
       st.integers(1, 9), st.booleans())  # fmt: skip
def test_nodes_exchanging_statistics_keep_every_invariant(steps, memory, every, horizon):
    """Three policies observe interleaved streams (halvings included) and exchange their
    statistics every few observations: each publishes valid statistics whose counts are its
    own without the prior (the prior halved with them), rates stay in [0, 1], offsets finite
    and <= 0, and the trust counts every node's closed trials."""
    policies = [_bound(ReusePolicy(history_nodes=8, memory=memory)) for _ in range(3)]
    clock = 0.0
    for index, (node, (key, first_page, hits, num_pages, step)) in enumerate(steps):
        clock += step
        policies[node].priority(FakeNode(b"%d" % key, first_page=first_page, hits=hits, last_access=clock,
                                         num_pages=num_pages), clock)  # fmt: skip
        if index % every == 0:
            published = [policy.statistics() for policy in policies]
            for me, policy in enumerate(policies):
                policy.merge_peer_statistics(published[:me] + published[me + 1 :], horizon=horizon)
                policy.check_invariants()
                assert all(-math.inf < offset <= 0.0 for offset in policy.offsets())
                assert policy.trust() == pytest.approx(
                    sum(stats.closed for stats in published) / (sum(stats.closed for stats in published) + 200.0))
    for policy in policies:
        stats, scale = policy.statistics(), policy._prior_scale
        assert list(stats.trials) == pytest.approx([trials - PRIOR_TRIALS * scale for trials in policy._trials],
                                                   abs=1e-9)  # fmt: skip
        assert list(stats.reused) == pytest.approx(
            [reused - prior * scale for reused, prior in zip(policy._reused, PRIOR_REUSED)], abs=1e-9)


_peer_stats = st.builds(
    lambda trials, shares, closed, horizon, events: _stats(
        trials, [t * s for t, s in zip(trials, shares)], closed, horizon, events),
    st.lists(st.floats(0.0, 1e6), min_size=8, max_size=8),
    st.lists(st.floats(0.0, 1.0), min_size=8, max_size=8),
    st.integers(0, 10**6), st.floats(0.01, 1e5), st.integers(0, 10**4))  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(st.lists(_peer_stats, min_size=1, max_size=6), st.integers(0, 5))
def test_a_pool_of_peers_merges_as_the_peers_do_and_pools_of_pools_are_one_pool(peers, cut):
    # the simulated cluster merges each node's peers as two pools (those before it, those after)
    separate, pooled = _trained(trust_trials=300.0), _trained(trust_trials=300.0)
    separate.merge_peer_statistics(peers)
    pooled.merge_peer_statistics([ReuseStatistics.pooled(peers)])
    assert pooled.horizon == pytest.approx(separate.horizon, rel=1e-9)
    assert pooled.trust() == pytest.approx(separate.trust(), rel=1e-12)
    assert pooled.offsets() == pytest.approx(separate.offsets(), rel=1e-9, abs=1e-9)
    cut = min(cut, len(peers))
    parts = [ReuseStatistics.pooled(part) for part in (peers[:cut], peers[cut:]) if part]
    whole, of_parts = ReuseStatistics.pooled(peers), ReuseStatistics.pooled(parts)
    assert (of_parts.closed, of_parts.boundary_events) == (whole.closed, whole.boundary_events)
    assert list(of_parts.trials) == pytest.approx(list(whole.trials), rel=1e-12)
    assert list(of_parts.reused) == pytest.approx(list(whole.reused), rel=1e-12)
    assert of_parts.horizon == pytest.approx(whole.horizon, rel=1e-9)
    assert ReuseStatistics.pooled([]) is None
