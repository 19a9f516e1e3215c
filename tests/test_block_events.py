"""Block events: the log and its subscriptions, and what a KVCache reports through it, tier by tier."""

import numpy as np
import pytest
from kv_cache_cases import MemoryDisk

from kvjax.cache.block_events import BlockEvent, BlockIndex, EventLog
from kvjax.cache.block_keys import Namespace, chained_block_keys
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig
from kvjax.tiers.page_pool import PoolConfig

POOL = PoolConfig(num_blocks=4, num_layers=1, num_kv_heads=1, page_size=2, head_dim=4, dtype="float32")
NS = Namespace("tenant-a")


def test_batches_reach_every_subscription_in_order_and_nothing_is_kept_without_one():
    log = EventLog()
    log.record(b"n" * 16, b"a" * 16, None, "device", "stored")  # nobody listens: dropped
    assert log.flush() == 0 and log.next_seq == 0
    first, second = log.subscribe(), log.subscribe(max_batches=1)
    log.record(b"n" * 16, b"a" * 16, None, "device", "stored")
    log.flush()
    log.record(b"n" * 16, b"a" * 16, None, "device", "removed")
    log.record(None, None, None, "host", "cleared")
    assert log.flush() == 2
    batches = first.poll()
    assert [[(e.seq, e.kind) for e in batch] for batch in batches] == [[(0, "stored")], [(1, "removed"), (2, "cleared")]]
    assert len(second.poll()) == 1 and second.lost_batches == 1  # fell behind: the oldest batch went
    assert first.poll() == []
    first.close()
    assert first.closed
    with pytest.raises(ValueError, match=r"event tier='gpu' kind='stored'; expected one of"):
        log.record(b"n" * 16, b"a" * 16, None, "gpu", "stored")
    with pytest.raises(ValueError, match=r"max_batches=0 must be an int >= 1"):
        log.subscribe(max_batches=0)


def test_a_block_index_folds_events_and_refuses_a_log_out_of_step():
    index = BlockIndex([(b"n" * 16, b"a" * 16, "disk")])
    index.apply([BlockEvent(0, b"n" * 16, b"a" * 16, None, "device", "stored"),
                 BlockEvent(1, None, None, None, "disk", "cleared")])  # fmt: skip
    assert index == BlockIndex([(b"n" * 16, b"a" * 16, "device")]) and len(index) == 1
    with pytest.raises(ValueError, match=r"event 7: stored 61616161 on device, which holds it: True"):
        index.apply([BlockEvent(7, b"n" * 16, b"a" * 16, None, "device", "stored")])
    with pytest.raises(ValueError, match=r"event 8: removed 62626262 on host, which holds it: False"):
        index.apply([BlockEvent(8, b"n" * 16, b"b" * 16, None, "host", "removed")])


def test_a_cache_reports_every_tier_with_keys_and_parents():
    disk = MemoryDisk(POOL.block_shape, POOL.dtype, capacity_blocks=8)
    config = KVCacheConfig(pool=POOL, host_bytes=4 * POOL.bytes_per_block, write_policy="write_back")
    tokens = [1, 2, 3, 4, 5]  # two full pages and one token
    keys = chained_block_keys(tokens, 2, NS)
    digest = NS.digest()
    with KVCache(config, disk_tier=disk) as cache:
        events = cache.subscribe()
        assert len(events.initial) == 0
        handle = cache.admit(tokens, NS)
        cache.commit(handle, tokens)
        cache.release(handle)
        cache.end_step()
        [batch] = events.poll()
        assert [(e.key, e.parent, e.tier, e.kind, e.namespace) for e in batch] == [
            (keys[0], None, "device", "stored", digest), (keys[1], keys[0], "device", "stored", digest)]
        cache.evict(4)  # write-back: both pages get host copies as they leave the device
        assert cache.flush(30.0)  # ... and disk copies
        cache.end_step()
        seen = [(e.key, e.tier, e.kind) for batch in events.poll() for e in batch]
        assert sorted(seen) == sorted([(k, "device", "removed") for k in keys] + [(k, "host", "stored") for k in keys]
                                      + [(k, "disk", "stored") for k in keys])  # fmt: skip
        assert cache.block_index() == BlockIndex([(digest, k, t) for k in keys for t in ("host", "disk")])
        late = cache.subscribe()  # a late subscriber starts from the holdings
        assert late.initial == cache.block_index()
    cleared = [(e.tier, e.kind) for batch in events.poll() for e in batch]
    assert cleared == [("device", "cleared"), ("host", "cleared")]  # close: the disk keeps its blocks
    assert np.array_equal(sorted(disk.held_blocks()), sorted((digest, k) for k in keys))


def test_a_refused_event_leaves_the_index_as_it_was():
    index = BlockIndex()
    key = chained_block_keys([1, 2], 2, None)[0]
    with pytest.raises(ValueError, match="removed .* on device, which holds it: False"):
        index.apply([BlockEvent(0, Namespace().digest(), key, None, "device", "removed")])
    assert index == BlockIndex() and len(index) == 0  # no empty entry left behind (they compared unequal)
