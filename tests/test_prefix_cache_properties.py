"""Stateful property test: random admit/commit/extend/release/match/evict/pin/unpin/tier/clock
sequences against a reference model, with check_invariants() after every step.

The model tracks what each device block holds (namespace + the token prefix whose last page
it stores), which blocks each live sequence holds, and which blocks each pin protects. It
checks that a hit or a match always returns blocks whose content equals what an uncached run
would have computed, that refcounts equal the model's holds, that no held or pinned block is
ever evicted or handed to someone else, and that free + reclaimable blocks are exactly the
pool minus what is held or pinned (so admission fails only when it truly cannot fit).
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvjax.cache.device_index import DeviceIndex
from kvjax.cache.policies import POLICIES
from kvjax.cache.prefix_trie import Tier

VOCAB = 3  # tiny: prefixes collide often
NAMESPACES = ("tenant-a", "tenant-b")
namespace_st = st.sampled_from(NAMESPACES[:1] * 3 + NAMESPACES[1:])  # mostly one tenant: more sharing
STORIES = ((0, 1, 2, 0, 1, 2, 0, 1, 2, 0), (0, 1, 2, 2, 2, 1, 1, 0, 0, 1), (1, 1, 1, 1, 0, 0, 0, 0, 2, 2))
random_tokens_st = st.lists(st.integers(0, VOCAB - 1), max_size=6)
# Mostly a prefix of a shared "story" plus a random tail, so requests share prefixes often.
story_tokens_st = st.builds(lambda story, cut, tail: list(story[:cut]) + tail,
                            st.sampled_from(STORIES), st.integers(2, 10), random_tokens_st)  # fmt: skip
tokens_st = st.one_of(story_tokens_st, story_tokens_st, story_tokens_st, random_tokens_st)
index_st = st.integers(0, 1000)


@dataclasses.dataclass
class ModelSeq:
    handle: object
    namespace: str
    tokens: list  # every token the sequence has (prompt + decoded)
    held: set  # blocks it holds: its block table plus cached copies of duplicate pages
    committed: int = 0  # full pages committed so far


@dataclasses.dataclass
class ModelPin:
    namespace: str
    tokens: list
    blocks: list  # device blocks of the pinned pages, in order
    until: float | None  # None: hard pin


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(8, 24), page_size=st.integers(1, 4), policy=st.sampled_from(sorted(POLICIES)))
    def setup(self, num_blocks, page_size, policy):
        self.clock = Clock()
        self.cache = DeviceIndex(num_blocks, page_size, policy=policy, vocab_size=VOCAB, clock=self.clock)
        self.num_blocks, self.page_size = num_blocks, page_size
        self.seqs: list[ModelSeq] = []
        self.released: list = []
        self.pins: list[ModelPin] = []
        self.content: dict[int, tuple] = {}  # block -> (namespace, token prefix it completes)
        self.expired_at = 0.0  # last time the cache processed soft-pin expiry

    # --- model helpers ---------------------------------------------------------------------

    def expire(self):
        """The cache processed soft-pin expiry just now (admit, evict, pin, growing extend)."""
        self.expired_at = self.clock.now
        self.pins = [p for p in self.pins if p.until is None or p.until > self.expired_at]

    def unavailable(self) -> set:
        blocks = set().union(*(s.held for s in self.seqs))
        for pin in self.pins:
            if pin.until is None or pin.until > self.expired_at:
                blocks |= set(pin.blocks)
        return blocks

    def page_content(self, namespace, tokens, page):
        return (namespace, tuple(tokens[: (page + 1) * self.page_size]))

    def write_pages(self, seq, blocks_from, first_page, last_page):
        """The engine computes pages [first_page, last_page) of ``seq`` into its own blocks."""
        for page in range(first_page, last_page):
            self.content[int(seq.handle.block_ids[page])] = self.page_content(seq.namespace, seq.tokens, page)

    def snapshot(self):
        nodes = sorted((n.first_page, bytes(n.label), n.blocks.tolist(), n.lock, n.hard_pins)
                       for n in self.cache.trie.nodes())  # fmt: skip
        return self.cache.allocator.refcounts().tolist(), self.cache.allocator.free_queue().tolist(), nodes

    def check_new_blocks(self, blocks, unavailable):
        assert unavailable.isdisjoint(blocks), "a held or pinned block was handed out again"
        for block in blocks:
            self.content[block] = None  # whatever it held is gone

    # --- rules -----------------------------------------------------------------------------

    @rule(namespace=namespace_st, tokens=tokens_st)
    def admit(self, namespace, tokens):
        num_pages = -(-len(tokens) // self.page_size)
        if not tokens:  # no last token to compute logits for
            before = self.snapshot()
            with pytest.raises(ValueError, match=r"tokens is empty \(num_tokens=0\)"):
                self.cache.admit(tokens, namespace)
            assert self.snapshot() == before
            return
        if num_pages > self.num_blocks:
            with pytest.raises(ValueError, match=f"needs {num_pages} blocks; the pool has {self.num_blocks}"):
                self.cache.admit(tokens, namespace)
            return
        cached = self.cache.match(tokens, namespace)
        expected_hits = min(cached.num_device_blocks, max(len(tokens) - 1, 0) // self.page_size)
        self.expire()
        unavailable, before = self.unavailable(), self.snapshot()
        # Hits stop being reclaimable once locked, so they count against what is available.
        available = self.num_blocks - len(unavailable | set(cached.blocks[:expected_hits].tolist()))
        handle = self.cache.admit(tokens, namespace)
        assert (handle is None) == (num_pages - expected_hits > available)
        if handle is None:
            assert self.snapshot() == before
            return
        hits = handle.num_hit_tokens // self.page_size
        assert hits == expected_hits and len(handle.block_table) == num_pages
        for page, block in enumerate(handle.block_table[:hits]):
            assert self.content[block] == self.page_content(namespace, tokens, page)
        self.check_new_blocks(handle.block_table[hits:], unavailable)
        seq = ModelSeq(handle, namespace, list(tokens), set(handle.block_table), committed=hits)
        self.write_pages(seq, handle.block_ids, hits, len(tokens) // self.page_size)
        self.seqs.append(seq)

    @rule(requests=st.lists(st.tuples(namespace_st, tokens_st, st.sampled_from([False] * 3 + [True])),
                            min_size=1, max_size=4))  # fmt: skip
    def whole_requests(self, requests):
        """Each: admit -> commit the whole prompt -> release (unless kept running)."""
        for namespace, tokens, keep in requests:
            before = len(self.seqs)
            self.admit(namespace, tokens)
            if len(self.seqs) > before:
                self.extend_and_commit(len(self.seqs) - 1, [], 1.0)
                if not keep:
                    self.release(len(self.seqs) - 1)

    @precondition(lambda self: self.seqs)
    @rule(index=index_st, extra=random_tokens_st, cut=st.floats(0, 1))
    def extend_and_commit(self, index, extra, cut):
        seq = self.seqs[index % len(self.seqs)]
        if self.extend(seq, len(extra)):
            seq.tokens += extra
        length = int(round(cut * len(seq.tokens)))
        self.cache.commit(seq.handle, seq.tokens[:length])
        full = length // self.page_size
        if full > seq.committed:
            self.write_pages(seq, seq.handle.block_ids, seq.committed, full)
            cached = self.cache.match(seq.tokens[:length], seq.namespace).blocks.tolist()
            for page in range(full):
                assert self.content[cached[page]] == self.page_content(seq.namespace, seq.tokens, page)
            seq.held |= set(cached[:full])  # duplicate pages: the cached copy is held too
            seq.committed = full

    @precondition(lambda self: self.seqs)
    @rule(index=index_st, count=st.integers(0, 6))
    def extend_only(self, index, count):
        seq = self.seqs[index % len(self.seqs)]
        if self.extend(seq, count):
            seq.tokens += [0] * count  # tokens decided now, written when committed

    def extend(self, seq, count):
        missing = -(-(len(seq.tokens) + count) // self.page_size) - len(seq.handle.block_ids)
        if missing > 0:
            self.expire()
        unavailable, before, old_table = self.unavailable(), self.snapshot(), seq.handle.block_table
        ok = self.cache.extend(seq.handle, count)
        assert ok == (missing <= self.num_blocks - len(unavailable))
        if not ok:
            assert self.snapshot() == before
            return False
        assert seq.handle.block_table[: len(old_table)] == old_table  # append-only
        new_blocks = seq.handle.block_table[len(old_table) :]
        self.check_new_blocks(new_blocks, unavailable)
        seq.held |= set(new_blocks)
        return True

    @precondition(lambda self: self.seqs)
    @rule(index=index_st)
    def release(self, index):
        seq = self.seqs.pop(index % len(self.seqs))
        self.cache.release(seq.handle)
        self.released.append(seq.handle)

    @precondition(lambda self: self.released)
    @rule(index=index_st)
    def release_twice_is_rejected(self, index):
        before = self.snapshot()
        with pytest.raises(ValueError, match="is not a live sequence"):
            self.cache.release(self.released[index % len(self.released)])
        assert self.snapshot() == before

    @rule(namespace=namespace_st, tokens=tokens_st)
    def match(self, namespace, tokens):
        result = self.cache.match(tokens, namespace)
        assert result.num_hit_blocks <= len(tokens) // self.page_size
        for page in range(result.num_device_blocks):
            assert self.content[int(result.blocks[page])] == self.page_content(namespace, tokens, page)
        assert (result.blocks[result.num_device_blocks :] == -1).all()

    @rule(count=st.integers(0, 8))
    def evict(self, count):
        self.expire()
        unavailable, free = self.unavailable(), self.cache.allocator.num_free
        victims = self.cache.evict(count)
        assert len(victims) == min(count, self.num_blocks - len(unavailable) - free)
        assert unavailable.isdisjoint(victims), "a held or pinned block was evicted"

    @rule(namespace=namespace_st, tokens=tokens_st, ttl=st.none() | st.floats(0.5, 5))
    def pin(self, namespace, tokens, ttl):
        self.expire()
        pinned = self.cache.pin(tokens, namespace, ttl=ttl)
        pages = pinned // self.page_size
        blocks = self.cache.match(tokens, namespace).blocks[:pages].tolist()
        if pages:
            until = None if ttl is None else self.clock.now + ttl
            self.pins.append(ModelPin(namespace, list(tokens), blocks, until))

    @precondition(lambda self: any(p.until is None for p in self.pins))
    @rule(index=index_st)
    def unpin(self, index):
        hard = [p for p in self.pins if p.until is None]
        chosen = hard[index % len(hard)]
        self.cache.unpin(chosen.tokens, chosen.namespace)
        # The cache undoes the most recent pin with the same namespace and full pages.
        same = [p for p in hard if self.pin_key(p.namespace, p.tokens) == self.pin_key(chosen.namespace, chosen.tokens)]
        self.pins.remove(same[-1])

    def pin_key(self, namespace, tokens):
        return namespace, tuple(tokens[: len(tokens) // self.page_size * self.page_size])

    @rule(namespace=namespace_st, tokens=tokens_st)
    def unpin_unpinned_is_rejected(self, namespace, tokens):
        key = self.pin_key(namespace, tokens)
        if any(p.until is None and self.pin_key(p.namespace, p.tokens) == key for p in self.pins):
            return
        before = self.snapshot()
        with pytest.raises(ValueError, match="no hard pin on these"):
            self.cache.unpin(tokens, namespace)
        assert self.snapshot() == before

    @rule(namespace=namespace_st, tokens=tokens_st, where=st.floats(0, 1),
          tier=st.sampled_from([Tier.HOST, Tier.DISK]), clear=st.sampled_from([False] * 3 + [True]))  # fmt: skip
    def set_or_clear_tier(self, namespace, tokens, where, tier, clear):
        cached = self.cache.match(tokens, namespace).num_hit_blocks
        page = min(int(where * cached), cached - 1) if cached else int(where * 3)
        if page >= cached:
            with pytest.raises(ValueError, match="is not cached"):
                self.cache.set_tier(tokens, namespace, page, tier)
            return
        pages = range(cached) if where > 0.5 and not clear else [page]  # often spill a whole path
        for page in pages:
            (self.cache.clear_tier if clear else self.cache.set_tier)(tokens, namespace, page, tier)

    @rule(tokens=tokens_st)
    def out_of_range_tokens_are_rejected(self, tokens):
        before = self.snapshot()
        with pytest.raises(ValueError, match=f"token id {VOCAB} at index {len(tokens)} is out of range"):
            self.cache.admit(tokens + [VOCAB], NAMESPACES[0])
        assert self.snapshot() == before

    @rule(seconds=st.floats(0, 3))
    def advance_clock(self, seconds):
        self.clock.now += seconds

    # --- checked after every step -----------------------------------------------------------

    @invariant()
    def cache_invariants_hold(self):
        self.cache.check_invariants()

    @invariant()
    def model_agrees(self):
        expected = np.zeros(self.num_blocks, np.int64)
        for seq in self.seqs:
            for block in seq.held:
                expected[block] += 1
        assert self.cache.allocator.refcounts().tolist() == expected.tolist()
        available = self.cache.allocator.num_free + self.cache.num_reclaimable
        assert available == self.num_blocks - len(self.unavailable())
        for pin in self.pins:
            if pin.until is None or pin.until > self.expired_at:
                blocks = self.cache.match(pin.tokens, pin.namespace).blocks[: len(pin.blocks)].tolist()
                assert blocks == pin.blocks, "a pinned block was evicted"


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(
    max_examples=120, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def random_tokens(rng):
    if rng.random() < 0.75:
        return list(rng.choice(STORIES)[: rng.randint(2, 10)]) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]
    return [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]


def random_step(machine, rng):
    """One rule of the machine with random arguments (the same rules hypothesis draws)."""
    namespace = rng.choice(NAMESPACES[:1] * 3 + NAMESPACES[1:])
    choice = rng.randrange(12)
    if choice < 3:
        requests = [(rng.choice(NAMESPACES), random_tokens(rng), rng.random() < 0.25) for _ in range(rng.randint(1, 4))]
        machine.whole_requests(requests)
    elif choice == 3:
        machine.admit(namespace, random_tokens(rng))
    elif choice == 4 and machine.seqs:
        extra = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]
        machine.extend_and_commit(rng.randrange(1000), extra, rng.random())
    elif choice in (5, 11) and machine.seqs:
        machine.release(rng.randrange(1000))
    elif choice == 6:
        machine.evict(rng.randint(0, 8))
    elif choice == 7:
        machine.pin(namespace, random_tokens(rng), rng.choice([None, rng.uniform(0.5, 5)]))
    elif choice == 8 and any(p.until is None for p in machine.pins):
        machine.unpin(rng.randrange(1000))
    elif choice == 9:
        machine.set_or_clear_tier(namespace, random_tokens(rng), rng.random(), rng.choice([Tier.HOST, Tier.DISK]),
                                  rng.random() < 0.25)  # fmt: skip
    elif choice == 10:
        machine.advance_clock(rng.uniform(0, 3))


@pytest.mark.parametrize("seed", range(8))
def test_long_random_walks(seed):
    """Longer runs than hypothesis draws (deep tries, splits, offloads, duplicates), seeded."""
    import random

    rng = random.Random(seed)
    machine = PrefixCacheMachine()
    machine.setup(rng.randint(8, 24), rng.randint(1, 4), sorted(POLICIES)[seed % len(POLICIES)])
    for _ in range(400):
        random_step(machine, rng)
        machine.cache_invariants_hold()
        machine.model_agrees()
