"""The prefix directory and a node's publisher against plain Python models, on a real Redis.

Two stateful machines, one redis-server for the module (flushed between examples):

* ``DirectoryMachine`` drives ``Directory`` directly: nodes register (new epochs), write the
  masks and dropped marks of their caches, lapse, deregister, heartbeat, add load; old
  processes write late under their old epochs; Redis loses everything. The model holds the
  node records and every block hash's fields as ``write_blocks`` documents them, and every
  lookup must equal a walk of those fields over the live epochs (for holdings shaped as a
  cache's), in every namespace.
* ``PublisherMachine`` drives ``DirectoryPublisher`` threads with event batches of a modelled
  cache (a tree of chained blocks in two namespaces, three tiers), lost batches and resets,
  lapsed records, node restarts and a lost Redis; once the publishers catch up, every lookup
  must give each node's leading run of the cache it models, its blocks by fastest tier, and
  the time it dropped a first block (within the step that dropped it).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from cluster_fixtures import wait_until
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvjax.cache.block_events import BlockEvent, BlockIndex
from kvjax.cache.block_keys import Namespace, chained_block_keys
from kvjax.cluster.directory import TIER_BITS, ClusterInfo, Directory, NodeLoad
from kvjax.cluster.publisher import DirectoryPublisher
from kvjax.cluster.redis_process import RedisProcess

CLUSTER = ClusterInfo(model="tiny", page_size=4)
NAMESPACES = (Namespace("tenant-a"), Namespace("tenant-b"))
# Three prompts, identical in both namespaces: 1 shares its first 3 blocks with 0, 2 shares none.
PROMPT_TOKENS = (list(range(24)), list(range(12)) + list(range(100, 112)), list(range(200, 216)))
NODES = ("n1", "n2", "n3")
TIERS = tuple(TIER_BITS)
_Block = tuple[bytes, bytes]


@dataclasses.dataclass(frozen=True)
class Prompt:
    namespace: bytes  # digest
    keys: tuple[bytes, ...]

    def blocks(self) -> list[_Block]:
        return [(self.namespace, key) for key in self.keys]


PROMPTS = tuple(Prompt(ns.digest(), tuple(chained_block_keys(tokens, CLUSTER.page_size, ns)))
                for ns in NAMESPACES for tokens in PROMPT_TOKENS)  # fmt: skip
# Block -> its parent block (None for a first block), over every prompt of every namespace.
PARENT: dict[_Block, _Block | None] = {}
for _prompt in PROMPTS:
    for _i, _block in enumerate(_prompt.blocks()):
        PARENT[_block] = _prompt.blocks()[_i - 1] if _i else None
DEPTH: dict[_Block, int] = {}
for _block in PARENT:
    _depth, _up = 0, PARENT[_block]
    while _up is not None:
        _depth, _up = _depth + 1, PARENT[_up]
    DEPTH[_block] = _depth
BY_DEPTH = sorted(PARENT, key=DEPTH.__getitem__)
# What a lookup is asked: every prompt, a prompt's keys under the other namespace's digest (a
# tenant asking with another's keys), and a prompt without its first block (no mark applies).
LOOKUPS = (*[(p.namespace, p.keys) for p in PROMPTS], (PROMPTS[3].namespace, PROMPTS[0].keys),
           (PROMPTS[0].namespace, PROMPTS[0].keys[1:]))  # fmt: skip


def fastest(mask: int) -> str:
    return "device" if mask & 1 else "host" if mask & 2 else "disk"


def walk(holds, keys: tuple[bytes, ...], namespace: bytes) -> tuple[int, dict[str, int]]:
    """The leading run of ``keys`` for which ``holds(block)`` gives a mask, and its blocks by
    fastest tier: the reference the lookup's searches must agree with."""
    run, by_tier = 0, dict.fromkeys(TIERS, 0)
    for key in keys:
        mask = holds((namespace, key))
        if not mask:
            break
        run += 1
        by_tier[fastest(mask)] += 1
    return run, by_tier


