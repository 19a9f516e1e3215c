"""The predicted-reuse eviction policy: kinds, learned offsets, exact victim order, invariants."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule
from test_eviction import Clock
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


PRIOR_TRIALS, PRIOR_FRESH, PRIOR_SEEN = 4.0, 0.1, 0.9  # the policy's prior, per kind


def _trained(horizon_s=10.0, trust_trials=0.0, offset_scale=1.0):
    """A policy that saw 128 one-off root nodes (t = 0..127 s), then 64 deeper nodes each hit
    1 s after insertion (t = 200..264 s): 256 one-page trials. Offsets recomputed at the end.
    By default it trusts what it learned in full (``trust_trials=0``)."""
    policy = _bound(ReusePolicy(initial_horizon_s=horizon_s, trust_trials=trust_trials, offset_scale=offset_scale))
    for i in range(128):
        policy.priority(FakeNode(b"one-off %d" % i, last_access=float(i)), float(i))
    for i in range(64):
        policy.priority(FakeNode(b"turn %d" % i, first_page=1, last_access=200.0 + i), 200.0 + i)
        policy.priority(FakeNode(b"turn %d" % i, first_page=1, hits=1, last_access=201.0 + i), 201.0 + i)
    policy.priority(FakeNode(b"later", first_page=1, hits=5, last_access=1000.0), 1000.0)  # closes the rest
    policy._refresh()
    return policy


def test_reuse_is_the_default_and_built_by_name():
    assert DEFAULT_POLICY == "reuse" and POLICIES["reuse"] is ReusePolicy
    assert isinstance(make_policy("reuse", history_nodes=8), ReusePolicy)


def test_before_any_trial_is_closed_it_ranks_like_plain_lru():
    """Trust 0: every offset 0, a priority is the node's last access, whatever its kind."""
    policy = _bound(ReusePolicy())
    assert policy.trust() == 0.0 and policy.offsets() == [0.0] * 8
    assert policy.priority(FakeNode(b"new", last_access=50.0), 50.0) == 50.0
    assert policy.priority(FakeNode(b"hot", first_page=3, hits=2, last_access=30.0), 50.0) == 30.0


def test_trust_grows_with_closed_trials_and_scales_the_learned_offsets():
    """_trained opened 257 trials and closed all but the last node's: trust 256 / (256 + 300)."""
    policy = _trained(trust_trials=300.0)
    full = _trained()
    assert policy.trust() == pytest.approx(256 / 556)
    assert policy.learned_offsets() == pytest.approx(full.offsets())
    assert policy.offsets() == pytest.approx([256 / 556 * offset for offset in full.offsets()])


def test_with_full_trust_before_evidence_it_ranks_like_a_softened_segmented_lru():
    """The prior: a page used once (fresh) is 9x less likely to be used again than one seen
    before, so it goes H ln 9 (22 s at H = 10 s) earlier; LRU inside each kind."""
    policy = _bound(ReusePolicy(trust_trials=0.0))
    fresh, seen = 10.0 * math.log(PRIOR_FRESH), 10.0 * math.log(PRIOR_SEEN)
    assert policy.offsets() == pytest.approx([fresh, seen, seen, seen] * 2)
    assert policy.priority(FakeNode(b"new", last_access=50.0), 50.0) == pytest.approx(50.0 + fresh)
    assert policy.priority(FakeNode(b"hot", first_page=3, hits=2, last_access=30.0), 50.0) == pytest.approx(30.0 + seen)
    assert 30.0 + seen > 50.0 + fresh  # the page hit twice outlives the newer page used once


