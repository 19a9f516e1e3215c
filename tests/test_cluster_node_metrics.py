"""A node's own Prometheus series (``kvjax.cluster.node_server``): what only grows is a
counter (``_total``), what goes up and down a gauge, read back through a Prometheus parser."""

import collections
import types

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from kvjax.cluster.node_server import _node_metrics
from kvjax.cluster.node_view import NodeLoad
from kvjax.cluster.remote_fetch import OUTCOMES


class _Transport:
    def __init__(self):
        self.counters = {"offers": 3, "offered_bytes": 3072, "acknowledged": 2, "reclaimed": 1,
                         "reclaim_timeouts": 0, "pulls": 4, "pulled_bytes": 4096, "pull_timeouts": 1,
                         "pull_failures": 0, "abandoned_pulls": 0}  # fmt: skip

    def stats(self):
        return {**self.counters, "outstanding_offers": 1}


def _families(worker, offers):
    text = prometheus_client.generate_latest(_node_metrics(worker, offers)).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}, text


def test_transfer_server_counters_are_counters_and_outstanding_offers_a_gauge():
    transport = _Transport()
    offers = types.SimpleNamespace(counters={"asks": 5, "offered_pages": 9, "empty": 1, "late": 0},
                                   transport=transport)  # fmt: skip
    remote = types.SimpleNamespace(counters=collections.Counter({o: 1 for o in OUTCOMES}, fetched_blocks=7),
                                   recent_seconds=[0.1, 0.2])  # fmt: skip
    worker = types.SimpleNamespace(load=NodeLoad(2, 100), publisher=None, remote=remote)
    families, text = _families(worker, offers)
    for name, value in transport.counters.items():
        family = families[f"kvjax_node_transfer_{name}"]
        assert family.type == "counter", (name, family.type)
        assert [s.value for s in family.samples if s.name.endswith("_total")] == [value], text
    outstanding = families["kvjax_node_transfer_outstanding_offers"]
    assert outstanding.type == "gauge" and outstanding.samples[0].value == 1
    for name in ("kvjax_node_inflight_requests", "kvjax_node_pending_prefill_tokens"):
        assert families[name].type == "gauge"
    for name in ("kvjax_node_offer_asks", "kvjax_node_remote_fetches", "kvjax_node_remote_fetched_blocks"):
        assert families[name].type == "counter"