class CacheModel:
    """One node's tiers as a cache keeps them: a block is held only with its parent, and on
    device only with its parent on device (the shape the directory's lookup relies on).
    Operations return the events they cause, in order, and keep a ``BlockIndex`` in step."""

    def __init__(self):
        self.tiers: dict[_Block, set[str]] = {}
        self.seq = 0
        self.index = BlockIndex()

    def mask(self, block: _Block) -> int:
        return sum(TIER_BITS[tier] for tier in self.tiers.get(block, ()))

    def masks(self) -> dict[_Block, int]:
        return {block: self.mask(block) for block in self.tiers}

    def entries(self) -> list[tuple[bytes, bytes, str]]:
        return [(ns, key, tier) for (ns, key), where in self.tiers.items() for tier in sorted(where)]

    def store(self, prompt: Prompt, count: int, tier: str) -> list[BlockEvent]:
        events = []
        for block in prompt.blocks()[:count]:
            if tier not in self.tiers.get(block, ()):
                self.tiers.setdefault(block, set()).add(tier)
                events.append(self._event(block, tier, "stored"))
        return self._applied(events)

    def remove(self, prompt: Prompt, start: int, tier: str) -> list[BlockEvent]:
        events = []
        for block in prompt.blocks()[start:]:
            if tier in self.tiers.get(block, ()):
                self._drop(block, tier)
                events.append(self._event(block, tier, "removed"))
        return self._applied(events + self._close())

    def clear(self, tier: str) -> list[BlockEvent]:
        for block in list(self.tiers):
            if tier in self.tiers[block]:
                self._drop(block, tier)
        events = [BlockEvent(self.seq, None, None, None, tier, "cleared")]
        self.seq += 1
        return self._applied(events + self._close())

    def _close(self) -> list[BlockEvent]:
        """Drop what lost its parent (every tier) or its parent's device copy (device): a
        trie drops the pages after a page it drops."""
        events = []
        for block in BY_DEPTH:
            parent = PARENT[block]
            if block not in self.tiers or parent is None:
                continue
            gone = set(self.tiers[block]) if parent not in self.tiers else \
                {"device"} & self.tiers[block] - self.tiers[parent]  # fmt: skip
            for tier in sorted(gone):
                self._drop(block, tier)
                events.append(self._event(block, tier, "removed"))
        return events

    def _drop(self, block: _Block, tier: str) -> None:
        self.tiers[block].discard(tier)
        if not self.tiers[block]:
            del self.tiers[block]

    def _event(self, block: _Block, tier: str, kind: str) -> BlockEvent:
        parent = PARENT[block]
        event = BlockEvent(self.seq, block[0], block[1], parent[1] if parent else None, tier, kind)
        self.seq += 1
        return event

    def _applied(self, events: list[BlockEvent]) -> list[BlockEvent]:
        self.index.apply(events)  # a log out of step with its cache raises here
        assert self.index == BlockIndex(self.entries()), self.index.difference(BlockIndex(self.entries()))
        return events


cache_ops = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(PROMPTS), st.integers(1, 6), st.sampled_from(TIERS)),
    st.tuples(st.just("remove"), st.sampled_from(PROMPTS), st.integers(0, 5), st.sampled_from(TIERS)),
    st.tuples(st.just("clear"), st.none(), st.none(), st.sampled_from(TIERS)),
)


def apply_op(cache: CacheModel, op) -> list[BlockEvent]:
    kind, prompt, count, tier = op
    if kind == "store":
        return cache.store(prompt, count, tier)
    if kind == "remove":
        return cache.remove(prompt, count, tier)
    return cache.clear(tier)


@pytest.fixture(scope="module")
def redis_module():
    """A redis-server of this module alone: examples flush it (and one rule loses it all)."""
    with RedisProcess.start() as server:
        yield server