def test_learned_offsets_are_horizon_times_log_reuse_rate():
    policy = _trained()
    assert policy.horizon == 10.0  # every hit came 1 s < H after its use: no boundary event
    assert policy.open_trials() == 1  # only the last node's
    rates = policy.reuse_rates()
    prior_fresh, prior_seen = PRIOR_TRIALS * PRIOR_FRESH, PRIOR_TRIALS * PRIOR_SEEN
    assert rates[ROOT_FRESH] == pytest.approx(prior_fresh / (PRIOR_TRIALS + 128))  # one-offs: never reused
    assert rates[DEEP_FRESH] == pytest.approx((prior_fresh + 64) / (PRIOR_TRIALS + 64))  # reused 1 s later
    assert rates[DEEP_HIT_ONCE] == pytest.approx(prior_seen / (PRIOR_TRIALS + 64))  # no third use within H
    assert rates[ROOT_RETURNED] == PRIOR_SEEN  # kinds never seen keep the prior
    offsets = policy.offsets()
    assert offsets[ROOT_FRESH] == pytest.approx(10.0 * math.log(prior_fresh / 132))  # -34.9 s
    assert offsets[DEEP_FRESH] == pytest.approx(10.0 * math.log(64.4 / 68))  # -0.5 s
    assert offsets[ROOT_HIT_MORE] == pytest.approx(10.0 * math.log(PRIOR_SEEN))


def test_a_trial_counts_once_when_reused_within_the_horizon_or_when_it_passes():
    """Censoring: a node seen a moment ago has not had its chance yet, so it is not counted
    as unused until H has passed; a reuse within H counts it as reused at once."""
    policy = _bound(ReusePolicy(initial_horizon_s=10.0))
    policy.priority(FakeNode(b"a", last_access=0.0), 0.0)
    policy.priority(FakeNode(b"b", last_access=6.0), 6.0)
    assert policy.open_trials() == 2 and policy.reuse_rates()[ROOT_FRESH] == PRIOR_FRESH
    policy.priority(FakeNode(b"b", hits=1, last_access=8.0), 8.0)  # b reused 2 s later
    assert policy.reuse_rates()[ROOT_FRESH] == pytest.approx((0.4 + 1) / (4 + 1))
    policy.priority(FakeNode(b"c", last_access=10.5), 10.5)  # a is 10.5 s old: counted, unused
    assert policy.reuse_rates()[ROOT_FRESH] == pytest.approx((0.4 + 1) / (4 + 2))
    assert policy.open_trials() == 2  # b's hit-once trial and c's
    policy.priority(FakeNode(b"a", hits=1, last_access=25.0), 25.0)  # too late: counted already
    assert policy.reuse_rates()[ROOT_FRESH] == pytest.approx((0.4 + 1) / (4 + 2))
    assert policy.horizon == pytest.approx(10.0 * math.e)  # but a hit 25 s > H after: H grows
    assert policy.open_trials() == 3  # so c (14.5 s old) is still open, with b's and a's new ones


def test_priority_is_last_access_plus_the_offset_of_the_kind():
    policy = _trained()
    offsets = policy.offsets()
    cases = [
        (FakeNode(b"new root", last_access=1500.0), ROOT_FRESH),
        (FakeNode(b"new turn", first_page=4, last_access=1500.0), DEEP_FRESH),
        (FakeNode(b"hot root", hits=1, last_access=1500.0), ROOT_HIT_ONCE),
        (FakeNode(b"hot deep", first_page=2, hits=9, last_access=1500.0), DEEP_HIT_MORE),
    ]
    for node, kind in cases:
        assert policy.priority(node, 1600.0) == 1500.0 + offsets[kind]


def test_a_node_that_comes_back_after_eviction_is_returned_not_fresh():
    policy = _bound(ReusePolicy())
    policy.priority(FakeNode(b"doc", last_access=1.0), 1.0)
    # Evicted, then inserted again by a later request: a new node, hits 0, newer access.
    policy.priority(FakeNode(b"doc", last_access=50.0), 50.0)
    assert policy.reuse_rates()[ROOT_FRESH] == pytest.approx(0.4 / 5)  # used again, but 49 s > H
    assert policy.horizon == 10.0  # a miss older than H says nothing about H
    policy.priority(FakeNode(b"doc", last_access=52.0), 52.0)  # evicted and back again, 2 s later
    assert policy.reuse_rates()[ROOT_RETURNED] == pytest.approx((3.6 + 1) / 5)
    assert policy.horizon == pytest.approx(10.0 * math.exp(-1.0))  # a miss 2 s < H: H shrinks


