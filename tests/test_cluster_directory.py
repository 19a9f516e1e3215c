"""The prefix directory on a real Redis: registration and epochs, block entries from synthetic
event batches, lookups, TTLs, namespace isolation, and a lost Redis rebuilt from a node."""

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import redis
from cluster_fixtures import wait_until

from kvjax.cache.block_events import BlockEvent
from kvjax.cache.block_keys import Namespace, chained_block_keys
from kvjax.cluster import publisher as publisher_module
from kvjax.cluster.directory import ClusterInfo, Directory, NodeLoad, tier_mask
from kvjax.cluster.publisher import DirectoryPublisher
from kvjax.cluster.redis_process import RedisProcess
from kvjax.text.canonicalize import CanonicalizeConfig
from kvjax.text.tokenizer import ByteTokenizer, as_tokenizer

CLUSTER = ClusterInfo(model="tiny", page_size=4)
TENANT_A, TENANT_B = Namespace("tenant-a"), Namespace("tenant-b")
TOKENS = list(range(40))  # 10 blocks of 4 tokens


def keys_of(namespace, tokens=TOKENS):
    return chained_block_keys(tokens, CLUSTER.page_size, namespace)


def stored(namespace, keys, tier="device", kind="stored", seq=0):
    """One batch of events: ``kind`` of every key, chained parents, on ``tier``."""
    digest = namespace.digest()
    return tuple(BlockEvent(seq + i, digest, key, keys[i - 1] if i else None, tier, kind) for i, key in enumerate(keys))


def masks_of(batch):
    """What a publisher would write for a batch of "stored" events on one tier."""
    return {(event.namespace, event.key): tier_mask([event.tier]) for event in batch}


def by_id(views):
    return {view.node_id: view for view in views}


def test_register_increments_the_epoch_and_lists_the_live_node(directory):
    assert directory.register("n1", "http://127.0.0.1:1", CLUSTER) == 1
    assert directory.register("n1", "http://127.0.0.1:2", CLUSTER) == 2
    (view,) = directory.live_nodes()
    assert (view.node_id, view.epoch, view.address, view.load) == ("n1", 2, "http://127.0.0.1:2", NodeLoad(0, 0))
    assert directory.cluster_info() == CLUSTER


def test_a_node_of_another_model_or_page_size_is_refused(directory):
    directory.register("n1", "http://a", CLUSTER)
    with pytest.raises(ValueError, match=r"cannot join prefix .*cluster page_size=4 but this node has 16"):
        directory.register("n2", "http://b", ClusterInfo(model="tiny", page_size=16))
    assert [view.node_id for view in directory.live_nodes()] == ["n1"]


def test_a_redis_error_that_mentions_a_cluster_is_not_taken_for_a_clash(directory, monkeypatch):
    # "cluster " anywhere in the error was read as the record's refusal: a Redis Cluster's
    # CLUSTERDOWN made the publisher stop for good instead of retrying
    def down(*args, **kwargs):
        raise redis.ResponseError("CLUSTERDOWN The cluster is down")

    monkeypatch.setattr(directory, "_register", down)
    with pytest.raises(redis.ResponseError, match="CLUSTERDOWN"):
        directory.register("n1", "http://a", CLUSTER)


@pytest.mark.parametrize("bad", ["", "a:b", "a b", None])
def test_bad_node_ids_are_refused(directory, bad):
    with pytest.raises(ValueError, match="node_id=.* must be a non-empty str"):
        directory.register(bad, "http://a", CLUSTER)


def test_bad_directory_options_are_refused(redis_server):
    with pytest.raises(ValueError, match="prefix='a:b' must be a non-empty name without ':'"):
        Directory.connect(redis_server.url, prefix="a:b")
    with pytest.raises(ValueError, match="node_ttl_s=0 must be > 0 seconds"):
        Directory.connect(redis_server.url, node_ttl_s=0)


def test_lookup_returns_each_nodes_leading_run_by_tier(directory):
    keys = keys_of(TENANT_A)
    e1 = directory.register("n1", "http://a", CLUSTER)
    e2 = directory.register("n2", "http://b", CLUSTER)
    directory.register("n3", "http://c", CLUSTER)
    # n1: blocks 0-5, 0-2 on device (and host), 3-5 on host only; n2: blocks 0-1 and 3-9 (a gap at 2)
    directory.write_blocks("n1", e1, {**masks_of(stored(TENANT_A, keys[:3], "host")),
                                      **{b: 3 for b in masks_of(stored(TENANT_A, keys[:3]))},
                                      **masks_of(stored(TENANT_A, keys[3:6], "host"))})  # fmt: skip
    directory.write_blocks("n2", e2, masks_of(stored(TENANT_A, keys[:2] + keys[3:], "disk")))
    views = by_id(directory.lookup(TENANT_A.digest(), keys))
    assert views["n1"].prefix_blocks == 6
    assert views["n1"].blocks_by_tier == {"device": 3, "host": 3, "disk": 0}
    assert views["n2"].prefix_blocks == 2
    assert views["n2"].blocks_by_tier == {"device": 0, "host": 0, "disk": 2}
    assert views["n3"].prefix_blocks == 0
    other_prompt = keys_of(TENANT_A, [7] + TOKENS[1:])  # differs in the first token: every key differs
    assert [view.prefix_blocks for view in directory.lookup(TENANT_A.digest(), other_prompt)] == [0, 0, 0]


def test_removed_entries_shorten_the_run_and_leave_no_key_behind(directory):
    keys = keys_of(TENANT_A)
    epoch = directory.register("n1", "http://a", CLUSTER)
    directory.write_blocks("n1", epoch, masks_of(stored(TENANT_A, keys)))
    name = directory.block_key(TENANT_A.digest(), keys[4])
    assert 0 < directory.client.pttl(name) <= directory.block_ttl_s * 1000
    # evicted from the tail, as a cache drops pages: a device page goes only after its children
    directory.write_blocks("n1", epoch, {(TENANT_A.digest(), key): 0 for key in keys[4:]})
    assert directory.lookup(TENANT_A.digest(), keys)[0].prefix_blocks == 4
    assert not directory.client.exists(name)  # the node's field was the last: the hash is gone


