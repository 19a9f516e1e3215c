"""Cluster replay: hand-computed routing and hits on tiny traces, the service model's load,
the balance figures, one node equal to the single-node replay, and the CLI."""

import dataclasses
import json

import numpy as np
import pytest

from kvjax.__main__ import main
from kvjax.cache.policies import ReusePolicy
from kvjax.cluster.router import RouterConfig
from kvjax.tools.cluster_replay import (
    DEFAULT_POLICY_SHARE_S,
    ClusterSpec,
    FetchModel,
    ServiceModel,
    cluster_replay,
    format_cluster_report,
    simulate_cluster,
    window_max_mean,
)
from kvjax.tools.replay import replay_trace
from kvjax.tools.trace import TraceRequest

BLOCK = 4  # tokens per hash id


def conversation(first_id, turns):
    """Prompts of one conversation: each turn resends the previous one plus a block."""
    return [tuple(range(first_id, first_id + 2 + turn)) for turn in range(turns)]


def trace(paths, *, every_s=1.0, outputs=None):
    """One request every ``every_s`` seconds, whole blocks, one output token by default."""
    outputs = outputs or [1] * len(paths)
    return [TraceRequest(1000.0 * every_s * i, BLOCK * len(path), output, tuple(path))
            for i, (path, output) in enumerate(zip(paths, outputs))]  # fmt: skip


# Conversation X (blocks 1, 2, then 3, then 4) then conversation Y (5, 6, 7, 8), three turns
# each, one after the other: 18 blocks, and one cache with room for all hits 2 + 3 per turn
# after the first of each: 10.
TWO_CONVERSATIONS = trace(conversation(1, 3) + conversation(5, 3))


FREE_FETCH = FetchModel(latency_s=0.0)  # a 4-token block is worth fetching only without a fixed cost


def run(requests, strategy, nodes=2, device_blocks=10, fetch=FREE_FETCH, **options):
    spec = ClusterSpec(nodes, device_blocks, block_tokens=BLOCK, **options)
    return cluster_replay(requests, spec, router=RouterConfig(strategy), fetch=fetch)


def test_prefix_keeps_each_conversation_on_one_node_and_hits_like_one_cache():
    report = run(TWO_CONVERSATIONS, "prefix")
    assert report.single_cache.hit_blocks == 10 and report.local.hit_blocks == 10
    assert report.remote_blocks == 0 and report.requests_per_node == (3, 3)
    assert report.reasons == {"affinity": 4, "no_prefix": 2}


@pytest.mark.parametrize("follow_dropped", [True, False])
def test_a_prefix_every_node_dropped_returns_to_the_node_that_dropped_it_last(follow_dropped):
    # 3 blocks of room per node: X (1-3) on n0, Y (10-12) on n1, then Z and W push both out;
    # when Y comes back fair turns would give it to n0, following the drop gives it to n1
    paths = [(1, 2, 3), (10, 11, 12), (20, 21, 22), (30, 31, 32), (10, 11, 12)]
    spec = ClusterSpec(2, 3, block_tokens=BLOCK)
    report = simulate_cluster(trace(paths), spec, router=RouterConfig(follow_dropped=follow_dropped), fetch=None)
    assert report.local.hit_blocks == 0  # nobody held Y when it came back
    if follow_dropped:
        assert report.reasons == {"no_prefix": 4, "returning": 1} and report.requests_per_node == (2, 3)
    else:
        assert report.reasons == {"no_prefix": 5} and report.requests_per_node == (3, 2)


def test_round_robin_splits_the_conversations_and_another_node_holds_the_rest():
    report = run(TWO_CONVERSATIONS, "round_robin")
    # X1 n0, X2 n1 (n0 held 2), X3 n0 (hits 2; n1 held 3), and Y the same way
    assert report.local.hit_blocks == 4 and report.remote_blocks == 6 and report.fetched_blocks == 6
    summary = report.as_dict()
    assert summary["remote_block_hit_rate"] == summary["reachable_remote_block_hit_rate"] == pytest.approx(6 / 18)
    assert summary["served_block_hit_rate"] == pytest.approx(10 / 18)  # as one cache: everything fetched
    assert report.requests_per_node == (3, 3) and report.max_mean_requests == 1.0