def test_the_horizon_takes_large_steps_first_then_horizon_step():
    policy = _bound(ReusePolicy(initial_horizon_s=10.0, horizon_step=0.02))
    policy.priority(FakeNode(b"a", last_access=0.0), 0.0)
    policy.priority(FakeNode(b"a", hits=1, last_access=30.0), 30.0)  # kept 30 s > H and hit
    assert policy.horizon == pytest.approx(10.0 * math.e)  # first step: e
    policy.priority(FakeNode(b"a", hits=2, last_access=90.0), 90.0)  # 60 s > 27 s: up again
    assert policy.horizon == pytest.approx(10.0 * math.exp(1.0 + 1.0 / math.sqrt(2.0)))


def test_pushing_a_node_again_unchanged_counts_nothing():
    policy = _bound(ReusePolicy())
    node = FakeNode(b"x", first_page=3, last_access=4.0, num_pages=9)
    first = policy.priority(node, 4.0)
    before = (policy.reuse_rates(), policy.horizon)
    node.num_pages = 5  # its tail was evicted: pushed again with the same last access
    assert policy.priority(node, 9.0) == first
    assert (policy.reuse_rates(), policy.horizon) == before


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
    assert rates[ROOT_FRESH] == pytest.approx((0.4 + 2.0) / (4 + 2.0))  # system: weight sqrt(4)
    assert rates[DEEP_FRESH] == pytest.approx((0.4 + 1) / (4 + 1))  # turn 1 reused; turn 2 still open
    assert rates[ROOT_HIT_ONCE] == PRIOR_SEEN  # the system prompt's second trial is open
    other = FakeNode(b"turn 2b", first_page=6, last_access=5.0, parent=turn)
    policy.priority(other, 5.0)  # a sibling at the same time: the walk stops at turn 1
    assert policy.reuse_rates()[ROOT_HIT_ONCE] == rates[ROOT_HIT_ONCE]



def _serve(cache, now, tokens, at):
    """Admit, commit and release ``tokens`` at time ``at`` (``now`` is the cache's clock cell);
    the blocks it used."""
    now[0] = at
    handle = cache.admit(tokens)
    cache.commit(handle, tokens)
    cache.release(handle)
    return handle.block_ids.tolist()


def test_victim_order_in_a_cache_follows_the_learned_kinds():
    # Trained: one-off root sequences are never reused, deeper extensions are reused at once.
    now = [0.0]
    cache = DeviceIndex(6, 1, policy=_trained(), clock=lambda: now[0])

    def run(tokens, at):
        return _serve(cache, now, tokens, at)

    chat = run([1, 2], 1990.0)  # a root sequence...
    turn = run([1, 2, 3], 1995.0)  # ...extended 5 s later: [1, 2] hit once, [3] deeper and fresh
    one_off = run([7, 8], 2000.0)  # a root sequence used once, the newest of all
    # LRU would take [3] (last used at 1995) before [7, 8] (2000). The learned kinds say a fresh
    # root page is 300x less likely to be used again: [7, 8] goes first, its tail page first.
    assert cache.evict(1) == [one_off[1]]
    assert cache.evict(1) == [one_off[0]]
    assert cache.evict(1) == [turn[2]]
    assert cache.evict(2) == chat
    cache.check_invariants()