def walked_run(entries, epoch, count):
    """The leading run and its blocks by fastest tier, walking every block (the reference)."""
    run, by_tier = 0, {"device": 0, "host": 0, "disk": 0}
    for index in range(count):
        held = entries.get(index)
        if held is None or held[0] != epoch:
            break
        run += 1
        by_tier["device" if held[1] & 1 else "host" if held[1] & 2 else "disk"] += 1
    return run, by_tier


def test_lookup_equals_a_walk_of_every_block_for_cache_shaped_holdings(directory):
    """Random holdings shaped as a cache's are (a block held only with its parent, a device
    block only with its parent on device; host and disk in any mix below), plus entries of an
    old epoch, of the same epoch by another client (a process from before Redis lost its
    data) and of dead nodes: the lookup's binary searches give what walking every block
    gives, for every node, prompt length and tier mix."""
    rng = random.Random(13)
    epochs = {node: directory.register(node, f"http://{node}", CLUSTER) for node in ("n1", "n2", "n3", "n4")}
    for trial in range(60):
        count = rng.choice([1, 2, 3, 7, 16, 33, 64])
        keys = keys_of(TENANT_A, list(range(trial * 1000, trial * 1000 + count * CLUSTER.page_size)))
        entries = {}
        for node, epoch in epochs.items():
            run = rng.choice([0, count, rng.randint(0, count)])
            device = rng.choice([0, run, rng.randint(0, run)])
            mine = {i: 1 | rng.choice([0, 2, 4, 6]) if i < device else rng.choice([2, 4, 6]) for i in range(run)}
            # a previous epoch's, or this epoch's number in another client's incarnation
            stale = {i: rng.choice([(epoch - 1, directory.incarnation), (epoch, "0ther")])
                     for i in range(run, count) if rng.random() < 0.5}  # fmt: skip
            directory.write_blocks(node, epoch, {(TENANT_A.digest(), keys[i]): mask for i, mask in mine.items()})
            for i, (old, incarnation) in stale.items():
                directory.client.hset(directory.block_key(TENANT_A.digest(), keys[i]), node, f"{old}/{incarnation}:1")
            entries[node] = {**{i: (None, 1) for i in stale}, **{i: (epoch, mask) for i, mask in mine.items()}}
        dead = f"1/{directory.incarnation}:7"
        directory.client.hset(directory.block_key(TENANT_A.digest(), keys[-1]), "gone", dead)
        for view in directory.lookup(TENANT_A.digest(), keys):
            expected = walked_run(entries[view.node_id], epochs[view.node_id], count)
            assert (view.prefix_blocks, dict(view.blocks_by_tier)) == expected, (trial, view.node_id)


def test_entries_of_an_old_epoch_are_never_used(directory):
    keys = keys_of(TENANT_A)
    old = directory.register("n1", "http://a", CLUSTER)
    directory.write_blocks("n1", old, masks_of(stored(TENANT_A, keys)))
    new = directory.register("n1", "http://a", CLUSTER)  # the node restarted
    assert directory.lookup(TENANT_A.digest(), keys)[0].prefix_blocks == 0
    directory.write_blocks("n1", old, masks_of(stored(TENANT_A, keys)))  # a late write of the old process
    assert directory.lookup(TENANT_A.digest(), keys)[0].prefix_blocks == 0
    directory.write_blocks("n1", new, masks_of(stored(TENANT_A, keys[:3])))
    assert directory.lookup(TENANT_A.digest(), keys)[0].prefix_blocks == 3


@pytest.fixture
def lossy_redis():
    """A redis-server of the test alone, free to lose its data (FLUSHALL, as a restart without
    persistence does) without disturbing the session's."""
    with RedisProcess.start() as server:
        yield server


def test_a_process_from_before_redis_lost_its_data_never_counts_as_one_registered_after(lossy_redis):
    # epochs restarted at 1 after the loss: the old process's epoch 1 was the new process's
    # too, so its late writes counted as the new one's and its heartbeat still said "ok"
    keys = keys_of(TENANT_A)
    old_process, new_process, peer = (Directory.connect(lossy_redis.url, node_ttl_s=60.0) for _ in range(3))
    old = old_process.register("n1", "http://old", CLUSTER)
    old_process.client.flushall()
    new = new_process.register("n1", "http://new", CLUSTER)
    old_process.write_blocks("n1", old, masks_of(stored(TENANT_A, keys)), NodeLoad(7, 700))
    old_process.write_learned("n1", old, {"from": "old"})
    (view,) = peer.lookup(TENANT_A.digest(), keys)
    assert (view.address, view.epoch, view.prefix_blocks, view.load) == ("http://new", new, 0, NodeLoad(0, 0))
    assert peer.peers_learned("n2") == {}
    assert old_process.heartbeat("n1", old, NodeLoad()) == "superseded"
    old_process.deregister("n1", old)  # its shutdown leaves the new record alone
    new_process.write_blocks("n1", new, masks_of(stored(TENANT_A, keys[:3])))
    new_process.write_learned("n1", new, {"from": "new"})
    assert peer.lookup(TENANT_A.digest(), keys)[0].prefix_blocks == 3
    assert peer.peers_learned("n2") == {"n1": {"from": "new"}}


def test_a_process_registering_again_after_redis_lost_its_data_starts_a_new_epoch(lossy_redis):
    # its writes between the loss and its re-registration (it had not heard yet) were under the
    # epoch the restarted counter handed it again: a block it let go meanwhile stayed counted
    keys = keys_of(TENANT_A)
    directory = Directory.connect(lossy_redis.url, node_ttl_s=60.0)
    first = directory.register("n1", "http://a", CLUSTER)
    directory.client.flushall()
    directory.write_blocks("n1", first, masks_of(stored(TENANT_A, keys)))  # it has not heard of the loss
    second = directory.register("n1", "http://a", CLUSTER)  # its heartbeat said "gone"
    directory.write_blocks("n1", second, masks_of(stored(TENANT_A, keys[:2])))  # what it holds now
    assert directory.lookup(TENANT_A.digest(), keys)[0].prefix_blocks == 2
    assert second > first
    assert Directory.connect(lossy_redis.url).register("n1", "http://b", CLUSTER) > second  # the counter went on


