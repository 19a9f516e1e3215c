"""The routing policy as plain code: strategies, the share bound, the load guard, fair turns on ties, and
the shared-system-prompt case where a weighted cost sends everything to one node."""

import collections
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.cluster.directory import NodeLoad, NodeView
from kvjax.cluster.router import RECENT_PER_NODE, STRATEGIES, RouterConfig, RoutingPolicy

PAGE = 16


def node(node_id, prefix_blocks=0, inflight=0, prefill_tokens=0):
    return NodeView(node_id, 1, f"http://{node_id}", NodeLoad(inflight, prefill_tokens), prefix_blocks)


def choose_ids(policy, views, times, tokens=100):
    return [policy.choose(views, tokens, PAGE).node_id for _ in range(times)]


def test_unknown_strategy_and_bad_guard_settings_are_refused():
    expected = r"strategy='fastest'; expected one of \('prefix', 'least_loaded', 'round_robin'\)"
    with pytest.raises(ValueError, match=expected):
        RouterConfig(strategy="fastest")
    with pytest.raises(ValueError, match="imbalance_abs=-1 and imbalance_rel=0.5 must be >= 0"):
        RouterConfig(imbalance_abs=-1)
    with pytest.raises(ValueError, match=r"tokens_per_load_unit=0 must be an int >= 1, or None \(learned\)"):
        RouterConfig(tokens_per_load_unit=0)
    with pytest.raises(ValueError, match=r"fair_window=0 must be an int >= 1 \(decisions\), or None \(50 per live"):
        RouterConfig(fair_window=0)
    with pytest.raises(ValueError, match=r"share_slack_abs=0.5 must be >= 1 \(requests\) and share_slack_rel=0.1 >= 0"):
        RouterConfig(share_slack_abs=0.5)
    with pytest.raises(ValueError, match=r"share_slack_rel=-0.1 >= 0"):
        RouterConfig(share_slack_rel=-0.1)
    with pytest.raises(ValueError, match=r"follow_dropped='yes' must be a bool"):
        RouterConfig(follow_dropped="yes")


def test_no_node_left_is_an_error_naming_the_excluded():
    policy = RoutingPolicy()
    with pytest.raises(ValueError, match=r"no live node to route to \(0 live, excluded: \[\]\)"):
        policy.choose([], 10, PAGE)
    with pytest.raises(ValueError, match=r"\(1 live, excluded: \['a'\]\)"):
        policy.choose([node("a")], 10, PAGE, exclude={"a"})


def test_prefix_goes_to_the_longest_holder_and_counts_its_uncached_tokens():
    policy = RoutingPolicy()
    decision = policy.choose([node("a", 2), node("b", 5), node("c", 0)], 100, PAGE)
    assert (decision.node_id, decision.reason) == ("b", "affinity")
    assert (decision.prefix_blocks, decision.uncached_tokens) == (5, 20)


def test_prefix_ties_take_turns():
    policy = RoutingPolicy()
    views = [node("a", 3), node("b", 3), node("c", 3), node("d", 1)]
    assert choose_ids(policy, views, 5) == ["a", "b", "c", "a", "b"]
    assert policy.choose(views, 100, PAGE).reason == "affinity_tie"


def test_an_overloaded_holder_sends_the_request_to_the_least_loaded():
    # loads with the request placed: a holds 64 of its 100 tokens (+0.36), b and c none (+1)
    policy = RoutingPolicy(RouterConfig(imbalance_abs=2, imbalance_rel=0, tokens_per_load_unit=100))
    within = [node("a", 4, inflight=3), node("b", 0, inflight=0), node("c", 0, inflight=1)]
    assert policy.choose(within, 100, PAGE).node_id == "a"  # 3.36 against a mean of 2.12: fine
    over = [node("a", 4, inflight=5), node("b", 0, inflight=0), node("c", 0, inflight=1)]
    decision = policy.choose(over, 100, PAGE)  # 5.36 against a mean of 2.79: overloaded
    assert (decision.node_id, decision.reason, decision.uncached_tokens) == ("b", "imbalanced", 100)
    # another holder of the same prefix that is not overloaded keeps the affinity
    assert policy.choose(over + [node("d", 4, inflight=1)], 100, PAGE).node_id == "d"


def test_the_guard_compares_with_the_mean_load_not_the_least():
    """With many nodes the least loaded one is nearly idle; a holder two requests above it
    but near the mean is not overloaded."""
    policy = RoutingPolicy(RouterConfig(imbalance_abs=2, imbalance_rel=0, tokens_per_load_unit=100))
    views = [node("a", 6, inflight=5)] + [node(f"n{i}", inflight=i % 7) for i in range(7)]
    assert policy.choose(views, 100, PAGE).node_id == "a"


