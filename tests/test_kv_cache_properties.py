"""Stateful property test of KVCache with tiny device, host and disk tiers.

Random admit / prefill / decode / release / evict (device and host) / prefetch / complete or
fail a transfer / poll / spill sequences, with ``check_invariants()`` after every step. The
test plays the model: a sequence's page ``p`` gets ``page_content(namespace, tokens through
page p)`` written into its block when computed, so after every step every cached page in
every tier (device pool, host, disk) must hold exactly what an uncached run would have
written for its prefix and tenant, and every hit a sequence is handed must too. Transfers
run only when a rule completes them (``ManualTransfer``), so fetches, copies and spills
stay in flight across evictions, releases and other admissions.
"""

import dataclasses

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_cache_cases import ManualTransfer, MemoryDisk, page_content
from scheduler_cases import Clock

from kvjax.fetch_cost import FetchCostModel
from kvjax.kv_cache import KVCache, KVCacheConfig
from kvjax.kv_cache_config import WRITE_POLICIES
from kvjax.page_pool import PoolConfig
from kvjax.trie_node import Tier

PAGE = 2
POOL = PoolConfig(num_blocks=8, num_layers=1, num_kv_heads=1, page_size=PAGE, head_dim=2, dtype="float32")
NAMESPACES = ("tenant-a", "tenant-b")
STORIES = ((0, 1, 2, 0, 1, 2, 0, 1, 2), (0, 1, 1, 2, 2, 0, 0, 1, 2))
tokens_st = st.builds(lambda story, cut, tail: list(story[:cut]) + tail, st.sampled_from(STORIES),
                      st.integers(1, 9), st.lists(st.integers(0, 2), max_size=2))  # fmt: skip
namespace_st = st.sampled_from(NAMESPACES[:1] * 3 + NAMESPACES[1:])
index_st = st.integers(0, 1000)
COST_MODELS = (FetchCostModel(seconds_per_token=1.0), FetchCostModel(fetch_latency=1.0))  # always / never