def test_a_node_without_heartbeat_leaves_within_its_ttl(redis_server, redis_prefix):
    directory = Directory.connect(redis_server.url, prefix=redis_prefix, node_ttl_s=1.0)
    keys = keys_of(TENANT_A)
    epoch = directory.register("n1", "http://a", CLUSTER)
    directory.write_blocks("n1", epoch, masks_of(stored(TENANT_A, keys)))
    assert directory.heartbeat("n1", epoch, NodeLoad(1, 10)) == "ok"
    assert directory.lookup(TENANT_A.digest(), keys)[0].load == NodeLoad(1, 10)
    assert wait_until(lambda: directory.lookup(TENANT_A.digest(), keys) == [])  # its entries are there, unused
    assert directory.heartbeat("n1", epoch, NodeLoad()) == "gone"
    assert directory.add_load("n1", 1, 100) is False
    assert not directory.client.exists(directory.node_key("n1"))  # no record resurrected by the router


def test_an_old_epochs_late_write_leaves_the_new_records_load_alone(directory):
    # the old process's load overwrote the new one's, and its writes kept the record alive
    old = directory.register("n1", "http://a", CLUSTER)
    directory.register("n1", "http://b", CLUSTER)
    directory.write_blocks("n1", old, {}, NodeLoad(5, 500))
    assert directory.live_nodes()[0].load == NodeLoad(0, 0)


def test_a_newer_epoch_of_the_same_id_supersedes_the_old_process(directory):
    old_process = Directory(directory.client, prefix=directory.prefix)  # one client per process
    old = old_process.register("n1", "http://a", CLUSTER)
    directory.register("n1", "http://b", CLUSTER)
    assert old_process.heartbeat("n1", old, NodeLoad()) == "superseded"
    old_process.deregister("n1", old)  # the old process shutting down must not drop the new record
    assert [view.address for view in directory.live_nodes()] == ["http://b"]


def test_deregister_drops_the_node_at_once_and_heartbeats_prune_the_set(directory):
    e1 = directory.register("n1", "http://a", CLUSTER)
    e2 = directory.register("n2", "http://b", CLUSTER)
    directory.deregister("n1", e1)
    assert [view.node_id for view in directory.live_nodes()] == ["n2"]
    directory.heartbeat("n2", e2, NodeLoad())
    assert directory.client.smembers(f"{directory.prefix}:nodes") == {b"n2"}


def test_routing_time_load_adds_to_the_node_record(directory):
    directory.register("n1", "http://a", CLUSTER)
    assert directory.add_load("n1", 1, 300) and directory.add_load("n1", 1, 20)
    assert directory.live_nodes()[0].load == NodeLoad(2, 320)


def test_a_dropped_first_block_is_marked_with_its_time_for_this_epoch_only(directory):
    keys, digest = keys_of(TENANT_A), TENANT_A.digest()
    epoch = directory.register("n1", "http://a", CLUSTER)
    directory.register("n2", "http://b", CLUSTER)
    directory.write_blocks("n1", epoch, masks_of(stored(TENANT_A, keys)))
    assert by_id(directory.lookup(digest, keys))["n1"].first_dropped_ms == 0  # held, not dropped
    # every block leaves n1: the first stays as a dropped entry, the others are deleted
    directory.write_blocks("n1", epoch, {(digest, key): 0 for key in keys}, dropped={(digest, keys[0]): 1234})
    views = by_id(directory.lookup(digest, keys))
    assert (views["n1"].prefix_blocks, views["n1"].first_dropped_ms) == (0, 1234)
    assert views["n2"].first_dropped_ms == 0
    assert not directory.client.exists(directory.block_key(digest, keys[1]))
    assert 0 < directory.client.pttl(directory.block_key(digest, keys[0])) <= directory.block_ttl_s * 1000
    # only the request's first key counts: a prompt that starts at block 1 sees no mark
    assert by_id(directory.lookup(digest, keys[1:]))["n1"].first_dropped_ms == 0
    assert by_id(directory.lookup(TENANT_B.digest(), keys))["n1"].first_dropped_ms == 0  # another tenant
    directory.write_blocks("n1", epoch, masks_of(stored(TENANT_A, keys[:1])))  # cached again: no mark
    assert (by_id(directory.lookup(digest, keys))["n1"].prefix_blocks,
            by_id(directory.lookup(digest, keys))["n1"].first_dropped_ms) == (1, 0)  # fmt: skip
    directory.write_blocks("n1", epoch, {(digest, keys[0]): 0}, dropped={(digest, keys[0]): 99})
    directory.register("n1", "http://a", CLUSTER)  # restarted: its old epoch's marks are not used
    assert by_id(directory.lookup(digest, keys))["n1"].first_dropped_ms == 0


def test_no_tenant_sees_another_tenants_blocks(directory):
    keys_a, keys_b = keys_of(TENANT_A), keys_of(TENANT_B)  # identical prompts
    assert not set(keys_a) & set(keys_b)
    epoch = directory.register("n1", "http://a", CLUSTER)
    directory.write_blocks("n1", epoch, masks_of(stored(TENANT_A, keys_a)))
    assert directory.lookup(TENANT_A.digest(), keys_a)[0].prefix_blocks == 10
    assert directory.lookup(TENANT_B.digest(), keys_b)[0].prefix_blocks == 0
    assert directory.lookup(TENANT_B.digest(), keys_a)[0].prefix_blocks == 0  # B's digest, A's keys
    names = directory.client.keys(f"{directory.prefix}:b:*")
    assert {name.decode().split(":")[2] for name in names} == {TENANT_A.digest().hex()}


# --- the publisher: events in, one transaction per wake-up, resync on loss -----------------


@contextlib.contextmanager
def running_publisher(directory, node_id="n1", holdings=(), deregister=True):
    """A started publisher (heartbeat every 0.1 s), closed on the way out."""
    publisher = DirectoryPublisher(directory, node_id, f"http://{node_id}", CLUSTER, holdings, heartbeat_s=0.1)
    publisher.start()
    try:
        yield publisher
    finally:
        publisher.close(deregister=deregister)


def run_of(directory, namespace, keys, node_id="n1"):
    return by_id(directory.lookup(namespace.digest(), keys)).get(node_id)