def test_a_holder_is_credited_with_the_prefill_its_hit_saves():
    policy = RoutingPolicy(RouterConfig(imbalance_abs=2, imbalance_rel=0, tokens_per_load_unit=25))
    # a holds the whole prompt: 3 in flight, nothing to prefill; elsewhere 100 tokens = 4 units
    views = [node("a", 7, inflight=3), node("b"), node("c")]
    decision = policy.choose(views, 100, PAGE)
    assert (decision.node_id, decision.reason, decision.uncached_tokens) == ("a", "affinity", 0)


def test_uncached_prefill_tokens_count_as_load():
    policy = RoutingPolicy(RouterConfig(imbalance_abs=2, imbalance_rel=0, tokens_per_load_unit=100))
    assert policy.load(node("a", inflight=1, prefill_tokens=250)) == 3.5
    assert policy.load(node("a", inflight=1, prefill_tokens=250), extra_prefill_tokens=50) == 4.0
    views = [node("a", 4, inflight=0, prefill_tokens=500), node("b")]
    assert policy.choose(views, 100, PAGE).node_id == "b"


def test_the_token_unit_is_learned_from_the_uncached_prompts_routed():
    policy = RoutingPolicy()  # tokens_per_load_unit=None
    assert policy.tokens_per_load_unit(num_prompt_tokens=3000) == 3000  # nothing routed yet: the request's own size
    policy.choose([node("a"), node("b")], 1000, PAGE)
    assert policy.tokens_per_load_unit() == 1000
    for _ in range(500):
        policy.choose([node("a", 60), node("b", 60)], 1000, PAGE)  # 40 tokens uncached each
    assert policy.tokens_per_load_unit() == pytest.approx(40, rel=0.01)
    assert RoutingPolicy(RouterConfig(tokens_per_load_unit=512)).tokens_per_load_unit() == 512


def test_the_relative_slack_grows_with_the_mean_load():
    policy = RoutingPolicy(RouterConfig(imbalance_abs=2, imbalance_rel=0.5, tokens_per_load_unit=100))
    views = [node("a", 4, inflight=30), node("b", inflight=20), node("c", inflight=20)]  # mean 24: slack 12
    assert policy.choose(views, 100, PAGE).node_id == "a"


def test_nothing_cached_anywhere_takes_fair_turns_among_nodes_not_overloaded():
    policy = RoutingPolicy(RouterConfig(imbalance_abs=2, imbalance_rel=0.25, tokens_per_load_unit=100))
    views = [node("a", inflight=1), node("b"), node("c")]
    assert choose_ids(policy, views, 3) == ["a", "b", "c"]
    assert policy.choose(views, 100, PAGE).reason == "no_prefix"
    assert set(choose_ids(policy, [node("a", inflight=9), node("b"), node("c")], 4)) == {"b", "c"}


def test_a_prefix_nobody_holds_returns_to_the_node_that_dropped_it_last():
    def dropped(node_id, ms, **load):
        return dataclasses.replace(node(node_id, **load), first_dropped_ms=ms)

    policy = RoutingPolicy(RouterConfig(imbalance_abs=2, imbalance_rel=0, tokens_per_load_unit=100))
    views = [dropped("a", 500), dropped("b", 900), dropped("c", 0)]
    decision = policy.choose(views, 100, PAGE)
    assert (decision.node_id, decision.reason, decision.uncached_tokens) == ("b", "returning", 100)
    # a holder of any of it wins over the node that dropped the first block
    assert policy.choose([dropped("a", 0, prefix_blocks=1), dropped("b", 900)], 100, PAGE).node_id == "a"
    # an overloaded dropper is skipped like any overloaded node: the others take fair turns
    decision = policy.choose([dropped("a", 500), dropped("b", 900, inflight=9), node("c")], 100, PAGE)
    assert (decision.node_id, decision.reason) == ("a", "returning")
    decision = policy.choose([node("a"), dropped("b", 900, inflight=9), node("c")], 100, PAGE)
    assert decision.reason == "no_prefix" and decision.node_id != "b"
    # off: fair turns as if nothing was dropped
    off = RoutingPolicy(RouterConfig(follow_dropped=False))
    assert [off.choose(views, 100, PAGE).reason for _ in range(3)] == ["no_prefix"] * 3
    assert choose_ids(RoutingPolicy(RouterConfig(follow_dropped=False)), views, 3) == ["a", "b", "c"]