@pytest.mark.parametrize("fetch", [None, FetchModel(link_bytes_per_s=1e6), FetchModel()])
def test_blocks_another_node_holds_are_served_only_when_fetching_beats_recomputing(fetch):
    # off; a link slower than prefill (each token's KV 0.13 s away); the default 1 ms fetch
    # latency against 0.2 ms of prefill for a 4-token block
    report = run(TWO_CONVERSATIONS, "round_robin", fetch=fetch)
    assert report.remote_blocks == 6 and report.fetched_blocks == 0
    assert report.served_block_hit_rate == report.local.block_hit_rate


def test_the_router_is_told_what_a_fetched_block_costs():
    # n0 caches (1, 2, 3); round robin sends the longer prompt to n1, which fetches all three
    requests = trace([(1, 2, 3), (1, 2, 3, 4)])
    service = ServiceModel(prefill_tokens_per_s=1.0)
    spec = ClusterSpec(2, 10, block_tokens=BLOCK)
    fetched = simulate_cluster(requests, spec, router=RouterConfig("round_robin"), service=service, fetch=FREE_FETCH)
    assert fetched.fetched_blocks == 3 and fetched.router.remote_fetch_cost == pytest.approx(0.0, abs=1e-3)
    recomputed = simulate_cluster(requests, spec, router=RouterConfig("round_robin"), service=service, fetch=None)
    assert recomputed.fetched_blocks == 0 and recomputed.router.remote_fetch_cost is None


def test_least_loaded_sees_the_requests_the_service_model_keeps_in_flight():
    # one long request (100 tokens at 10 tokens/s: 10 s) then three short ones, a second apart
    requests = trace([(1,), (2,), (3,), (4,)], outputs=[100, 1, 1, 1])
    service = ServiceModel(prefill_tokens_per_s=1000.0, decode_tokens_per_s=10.0)
    spec = ClusterSpec(2, 10, block_tokens=BLOCK)
    least = simulate_cluster(requests, spec, router=RouterConfig("least_loaded"), service=service)
    assert least.requests_per_node == (1, 3)  # n0 is busy with the long one the whole time
    rr = simulate_cluster(requests, spec, router=RouterConfig("round_robin"), service=service)
    assert rr.requests_per_node == (2, 2)


def test_a_node_prefills_one_request_at_a_time():
    # 8 uncached tokens at 4 tokens/s: each prefill takes 2 s, so the second request, 1 s
    # later, still sees the first's tokens pending on n0 and goes to n1; the third (at 2 s)
    # sees n1's pending and n0 free again
    requests = trace([(1, 2), (3, 4), (5, 6)])
    service = ServiceModel(prefill_tokens_per_s=4.0, decode_tokens_per_s=1000.0)
    report = simulate_cluster(requests, ClusterSpec(2, 10, block_tokens=BLOCK),
                              router=RouterConfig("least_loaded", tokens_per_load_unit=8), service=service)
    assert report.requests_per_node == (2, 1)


def test_window_balance_is_a_sliding_percentile_of_max_over_mean():
    chosen = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    # windows of 4: max/mean 2, 1.5, 1, 1.5, 2
    assert window_max_mean(chosen, 2, 4) == 2.0
    assert window_max_mean(chosen, 2, 4, quantile=50) == 1.5
    assert window_max_mean(chosen, 2, 100) == 1.0  # longer than the run: the whole run
    assert window_max_mean(np.array([], np.int64), 2, 4) == 0.0


@pytest.mark.parametrize("strategy", ["prefix", "least_loaded", "round_robin"])
def test_one_node_is_the_single_node_replay(strategy):
    requests = trace([(1,), (2,), (3,), (1,), (2,), (3,), (1, 4)])
    report = run(requests, strategy, nodes=1, device_blocks=2, host_blocks=3)
    single = replay_trace(requests, 2, host_blocks=3, block_tokens=BLOCK)
    assert report.local == single == report.single_cache
    assert report.local.host_hit_blocks > 0  # the host tier per node is there