def test_the_publisher_folds_event_batches_into_entries(directory):
    keys = keys_of(TENANT_A)
    initial = [(TENANT_A.digest(), key, "disk") for key in keys[:2]]  # the cache's holdings at start
    with running_publisher(directory, holdings=initial) as publisher:
        assert run_of(directory, TENANT_A, keys).prefix_blocks == 2
        publisher.submit([stored(TENANT_A, keys[:6]), stored(TENANT_A, keys[:6], "host", seq=6)], NodeLoad(2, 64))
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 6)
        view = run_of(directory, TENANT_A, keys)
        assert view.blocks_by_tier == {"device": 6, "host": 0, "disk": 0} and view.load == NodeLoad(2, 64)
        publisher.submit([stored(TENANT_A, keys[3:4], "host", kind="removed", seq=12)])  # still on device
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).blocks_by_tier["host"] == 0)
        assert run_of(directory, TENANT_A, keys).prefix_blocks == 6
        publisher.submit([(BlockEvent(13, None, None, None, "device", "cleared"),)])  # block 3 is gone now
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 3)
        assert run_of(directory, TENANT_A, keys).blocks_by_tier == {"device": 0, "host": 3, "disk": 0}
    assert directory.live_nodes() == []  # a clean shutdown deregisters


def test_the_publisher_marks_the_first_blocks_a_node_drops(directory):
    keys = keys_of(TENANT_A)
    with running_publisher(directory) as publisher:
        publisher.submit([stored(TENANT_A, keys[:4]), stored(TENANT_A, keys[:4], "host", seq=4)])
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 4)
        before_ms = int(time.time() * 1000)
        publisher.submit([stored(TENANT_A, keys[:4], kind="removed", seq=8)])  # still on host
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).blocks_by_tier["host"] == 4)
        assert run_of(directory, TENANT_A, keys).first_dropped_ms == 0
        publisher.submit([stored(TENANT_A, keys[:4], "host", kind="removed", seq=12)])  # now gone from the node
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).first_dropped_ms >= before_ms)
        assert run_of(directory, TENANT_A, keys).prefix_blocks == 0
        assert not directory.client.exists(directory.block_key(TENANT_A.digest(), keys[1]))


def test_a_cleared_tier_marks_the_first_blocks_it_held_last(directory):
    keys = keys_of(TENANT_A)
    with running_publisher(directory) as publisher:
        publisher.submit([stored(TENANT_A, keys[:3]), stored(TENANT_A, keys[:2], "host", seq=3)])
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 3)
        publisher.submit([(BlockEvent(5, None, None, None, "device", "cleared"),)])  # block 0 still on host
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 2)
        assert run_of(directory, TENANT_A, keys).first_dropped_ms == 0
        publisher.submit([(BlockEvent(6, None, None, None, "host", "cleared"),)])
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).first_dropped_ms > 0)


def test_marks_outlive_a_new_epoch(directory):
    """A node whose record lapsed registers a new epoch: its marks are written again under it
    (with their first times), so routing still finds where the prefix was last seen."""
    keys = keys_of(TENANT_A)
    with running_publisher(directory) as publisher:
        publisher.submit([stored(TENANT_A, keys[:2]), stored(TENANT_A, keys[:2], kind="removed", seq=2)])
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).first_dropped_ms > 0)
        first_ms, old_epoch = run_of(directory, TENANT_A, keys).first_dropped_ms, publisher.epoch
        directory.client.delete(directory.node_key("n1"))  # the record lapsed (or Redis lost it)
        assert wait_until(lambda: publisher.epoch not in (None, old_epoch) and publisher.status == "registered")
        assert wait_until(lambda: (view := run_of(directory, TENANT_A, keys)) is not None
                          and view.first_dropped_ms == first_ms)  # fmt: skip
        publisher.submit([stored(TENANT_A, keys[:1], seq=4)])  # cached again: the mark goes
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 1)
        assert run_of(directory, TENANT_A, keys).first_dropped_ms == 0 and not publisher._marks


def test_a_restarted_redis_is_rebuilt_from_the_node(tmp_path, redis_prefix):
    with RedisProcess.start(directory=tmp_path) as server:
        directory = Directory.connect(server.url, prefix=redis_prefix, node_ttl_s=0.6)
        keys = keys_of(TENANT_A)
        with running_publisher(directory) as publisher:
            publisher.submit([stored(TENANT_A, keys[:5])])
            assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 5)
            server.restart()  # empty: no persistence
            assert wait_until(lambda: (view := run_of(directory, TENANT_A, keys)) is not None
                              and view.prefix_blocks == 5)  # fmt: skip
            assert publisher.status == "registered" and publisher.counters["resyncs"] >= 2
            publisher.submit([stored(TENANT_A, keys[5:7], seq=5)])  # events after the rebuild still flow
            assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 7)


def test_the_publisher_rewrites_everything_under_a_new_epoch_after_a_lapse(directory):
    keys = keys_of(TENANT_A)
    with running_publisher(directory) as publisher:
        publisher.submit([stored(TENANT_A, keys[:4])])
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 4)
        directory.client.delete(directory.node_key("n1"))  # its record lapsed (e.g. a long pause)
        # registering epoch 2 and writing its blocks are two steps: a lookup between them sees
        # the new epoch with nothing under it yet (the test read that as a failure, under load)
        assert wait_until(lambda: (view := run_of(directory, TENANT_A, keys)) is not None and view.epoch == 2
                          and view.prefix_blocks == 4)  # fmt: skip


def test_reset_replaces_the_holdings_after_lost_batches(directory):
    keys = keys_of(TENANT_A)
    with running_publisher(directory) as publisher:
        publisher.submit([stored(TENANT_A, keys[:8])])
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 8)
        publisher.reset([(TENANT_A.digest(), key, "host") for key in keys[:3]])  # what the cache holds
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 3)
        assert run_of(directory, TENANT_A, keys).blocks_by_tier == {"device": 0, "host": 3, "disk": 0}


def test_a_reset_holding_a_dropped_first_block_again_publishes_it_held(directory):
    # the lost batches cached the marked block again; the resync wrote its mask, then the
    # remembered mark over it: the node looked as if it held nothing of the prefix
    keys = keys_of(TENANT_A)
    with running_publisher(directory) as publisher:
        publisher.submit([stored(TENANT_A, keys[:2]), stored(TENANT_A, keys[:2], kind="removed", seq=2)])
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).first_dropped_ms > 0)
        publisher.reset([(TENANT_A.digest(), key, "host") for key in keys[:2]])
        assert wait_until(lambda: publisher.epoch == 2)  # set once the resync wrote everything, marks last
        view = run_of(directory, TENANT_A, keys)
        assert (view.prefix_blocks, view.first_dropped_ms) == (2, 0)


