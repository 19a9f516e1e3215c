"""Block events: the log and its subscriptions, and what a KVCache reports through it, tier by tier."""

import collections
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_cache_cases import MemoryDisk

from kvjax.cache.block_events import EVENT_KINDS, TIER_NAMES, BlockEvent, BlockIndex, EventLog
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


# ---- properties ----------------------------------------------------------------------------

BLOCKS = [(b"n" * 16, bytes([i]) * 16) for i in range(3)] + [(b"m" * 16, bytes([0]) * 16)]  # a key in two namespaces
tier_st = st.sampled_from(TIER_NAMES)


@dataclasses.dataclass
class ModelSubscription:
    subscription: object
    max_batches: int
    shadow: BlockIndex | None  # initial plus every batch polled; None once it lost a batch
    batches: collections.deque = dataclasses.field(default_factory=collections.deque)  # flushed, not polled
    lost: int = 0
    open: bool = True


class EventLogMachine(RuleBasedStateMachine):
    """Random store / remove / clear / flush / subscribe / poll / close against a plain model:
    the tiers' holdings (a set of (namespace, key, tier)), the log's next seq and open batch,
    and each subscription's queue of batches and losses. Every poll returns exactly the
    batches the model queued (whole, in order, the oldest dropped past ``max_batches`` and
    counted); a subscription that lost nothing rebuilds, from its ``initial`` holdings and the
    batches alone, what the tiers held at the last flush."""

    def __init__(self):
        super().__init__()
        self.log = EventLog()
        self.held: set = set()  # (namespace, key, tier) the tiers hold
        self.flushed: set = set()  # the holdings the open batch's events start from
        self.seq = 0
        self.pending: list = []
        self.subs: list[ModelSubscription] = []

    def listening(self):
        return [sub for sub in self.subs if sub.open]

    def recorded(self, namespace, key, tier, kind):
        self.log.record(namespace, key, None, tier, kind)
        if not self.listening():  # nobody listens: nothing recorded, nothing pending
            self.flushed = set(self.held)
            return
        self.pending.append(BlockEvent(self.seq, namespace, key, None, tier, kind))
        self.seq += 1

    @rule(block=st.sampled_from(BLOCKS), tier=tier_st)
    def store_or_remove(self, block, tier):
        entry = (*block, tier)
        kind = "removed" if entry in self.held else "stored"
        (self.held.discard if kind == "removed" else self.held.add)(entry)
        self.recorded(*block, tier, kind)

    @rule(tier=tier_st)
    def clear(self, tier):
        self.held = {entry for entry in self.held if entry[2] != tier}
        self.recorded(None, None, tier, "cleared")

    @rule()
    def flush(self):
        assert self.log.flush() == len(self.pending)
        if self.pending:
            for sub in self.listening():
                sub.batches.append(tuple(self.pending))
                while len(sub.batches) > sub.max_batches:
                    sub.batches.popleft()
                    sub.lost += 1
        self.pending, self.flushed = [], set(self.held)

    @rule(max_batches=st.integers(1, 3), flush_first=st.booleans())
    def subscribe(self, max_batches, flush_first):
        """A new subscription gets the batches flushed from now on, the open one included
        (``KVCache.subscribe`` flushes first); its holdings start from the last flush."""
        if flush_first:
            self.flush()
        subscription = self.log.subscribe(max_batches)
        self.subs.append(ModelSubscription(subscription, max_batches, BlockIndex(self.flushed)))

    @precondition(lambda self: self.subs)
    @rule(i=st.integers(0, 100))
    def poll(self, i):
        sub = self.subs[i % len(self.subs)]
        batches = sub.subscription.poll()
        assert batches == list(sub.batches) and sub.subscription.lost_batches == sub.lost
        sub.batches.clear()
        if sub.lost:
            sub.shadow = None  # it rebuilds from a fresh subscription's initial
            return
        for batch in batches:
            sub.shadow.apply(batch)
        if sub.open:
            assert sub.shadow == BlockIndex(self.flushed), sub.shadow.difference(BlockIndex(self.flushed))

    @precondition(lambda self: any(sub.open for sub in self.subs))
    @rule(i=st.integers(0, 100))
    def close(self, i):
        sub = self.listening()[i % len(self.listening())]
        sub.subscription.close()
        sub.open = False
        assert sub.subscription.closed
        if not self.listening():  # the open batch had no reader left: dropped
            self.pending, self.flushed = [], set(self.held)

    @invariant()
    def log_matches_model(self):
        assert self.log.active == bool(self.listening())
        assert self.log.next_seq == self.seq
        for sub in self.subs:  # what a subscription holds is numbered consecutively (losses drop the oldest)
            seqs = [event.seq for batch in sub.batches for event in batch]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True


TestEventLogMachine = EventLogMachine.TestCase
TestEventLogMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


event_st = st.tuples(st.sampled_from(BLOCKS), tier_st, st.sampled_from(EVENT_KINDS))


@settings(max_examples=200, deadline=None)
@given(start=st.sets(st.tuples(st.sampled_from(BLOCKS), tier_st)), events=st.lists(event_st, max_size=30))
def test_a_block_index_holds_what_a_set_of_the_events_holds(start, events):
    """Folded one at a time, events change the index as they change a plain set; one out of
    step (a store of a block held, a removal of one not held) raises and changes nothing."""
    held = {(*block, tier) for block, tier in start}
    index = BlockIndex(held)
    for seq, (block, tier, kind) in enumerate(events):
        namespace, key = (None, None) if kind == "cleared" else block
        event = BlockEvent(seq, namespace, key, None, tier, kind)
        if kind != "cleared" and (kind == "stored") == ((*block, tier) in held):
            with pytest.raises(ValueError, match=f"event {seq}: {kind}"):
                index.apply([event])
        else:
            index.apply([event])
            if kind == "cleared":
                held = {entry for entry in held if entry[2] != tier}
            else:
                (held.add if kind == "stored" else held.discard)((*block, tier))
        assert set(index.entries()) == held and len(index) == len(held)
        assert all(index.tiers(*b) == {t for *other, t in held if tuple(other) == b} for b in BLOCKS)
    assert index == BlockIndex(held)