@pytest.mark.parametrize("trust_trials", [0.0, 300.0])
def test_with_little_evidence_the_order_is_the_prior_at_full_trust_else_lru(trust_trials):
    now = [0.0]
    cache = DeviceIndex(5, 1, policy=ReusePolicy(trust_trials=trust_trials), clock=lambda: now[0])

    def run(tokens, at):
        return _serve(cache, now, tokens, at)

    run([1, 2], 0.0)
    hot = run([1, 2, 3], 1.0)  # [1, 2] hit once; [3] a fresh child of it (a page of its own history)
    one_off = run([7, 8], 5.0)  # a root sequence used once, the newest of all
    assert cache.evict(1) == [hot[2]]  # the oldest fresh page, and a leaf: first either way
    if trust_trials:  # one closed trial: trust 1/301, the offsets < 0.1 s: LRU order
        assert cache.evict(2) == hot[:2]
        assert cache.evict(2) == one_off
    else:
        # LRU would take [1, 2] (last used at 1 s) before [7, 8] (5 s). Three trials in, the
        # prior (and one reuse of a fresh root node) still rules: a fresh root page goes 9.9 s
        # earlier than a page hit once, so [7, 8] goes first (evicted from its tail, returned in order).
        assert cache.evict(2) == one_off
        assert cache.evict(2) == hot[:2]
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
        ({"history_nodes": 0}, r"history_nodes=0 must be an int >= 1"),
        ({"horizon_step": 0.0}, r"horizon_step=0.0 must be in \(0, 1\]"),
        ({"horizon_step": 2.0}, r"horizon_step=2.0 must be in \(0, 1\]"),
        ({"memory": 0}, r"memory=0 must be an int >= 1"),
        ({"initial_horizon_s": 0.0}, r"initial_horizon_s=0.0 must be a positive number of seconds"),
        ({"initial_horizon_s": math.inf}, r"initial_horizon_s=inf must be a positive number"),
        ({"trust_trials": -1.0}, r"trust_trials=-1.0 must be a finite number of trials >= 0"),
        ({"trust_trials": math.inf}, r"trust_trials=inf must be a finite number"),
        ({"offset_scale": -0.5}, r"offset_scale=-0.5 must be a finite number >= 0"),
        ({"offset_scale": math.inf}, r"offset_scale=inf must be a finite number >= 0"),
        ({"offset_scale": True}, r"offset_scale=True must be a finite number >= 0"),
    ],
)
def test_bad_parameters_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReusePolicy(**kwargs)


@pytest.mark.parametrize("scale", [0.0, 0.5, 3.0])
def test_offset_scale_multiplies_the_offsets_and_leaves_the_learning_alone(scale):
    """The same observations with ``offset_scale`` K: the same rates, horizon and learned
    offsets; the offsets in use K times those of the model (0: plain LRU, every priority the
    node's last access)."""
    plain, scaled = _trained(), _trained(offset_scale=scale)
    assert scaled.reuse_rates() == plain.reuse_rates() and scaled.horizon == plain.horizon
    assert scaled.learned_offsets() == plain.learned_offsets()
    assert min(plain.offsets()) < -1.0  # the model separates the kinds: the scale has something to scale
    assert scaled.offsets() == pytest.approx([scale * offset for offset in plain.offsets()])
    node = FakeNode(b"one-off 3", last_access=1001.0)
    assert scaled.priority(node, 1001.0) == pytest.approx(1001.0 + scale * plain.offsets()[ROOT_RETURNED])
    scaled.check_invariants()


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


