"""HostPool: slots of one preallocated host array, bit-exact both ways, padded batches, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tier_cases import DTYPES, random_blocks, same_bits

from kvjax.tiers.host_pool import HostPool

BLOCK_SHAPE = (2, 2, 1, 4, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_host_device_round_trip_is_bit_exact(dtype):
    blocks = random_blocks(5, BLOCK_SHAPE, dtype, seed=1)  # NaN payloads and infinities included
    pool = HostPool(BLOCK_SHAPE, dtype, num_slots=8)
    pool.write(np.array([6, 0, 3, 1, 7]), jax.device_put(blocks))
    assert same_bits(pool.to_device(np.array([0, 6, 7])), blocks[[1, 0, 4]])
    assert same_bits(pool.read(np.array([3, 1])), blocks[[2, 3]])


def test_writes_copy_into_the_pool_and_padding_rows_are_zero():
    blocks = random_blocks(3, BLOCK_SHAPE, "float32", seed=2)
    pool = HostPool(BLOCK_SHAPE, "float32", num_slots=4)
    source = blocks.copy()
    pool.write(np.array([2, 3]), source[:3])  # a padded batch: the third row is ignored
    source[:] = 0  # the caller's later writes do not reach the pool
    padded = pool.to_device(np.array([3, 2]), num_rows=4)
    assert padded.shape == (4, *BLOCK_SHAPE)
    assert same_bits(padded[:2], blocks[[1, 0]]) and not np.asarray(padded[2:]).any()
    assert pool.capacity_bytes == 4 * pool.block_nbytes == 4 * 2 * 2 * 1 * 4 * 8 * 4


def test_a_pool_without_bytes_keeps_slots_and_no_array():
    pool = HostPool(BLOCK_SHAPE, "bfloat16", num_slots=1 << 30, store_bytes=False)  # 2**30 slots, no memory
    pool.write(np.array([5, 9]), jnp.ones((2, *BLOCK_SHAPE), jnp.bfloat16))
    assert pool.to_device(np.array([5])) is None
    assert pool.read(np.array([5])).shape == (1, *BLOCK_SHAPE)
    assert pool.capacity_bytes == (1 << 30) * pool.block_nbytes


def test_bad_input_raises_and_changes_nothing():
    pool = HostPool(BLOCK_SHAPE, "float32", num_slots=2)
    pool.write(np.array([0]), np.ones((1, *BLOCK_SHAPE), np.float32))
    before = pool.read(np.array([0, 1]))
    with pytest.raises(ValueError, match=r"slot 2 is out of range; expected 0 <= slot < 2"):
        pool.write(np.array([1, 2]), np.zeros((2, *BLOCK_SHAPE), np.float32))
    with pytest.raises(ValueError, match=r"blocks \(1, 2, 2, 1, 4, 4\) float32 must be \[>= 1, \*\(2, 2, 1, 4, 8\)\] float32"):
        pool.write(np.array([1]), np.zeros((1, 2, 2, 1, 4, 4), np.float32))
    with pytest.raises(ValueError, match=r"blocks \(1, 2, 2, 1, 4, 8\) int32 must be"):
        pool.write(np.array([1]), np.zeros((1, *BLOCK_SHAPE), np.int32))
    with pytest.raises(ValueError, match=r"num_rows=1 must be >= 2 slots"):
        pool.to_device(np.array([0, 1]), num_rows=1)
    with pytest.raises(ValueError, match=r"slots must be a 1-D array of ints"):
        pool.read(np.array([0.5]))
    with pytest.raises(ValueError, match=r"num_slots=-1 must be an int >= 0"):
        HostPool(BLOCK_SHAPE, "float32", num_slots=-1)
    with pytest.raises(ValueError, match=r"block_shape=\(2, 0\) must be a non-empty shape of positive sizes"):
        HostPool((2, 0), "float32", num_slots=1)
    assert same_bits(pool.read(np.array([0, 1])), before)
