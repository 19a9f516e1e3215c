"""Learned reuse statistics through a real Redis directory: live epochs only, the
publisher's heartbeat exchange, and a node's policy merging its peers'."""

import json

from cluster_fixtures import wait_until
from test_cluster_directory import CLUSTER, running_publisher
from test_policies_reuse import _trained

from kvjax.cache.policies import ReusePolicy, ReuseStatistics
from kvjax.cluster.node_worker import share_learned

STATS = {"trials": [4.0] * 8, "reused": [1.0] * 8, "closed": 32, "horizon": 12.5, "boundary_events": 3}


def test_peers_learned_reads_live_epochs_only_and_never_the_own(directory):
    e1 = directory.register("n1", "http://a", CLUSTER)
    e2 = directory.register("n2", "http://b", CLUSTER)
    e3 = directory.register("n3", "http://c", CLUSTER)
    directory.write_learned("n1", e1, STATS)
    directory.write_learned("n2", e2, {**STATS, "closed": 7})
    directory.write_learned("n3", e3, STATS)
    assert directory.peers_learned("n1") == {"n2": {**STATS, "closed": 7}, "n3": STATS}
    directory.register("n3", "http://c", CLUSTER)  # n3 restarted: its record of the old epoch is stale
    directory.deregister("n2", e2)  # n2 left
    assert directory.peers_learned("n1") == {}
    directory.client.set(directory.learned_key("n1"), "not json")  # malformed: left out
    assert directory.peers_learned("n3") == {}
    directory.client.set(directory.learned_key("n1"), json.dumps({"epoch": e1, "statistics": 3}))
    assert directory.peers_learned("n3") == {}
    directory.client.set(directory.learned_key("n1"), "[" * 100_000 + "]" * 100_000)  # too deep for json
    assert directory.peers_learned("n3") == {}


def test_learned_records_expire_with_the_node_ttl(directory):
    epoch = directory.register("n1", "http://a", CLUSTER)
    directory.write_learned("n1", epoch, STATS)
    assert directory.learned_key("n1") == f"{directory.prefix}:node:n1:learned"  # the documented layout
    ttl_ms = directory.client.pttl(directory.learned_key("n1"))
    assert 0 < ttl_ms <= directory.node_ttl_s * 1000


def test_publishers_exchange_statistics_and_policies_merge_them(directory):
    """Two nodes' publishers (heartbeat 0.1 s): each node's policy ends up merging the
    other's statistics, decoded exactly; a malformed peer record is skipped."""
    alone = _trained(trust_trials=300.0)
    policies = {"n1": _trained(trust_trials=300.0), "n2": ReusePolicy(trust_trials=300.0)}
    with running_publisher(directory, "n1") as p1, running_publisher(directory, "n2") as p2:
        publishers = {"n1": p1, "n2": p2}
        for node, policy in policies.items():
            assert share_learned(policy, publishers[node]) is False  # nothing read yet
        merged = {}

        def exchanged():
            for node, policy in policies.items():
                if share_learned(policy, publishers[node]):
                    merged[node] = True
            return len(merged) == 2 and policies["n2"]._peer_closed == 256

        assert wait_until(exchanged)
        assert policies["n1"]._peer_closed == 0  # n2 has closed nothing yet
        assert policies["n2"].trust() == alone.trust()  # n1's 256 closed trials count at n2
        assert policies["n2"]._peer_trials == list(policies["n1"].statistics().trials)
    assert share_learned(object(), p1) is False  # another policy shares nothing


def test_a_malformed_peer_record_is_skipped_with_a_warning(directory, caplog):
    policy = ReusePolicy()
    with running_publisher(directory, "n1") as publisher:
        epoch = directory.register("n2", "http://b", CLUSTER)
        directory.write_learned("n2", epoch, {**STATS, "horizon": -1.0})
        policy_stats = ReuseStatistics.from_dict(STATS)
        assert policy_stats.closed == 32
        assert wait_until(lambda: share_learned(policy, publisher))
    assert "n2 published malformed reuse statistics" in caplog.text and "horizon=-1.0" in caplog.text
    assert policy._peer_closed == 0
