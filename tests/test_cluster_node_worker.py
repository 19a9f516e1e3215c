"""The node's engine thread hands the cache's block event batches and its load to the
directory publisher: events recorded into a real EventLog reach a real Redis, with the
engine of the tiny preset (never stepped here, so nothing compiles)."""

import pytest
from cluster_fixtures import wait_until

from kvjax.cache.block_events import EventLog
from kvjax.cache.block_keys import Namespace, chained_block_keys
from kvjax.cluster.directory import NodeLoad
from kvjax.cluster.node_worker import EngineWorker, cluster_info_of
from kvjax.cluster.publisher import DirectoryPublisher
from kvjax.serving.engine import Engine

TENANT = Namespace("tenant-a")


@pytest.fixture(scope="module")
def engine():
    with Engine.from_preset("tiny", tiers=False) as engine:
        yield engine


def test_the_cluster_record_says_how_the_engine_keys_prompts(engine):
    assert cluster_info_of(engine, "tiny").to_fields() == {"model": "tiny", "page_size": "16", "tokenizer": "byte",
                                                           "canonicalize": "0"}  # fmt: skip


def test_event_batches_flow_from_the_engine_thread_to_the_directory(engine, directory):
    log = EventLog()
    publisher = DirectoryPublisher(directory, "n1", "http://n1", cluster_info_of(engine, "tiny"), heartbeat_s=0.1)
    publisher.start()
    worker = EngineWorker(engine, publisher, log.subscribe())
    worker.start()
    try:
        keys = chained_block_keys(list(range(64)), 16, TENANT)
        for parent, key in zip([None, *keys], keys):  # one step's batch, as the cache would flush it
            log.record(TENANT.digest(), key, parent, "device", "stored")
        log.flush()
        assert wait_until(lambda: directory.lookup(TENANT.digest(), keys)[0].prefix_blocks == 4)
        for parent, key in ((keys[2], keys[3]), (keys[1], keys[2])):  # evicted from the tail, as a cache does
            log.record(TENANT.digest(), key, parent, "device", "removed")
        log.flush()
        assert wait_until(lambda: directory.lookup(TENANT.digest(), keys)[0].prefix_blocks == 2)
        assert directory.live_nodes()[0].load == NodeLoad(0, 0)
    finally:
        worker.stop()  # stops the publisher too, which drops the node's record
    assert directory.live_nodes() == []


def test_a_subscription_that_fell_behind_is_replaced_by_the_caches_holdings(engine, directory):
    log = EventLog()
    publisher = DirectoryPublisher(directory, "n1", "http://n1", cluster_info_of(engine, "tiny"), heartbeat_s=0.1)
    publisher.start()
    worker = EngineWorker(engine, publisher, log.subscribe(max_batches=1))
    keys = chained_block_keys(list(range(64)), 16, TENANT)
    for parent, key in zip([None, *keys], keys):  # four batches before the engine thread polls: three lost
        log.record(TENANT.digest(), key, parent, "device", "stored")
        log.flush()
    worker.start()
    try:
        # the engine's cache holds none of these blocks: the directory must not claim any either
        assert wait_until(lambda: publisher.counters["resyncs"] == 2)
        assert directory.lookup(TENANT.digest(), keys)[0].prefix_blocks == 0
    finally:
        worker.stop()