def test_a_returning_prefix_stays_within_the_share_bound():
    """Every request's first block was dropped by node a: a takes them up to its share plus
    the slack of the recent window, then the others take fair turns."""
    policy = RoutingPolicy(RouterConfig(share_slack_abs=2, share_slack_rel=0, fair_window=30))
    views = [dataclasses.replace(node("a"), first_dropped_ms=7), node("b"), node("c")]
    chosen = choose_ids(policy, views, 300)
    counts = collections.Counter(chosen[-30:])
    assert max(counts.values()) <= 30 / 3 + 2 and counts["a"] >= 10


def test_the_default_guard_lets_a_holder_run_well_above_the_mean_in_flight():
    """A safety valve, not a balancer: 8 more requests in flight than the others keep the
    affinity (outputs of 4 to 900 tokens make such gaps common and harmless)."""
    views = [node("a", 5, inflight=10), node("b", inflight=2), node("c", inflight=2)]
    assert RoutingPolicy().choose(views, 100, PAGE).reason == "affinity"
    views = [node("a", 5, inflight=40), node("b", inflight=2), node("c", inflight=2)]  # a fell behind
    assert RoutingPolicy().choose(views, 100, PAGE).reason == "imbalanced"


def test_fair_turns_give_the_other_requests_to_the_nodes_affinity_left_behind():
    policy = RoutingPolicy(RouterConfig(tokens_per_load_unit=100))
    assert choose_ids(policy, [node("a", 5), node("b"), node("c")], 3) == ["a", "a", "a"]  # affinity
    # a round-robin pointer would go on a, b, c; fair turns catch b and c up first
    assert choose_ids(policy, [node("a"), node("b"), node("c")], 7) == ["b", "c", "b", "c", "b", "c", "a"]


def test_a_holder_over_its_share_sends_the_request_to_the_longest_prefix_among_the_others():
    policy = RoutingPolicy(RouterConfig(share_slack_abs=2, share_slack_rel=0, fair_window=30))
    views = [node("a", 5), node("b", 2), node("c")]
    # a may take share + 2 of the requests counting each new one: 3 of 3, 4 of 6, ...
    assert choose_ids(policy, views, 3) == ["a", "a", "a"]
    decision = policy.choose(views, 100, PAGE)
    assert (decision.node_id, decision.reason, decision.prefix_blocks) == ("b", "over_share", 2)
    # b caches the prefix too: the two holders take turns, c gets what they leave
    views = [node("a", 5), node("b", 5), node("c")]
    assert choose_ids(policy, views, 4) == ["b", "b", "a", "b"]  # fair turns: b catches up with a first


def test_a_shared_prefix_reaches_every_node_through_the_share_bound():
    policy = RoutingPolicy(RouterConfig(fair_window=40))
    holders = {"a"}
    served = collections.Counter()
    for _ in range(200):
        views = [node(n, 4 if n in holders else 0) for n in "abcd"]
        chosen = policy.choose(views, 100, PAGE).node_id
        holders.add(chosen)
        served[chosen] += 1
    assert holders == set("abcd") and max(served.values()) / 50 <= 1.10


def window_counts_within_bound(chosen, valve, window, num_nodes, config):
    """Every run of ``window`` consecutive decisions (and every shorter run at the start)
    gives a node at most share + long_prefix_slack x max(abs, rel x share) of them, plus the safety-valve
    decisions ("overloaded") it took in that run."""
    share = window / num_nodes
    bound = share + config.long_prefix_slack * max(config.share_slack_abs, config.share_slack_rel * share)
    for end in range(1, len(chosen) + 1):
        run = range(max(end - window, 0), end)
        counts = collections.Counter(chosen[i] for i in run)
        extra = collections.Counter(chosen[i] for i in run if valve[i])
        for node_id, count in counts.items():
            assert count <= bound + extra[node_id], (end, node_id, count, bound, extra[node_id])
    return bound