@settings(max_examples=150, deadline=None)
@given(_observations, st.floats(0.0, 30.0))
def test_every_trial_is_counted_exactly_once_or_still_open(observations, wait):
    """Censoring keeps the books: with no halving, the counted trials plus the open ones are
    the prior plus every trial opened, reuses are at most trials per kind, and once the
    clock passes every trial's horizon none is open any more."""
    policy = _bound(ReusePolicy(history_nodes=1000, memory=10**9))
    seen, opened, clock = {}, 0.0, 0.0
    for key, first_page, hits, num_pages, step in observations:
        clock += step
        if seen.get((first_page, b"%d" % key), -1.0) < clock:  # a new observation: one trial
            seen[(first_page, b"%d" % key)] = clock
            opened += math.sqrt(num_pages) if num_pages > 1 else 1.0
        node = FakeNode(b"%d" % key, first_page=first_page, hits=hits, last_access=clock, num_pages=num_pages)
        policy.priority(node, clock)
        open_weight = sum(trial.weight for trial in policy._open if trial.open)
        assert sum(policy._trials) + open_weight == pytest.approx(8 * PRIOR_TRIALS + opened)
        assert all(0.0 <= rate <= 1.0 for rate in policy.reuse_rates())
    policy.priority(FakeNode(b"probe", first_page=9, last_access=clock), clock + policy.horizon * 1e3 + wait)
    assert policy.open_trials() == 0


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


@settings(max_examples=150, deadline=None)
@given(_observations, st.integers(1, 6), st.integers(1, 40), st.sampled_from([0.0, 1.0, 7.0, 300.0]))
def test_trust_is_closed_trials_over_closed_plus_trust_trials_and_never_falls(
        observations, history_nodes, memory, trust_trials):  # fmt: skip
    """Whatever is observed (halvings and a bounded history included): trust counts every
    trial closed so far (reused, expired or pushed out of the bound), only grows, and the
    offsets priority adds are trust times the learned ones once recomputed."""
    policy = _bound(ReusePolicy(history_nodes=history_nodes, memory=memory, trust_trials=trust_trials))
    closed, clock, previous = 0, 0.0, policy.trust()
    original_close = policy._close

    def close(trial, *, reused):
        nonlocal closed
        closed += trial.open
        original_close(trial, reused=reused)

    policy._close = close
    for key, first_page, hits, num_pages, step in observations:
        clock += step
        policy.priority(FakeNode(b"%d" % key, first_page=first_page, hits=hits, last_access=clock,
                                 num_pages=num_pages), clock)  # fmt: skip
        trust = policy.trust()
        assert trust == (closed / (closed + trust_trials) if trust_trials else 1.0)
        assert previous <= trust <= 1.0
        previous = trust
        policy._refresh()
        assert policy.offsets() == pytest.approx([trust * offset for offset in policy.learned_offsets()])
        policy.check_invariants()


def test_counts_halved_for_ever_keep_every_reuse_rate_defined():
    # a kind never observed halved to 0 trials after ~1,000 halvings: 0/0 in the middle of a
    # release, which left the cache broken; its count now stops at a floor
    clock = Clock()
    cache = DeviceIndex(64, 2, policy=ReusePolicy(memory=1), clock=clock)
    for i in range(1500):
        clock.now += 1.0
        tokens = [i, 7, 7, 7, 7]  # one-off prompts: one kind only
        handle = cache.admit(tokens)
        cache.commit(handle, tokens)
        cache.release(handle)
    policy = cache.trie.policy
    assert all(0.0 <= rate <= 1.0 for rate in policy.reuse_rates())
    assert all(math.isfinite(offset) for offset in policy.offsets())
    policy.check_invariants()
    cache.check_invariants()


@pytest.mark.parametrize("make, message", [
    (lambda: ReusePolicy(memory=float("nan")), r"memory=nan must be an int >= 1"),
    (lambda: ReusePolicy(history_nodes=float("nan")), r"history_nodes=nan must be an int >= 1"),
    (lambda: make_policy("cost_aware", half_life_s=float("nan")), r"half_life_s=nan must be a finite number"),
    (lambda: make_policy("segmented", ghost_pages=float("nan")), r"ghost_pages=nan must be an int >= 0"),
    (lambda: make_policy("adaptive", initial_omega=math.inf, max_omega=math.inf), r"max_omega=inf < inf"),
])
def test_policy_settings_that_are_nan_or_infinite_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()