def test_a_second_process_with_the_same_id_supersedes_the_first(directory):
    second_process = Directory(directory.client, prefix=directory.prefix, node_ttl_s=directory.node_ttl_s)
    with running_publisher(directory) as first, running_publisher(second_process) as second:
        assert wait_until(lambda: first.status == "superseded")
        assert second.status == "registered" and directory.live_nodes()[0].epoch == second.epoch
        assert first.successor.epoch == second.epoch  # what the first node's refusals name


MARKER_MS = 3_600_000  # a block key TTL that no write or refresh of these tests' directories sets


def mark(directory, blocks):
    """Set the blocks' key TTLs to ``MARKER_MS``: a write or refresh sets one back to at most
    ``block_ttl_s``, which ``refreshed`` sees without waiting for anything to expire."""
    for block in blocks:
        assert directory.client.pexpire(directory.block_key(*block), MARKER_MS), block


def refreshed(directory, blocks):
    """Every block key exists and had its TTL set to ``block_ttl_s`` since ``mark``."""
    return all(0 <= directory.client.pttl(directory.block_key(*block)) <= directory.block_ttl_s * 1000
               for block in blocks)  # fmt: skip


class SteppedDirectory(Directory):
    """A directory whose heartbeats each wait for the test's ``beat()``: a test counts a
    publisher's heartbeats (each refreshes a slice of the held blocks) instead of sleeping."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._turn = threading.Condition()
        self._arrived = self._let_through = 0
        self._free = False

    def heartbeat(self, node_id, epoch, load):
        with self._turn:
            self._arrived += 1
            self._turn.notify_all()
            self._turn.wait_for(lambda: self._free or self._let_through >= self._arrived)
        return super().heartbeat(node_id, epoch, load)

    def beat(self):
        """Let the waiting heartbeat run; returns once the publisher did all it does before the
        next one (which then waits)."""
        with self._turn:
            assert self._turn.wait_for(lambda: self._arrived > self._let_through, timeout=10)
            self._let_through += 1
            self._turn.notify_all()
            assert self._turn.wait_for(lambda: self._arrived > self._let_through, timeout=10)

    def run_free(self):
        """Heartbeats stop waiting (before the publisher closes)."""
        with self._turn:
            self._free = True
            self._turn.notify_all()


def test_the_publisher_refreshes_block_ttls(redis_server, redis_prefix):
    directory = Directory.connect(redis_server.url, prefix=redis_prefix, node_ttl_s=2.0, block_ttl_s=1.5)
    keys = keys_of(TENANT_A)
    blocks = [(TENANT_A.digest(), key) for key in keys[:4]]
    with running_publisher(directory, deregister=False) as publisher:
        publisher.submit([stored(TENANT_A, keys[:4])])
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 4)
        mark(directory, blocks)  # written once: only the heartbeat's refreshes set the TTLs again
        assert wait_until(lambda: refreshed(directory, blocks))
        assert run_of(directory, TENANT_A, keys).prefix_blocks == 4
    assert wait_until(lambda: directory.client.keys(f"{redis_prefix}:b:*") == [])  # nobody refreshes them: gone


def test_held_blocks_stay_refreshed_after_most_of_the_holdings_leave(redis_server, redis_prefix):
    # the slice per heartbeat was sized by the holdings now, the queue by the holdings when it
    # was built: after a mass eviction the queue took many TTLs to drain, and held blocks at
    # its end expired. Heartbeats are counted, not waited out: every held block must be
    # refreshed within half a block TTL of them, block_ttl_s / 2 / heartbeat_s = 6.
    directory = SteppedDirectory.connect(redis_server.url, prefix=redis_prefix, node_ttl_s=60.0, block_ttl_s=2.4)
    heartbeats_per_half_ttl = 6
    evicted, kept = keys_of(TENANT_A, list(range(120))), keys_of(TENANT_B, TOKENS[:12])
    evicted_blocks = [(TENANT_A.digest(), key) for key in evicted]
    kept_blocks = [(TENANT_B.digest(), key) for key in kept]
    publisher = DirectoryPublisher(directory, "n1", "http://n1", CLUSTER, heartbeat_s=0.2)
    publisher.start()
    try:
        publisher.submit([stored(TENANT_A, evicted), stored(TENANT_B, kept, seq=30)])
        directory.beat()  # the first heartbeat (nothing held yet), then the 33 blocks are written
        assert run_of(directory, TENANT_B, kept).prefix_blocks == 3
        mark(directory, evicted_blocks + kept_blocks)
        directory.beat()  # queues the 33 held blocks, the kept ones last, and refreshes the first slice
        assert refreshed(directory, evicted_blocks[:1]) and not refreshed(directory, kept_blocks[-1:])
        publisher.submit([stored(TENANT_A, evicted, kind="removed", seq=33)])
        for _ in range(heartbeats_per_half_ttl):
            directory.beat()
        assert run_of(directory, TENANT_A, evicted).prefix_blocks == 0
        assert refreshed(directory, kept_blocks)
        assert run_of(directory, TENANT_B, kept).prefix_blocks == 3
    finally:
        directory.run_free()
        publisher.close()


def test_registration_fails_clearly_without_redis(redis_prefix):
    directory = Directory.connect("redis://127.0.0.1:1/0", prefix=redis_prefix, timeout_s=0.2)
    publisher = DirectoryPublisher(directory, "n1", "http://a", CLUSTER, heartbeat_s=0.05)
    with pytest.raises(RuntimeError, match=r"node 'n1' could not register in the directory within 0.3s: "
                                           r"ConnectionError"):  # fmt: skip
        publisher.start(timeout_s=0.3)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_the_redis_command_stops_its_server_on_sigterm_and_ctrl_c(stop, tmp_path):
    # SIGTERM used to kill the command before it stopped redis-server (left running), and
    # SIGINT never reached its wait (the command hung)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = subprocess.Popen([sys.executable, "-m", "kvjax.cluster", "redis", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        ready = json.loads(command.stdout.readline())
        assert f":{port}" in ready["ready"]
        command.send_signal(stop)
        assert command.wait(timeout=30) == 0
        assert wait_until(lambda: not _running(ready["pid"]))
    finally:
        if command.poll() is None:
            command.kill()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is not running
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    return True


@pytest.mark.parametrize("tokenizer, canonicalize", [
    (ByteTokenizer(), None), (ByteTokenizer(), CanonicalizeConfig()), (ByteTokenizer(add_bos=True), None),
    (ByteTokenizer(), CanonicalizeConfig(tabs=True, dynamic_fields={"id": r"req-\d+"})),
    (ByteTokenizer(), CanonicalizeConfig(enabled=False)),
])  # fmt: skip
def test_the_cluster_record_names_exactly_how_nodes_key_text(tokenizer, canonicalize):
    # any ByteTokenizer was "byte" and any canonicalization the default: a router keyed prompts
    # otherwise than the nodes, and no lookup ever matched
    info = ClusterInfo.of("tiny", 16, tokenizer, canonicalize)
    assert ClusterInfo.from_fields(info.to_fields()) == info
    keyed_with, config = info.text_keying()
    assert keyed_with == tokenizer
    assert config == (canonicalize if canonicalize is not None and canonicalize.enabled else None)
    default = ClusterInfo.of("tiny", 16, ByteTokenizer(), CanonicalizeConfig())
    assert (default.tokenizer, default.canonicalize) == ("byte", True)
    assert (info == default) == (tokenizer == ByteTokenizer() and canonicalize == CanonicalizeConfig())
    checked = as_tokenizer(tokenizer, vocab_size=200)  # as an engine holds it: ids checked against the model's
    assert ClusterInfo.of("tiny", 16, checked, canonicalize) == info


def test_a_node_keying_text_otherwise_cannot_join(directory):
    directory.register("n1", "http://a", ClusterInfo.of("tiny", 4, ByteTokenizer(), None))
    with pytest.raises(ValueError, match=r"cannot join prefix .*: cluster tokenizer=byte but this node has byte:"):
        directory.register("n2", "http://b", ClusterInfo.of("tiny", 4, ByteTokenizer(add_bos=True), None))


def test_a_redis_started_on_a_port_another_server_holds_fails_and_names_it(redis_server):
    # a PING answered by the other server: the wrapper said ready while its own server had exited
    with pytest.raises(RuntimeError, match=rf"did not come up on 127.0.0.1:{redis_server.port} .*is the port in use"):
        RedisProcess.start(port=redis_server.port, timeout=5.0)


@pytest.mark.parametrize("argv, message", [
    (["router", "--redis", "localhost:6379"], r"router: --redis 'localhost:6379': Redis URL must specify"),
    (["node", "--node-id", "a:b"], r"node: node_id='a:b' must be a non-empty str"),
])  # fmt: skip
def test_cluster_commands_refuse_bad_settings_in_one_line_before_compiling(argv, message):
    from kvjax.cluster.__main__ import main

    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_a_port_in_use_is_named_before_a_node_compiles(redis_server):
    from kvjax.cluster.__main__ import main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(SystemExit, match=rf"node: cannot listen on 127.0.0.1:{port}: Address already in use"):
            main(["node", "--node-id", "n9", "--port", str(port), "--redis", redis_server.url])
    finally:
        taken.close()


def test_a_node_taking_a_live_nodes_id_says_so(directory, caplog):
    from kvjax.cluster.__main__ import _warn_if_replacing

    directory.register("n1", "http://127.0.0.1:8001", CLUSTER)
    with caplog.at_level("WARNING", logger="kvjax.cluster"):
        _warn_if_replacing(directory, "n1", "http://127.0.0.1:8003")  # took its place silently
        _warn_if_replacing(directory, "n2", "http://127.0.0.1:8004")
        _warn_if_replacing(directory, "n1", "http://127.0.0.1:8001")  # itself, restarted at its address
    [warning] = [record.getMessage() for record in caplog.records]
    assert warning.startswith("node n1 is live at http://127.0.0.1:8001 (epoch 1): this node replaces it")


class PausedDirectory(Directory):
    """A directory whose publisher can be stopped at its next heartbeat (``pause``, which
    returns once it waits there) and let on (``resume``): a test acts on Redis while the
    publisher makes no call (it only calls on a wake-up, and the test submits nothing)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._open, self._waiting = threading.Event(), threading.Event()
        self._open.set()

    def heartbeat(self, node_id, epoch, load):
        if not self._open.is_set():
            self._waiting.set()
            self._open.wait()
        return super().heartbeat(node_id, epoch, load)

    def pause(self):
        self._waiting.clear()
        self._open.clear()
        assert self._waiting.wait(10)

    def resume(self):
        self._open.set()