@settings(max_examples=80, deadline=None)
@given(
    st.data(),
    st.integers(2, 6),
    st.one_of(st.none(), st.integers(4, 60)),
    st.sampled_from([0.0, 0.05, 0.15, 0.5]),
    st.sampled_from([1.0, 2.0, 3.5]),
    st.booleans(),
)
def test_every_run_of_fair_window_decisions_stays_within_the_share_bound(data, num_nodes, window, rel, abs_, guard):
    """The share bound's guarantee, for any sequence of lookups with a stable set of nodes:
    whatever each node holds and whatever its load, a node gets at most its share plus the
    slack of every run of ``fair_window`` consecutive decisions, beyond the requests the
    safety valve sent it; with the guard out of play (``guard`` False) the valve never
    fires and the bound is exact."""
    config = RouterConfig(share_slack_abs=abs_, share_slack_rel=rel, fair_window=window,
                          long_prefix_slack=data.draw(st.sampled_from([1.0, 1.5, 3.0])),
                          long_prefix_units=data.draw(st.sampled_from([0.0, 0.5, 4.0])),
                          imbalance_abs=2.0 if guard else 1e9, imbalance_rel=0.25 if guard else 0.0)  # fmt: skip
    policy = RoutingPolicy(config)
    ids = "abcdef"[:num_nodes]
    view = st.tuples(st.integers(0, 6), st.integers(0, 12), st.integers(0, 300))  # prefix, in flight, pending
    steps = data.draw(st.lists(st.lists(view, min_size=num_nodes, max_size=num_nodes), min_size=1, max_size=250))
    chosen, valve = [], []
    for step in steps:
        views = [node(n, p, inflight=i, prefill_tokens=t) for n, (p, i, t) in zip(ids, step)]
        decision = policy.choose(views, data.draw(st.integers(1, 120)), PAGE)
        chosen.append(decision.node_id)
        valve.append(decision.reason == "overloaded")
    window_counts_within_bound(chosen, valve, window or RECENT_PER_NODE * num_nodes, num_nodes, config)
    if not guard:
        assert not any(valve)


def test_the_safety_valve_sends_the_request_to_the_least_loaded_when_every_node_within_its_share_is_overloaded():
    policy = RoutingPolicy(RouterConfig(share_slack_abs=1, share_slack_rel=0, fair_window=4, imbalance_abs=2,
                                        imbalance_rel=0, tokens_per_load_unit=100))  # fmt: skip
    assert choose_ids(policy, [node("a", 5), node("b", 5)], 2) == ["a", "b"]
    # a fell behind (9 in flight against b's 0): b takes what its share allows, 3 of any 4
    views = [node("a", 5, inflight=9), node("b", 5)]
    assert choose_ids(policy, views, 2) == ["b", "b"]
    decision = policy.choose(views, 100, PAGE)  # b would take 4 of 4; a, within, is overloaded
    assert (decision.node_id, decision.reason) == ("b", "overloaded")


def test_a_retry_keeps_the_window_of_the_live_nodes():
    policy = RoutingPolicy()
    views = [node("a"), node("b"), node("c"), node("d")]
    choose_ids(policy, views, 150)
    policy.choose(views, 100, PAGE, exclude={"a"})
    assert len(policy._recent) == 151  # not cut to 3 x 50 for the retry


def test_least_loaded_and_round_robin_ignore_the_prefix():
    views = [node("a", 9, inflight=4), node("b", 0, inflight=1), node("c", 0, inflight=1)]
    assert choose_ids(RoutingPolicy(RouterConfig("least_loaded")), views, 3) == ["b", "c", "b"]
    assert choose_ids(RoutingPolicy(RouterConfig("round_robin")), views, 4) == ["a", "b", "c", "a"]


def test_round_robin_stays_fair_while_nodes_come_and_go():
    policy = RoutingPolicy(RouterConfig("round_robin"))
    assert choose_ids(policy, [node("a"), node("b"), node("c")], 2) == ["a", "b"]
    assert choose_ids(policy, [node("a"), node("c")], 2) == ["c", "a"]  # b left: c is next, then a
    assert choose_ids(policy, [node("a"), node("b"), node("c")], 1) == ["b"]


def test_excluded_nodes_are_skipped():
    policy = RoutingPolicy()
    assert policy.choose([node("a", 5), node("b", 1)], 100, PAGE, exclude={"a"}).node_id == "b"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_routes_to_a_live_node(strategy):
    views = [node("a", 1), node("b", 2)]
    assert RoutingPolicy(RouterConfig(strategy)).choose(views, 64, PAGE).node_id in {"a", "b"}


# --- the shared-system-prompt case ---------------------------------------------------------


def simulate(choose, num_requests=800, num_nodes=4, arrivals_per_tick=3, service_ticks=4, system_blocks=20):
    """Every request shares one system prompt (``system_blocks``) plus a unique question; a
    node caches the system prompt once it served a request with it. Load is counted at
    routing time: a routed request stays in flight for ``service_ticks``. Returns requests
    per node."""
    holds = set()
    finish = collections.defaultdict(list)  # node id -> finish ticks of its in-flight requests
    served = collections.Counter()
    for i in range(num_requests):
        tick = i // arrivals_per_tick
        views = []
        for n in range(num_nodes):
            node_id = f"n{n}"
            finish[node_id] = [t for t in finish[node_id] if t > tick]
            views.append(node(node_id, system_blocks if node_id in holds else 0, inflight=len(finish[node_id])))
        chosen = choose(views)
        served[chosen] += 1
        finish[chosen].append(tick + service_ticks)
        holds.add(chosen)
    return served