@pytest.mark.parametrize(("share_s", "exchanges"), [(2.0, 4), (3.0, 3), (None, 0)])
def test_nodes_exchange_reuse_statistics_every_policy_share_s_of_the_trace_clock(monkeypatch, share_s, exchanges):
    """Requests at 0, 1, ..., 6 s: an exchange at the first arrival, then at the first arrival
    share_s or more after the previous exchange; in each, every node merges the other nodes'
    statistics, published before anyone merged (pooled: the peers' counts add up to the other
    nodes' together, whatever the pools)."""
    merges, published = [], {}
    original_merge, original_statistics = ReusePolicy.merge_peer_statistics, ReusePolicy.statistics

    def statistics(policy):
        published[id(policy)] = stats = original_statistics(policy)
        return stats

    def merge(policy, peers, **kwargs):
        peers = list(peers)
        others = [stats for owner, stats in published.items() if owner != id(policy)]
        merges.append((id(policy), sum(stats.closed for stats in peers), sum(stats.closed for stats in others),
                       sum(stats.boundary_events + 1 for stats in peers),
                       sum(stats.boundary_events + 1 for stats in others)))  # fmt: skip
        original_merge(policy, peers, **kwargs)

    monkeypatch.setattr(ReusePolicy, "merge_peer_statistics", merge)
    monkeypatch.setattr(ReusePolicy, "statistics", statistics)
    requests = trace([(1, 2), (3, 4), (1, 2, 5), (3, 4, 6), (1, 2, 5, 7), (8,), (3, 4, 6, 9)])
    report = cluster_replay(requests, ClusterSpec(3, 10, block_tokens=BLOCK, policy_share_s=share_s), fetch=None)
    assert len(merges) == 3 * exchanges and len({policy for policy, *_ in merges}) == (3 if exchanges else 0)
    assert all(len(published) == 3 and peers == others and peer_weight == other_weight
               for _, peers, others, peer_weight, other_weight in merges)  # fmt: skip
    assert any(peers > 0 for _, peers, *_ in merges) == bool(exchanges)
    assert report.as_dict()["policy_share_s"] == share_s