@contextlib.contextmanager
def _three_blocks_published(tmp_path, redis_prefix, keys):
    """A Redis that can restart from a snapshot, a ``PausedDirectory`` on it and a running
    publisher that has published ``keys[:3]`` of TENANT_A: (server, directory, publisher)."""
    with RedisProcess.start(directory=tmp_path) as server:
        directory = PausedDirectory.connect(server.url, prefix=redis_prefix, node_ttl_s=60.0)
        with running_publisher(directory) as publisher:
            publisher.submit([stored(TENANT_A, keys[:3])])
            assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 3)
            yield server, directory, publisher


def _restart_paused(server, directory) -> None:
    """Restart Redis while the directory's calls wait (none fails: it comes back in between)."""
    directory.pause()
    server.restart()
    directory.resume()


def test_a_redis_rolled_back_to_an_earlier_epoch_of_the_node_is_registered_again_not_taken_for_a_takeover(
        tmp_path, redis_prefix):  # fmt: skip
    # Redis restarted from a snapshot taken before the node's last re-registration: the record
    # holds the node's own earlier epoch (its incarnation, a lower epoch). The heartbeat took
    # that for a newer process and the node stopped publishing and serving for good.
    keys = keys_of(TENANT_A)
    with _three_blocks_published(tmp_path, redis_prefix, keys) as (server, directory, publisher):
        directory.client.save()  # the snapshot: epoch 1
        directory.client.delete(directory.node_key("n1"))  # the record lapsed: epoch 2
        assert wait_until(lambda: publisher.epoch == 2 and publisher.status == "registered")
        _restart_paused(server, directory)  # back from the snapshot, with epoch 1's record
        assert wait_until(lambda: publisher.epoch == 3 and publisher.status == "registered")
        assert run_of(directory, TENANT_A, keys).prefix_blocks == 3