def _settings(max_examples: int, steps: int):
    return settings(max_examples=max_examples, stateful_step_count=steps, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip


# --- the directory's own contract ----------------------------------------------------------


@dataclasses.dataclass
class Record:
    epoch: int
    address: str
    load: NodeLoad


class _OnRedis(RuleBasedStateMachine):
    """A machine over its own ``Directory`` (``prefix``, ``node_ttl_s``) on a flushed Redis."""

    server: RedisProcess
    prefix: str
    node_ttl_s: float

    def __init__(self):
        super().__init__()
        self.directory = Directory.connect(self.server.url, prefix=self.prefix, node_ttl_s=self.node_ttl_s)
        self.directory.client.flushall()


class DirectoryMachine(_OnRedis):
    """``Directory`` against a model of its records and block fields (module docstring)."""

    prefix, node_ttl_s = "p", 60.0

    def __init__(self):
        super().__init__()
        self.records: dict[str, Record] = {}  # live node records
        self.counters: dict[str, int] = {}  # node id -> last epoch handed out (INCR), lost with Redis
        self.epochs_seen: dict[str, list[int]] = {}  # what the client registered, kept by it across losses
        self.fields: dict[_Block, dict[str, tuple[int, int, int]]] = {}  # node -> (epoch, mask, dropped ms)
        self.caches = {node: CacheModel() for node in NODES}  # what each node's current process holds
        self.first_blocks = {node: set() for node in NODES}
        self.clock_ms = 1000  # the nodes' clock, for dropped marks
        # a previous process of a node: another client (incarnation) on the same connection
        self.previous_process = Directory(self.directory.client, prefix=self.prefix, node_ttl_s=self.node_ttl_s)

    def teardown(self):
        self.directory.client.close()

    # nodes ---------------------------------------------------------------------------------

    @rule(node=st.sampled_from(NODES), port=st.integers(1, 3), republish=st.booleans())
    def register(self, node, port, republish):
        """A node (re)starts: a new epoch; a restarted process either writes what it holds
        again (a publisher's resync) or starts with an empty cache."""
        epoch = self.directory.register(node, f"http://{node}:{port}", CLUSTER)
        last = self.epochs_seen.get(node, [0])[-1]
        self.counters[node] = max(self.counters.get(node, 0), last) + 1
        assert epoch == self.counters[node], "an epoch is the node's INCR, or one past the client's last after a loss"
        self.epochs_seen.setdefault(node, []).append(epoch)
        self.records[node] = Record(epoch, f"http://{node}:{port}", NodeLoad())
        if not republish:
            self.caches[node], self.first_blocks[node] = CacheModel(), set()
        self._write(node, epoch, self.caches[node].masks())

    @rule(node=st.sampled_from(NODES), ops=st.lists(cache_ops, min_size=1, max_size=3),
          load=st.none() | st.builds(NodeLoad, st.integers(0, 9), st.integers(0, 999)))  # fmt: skip
    def step(self, node, ops, load):
        """One step of the node's cache: the changed blocks' masks in one transaction, a first
        block that left every tier as a mark with the node's clock."""
        cache = self.caches[node]
        before = cache.masks()
        for op in ops:
            for event in apply_op(cache, op):
                if event.kind == "stored" and event.parent is None:
                    self.first_blocks[node].add((event.namespace, event.key))
        after = cache.masks()
        changed = {block: after.get(block, 0) for block in set(before) | set(after) if before.get(block) != after.get(block)}
        self.clock_ms += 7
        dropped = {block: self.clock_ms for block, mask in changed.items() if not mask and block in self.first_blocks[node]}
        self.first_blocks[node] -= set(dropped)
        epoch = self.records[node].epoch if node in self.records else self.counters.get(node, 0)
        self._write(node, epoch, changed, load, dropped)

    @rule(node=st.sampled_from(NODES), ops=st.lists(cache_ops, min_size=1, max_size=2))
    def late_write_of_an_old_process(self, node, ops):
        """A previous epoch's process still writing (it has not heard it was superseded)."""
        if self.counters.get(node, 0) < 2:
            return
        old = self.counters[node] - 1
        stray = CacheModel()
        for op in ops:
            apply_op(stray, op)
        self._write(node, old, stray.masks(), NodeLoad(5, 5))

    @rule(node=st.sampled_from(NODES))
    def lapse(self, node):
        """The node's record expires (no heartbeat for its TTL)."""
        self.directory.client.delete(self.directory.node_key(node))
        self.records.pop(node, None)

    @rule(node=st.sampled_from(NODES), stale=st.booleans())
    def deregister(self, node, stale):
        epoch = self.counters.get(node, 0) - (1 if stale else 0)
        self.directory.deregister(node, epoch)
        if node in self.records and self.records[node].epoch == epoch:
            del self.records[node]

    @rule(node=st.sampled_from(NODES), stale=st.booleans(), load=st.builds(NodeLoad, st.integers(0, 9), st.integers(0, 99)))
    def heartbeat(self, node, stale, load):
        epoch = self.counters.get(node, 0) - (1 if stale else 0)
        status = (self.previous_process if stale else self.directory).heartbeat(node, epoch, load)
        record = self.records.get(node)
        expected = "gone" if record is None else "ok" if record.epoch == epoch else "superseded"
        assert status == expected, (node, epoch, record)
        if status == "ok":
            record.load = load

    @rule(node=st.sampled_from(NODES), inflight=st.integers(-1, 2), prefill=st.integers(0, 300))
    def route_to(self, node, inflight, prefill):
        """A router counts a request on the node at once."""
        assert self.directory.add_load(node, inflight, prefill) == (node in self.records)
        if node in self.records:
            load = self.records[node].load
            self.records[node].load = NodeLoad(load.inflight + inflight, load.prefill_tokens + prefill)

    @rule()
    def redis_lost(self):
        """Redis restarts empty: every record, block and epoch counter is gone."""
        self.directory.client.flushall()
        self.records.clear()
        self.counters.clear()
        self.fields.clear()

    # the model of write_blocks ---------------------------------------------------------------

    def _write(self, node, epoch, masks, load=None, dropped=None):
        dropped = dropped or {}
        self.directory.write_blocks(node, epoch, masks, load, dropped=dropped)
        for block, mask in masks.items():
            holders = self.fields.setdefault(block, {})
            if mask or block in dropped:
                holders[node] = (epoch, mask, 0 if mask else dropped[block])
            else:
                holders.pop(node, None)
                if not holders:
                    del self.fields[block]
        if load is not None and node in self.records and self.records[node].epoch == epoch:
            self.records[node].load = load  # an old epoch's process does not speak for the new one

    # checks ----------------------------------------------------------------------------------

    @invariant()
    def a_clients_epochs_only_grow_even_across_a_loss(self):
        for node, seen in self.epochs_seen.items():
            assert seen == sorted(set(seen)), (node, seen)

    @invariant()
    def no_hash_outlives_its_fields(self):
        names = {name.decode() for name in self.directory.client.keys("p:b:*")}
        assert names == {self.directory.block_key(*block) for block in self.fields}

    @invariant()
    def lookups_walk_the_live_epochs(self):
        for namespace, keys in LOOKUPS:
            views = self.directory.lookup(namespace, keys)
            assert [view.node_id for view in views] == sorted(self.records), "exactly the live nodes"
            for view in views:
                record = self.records[view.node_id]
                assert (view.epoch, view.address, view.load) == (record.epoch, record.address, record.load)
                entry = self._entry_of(view.node_id, record.epoch)
                run, by_tier = walk(entry, keys, namespace)
                first = self.fields.get((namespace, keys[0]), {}).get(view.node_id)
                mark = first[2] if first and first[0] == record.epoch and not first[1] else 0
                assert view.first_dropped_ms == mark, (view, first)
                if self._cache_shaped(view.node_id, record.epoch):
                    assert (view.prefix_blocks, dict(view.blocks_by_tier)) == (run, by_tier), (view, run, by_tier)
                else:  # an old process clobbered some fields: a hint, but never an old entry counted
                    assert sum(view.blocks_by_tier.values()) == view.prefix_blocks
                    if view.prefix_blocks:
                        assert entry((namespace, keys[0])) and entry((namespace, keys[view.prefix_blocks - 1]))

    def _entry_of(self, node, epoch):
        def mask(block):
            held = self.fields.get(block, {}).get(node)
            return held[1] if held and held[0] == epoch else 0

        return mask

    def _cache_shaped(self, node, epoch) -> bool:
        mask = self._entry_of(node, epoch)
        for block, parent in PARENT.items():
            if parent is not None and mask(block) and (not mask(parent) or mask(block) & 1 > mask(parent) & 1):
                return False
        return True


def test_directory_lookups_walk_the_live_epochs(redis_module):
    DirectoryMachine.server = redis_module
    run_state_machine_as_test(DirectoryMachine, settings=_settings(max_examples=120, steps=25))


# --- a node's publisher: events in, the cache's runs out -----------------------------------


class PublisherMachine(_OnRedis):
    """``DirectoryPublisher`` threads fed by modelled caches (module docstring)."""

    prefix, node_ttl_s = "q", 3.0

    def __init__(self):
        super().__init__()
        self.caches = {node: CacheModel() for node in NODES[:2]}
        self.publishers: dict[str, DirectoryPublisher] = {}
        self.first_blocks = {node: set() for node in self.caches}  # stored with no parent, as the publisher knows
        self.marks: dict[str, dict[_Block, int]] = {node: {} for node in self.caches}  # -> unix ms before the drop
        self.epochs: dict[str, int] = {}  # last epoch seen per node since Redis was lost
        for node in self.caches:
            self._start(node)

    def teardown(self):
        for publisher in self.publishers.values():
            publisher.close(deregister=False)
        self.directory.client.close()

    def _start(self, node):
        publisher = DirectoryPublisher(self.directory, node, f"http://{node}", CLUSTER, self.caches[node].entries(),
                                       heartbeat_s=0.05)  # fmt: skip
        publisher.start()
        self.publishers[node] = publisher
        self.first_blocks[node], self.marks[node] = set(), {}  # a new process remembers neither

    @rule(node=st.sampled_from(NODES[:2]), ops=st.lists(cache_ops, min_size=1, max_size=3),
          steps=st.integers(1, 2))  # fmt: skip
    def step(self, node, ops, steps):
        """The node's engine steps: one batch per step, submitted together."""
        if node not in self.publishers:
            return
        cache, before_ms = self.caches[node], int(time.time() * 1000)
        held_before = set(cache.tiers)
        batches = [[] for _ in range(steps)]
        for i, op in enumerate(ops):
            batches[i * steps // len(ops)].extend(apply_op(cache, op))
        touched = set(held_before)  # a tier cleared touches what it held
        for event in (event for batch in batches for event in batch):
            touched.add((event.namespace, event.key))
            if event.kind == "stored" and event.parent is None:
                self.first_blocks[node].add((event.namespace, event.key))
        for block in touched - set(cache.tiers):  # left its last tier, if only held within the step
            if block in self.first_blocks[node]:
                self.first_blocks[node].discard(block)
                self.marks[node][block] = before_ms
        for block in cache.tiers:
            self.marks[node].pop(block, None)
        self.publishers[node].submit([tuple(batch) for batch in batches if batch], NodeLoad(len(cache.tiers), 0))

    @rule(node=st.sampled_from(NODES[:2]), ops=st.lists(cache_ops, min_size=0, max_size=3))
    def lose_batches_then_reset(self, node, ops):
        """The node's subscription fell behind: these steps' batches are lost, and the node
        hands over the cache's full holdings instead (which carry no parents)."""
        if node not in self.publishers:
            return
        cache = self.caches[node]
        for op in ops:
            apply_op(cache, op)
        self.publishers[node].reset(cache.entries())
        self.first_blocks[node] = set()
        for block in cache.tiers:  # held again: no longer dropped
            self.marks[node].pop(block, None)

    @precondition(lambda self: any(self.marks[node] for node in self.publishers))
    @rule(data=st.data(), tier=st.sampled_from(TIERS))
    def lost_batches_cached_a_dropped_first_block_again(self, data, tier):
        """As above, where the lost batches stored a first block the node had marked dropped."""
        node = data.draw(st.sampled_from(sorted(node for node in self.publishers if self.marks[node])))
        block = data.draw(st.sampled_from(sorted(self.marks[node])))
        prompt = next(prompt for prompt in PROMPTS if prompt.blocks()[0] == block)
        self.caches[node].store(prompt, data.draw(st.integers(1, 3)), tier)
        self.lose_batches_then_reset(node, [])

    @rule(node=st.sampled_from(NODES[:2]))
    def record_lapses(self, node):
        """The node's record expired (a long pause): its heartbeat re-registers it."""
        self.directory.client.delete(self.directory.node_key(node))

    @rule(node=st.sampled_from(NODES[:2]), clean=st.booleans())
    def process_stops(self, node, clean):
        if node not in self.publishers:
            return
        self.publishers.pop(node).close(deregister=clean)
        if not clean:  # a crash: the record lives until its TTL; the test lets it lapse now
            self.directory.client.delete(self.directory.node_key(node))

    @rule(node=st.sampled_from(NODES[:2]))
    def process_starts(self, node):
        """A new process of the node, with what its cache holds (e.g. its disk tier's index)."""
        if node not in self.publishers:
            self._start(node)

    @rule()
    def redis_lost(self):
        self.directory.client.flushall()
        self.epochs.clear()

    @invariant()
    def lookups_give_each_nodes_run_once_published(self):
        expected = self._expected()
        # returns once they match; the bound only has to outlast a starved publisher thread
        if not wait_until(lambda: self._matches(expected), timeout=10.0, interval=0.01):
            got = [self._observed(ns, keys) for ns, keys in LOOKUPS]
            raise AssertionError(f"expected {expected}\ngot {got}\nstatus "
                                 f"{ {n: (p.status, p.epoch, p.last_error) for n, p in self.publishers.items()} }")
        for node, publisher in self.publishers.items():
            assert publisher.epoch > self.epochs.get(node, 0) - (publisher.epoch == self.epochs.get(node)), node
            self.epochs[node] = publisher.epoch

    def _expected(self):
        expected = []
        for namespace, keys in LOOKUPS:
            views = {}
            for node in sorted(self.publishers):
                cache = self.caches[node]
                run, by_tier = walk(cache.mask, keys, namespace)
                first = (namespace, keys[0])
                mark = self.marks[node].get(first) if not cache.mask(first) else None
                views[node] = (self.publishers[node].epoch, run, by_tier, mark)
            expected.append(views)
        return expected

    def _observed(self, namespace, keys):
        return {view.node_id: (view.epoch, view.prefix_blocks, dict(view.blocks_by_tier), view.first_dropped_ms)
                for view in self.directory.lookup(namespace, keys)}  # fmt: skip

    def _matches(self, expected) -> bool:
        now_ms = int(time.time() * 1000)
        for (namespace, keys), want in zip(LOOKUPS, expected):
            got = self._observed(namespace, keys)
            if set(want) != set(got):
                return False
            for node, (_, run, by_tier, mark) in want.items():
                epoch, got_run, got_tiers, got_ms = got[node]
                if epoch != self.publishers[node].epoch or (got_run, got_tiers) != (run, by_tier):
                    return False
                if (got_ms == 0) != (mark is None) or (mark is not None and not mark <= got_ms <= now_ms):
                    return False
        return True


def test_publisher_lookups_follow_the_nodes_caches(redis_module):
    PublisherMachine.server = redis_module
    run_state_machine_as_test(PublisherMachine, settings=_settings(max_examples=40, steps=12))
