"""Host tier: bit-exact round trips, memory kinds, eviction order, locks, byte accounting."""

import logging
import types

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
import tier_cases
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tier_cases import DTYPES, same_bits

from kvjax.tiers import host_tier
from kvjax.tiers.host_tier import HostTier

BLOCK_SHAPE = (2, 2, 1, 4, 8)  # [num_layers, 2, num_kv_heads, page_size, head_dim]


def random_blocks(n, dtype, seed=0):
    return tier_cases.random_blocks(n, BLOCK_SHAPE, dtype, seed)


def keys(*names):
    return [name.encode().ljust(16, b"\0") for name in names]


def block_bytes(dtype="float32"):
    return tier_cases.block_bytes(BLOCK_SHAPE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_host_device_round_trip_is_bit_exact(dtype):
    tier = HostTier(BLOCK_SHAPE, dtype, capacity_bytes=16 * block_bytes(dtype))
    blocks = random_blocks(4, dtype, seed=len(dtype))
    stored = tier.put(keys("a", "b", "c", "d"), jax.device_put(blocks), namespace=b"ns")
    assert stored == keys("a", "b", "c", "d")
    fetched = tier.get(keys("d", "a"))
    assert fetched.sharding.memory_kind == "device"
    assert same_bits(fetched, blocks[[3, 0]])
    assert same_bits(tier.get_host(keys("b", "c")), blocks[[1, 2]])
    per_block = tier.get_blocks(keys("c"))
    assert len(per_block) == 1 and same_bits(per_block[0], blocks[2])


def test_blocks_live_in_pinned_host_memory_and_put_is_one_batch():
    tier = HostTier(BLOCK_SHAPE, "float32", capacity_bytes=1 << 20)
    assert tier.memory_kind == "pinned_host"
    tier.put(keys("a", "b"), random_blocks(2, "float32"), namespace=b"ns")
    entry = tier._entries[keys("a")[0]]
    assert entry.bits.sharding.memory_kind == "pinned_host"
    assert tier.namespace_of(keys("a")[0]) == b"ns" and tier.namespace_of(b"x") is None


def test_the_tier_keeps_its_own_copy_of_numpy_blocks():
    tier = HostTier(BLOCK_SHAPE, "float32", 1 << 20)
    original = random_blocks(2, "float32")
    buffer = np.empty(original.nbytes + 64, np.uint8)  # 64-byte aligned: CPU device_put of
    start = -buffer.ctypes.data % 64                    # such numpy memory can alias it
    blocks = buffer[start:start + original.nbytes].view(np.float32).reshape(original.shape)
    blocks[:] = original
    tier.put(keys("a", "b"), blocks, namespace=b"ns")
    blocks[:] = 0  # the caller reuses its buffer
    assert same_bits(tier.get_host(keys("a", "b")), original)


def test_explicit_memory_kind_and_unknown_kind():
    tier = HostTier(BLOCK_SHAPE, "float32", 1 << 20, memory_kind="unpinned_host")
    tier.put(keys("a"), random_blocks(1, "float32"), namespace=b"ns")
    assert tier._entries[keys("a")[0]].bits.sharding.memory_kind == "unpinned_host"
    with pytest.raises(ValueError, match=r"memory_kind='hbm' is not available on cpu"):
        HostTier(BLOCK_SHAPE, "float32", 1 << 20, memory_kind="hbm")


def test_fallback_without_pinned_host_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(host_tier, "_fallbacks_logged", set())
    memories = [types.SimpleNamespace(kind="device"), types.SimpleNamespace(kind="unpinned_host")]

    class FakeDevice:  # a backend without pinned_host
        platform = "fakepu"
        addressable_memories = staticmethod(lambda: memories)

    sharding = types.SimpleNamespace(device_set={FakeDevice()})
    with caplog.at_level(logging.WARNING, logger="kvjax.tiers.host_tier"):
        assert host_tier._pick_memory_kind(sharding, None) == "unpinned_host"
        assert host_tier._pick_memory_kind(sharding, None) == "unpinned_host"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "fakepu has no pinned_host" in messages[0]
    memories.pop()
    assert host_tier._pick_memory_kind(sharding, None) == "device"


def test_missing_key_is_a_miss_not_an_error():
    tier = HostTier(BLOCK_SHAPE, "float32", 1 << 20)
    tier.put(keys("a"), random_blocks(1, "float32"), namespace=b"ns")
    assert tier.get(keys("a", "zz")) is None
    assert tier.get_host(keys("zz")) is None
    stats = tier.stats()
    assert (stats.hit_blocks, stats.miss_blocks) == (0, 3)
    assert tier.get(keys("a")) is not None and tier.stats().hit_blocks == 1


def test_lru_evicts_least_recently_used_and_fifo_ignores_hits():
    for policy, survivor in (("lru", "a"), ("fifo", "b")):
        tier = HostTier(BLOCK_SHAPE, "float32", 2 * block_bytes(), policy=policy)
        tier.put(keys("a", "b"), random_blocks(2, "float32"), namespace=b"ns")
        tier.get_host(keys("a"))  # refreshes "a" under LRU only
        tier.put(keys("c"), random_blocks(1, "float32"), namespace=b"ns")
        held = {k for k in keys("a", "b", "c") if tier.contains(k)}
        assert held == set(keys(survivor, "c")), policy
        assert tier.stats().evicted_blocks == 1


def test_locked_blocks_are_not_evicted_and_overflow_is_rejected():
    tier = HostTier(BLOCK_SHAPE, "float32", 2 * block_bytes())
    blocks = random_blocks(3, "float32")
    tier.put(keys("a", "b"), blocks[:2], namespace=b"ns")
    assert tier.lock(keys("a", "b"))
    assert tier.put(keys("c"), blocks[2:], namespace=b"ns") == []
    assert tier.stats().rejected_blocks == 1 and not tier.contains(keys("c")[0])
    tier.unlock(keys("a"))
    assert tier.put(keys("c"), blocks[2:], namespace=b"ns") == keys("c")
    assert not tier.contains(keys("a")[0]) and tier.contains(keys("b")[0])
    assert not tier.lock(keys("b", "a"))  # "a" is gone: nothing gets locked
    tier.unlock(keys("b"))
    with pytest.raises(ValueError, match=r"key=62.* is not locked in the host tier"):
        tier.unlock(keys("b"))


def test_partial_put_stores_the_leading_blocks_that_fit():
    tier = HostTier(BLOCK_SHAPE, "float32", 2 * block_bytes())
    blocks = random_blocks(3, "float32")
    assert tier.put(keys("a", "b", "c"), blocks, namespace=b"ns") == keys("a", "b")
    assert tier.stats().rejected_blocks == 1
    assert same_bits(tier.get_host(keys("b")), blocks[1:2])


def test_discard_of_a_locked_block_waits_for_its_last_unlock():
    tier = HostTier(BLOCK_SHAPE, "float32", 4 * block_bytes())
    blocks = random_blocks(2, "float32")
    tier.put(keys("a", "b"), blocks, namespace=b"ns")
    assert tier.lock(keys("a"))
    assert tier.discard(keys("a", "b", "zz")) == 2
    assert not tier.contains(keys("a")[0]) and len(tier) == 0
    assert tier.bytes_used == block_bytes()  # the locked copy is still in host memory
    assert same_bits(tier.get_host(keys("a")), blocks[:1])  # lock holders can still read it
    tier.unlock(keys("a"))
    assert tier.bytes_used == 0 and tier.get_host(keys("a")) is None
    tier.check_invariants()


def test_duplicate_put_copies_nothing():
    tier = HostTier(BLOCK_SHAPE, "float32", 4 * block_bytes())
    tier.put(keys("a"), random_blocks(1, "float32"), namespace=b"ns")
    assert tier.put(keys("a", "b"), random_blocks(2, "float32"), namespace=b"ns") == keys("b")
    assert tier.stats().duplicate_blocks == 1 and tier.bytes_used == 2 * block_bytes()


def test_bad_input_raises_and_leaves_state_unchanged():
    tier = HostTier(BLOCK_SHAPE, "float32", 4 * block_bytes())
    tier.put(keys("a"), random_blocks(1, "float32"), namespace=b"ns")
    with pytest.raises(ValueError, match=r"blocks shape \(2, 2, 2, 1, 4, 8\) dtype float32 must "
                                         r"be \(1, 2, 2, 1, 4, 8\) float32"):
        tier.put(keys("b"), random_blocks(2, "float32"), namespace=b"ns")
    with pytest.raises(ValueError, match=r"dtype float16 must be \(1, 2, 2, 1, 4, 8\) float32"):
        tier.put(keys("b"), random_blocks(1, "float16"), namespace=b"ns")
    with pytest.raises(ValueError, match=r"block key 'b' must be non-empty bytes"):
        tier.put(["b"], random_blocks(1, "float32"), namespace=b"ns")
    with pytest.raises(ValueError, match=r"keys contain duplicates: len\(keys\)=2 but 1 unique"):
        tier.put(keys("b", "b"), random_blocks(2, "float32"), namespace=b"ns")
    assert len(tier) == 1 and tier.stats().put_blocks == 1
    with pytest.raises(ValueError, match=r"policy='mru' is not one of \('lru', 'fifo'\)"):
        HostTier(BLOCK_SHAPE, "float32", 1, policy="mru")
    with pytest.raises(ValueError, match=r"capacity_bytes=-1 must be >= 0"):
        HostTier(BLOCK_SHAPE, "float32", -1)
    with pytest.raises(ValueError, match=r"block_shape=\(2, 0\) must be a non-empty shape"):
        HostTier((2, 0), "float32", 1)
    with pytest.raises(ValueError, match=r"dtype='complex128' must have an itemsize in \[1, 2, 4, 8\]"):
        HostTier(BLOCK_SHAPE, "complex128", 1)


class HostTierMachine(RuleBasedStateMachine):
    """Random put/get/discard/lock sequences against a reference model of LRU eviction."""

    NAMES = [bytes([i]) * 16 for i in range(8)]
    CAPACITY_BLOCKS = 4

    def __init__(self):
        super().__init__()
        self.tier = HostTier((4,), "int8", self.CAPACITY_BLOCKS * 4)
        self.order = []  # reference model: held keys, least recently used first
        self.locks = {}  # key -> lock count
        self.doomed = set()  # discarded while locked

    @rule(names=st.lists(st.sampled_from(NAMES), min_size=0, max_size=5, unique=True))
    def put(self, names):
        blocks = np.stack([np.full((4,), name[0], np.int8) for name in names]) if names else (
            np.zeros((0, 4), np.int8))
        stored = self.tier.put(names, blocks, namespace=b"ns")
        new = [k for k in names if k not in self.order]
        self.doomed -= set(names)
        unlocked = [k for k in self.order if not self.locks.get(k)]
        shortfall = len(self.order) + len(new) - self.CAPACITY_BLOCKS
        for victim in unlocked[:max(0, shortfall)]:
            self.order.remove(victim)
        fit = min(len(new), self.CAPACITY_BLOCKS - len(self.order))
        assert stored == new[:fit]
        self.order.extend(new[:fit])

    @rule(names=st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    def get(self, names):
        got = self.tier.get_host(names)
        if all(k in self.order for k in names):
            assert got is not None
            assert [int(row[0]) for row in got] == [k[0] for k in names]
            for key in names:  # LRU refresh
                self.order.remove(key)
                self.order.append(key)
        else:
            assert got is None

    @rule(names=st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    def discard(self, names):
        expected = sum(k in self.order and k not in self.doomed for k in names)
        assert self.tier.discard(names) == expected
        for key in names:
            if key in self.order and self.locks.get(key):
                self.doomed.add(key)
            elif key in self.order:
                self.order.remove(key)

    @rule(names=st.lists(st.sampled_from(NAMES), min_size=1, max_size=2, unique=True))
    def lock(self, names):
        ok = all(k in self.order and k not in self.doomed for k in names)
        assert self.tier.lock(names) == ok
        if ok:
            for key in names:
                self.locks[key] = self.locks.get(key, 0) + 1

    @precondition(lambda self: any(self.locks.values()))
    @rule(data=st.data())
    def unlock(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, n in self.locks.items() if n)))
        self.tier.unlock([key])
        self.locks[key] -= 1
        if not self.locks[key] and key in self.doomed:
            self.doomed.discard(key)
            self.order.remove(key)

    @invariant()
    def matches_model(self):
        self.tier.check_invariants()
        assert self.tier.bytes_used == 4 * len(self.order) <= self.tier.capacity_bytes
        assert [k for k in self.NAMES if self.tier.contains(k)] == [
            k for k in self.NAMES if k in self.order and k not in self.doomed]
        assert all(k in self.order for k, n in self.locks.items() if n)


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = hypothesis.settings(
    max_examples=60, stateful_step_count=25, deadline=None)