def max_mean(served, num_nodes=4):
    counts = [served.get(f"n{n}", 0) for n in range(num_nodes)]
    return max(counts) / (sum(counts) / num_nodes)


def weighted_cost(views, weight=0.5):
    """What most routers do: matched blocks minus weight x load (here a small weight)."""
    return max(views, key=lambda view: (view.prefix_blocks - weight * view.load.inflight, view.node_id)).node_id


def test_a_shared_system_prompt_spreads_over_every_node():
    assert max_mean(simulate(weighted_cost)) > 2.5  # the failure users report: one node takes it all
    policy = RoutingPolicy()
    assert max_mean(simulate(lambda views: policy.choose(views, 400, PAGE).node_id)) <= 1.10


def test_a_burst_with_nothing_finishing_still_spreads():
    policy = RoutingPolicy()
    served = simulate(lambda views: policy.choose(views, 400, PAGE).node_id, num_requests=400,
                      arrivals_per_tick=400, service_ticks=10)  # fmt: skip
    assert max_mean(served) <= 1.10


def test_when_the_holder_is_overloaded_the_blocks_others_can_fetch_count_at_their_cost():
    # a holds all 6 pages (96 of 100 tokens) but has 6 in flight (6.04 against a mean of 3.05);
    # b holds 3 pages with 1 in flight, c none with 60 tokens pending
    views = [node("a", 6, inflight=6), node("b", 3, inflight=1), node("c", 0, prefill_tokens=60)]
    config = RouterConfig(imbalance_abs=2, imbalance_rel=0, tokens_per_load_unit=100)
    # without fetch: b would prefill 52 tokens (1 + 0.52), c all 100 (0.6 + 1.0): b
    assert RoutingPolicy(config).choose(views, 100, PAGE).node_id == "b"
    # a fetched block costing a tenth of a recomputed one: b 1.52 - 0.9 * 48 / 100 = 1.09,
    # c 1.6 - 0.9 * 96 / 100 = 0.74
    fetching = RoutingPolicy(RouterConfig(imbalance_abs=2, imbalance_rel=0, tokens_per_load_unit=100,
                                          remote_fetch_cost=0.1))  # fmt: skip
    decision = fetching.choose(views, 100, PAGE)
    assert (decision.node_id, decision.reason) == ("c", "imbalanced")
    assert decision.uncached_tokens == 100  # what the node itself reports until its fetch lands
    # affinity itself is unchanged: a holder within the guard still takes it
    within = [node("a", 6, inflight=1), node("b", 3, inflight=1), node("c", 0)]
    assert fetching.choose(within, 100, PAGE).node_id == "a"
    with pytest.raises(ValueError, match=r"remote_fetch_cost=1.5 must be a number in \[0, 1\]"):
        RouterConfig(remote_fetch_cost=1.5)


def test_a_holder_over_the_plain_slack_keeps_a_request_only_when_moving_it_would_recompute_a_long_prefix():
    """Plain slack 2 requests over the share, wide slack 2 x that: a holder over share + 2
    keeps a request whose prefix is worth more than ``long_prefix_units`` typical prompts
    (here 1 unit = 100 tokens = 6.25 pages of 16) while within share + 4, and loses one whose
    prefix is short."""
    config = RouterConfig(share_slack_abs=2, share_slack_rel=0, fair_window=40, long_prefix_slack=2,
                          long_prefix_units=1, tokens_per_load_unit=100)  # fmt: skip

    def after_ten_short_ones():
        policy = RoutingPolicy(config)
        ids = [policy.choose([node("a", 3), node("b")], 100, PAGE).node_id for _ in range(10)]
        assert ids.count("a") == 7  # a takes each while its count + 1 <= (n + 1) / 2 + 2
        return policy  # next: share 5.5, a at 7 + 1 = 8 > 7.5 but <= 9.5

    short = after_ten_short_ones().choose([node("a", 3), node("b")], 100, PAGE)
    assert (short.node_id, short.reason) == ("b", "over_share")  # 3 pages = 48 tokens: cheap to move
    long = after_ten_short_ones().choose([node("a", 9), node("b")], 100, PAGE)
    assert (long.node_id, long.reason) == ("a", "affinity")  # 9 pages = 144 tokens > 100
    with pytest.raises(ValueError, match=r"long_prefix_slack=0.5 must be >= 1"):
        RouterConfig(long_prefix_slack=0.5)