def test_nodes_of_another_policy_or_a_single_node_exchange_nothing(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("merge_peer_statistics called")

    monkeypatch.setattr(ReusePolicy, "merge_peer_statistics", fail)
    requests = trace([(1, 2), (3, 4), (1, 2, 5)])
    simulate_cluster(requests, ClusterSpec(2, 10, block_tokens=BLOCK, policy="lru"), fetch=None)
    simulate_cluster(requests, ClusterSpec(1, 10, block_tokens=BLOCK), fetch=None)


def test_pooled_nodes_share_one_capacity_but_no_blocks():
    """Round robin over 2 nodes of 3 blocks (LRU): n0 serves (1, 2) and (3, 4) in turn, 4 blocks
    it cannot hold, n1 serves (9,) each time. Pooled into one cache of 6, n0 keeps all four
    and hits like one cache of 6 does; n1 never hits n0's blocks: the first (1, 2) on n1's
    side of the same pooled cache misses, as it does on a node of its own."""
    paths = [(1, 2), (9,), (3, 4), (9,), (1, 2), (9,), (3, 4)]
    spec = ClusterSpec(2, 3, block_tokens=BLOCK, policy="lru")
    split = cluster_replay(trace(paths), spec, router=RouterConfig("round_robin"), fetch=None)
    pooled = cluster_replay(trace(paths), dataclasses.replace(spec, pooled=True), router=RouterConfig("round_robin"),
                            fetch=None)  # fmt: skip
    assert pooled.local.hit_blocks == pooled.single_cache.hit_blocks == 6  # (1, 2), (9,) twice, (3, 4)
    assert split.local.hit_blocks < pooled.local.hit_blocks
    assert pooled.requests_per_node == split.requests_per_node == (4, 3)
    same = cluster_replay(trace([(1, 2), (1, 2), (1, 2)]), dataclasses.replace(spec, pooled=True),
                          router=RouterConfig("round_robin"), fetch=FREE_FETCH)  # fmt: skip
    assert same.local.hit_blocks == 2 and same.remote_blocks == same.fetched_blocks == 2  # n1 fetched from n0
    assert same.as_dict()["pooled"] is True and split.as_dict()["pooled"] is False


def test_pooled_caches_follow_each_node_s_drops_and_share_nothing(monkeypatch):
    """The returning-prefix rule sees each node's own drops in the pooled cache (the test
    above's drop scenario gives the same decisions), and one pooled cache has one policy:
    no statistics to exchange."""
    paths = [(1, 2, 3), (10, 11, 12), (20, 21, 22), (30, 31, 32), (10, 11, 12)]
    spec = ClusterSpec(2, 3, block_tokens=BLOCK, pooled=True)
    monkeypatch.setattr(ReusePolicy, "merge_peer_statistics", lambda *args, **kwargs: pytest.fail("merged"))
    report = cluster_replay(trace(paths), spec, router=RouterConfig(), fetch=None)
    assert report.reasons == {"no_prefix": 4, "returning": 1} and report.requests_per_node == (2, 3)
    assert report.as_dict()["policy_share_s"] is None


def test_bad_settings_are_refused_before_replaying():
    with pytest.raises(ValueError, match="nodes=0 must be an int >= 1"):
        ClusterSpec(0, 10)
    for bad in (0, -1.0, float("inf"), True, "2"):
        with pytest.raises(ValueError, match=f"policy_share_s={bad!r} must be a positive finite number"):
            ClusterSpec(2, 10, policy_share_s=bad)
    with pytest.raises(ValueError, match="pooled=1 must be a bool"):
        ClusterSpec(2, 10, pooled=1)
    with pytest.raises(ValueError, match="device_blocks=0 must be an int in"):
        cluster_replay(TWO_CONVERSATIONS, ClusterSpec(2, 0))
    with pytest.raises(ValueError, match=r"prefill_tokens_per_s=0 must be a finite number > 0 \(tokens per second\)"):
        ServiceModel(prefill_tokens_per_s=0)
    for bad in ("1", None, True, -1.0, float("inf")):  # a str or None raised a bare TypeError; True passed
        with pytest.raises(ValueError, match=rf"latency_s={bad!r} must be a finite number >= 0 \(seconds\)"):
            FetchModel(latency_s=bad)
    # the one cache of the cluster's capacity was checked only after every request had replayed
    with pytest.raises(ValueError, match=r"nodes x device_blocks = 3 x 1000000000 = 3000000000 blocks exceeds"):
        ClusterSpec(3, 1_000_000_000)


def test_the_offline_yardstick_keeps_what_a_node_computes_and_names_its_room():
    # a request longer than a node's device is computed (and cached) only up to it; a yardstick
    # caching the whole request evicted what the nodes kept, and a cluster beat its 'bound'
    report = cluster_replay(trace([(0,), (1, 0), (0,)]), ClusterSpec(2, 1, host_blocks=2, block_tokens=BLOCK))
    assert report.local.hit_blocks <= report.offline.hit_blocks
    assert f"offline at {2 * (1 + 2)} blocks" in format_cluster_report("t", report)


# --- the CLI -------------------------------------------------------------------------------


def write_trace(tmp_path, requests):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                            for r in requests))  # fmt: skip
    return str(path)


def test_cli_cluster_replay_ends_with_the_cluster_fields(tmp_path, capsys):
    argv = ["replay", write_trace(tmp_path, TWO_CONVERSATIONS), "--nodes", "2", "--device-blocks", "10",
            "--block-tokens", str(BLOCK), "--router", "round_robin", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("service-time model:") for line in out)
    summary = json.loads(out[-1])
    assert (summary["nodes"], summary["router"], summary["requests"]) == (2, "round_robin", 6)
    assert summary["block_hit_rate"] == pytest.approx(4 / 18)
    assert summary["reachable_remote_block_hit_rate"] == pytest.approx(6 / 18)
    assert summary["remote_block_hit_rate"] == 0.0  # 4-token blocks: the 1 ms fetch latency costs more
    assert summary["single_cache_block_hit_rate"] == pytest.approx(10 / 18)
    assert summary["max_mean_requests"] == 1.0 and summary["p95_window_max_mean_requests"] == 1.0
    assert "unlimited_block_hit_rate" in summary and "offline_block_hit_rate" in summary


