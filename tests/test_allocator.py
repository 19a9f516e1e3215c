"""BlockAllocator: all-or-nothing allocation, FIFO free queue, refcounts, lazy reclaim, figures."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvjax.cache.allocator import BlockAllocator, fragmentation


def snapshot(allocator):
    return allocator.refcounts().tolist(), allocator.free_queue().tolist()


def test_allocate_hands_out_free_blocks_in_fifo_order():
    allocator = BlockAllocator(6)
    assert allocator.allocate(2).tolist() == [0, 1]
    first = allocator.allocate(2)
    allocator.decref(first)
    allocator.free([3, 2])
    # Blocks 4, 5 were free longest; 3 then 2 were freed in that order.
    assert allocator.free_queue().tolist() == [4, 5, 3, 2]
    assert allocator.allocate(4).tolist() == [4, 5, 3, 2]


def test_allocate_is_all_or_nothing():
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    before = snapshot(allocator)
    assert allocator.allocate(2) is None
    assert snapshot(allocator) == before
    assert allocator.allocate(0).tolist() == []
    assert allocator.allocate(1).tolist() == [3]


def test_evicted_blocks_are_handed_out_in_the_order_they_were_freed_after_free_ones():
    # The device index evicts by policy and frees the victims; they go after what was free.
    allocator = BlockAllocator(5)
    held = allocator.allocate(5)
    allocator.decref(held)  # all five now cached-unreferenced: refcount 0, not free
    allocator.free([4])
    assert allocator.allocate(3) is None  # only block 4 is free: nothing changes
    allocator.free([2, 0])  # an eviction in policy order
    blocks = allocator.allocate(3)
    assert blocks.tolist() == [4, 2, 0]
    assert [allocator.refcount(b) for b in blocks] == [1, 1, 1]
    assert not allocator.is_free(3) and allocator.refcount(3) == 0


def test_memory_grows_with_the_blocks_handed_out_not_the_pool():
    allocator = BlockAllocator(2**31 - 1)
    assert allocator.num_free == 2**31 - 1 and allocator.num_used_ids == 0
    blocks = allocator.allocate(3000)
    assert blocks.tolist() == list(range(3000))
    allocator.decref(blocks[:10])
    allocator.free(blocks[5:10])
    assert allocator.allocate(2).tolist() == [3000, 3001]  # never-used ids come first
    assert allocator.num_used_ids == 3002 and allocator.refcounts(3002).tolist() == [0] * 10 + [1] * 2992
    assert allocator._refcount.nbytes < 64 * 3002  # grown geometrically, not to 2**31
    allocator.check_invariants()
    with pytest.raises(ValueError, match=r"block 2147483000 is already free"):
        allocator.free([2147483000])


def test_refcounts_track_increfs_and_decrefs():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    allocator.incref(blocks)
    allocator.incref([int(blocks[0])])
    assert [allocator.refcount(b) for b in blocks] == [3, 2]
    assert allocator.decref(blocks).tolist() == []
    assert allocator.decref(blocks).tolist() == [int(blocks[1])]
    assert allocator.num_referenced == 1
    assert not allocator.is_free(int(blocks[1]))  # lazy reclaim: unreferenced, not free


def test_decref_returns_blocks_that_reach_zero_without_freeing_them():
    allocator = BlockAllocator(3)
    blocks = allocator.allocate(3)
    zero = allocator.decref(blocks)
    assert sorted(zero.tolist()) == [0, 1, 2]
    assert allocator.num_free == 0
    allocator.free(zero)
    assert allocator.num_free == 3


@pytest.mark.parametrize(
    "call, blocks, message",
    [
        ("free", [7], r"block id 7 is out of range; expected 0 <= id < 4"),
        ("free", [-1], r"block id -1 is out of range"),
        ("free", [3], r"block 3 is already free"),
        ("free", [0], r"block 0 is still referenced"),
        ("free", [1, 1], r"block id 1 appears more than once"),
        ("decref", [2], r"block 2 has refcount 0"),
        ("incref", [3], r"block 3 is free; allocate it before referencing it"),
        ("incref", [[0], [1]], r"block ids must be a 1-D sequence of integers"),
        ("incref", [0.5], r"block ids must be a 1-D sequence of integers"),
    ],
)
def test_bad_block_ids_raise_and_change_nothing(call, blocks, message):
    allocator = BlockAllocator(4)
    allocator.allocate(2)  # 0, 1 referenced
    allocator.decref(allocator.allocate(1))  # 2 cached-unreferenced; 3 free
    before = snapshot(allocator)
    with pytest.raises(ValueError, match=message):
        getattr(allocator, call)(blocks if len(blocks) != 1 else blocks[0])
    assert snapshot(allocator) == before


def test_batch_with_one_bad_block_changes_nothing():
    allocator = BlockAllocator(4)
    allocator.allocate(2)
    allocator.decref(allocator.allocate(1))
    before = snapshot(allocator)
    with pytest.raises(ValueError, match="block 3 is already free"):
        allocator.free([2, 3])
    assert snapshot(allocator) == before


def test_constructor_validates_arguments():
    with pytest.raises(ValueError, match=r"num_blocks=0 must be in \[1, 2\*\*31\)"):
        BlockAllocator(0)
    with pytest.raises(ValueError, match=r"watermarks must satisfy 0 <= low_watermark=0.95"):
        BlockAllocator(8, high_watermark=0.9, low_watermark=0.95)
    with pytest.raises(ValueError, match=r"num_blocks=-2 must be an int >= 0"):
        BlockAllocator(8).allocate(-2)


def test_watermarks_and_occupancy():
    allocator = BlockAllocator(10, high_watermark=0.8, low_watermark=0.5)
    blocks = allocator.allocate(8)
    assert allocator.occupancy == pytest.approx(0.8)
    assert not allocator.above_high_watermark()
    allocator.allocate(1)
    assert allocator.above_high_watermark()
    assert allocator.blocks_to_low_watermark() == 4  # 9 occupied, target 5
    allocator.decref(blocks[:4])
    assert allocator.blocks_to_low_watermark() == 4  # cached blocks still occupy the pool
    allocator.free(blocks[:4])
    assert allocator.blocks_to_low_watermark() == 0


def test_fragmentation_counts_unused_slots_in_partial_pages():
    # 17 tokens in 2 pages of 16 (15 unused); 32 tokens in 2 pages (none); 1 in 1 (15).
    assert fragmentation([17, 32, 1], [2, 2, 1], 16) == pytest.approx(30 / 80)
    assert fragmentation([], [], 16) == 0.0
    with pytest.raises(ValueError, match="sequence 0 has 40 tokens for 32 token slots"):
        fragmentation([40], [2], 16)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/incref/decref/free against a dictionary model of refcounts."""

    def __init__(self):
        super().__init__()
        self.allocator = BlockAllocator(12)
        self.refs = {}  # block -> refcount, for blocks not free
        self.free_order = list(range(12))

    @rule(count=st.integers(0, 14))
    def allocate(self, count):
        blocks = self.allocator.allocate(count)
        if count > len(self.free_order):
            assert blocks is None
            return
        assert blocks.tolist() == self.free_order[:count]
        del self.free_order[:count]
        self.refs.update((b, 1) for b in blocks.tolist())

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data):
        block = data.draw(st.sampled_from(sorted(self.refs)))
        self.allocator.incref([block])
        self.refs[block] += 1

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data())
    def decref(self, data):
        block = data.draw(st.sampled_from(sorted(b for b, r in self.refs.items() if r)))
        self.allocator.decref([block])
        self.refs[block] -= 1

    @precondition(lambda self: any(r == 0 for r in self.refs.values()))
    @rule(data=st.data())
    def free(self, data):
        block = data.draw(st.sampled_from(sorted(b for b, r in self.refs.items() if r == 0)))
        self.allocator.free([block])
        del self.refs[block]
        self.free_order.append(block)

    @rule(block=st.integers(0, 11))
    def double_free_is_rejected(self, block):
        if block in self.refs and self.refs[block] == 0:
            return
        with pytest.raises(ValueError):
            self.allocator.free([block])

    @invariant()
    def matches_model(self):
        self.allocator.check_invariants()
        expected = np.zeros(12, np.int64)
        for block, count in self.refs.items():
            expected[block] = count
        assert self.allocator.refcounts().tolist() == expected.tolist()
        assert self.allocator.free_queue().tolist() == self.free_order


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("count", [1.5, np.float64(2.0), True, -1, "2"])
def test_a_count_that_is_not_an_int_is_refused_and_changes_nothing(count):
    allocator = BlockAllocator(8)
    with pytest.raises(ValueError, match=r"num_blocks=.* must be an int >= 0"):
        allocator.allocate(count)  # 1.5 used to hand out 2 ids and leave num_free at 6.5
    assert allocator.num_free == 8
    allocator.check_invariants()


def test_the_low_watermark_target_survives_float_rounding():
    allocator = BlockAllocator(100, high_watermark=0.3, low_watermark=0.29)  # 0.29 * 100 = 28.999...
    allocator.allocate(30)
    assert allocator.blocks_to_low_watermark() == 1
