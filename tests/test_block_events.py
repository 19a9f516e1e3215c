"""Block events: the log and its subscriptions, and what a KVCache reports through it, tier by tier."""

import collections
import dataclasses
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
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


STORIES = ((1, 2, 3, 4, 5, 6), (1, 2, 3, 5, 6, 7), (7, 7, 1, 2))
serve_tokens_st = st.builds(lambda story, cut: list(story[:cut]), st.sampled_from(STORIES), st.integers(2, 6))


class CacheSubscriptionMachine(RuleBasedStateMachine):
    """A real KVCache (threaded transfer engine, a disk directory) under random serve /
    evict / evict_host / flush / poll steps, subscribed to at random points, some with room
    for one batch: after every step each subscription's ``initial`` plus the batches it
    polled equals ``block_index()``, with consecutive seqs; one that lost batches starts over
    from a new subscription. Disk events come from the engine's worker thread: the index
    and the batches agree at every instant, whatever the worker has done by then."""

    @initialize(write_policy=st.sampled_from(["write_back", "write_through"]), max_batches=st.sampled_from([1, 4096]))
    def setup(self, write_policy, max_batches):
        self.directory = tempfile.mkdtemp(prefix="kvjax-events-machine-")
        config = KVCacheConfig(pool=POOL, host_bytes=3 * POOL.bytes_per_block, write_policy=write_policy,
                               disk_dir=self.directory, disk_bytes=6 * POOL.bytes_per_block,
                               disk_segment_bytes=2 * POOL.bytes_per_block, transfer_buckets=(1, 2, 4))  # fmt: skip
        self.cache = KVCache(config)
        self.subs = []  # [subscription, shadow index, next seq or None, lost batches seen]
        self.subscribe(max_batches)

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        self.cache.close()  # device and host cleared; the disk keeps its blocks
        for entry in self.subs:
            self.catch_up(entry)
            assert entry[0].lost_batches or {tier for *_, tier in entry[1].entries()} <= {"disk"}
        shutil.rmtree(self.directory, ignore_errors=True)

    @rule(tokens=serve_tokens_st, namespace=st.sampled_from(["tenant-a", "tenant-b"]))
    def serve(self, tokens, namespace):
        handle = self.cache.admit(tokens, namespace)
        if handle is None:
            return
        self.cache.end_step()  # the admission's step: one batch, the commit's another
        assert self.cache.wait_ready(handle, 20)
        self.cache.commit(handle, tokens)
        self.cache.release(handle)
        self.cache.end_step()

    @rule(requests=st.lists(st.tuples(serve_tokens_st, st.sampled_from(["tenant-a", "tenant-b"])), min_size=2,
                            max_size=3))  # fmt: skip
    def serve_several(self, requests):
        """Steps with no poll of the subscriptions between them: one that keeps one batch loses some."""
        for tokens, namespace in requests:
            self.serve(tokens, namespace)

    @rule(num_blocks=st.integers(1, 4))
    def evict(self, num_blocks):
        self.cache.evict(num_blocks)
        self.cache.end_step()

    @rule(num_blocks=st.integers(1, 3))
    def evict_host(self, num_blocks):
        self.cache.evict_host(num_blocks)

    @rule()
    def flush(self):
        self.cache.flush(20)  # False when the full disk refuses blocks: not the point here

    @rule()
    def poll(self):
        self.cache.poll()

    @rule(max_batches=st.sampled_from([1, 2, 4096]))
    def subscribe(self, max_batches):
        subscription = self.cache.subscribe(max_batches)
        self.subs.append([subscription, subscription.initial, None, 0])

    @precondition(lambda self: len(self.subs) > 1)
    @rule(i=st.integers(0, 100))
    def unsubscribe(self, i):
        self.subs.pop(i % len(self.subs))[0].close()

    def catch_up(self, entry):
        """Poll ``entry``'s subscription: consecutive seqs, a gap only where it lost batches;
        its shadow takes the batches while it has lost none."""
        subscription, shadow, next_seq, lost_seen = entry
        for i, batch in enumerate(subscription.poll()):
            seqs = [event.seq for event in batch]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            gap = i == 0 and subscription.lost_batches > lost_seen
            assert next_seq is None or (seqs[0] > next_seq if gap else seqs[0] == next_seq)
            next_seq = seqs[-1] + 1
            if not subscription.lost_batches:
                shadow.apply(batch)
        entry[2:] = next_seq, subscription.lost_batches

    @invariant()
    def subscriptions_rebuild_the_holdings(self):
        for i, entry in enumerate(self.subs):
            if entry[0].lost_batches:  # fell behind: start over from the holdings
                entry[0].close()
                subscription = self.cache.subscribe(entry[0]._max_batches)
                self.subs[i] = [subscription, subscription.initial, None, 0]
        holdings = self.cache.block_index()
        for entry in self.subs:
            self.catch_up(entry)
            if not entry[0].lost_batches:
                assert entry[1] == holdings, entry[1].difference(holdings)


TestCacheSubscriptionMachine = CacheSubscriptionMachine.TestCase
TestCacheSubscriptionMachine.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)