def test_a_redis_restarted_with_older_data_is_rewritten_from_the_node(tmp_path, redis_prefix):
    # Redis came back from a snapshot (or a replica took over) without any publisher call
    # failing: the heartbeat found the record, the writes since the snapshot were lost, and
    # the directory missed the blocks stored since (and kept those removed since) for good.
    keys = keys_of(TENANT_A)
    with _three_blocks_published(tmp_path, redis_prefix, keys) as (server, directory, publisher):
        directory.client.save()  # the snapshot: 3 blocks
        publisher.submit([stored(TENANT_A, keys[3:6], seq=3)])
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 6)
        _restart_paused(server, directory)  # back from the snapshot
        assert wait_until(lambda: (view := run_of(directory, TENANT_A, keys)) is not None
                          and view.prefix_blocks == 6)  # fmt: skip
        assert publisher.status == "registered"



def test_a_publisher_backs_off_while_redis_is_down_and_registers_again_when_it_is_back(tmp_path, redis_prefix, caplog):
    # every engine step woke the publisher, and every wake-up tried to register again: one
    # failed connection per step for as long as Redis was down
    keys = keys_of(TENANT_A)
    with RedisProcess.start(directory=tmp_path) as server:
        directory = Directory.connect(server.url, prefix=redis_prefix, node_ttl_s=2.0, timeout_s=0.5)
        publisher = DirectoryPublisher(directory, "n1", "http://n1", CLUSTER, heartbeat_s=1.0)
        publisher.start()
        try:
            server.stop()  # down
            with caplog.at_level("WARNING", logger="kvjax.cluster.publisher"):
                before = publisher.counters["errors"]  # one per failed attempt
                steps = 40
                for step in range(steps):  # engine steps, each taken by the publisher on its own
                    publisher.submit([stored(TENANT_A, keys[step % 10 : step % 10 + 1], seq=step)])
                    assert wait_until(lambda: not publisher._pending, interval=0.001)
                assert publisher.status == "disconnected" and publisher.num_blocks == 10  # folded in meanwhile
                assert publisher.counters["errors"] - before < steps / 2
            assert len([r for r in caplog.records if "directory write failed" in r.getMessage()]) == 1
            server.restart()  # back, empty
            assert wait_until(lambda: publisher.status == "registered")
            assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 10)
        finally:
            publisher.close()


def test_a_held_blocks_entry_that_redis_lost_is_written_again(redis_server, redis_prefix):
    # Redis evicting a block key under memory pressure (every block key has a TTL, which the
    # volatile-* policies pick from) or an operator deleting it: the heartbeat only extended
    # the TTLs of the keys still there, so the directory lost the block until the node dropped it
    directory = Directory.connect(redis_server.url, prefix=redis_prefix, node_ttl_s=2.0, block_ttl_s=1.0)
    keys = keys_of(TENANT_A)
    with running_publisher(directory) as publisher:
        publisher.submit([stored(TENANT_A, keys[:4])])
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 4)
        assert directory.client.delete(directory.block_key(TENANT_A.digest(), keys[0]))  # evicted
        assert run_of(directory, TENANT_A, keys).prefix_blocks == 0
        assert wait_until(lambda: run_of(directory, TENANT_A, keys).prefix_blocks == 4)


def test_a_publisher_that_stopped_keeps_no_backlog(directory):
    # the node's engine thread submits every step's batches whatever the publisher's state:
    # once its thread had stopped (the cluster record changed under it, or another process
    # took the id, or the node left the directory to drain), they piled up for the node's life
    keys = keys_of(TENANT_A)
    with running_publisher(directory) as publisher:
        directory.client.hset(f"{directory.prefix}:cluster", "model", "another")  # Redis refilled by others
        directory.client.delete(directory.node_key("n1"))
        assert wait_until(lambda: not publisher._thread.is_alive())
        assert publisher.status == "disconnected" and "cluster model=another" in publisher.last_error
        for step in range(5):
            publisher.submit([stored(TENANT_A, keys[:2], seq=2 * step)], NodeLoad(1, 0))
        assert publisher._pending == []
        publisher.reset([(TENANT_A.digest(), key, "device") for key in keys])
        assert publisher._pending_reset is None


# --- a clean shutdown leaves at once; a failed call that lost nothing costs no full publish ---