@dataclasses.dataclass
class ModelSeq:
    handle: object
    namespace: str
    tokens: list
    computed: bool = False


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(write_policy=st.sampled_from(WRITE_POLICIES), cost=st.sampled_from(COST_MODELS),
                host_blocks=st.sampled_from([2, 4]))  # fmt: skip
    def setup(self, write_policy, cost, host_blocks):
        self.clock = Clock()
        self.disk = MemoryDisk(POOL.block_shape, POOL.dtype, capacity_blocks=5)
        config = KVCacheConfig(pool=POOL, host_bytes=host_blocks * POOL.bytes_per_block, vocab_size=3,
                               write_policy=write_policy, selective_min_hits=1, cost_model=cost)  # fmt: skip
        self.cache = KVCache(config, clock=self.clock, disk_tier=self.disk, transfer_factory=ManualTransfer)
        self.transfer = self.cache.transfer
        self.seqs: list[ModelSeq] = []

    def teardown(self):
        if hasattr(self, "cache"):
            self.cache.close()

    # --- requests --------------------------------------------------------------------------

    @rule(tokens=tokens_st, namespace=namespace_st)
    def admit(self, tokens, namespace):
        self.clock.now += 1.0
        handle = self.cache.admit(tokens, namespace)
        self.cache.poll()  # as an engine does every step
        if handle is not None:
            assert len(handle.block_ids) == -(-len(tokens) // PAGE)
            self.seqs.append(ModelSeq(handle, namespace, list(tokens)))

    @rule(tokens=tokens_st, namespace=namespace_st, evict=st.integers(0, 8))
    def serve(self, tokens, namespace, evict):
        """A whole request, as an engine runs it: evict a little, admit, wait for its fetches
        (completing every transfer in flight), prefill, release."""
        self.evict(evict)
        self.admit(tokens, namespace)
        seq = self.seqs[-1] if self.seqs and self.seqs[-1].tokens == list(tokens) else None
        if seq is None or seq.computed:
            return
        while not self.cache.is_ready(seq.handle):
            self.transfer.complete_all()
            self.cache.poll()
        self.prefill(self._waiting_to_compute().index(seq))
        self.seqs.remove(seq)
        self.cache.release(seq.handle)

    @precondition(lambda self: self._waiting_to_compute())
    @rule(i=index_st)
    def prefill(self, i):
        """Check the hit pages, then write what the model computes for the others."""
        seq = self._waiting_to_compute()[i % len(self._waiting_to_compute())]
        handle = seq.handle
        num_hit = handle.num_hit_tokens // PAGE
        assert handle.num_hit_tokens % PAGE == 0 and handle.num_hit_tokens < max(len(seq.tokens), 1)
        got = self._gather(handle.block_ids[:num_hit])
        for page in range(num_hit):
            expected = page_content(seq.namespace, seq.tokens[: (page + 1) * PAGE], POOL.block_shape)
            np.testing.assert_array_equal(got[page], expected, err_msg=f"hit page {page} holds wrong KV")
        self._write(seq, num_hit)
        self.cache.commit(handle, seq.tokens)
        seq.computed = True

    @precondition(lambda self: any(s.computed for s in self.seqs))
    @rule(i=index_st, new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def decode(self, i, new_tokens):
        computed = [s for s in self.seqs if s.computed]
        seq = computed[i % len(computed)]
        if self.cache.extend(seq.handle, len(new_tokens)):
            first = len(seq.tokens) // PAGE
            seq.tokens += new_tokens
            self._write(seq, first)
            self.cache.commit(seq.handle, seq.tokens)

    @precondition(lambda self: self.seqs)
    @rule(i=index_st)
    def release(self, i):
        seq = self.seqs.pop(i % len(self.seqs))
        self.cache.release(seq.handle)

    @rule(num_blocks=st.integers(0, 8))
    def evict(self, num_blocks):
        evicted = self.cache.evict(num_blocks)
        held = {b for s in self.seqs for b in s.handle.block_ids.tolist()}
        assert not held & set(evicted), "a block held by a sequence was evicted"

    @rule(num_blocks=st.integers(0, 4))
    def evict_host(self, num_blocks):
        self.cache.evict_host(num_blocks)

    @rule(tokens=tokens_st, namespace=namespace_st)
    def prefetch(self, tokens, namespace):
        self.cache.prefetch(tokens, namespace)
        self.cache.poll()

    # --- transfers -------------------------------------------------------------------------

    @precondition(lambda self: self.transfer.pending)
    @rule(i=index_st, ok=st.sampled_from([True, True, True, False]))
    def finish_transfer(self, i, ok):
        self.transfer.complete(i % len(self.transfer.pending), ok)
        self.cache.poll()

    @rule()
    def poll(self):
        self.cache.poll()

    @precondition(lambda self: len(self.disk))
    @rule(i=index_st)
    def corrupt_disk_block(self, i):
        """Damage a disk block: its next read is a miss (and a metric), never wrong KV."""
        namespace, key = list(self.disk._blocks)[i % len(self.disk)]
        self.disk.corrupt(key, namespace)

    @rule()
    def spill_everything(self):
        self.cache._mover.spill_host(everything=True)

    # --- checks ----------------------------------------------------------------------------

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "cache"):
            self.cache.check_invariants()
            assert self.cache.num_sequences == len(self.seqs)  # prefetch holds are not sequences
            self._check_cached_content()

    # --- helpers ---------------------------------------------------------------------------

    def _waiting_to_compute(self):
        return [s for s in self.seqs if not s.computed and self.cache.is_ready(s.handle)]

    def _gather(self, block_ids) -> np.ndarray:
        padded = np.full(POOL.num_blocks, -1, np.int32)  # one shape: one compile
        padded[: len(block_ids)] = block_ids
        return np.asarray(self.cache.pool.gather(padded))[: len(block_ids)]

    def _write(self, seq, first_page):
        """Write the model's KV for pages ``first_page ..`` of ``seq`` (its private blocks)."""
        ids = np.full(POOL.num_blocks, -1, np.int32)
        blocks = np.zeros((POOL.num_blocks, *POOL.block_shape), np.float32)
        pages = range(first_page, -(-len(seq.tokens) // PAGE))
        for row, page in enumerate(pages):
            ids[row] = seq.handle.block_ids[page]
            blocks[row] = page_content(seq.namespace, seq.tokens[: (page + 1) * PAGE], POOL.block_shape)
        self.cache.pool.scatter(ids, blocks)

    def _check_cached_content(self):
        """Every page with a copy in any tier holds its prefix's KV, in its namespace."""
        cache, trie = self.cache, self.cache.trie
        prefixes = {}
        device_pages, device_blocks = [], []
        for node in trie.nodes():  # parents first
            parent_tokens = prefixes.get(id(node.parent), [])
            tokens = parent_tokens + np.frombuffer(node.label, "<i4").tolist()
            prefixes[id(node)] = tokens
            namespace = trie.namespace_of(node).tenant
            keys = trie.page_keys(node)
            for i, bits in enumerate(node.page_tiers().tolist()):
                page_tokens = tokens[: len(parent_tokens) + (i + 1) * PAGE]
                expected = page_content(namespace, page_tokens, POOL.block_shape)
                if bits & Tier.DEVICE:
                    device_pages.append(expected)
                    device_blocks.append(node.blocks[i])
                entry = cache._index.host_state(keys[i])
                if bits & Tier.HOST and entry.ready:
                    np.testing.assert_array_equal(cache.host_tier.get_host([keys[i]])[0], expected)
                digest = trie.namespace_of(node).digest()
                if bits & Tier.DISK and self.disk.contains(keys[i], digest):
                    np.testing.assert_array_equal(self.disk._blocks[(digest, keys[i])], expected)
        if device_blocks:
            got = self._gather(device_blocks)
            for row, expected in enumerate(device_pages):
                np.testing.assert_array_equal(got[row], expected, err_msg="a cached device page holds wrong KV")


KVCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestKVCacheMachine = KVCacheMachine.TestCase