@pytest.mark.parametrize("extra, share_s", [([], DEFAULT_POLICY_SHARE_S), (["--policy-share-s", "0.5"], 0.5),
                                             (["--no-policy-sharing"], None)])
def test_cli_sets_how_often_nodes_share_what_their_policies_learned(tmp_path, capsys, extra, share_s):
    argv = ["replay", write_trace(tmp_path, TWO_CONVERSATIONS), "--nodes", "2", "--device-blocks", "10",
            "--block-tokens", str(BLOCK), "--json", *extra]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["policy_share_s"] == share_s


def test_cli_pools_the_nodes_caches_on_request(tmp_path, capsys):
    argv = ["replay", write_trace(tmp_path, TWO_CONVERSATIONS), "--nodes", "2", "--device-blocks", "10",
            "--block-tokens", str(BLOCK), "--router", "round_robin", "--pooled", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert any("pooled into one cache" in line for line in out)
    summary = json.loads(out[-1])
    assert summary["pooled"] is True and summary["block_hit_rate"] == pytest.approx(4 / 18)  # no node hits another's


@pytest.mark.parametrize("extra", [["--policy", "lru"], ["--nodes", "1"]])
def test_the_report_says_nothing_was_shared_where_no_exchange_happens(tmp_path, capsys, extra):
    argv = ["replay", write_trace(tmp_path, TWO_CONVERSATIONS), "--nodes", "2", "--device-blocks", "10",
            "--block-tokens", str(BLOCK), "--json", "--policy-share-s", "0.5", *extra]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["policy_share_s"] is None


def test_cli_without_nodes_is_the_single_node_replay(tmp_path, capsys):
    assert main(["replay", write_trace(tmp_path, TWO_CONVERSATIONS), "--device-blocks", "10", "--block-tokens",
                 str(BLOCK), "--json"]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert "nodes" not in summary and summary["block_hit_rate"] == pytest.approx(10 / 18)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--router", "prefix"], "kvjax replay: error: --router: cluster options; add --nodes N"),
        (["--nodes", "0"], "kvjax replay: error: nodes=0 must be an int >= 1"),
        (["--nodes", "2", "--decode-tokens-per-s", "-1"], "decode_tokens_per_s=-1.0 must be a finite number > 0"),
        (["--nodes", "2", "--imbalance-abs", "-1"], "imbalance_abs=-1.0 and imbalance_rel=0.5 must be >= 0"),
        (["--nodes", "2", "--share-slack-rel", "-1"], "share_slack_abs=2.0 must be >= 1 (requests) and "
                                                      "share_slack_rel=-1.0 >= 0"),
        (["--no-policy-sharing"], "kvjax replay: error: --no-policy-sharing: cluster options; add --nodes N"),
        (["--pooled"], "kvjax replay: error: --pooled: cluster options; add --nodes N"),
        (["--nodes", "2", "--policy-share-s", "0"], "policy_share_s=0.0 must be a positive finite number of seconds"),
        (["--nodes", "2", "--policy-share-s", "1", "--no-policy-sharing"],
         "--policy-share-s 1 and --no-policy-sharing contradict each other"),
        (["--nodes", "2", "--remote-fetch-cost", "0.5", "--no-remote-fetch"],
         "--remote-fetch-cost 0.5 and --no-remote-fetch contradict each other"),
    ],
)
def test_cli_refuses_bad_cluster_options_with_one_line(tmp_path, capsys, extra, message):
    argv = ["replay", write_trace(tmp_path, TWO_CONVERSATIONS), "--device-blocks", "10", "--block-tokens", str(BLOCK),
            *extra]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_refuses_an_unknown_router(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", write_trace(tmp_path, TWO_CONVERSATIONS), "--device-blocks", "10", "--nodes", "2",
              "--router", "fastest"])  # fmt: skip
    assert exit_info.value.code == 2 and "invalid choice: 'fastest'" in capsys.readouterr().err