class FlakyDirectory(Directory):
    """A directory whose chosen calls fail with a Redis error: ``fail["heartbeat"] = n`` fails
    the next n heartbeats (-1: until set back to 0), likewise "write_blocks" and "server_id";
    ``hold_register`` (an Event, set: let it through) holds every registration after the first
    until it is set; ``deregistered`` counts deregistrations."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail = {"heartbeat": 0, "write_blocks": 0, "server_id": 0}
        self.hold_register: threading.Event | None = None
        self.registered = self.deregistered = 0

    def _maybe_fail(self, name):
        if self.fail[name]:
            self.fail[name] -= self.fail[name] > 0
            raise redis.TimeoutError(f"{name} timed out (on purpose)")

    def heartbeat(self, *args, **kwargs):
        self._maybe_fail("heartbeat")
        return super().heartbeat(*args, **kwargs)

    def write_blocks(self, *args, **kwargs):
        self._maybe_fail("write_blocks")
        return super().write_blocks(*args, **kwargs)

    def server_id(self):
        self._maybe_fail("server_id")
        return super().server_id()

    def register(self, *args, **kwargs):
        self.registered += 1
        if self.registered > 1 and self.hold_register is not None:
            assert self.hold_register.wait(timeout=30)
        return super().register(*args, **kwargs)

    def deregister(self, *args, **kwargs):
        self.deregistered += 1
        return super().deregister(*args, **kwargs)


@pytest.fixture
def flaky(redis_server, redis_prefix):
    """A ``FlakyDirectory`` with a long node TTL: a node missing from it deregistered, it did not expire."""
    directory = FlakyDirectory.connect(redis_server.url, prefix=redis_prefix, node_ttl_s=60.0)
    yield directory
    directory.client.close()


def test_a_node_closed_while_its_last_redis_call_had_failed_still_leaves_at_once(flaky):
    # close() deregistered only a "registered" publisher: one failed call (here its heartbeat,
    # while Redis answers everything else) left it "disconnected", and routers kept choosing
    # the closed node until its record expired, up to node_ttl_s later
    keys = keys_of(TENANT_A)
    publisher = DirectoryPublisher(flaky, "n1", "http://n1", CLUSTER, heartbeat_s=0.1)
    publisher.start()
    publisher.submit([stored(TENANT_A, keys[:4])])
    assert wait_until(lambda: (view := run_of(flaky, TENANT_A, keys)) is not None and view.prefix_blocks == 4)
    flaky.fail["server_id"] = -1  # every heartbeat fails from now on
    assert wait_until(lambda: publisher.status == "disconnected")
    publisher.close()
    assert publisher.status == "closed" and not publisher._thread.is_alive()
    assert flaky.live_nodes() == [] and run_of(flaky, TENANT_A, keys) is None
    assert not flaky.client.exists(flaky.node_key("n1"))
    assert flaky.client.smembers(f"{flaky.prefix}:nodes") == set()  # not left for a heartbeat to prune


def test_a_node_closed_while_it_registers_again_leaves_no_record_behind(flaky, monkeypatch):
    # close() waits a while for the thread, then deregisters the epoch it knows: a thread
    # still inside a slow re-registration registered the next epoch after that, and the
    # closed node stayed listed until the new record expired
    monkeypatch.setattr(publisher_module, "_CLOSE_WAIT_S", 0.2, raising=False)
    keys = keys_of(TENANT_A)
    flaky.hold_register = threading.Event()
    publisher = DirectoryPublisher(flaky, "n1", "http://n1", CLUSTER, heartbeat_s=0.1)
    publisher.start()
    publisher.submit([stored(TENANT_A, keys[:4])])
    assert wait_until(lambda: (view := run_of(flaky, TENANT_A, keys)) is not None and view.prefix_blocks == 4)
    flaky.client.delete(flaky.node_key("n1"))  # the record lapsed: the publisher registers again
    assert wait_until(lambda: flaky.registered == 2)  # held inside the registration
    publisher.close()  # the thread is still busy
    flaky.hold_register.set()
    assert wait_until(lambda: not publisher._thread.is_alive())
    assert flaky.live_nodes() == [] and run_of(flaky, TENANT_A, keys) is None
    assert publisher.status == "closed"


def test_close_twice_or_from_two_threads_at_once_deregisters_once(flaky):
    publisher = DirectoryPublisher(flaky, "n1", "http://n1", CLUSTER, heartbeat_s=0.05)
    publisher.start()
    closers = [threading.Thread(target=publisher.close) for _ in range(4)]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(timeout=30)
    publisher.close()
    assert publisher.status == "closed" and flaky.live_nodes() == []
    assert flaky.deregistered == 1


def test_a_failed_write_that_lost_nothing_is_written_again_without_a_full_publish(flaky):
    # any failed call made the publisher register a new epoch and write everything it held
    # again, though Redis had lost nothing (one timed-out command): work that grows with the
    # cache, for nothing. The changes the failed write carried must still reach Redis.
    keys = keys_of(TENANT_A)
    holdings = [(TENANT_A.digest(), key, "host") for key in keys[:6]]
    publisher = DirectoryPublisher(flaky, "n1", "http://n1", CLUSTER, holdings, heartbeat_s=0.1)
    epoch = publisher.start()
    try:
        assert run_of(flaky, TENANT_A, keys).prefix_blocks == 6
        published = publisher.counters["published_blocks"]
        flaky.fail["write_blocks"] = 1
        publisher.submit([stored(TENANT_A, keys[4:6], "host", kind="removed", seq=0)])  # the write that fails
        assert wait_until(lambda: publisher.counters["errors"] == 1)
        publisher.submit([stored(TENANT_A, keys[:2], seq=2)])  # folded in while it waits to retry
        assert wait_until(lambda: run_of(flaky, TENANT_A, keys).blocks_by_tier == {"device": 2, "host": 2, "disk": 0})
        assert (publisher.epoch, publisher.counters["resyncs"]) == (epoch, 1)
        assert not flaky.client.exists(flaky.block_key(TENANT_A.digest(), keys[5]))  # the removal was written
        assert wait_until(lambda: publisher.status == "registered")
        flaky.fail["heartbeat"] = 1  # a failed heartbeat: nothing to write again
        assert wait_until(lambda: publisher.counters["errors"] == 2)
        assert wait_until(lambda: publisher.status == "registered")
        assert (publisher.epoch, publisher.counters["resyncs"], flaky.registered) == (epoch, 1, 1)
        assert publisher.counters["published_blocks"] - published == 4  # the changed blocks, not the holdings
    finally:
        publisher.close()


def test_a_failed_call_during_which_the_record_was_lost_publishes_everything_again(flaky):
    keys = keys_of(TENANT_A)
    holdings = [(TENANT_A.digest(), key, "device") for key in keys[:6]]
    publisher = DirectoryPublisher(flaky, "n1", "http://n1", CLUSTER, holdings, heartbeat_s=0.1)
    epoch = publisher.start()
    try:
        flaky.fail["heartbeat"] = -1
        assert wait_until(lambda: publisher.status == "disconnected")
        flaky.client.delete(flaky.node_key("n1"))  # Redis lost the record meanwhile
        flaky.fail["heartbeat"] = 0
        assert wait_until(lambda: publisher.status == "registered")
        assert publisher.epoch == epoch + 1 and publisher.counters["resyncs"] == 2
        assert run_of(flaky, TENANT_A, keys).prefix_blocks == 6
    finally:
        publisher.close()


def test_blocks_changed_while_redis_is_away_are_remembered_up_to_what_a_full_publish_writes(flaky):
    # past that, a full publish is no more work, and the set stops growing with the outage
    keys = keys_of(TENANT_A)
    publisher = DirectoryPublisher(flaky, "n1", "http://n1", CLUSTER, heartbeat_s=0.1)
    epoch = publisher.start()
    try:
        flaky.fail["heartbeat"] = -1
        assert wait_until(lambda: publisher.status == "disconnected")
        publisher.submit([stored(TENANT_A, keys[:3])])
        assert wait_until(lambda: not publisher._pending)
        assert publisher._unwritten == {(TENANT_A.digest(), key) for key in keys[:3]} and not publisher._needs_resync
        publisher.submit([stored(TENANT_A, keys[1:3], kind="removed", seq=3),
                          stored(TENANT_A, keys[3:6], "host", seq=5)])  # fmt: skip
        # 6 changed, 4 held and 0 marks: a resync (which calls no heartbeat) at the next retry
        assert wait_until(lambda: publisher.counters["resyncs"] == 2)
        flaky.fail["heartbeat"] = 0
        assert wait_until(lambda: publisher.status == "registered" and publisher.epoch == epoch + 1)
        assert publisher._unwritten == set() and publisher.counters["resyncs"] == 2
        assert run_of(flaky, TENANT_A, keys).prefix_blocks == 1
    finally:
        publisher.close()
