"""gather_blocks / scatter_blocks: every implementation against the references, byte for byte."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from pool_cases import IMPLS, assert_same_bytes, lower_for, random_bytes, shapes_of

from pallas_kernels import (
    block_copy_pallas,
    check_block_ids,
    gather_blocks,
    gather_blocks_reference,
    scatter_blocks,
    scatter_blocks_reference,
)

NUM_BLOCKS = 7
# One block: (num_layers, 2, num_kv_heads, page_size, head_dim). The second block's
# 3 * 2 * 1 * 4 * 24 = 576 elements are not a power of two: the Triton kernel copies it as
# 9 chunks of 64.
SHAPES = [(2, 2, 2, 8, 32), (3, 2, 1, 4, 24)]
# Byte copies: quantized pools move exactly like float ones. Each dtype meets one block
# shape (and each shape two dtypes) to keep the interpret-mode compiles few.
DTYPE_SHAPES = [(jnp.float32, SHAPES[0]), (jnp.bfloat16, SHAPES[1]), (jnp.int8, SHAPES[1]),
                (jnp.float8_e4m3fn, SHAPES[0])]


def pool_and_ids(rng, dtype, block_shape, ids):
    pool = random_bytes(rng, (NUM_BLOCKS,) + block_shape, dtype)
    return pool, np.asarray(ids, np.int32)


def shuffled_ids(rng) -> np.ndarray:
    """Distinct shuffled ids, first and last block included, with padding between and after."""
    middle = rng.permutation(np.arange(1, NUM_BLOCKS - 1))[:3]
    live = [NUM_BLOCKS - 1, 0, *middle]
    ids = np.array([live[0], -1, live[1], live[2], -5, live[3], live[4], -1], np.int32)
    check_block_ids(ids, num_blocks=NUM_BLOCKS)
    return ids


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,block_shape", DTYPE_SHAPES)
def test_gather_matches_reference_bytes(impl, dtype, block_shape):
    rng = np.random.default_rng(sum(block_shape))
    pool, ids = pool_and_ids(rng, dtype, block_shape, shuffled_ids(rng))
    out = gather_blocks(jnp.asarray(pool), jnp.asarray(ids), impl=impl)
    assert_same_bytes(out, gather_blocks_reference(pool, ids))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,block_shape", DTYPE_SHAPES)
def test_scatter_matches_reference_bytes(impl, dtype, block_shape):
    rng = np.random.default_rng(sum(block_shape) + 1)
    pool, ids = pool_and_ids(rng, dtype, block_shape, shuffled_ids(rng))
    blocks = random_bytes(rng, (len(ids),) + block_shape, dtype)
    out = scatter_blocks(jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(blocks), impl=impl)
    assert_same_bytes(out, scatter_blocks_reference(pool, ids, blocks))


@pytest.mark.parametrize("impl", IMPLS)
def test_float8_e5m2_nan_payloads_survive(impl):
    """XLA's CPU backend rewrites e5m2 NaN bits when it gathers or scatters floats; the
    kernels move unsigned-integer views, so every payload survives."""
    rng = np.random.default_rng(10)
    pool, ids = pool_and_ids(rng, jnp.float8_e5m2, SHAPES[0], shuffled_ids(rng))
    blocks = random_bytes(rng, (len(ids),) + SHAPES[0], jnp.float8_e5m2)
    assert np.isnan(pool.astype(np.float32)).any()
    out = gather_blocks(jnp.asarray(pool), jnp.asarray(ids), impl=impl)
    assert_same_bytes(out, gather_blocks_reference(pool, ids))
    out = scatter_blocks(jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(blocks), impl=impl)
    assert_same_bytes(out, scatter_blocks_reference(pool, ids, blocks))


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_rows_and_untouched_pool(impl):
    """Independent of the reference: row i is block ids[i], padding rows are all-zero bytes,
    and the pool itself is not changed by a gather."""
    rng = np.random.default_rng(3)
    pool, ids = pool_and_ids(rng, jnp.float32, SHAPES[0], shuffled_ids(rng))
    pool_dev = jnp.asarray(pool)
    out = np.asarray(gather_blocks(pool_dev, jnp.asarray(ids), impl=impl))
    for row, block in enumerate(ids):
        if block >= 0:
            assert_same_bytes(out[row], pool[block])
        else:
            assert not out[row].view(np.uint32).any()
    assert_same_bytes(pool_dev, pool)


@pytest.mark.parametrize("impl", IMPLS)
def test_scatter_changes_exactly_the_addressed_blocks(impl):
    rng = np.random.default_rng(4)
    ids = shuffled_ids(rng)
    pool = np.full((NUM_BLOCKS,) + SHAPES[0], np.nan, np.float32)
    blocks = rng.standard_normal((len(ids),) + SHAPES[0]).astype(np.float32)
    out = np.asarray(scatter_blocks(jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(blocks),
                                    impl=impl))
    for row, block in enumerate(ids):
        if block >= 0:
            np.testing.assert_array_equal(out[block], blocks[row])
    assert np.isnan(np.delete(out, ids[ids >= 0], axis=0)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_then_scatter_round_trips(impl):
    """The offload path: gather blocks out, scatter them into other blocks, gather again."""
    rng = np.random.default_rng(5)
    pool, src = pool_and_ids(rng, jnp.float8_e4m3fn, SHAPES[0], shuffled_ids(rng))
    dst = np.where(src >= 0, (src + 3) % NUM_BLOCKS, src).astype(np.int32)  # other blocks
    blocks = gather_blocks(jnp.asarray(pool), jnp.asarray(src), impl=impl)
    moved = scatter_blocks(jnp.asarray(pool), jnp.asarray(dst), blocks, impl=impl)
    assert_same_bytes(gather_blocks(moved, jnp.asarray(dst), impl=impl), blocks)


@pytest.mark.parametrize("impl", IMPLS)
def test_scatter_is_in_place(impl):
    rng = np.random.default_rng(6)
    pool_np, ids = pool_and_ids(rng, jnp.float32, SHAPES[0], shuffled_ids(rng))
    blocks = random_bytes(rng, (len(ids),) + SHAPES[0], jnp.float32)
    pool = jnp.asarray(pool_np)
    address = pool.unsafe_buffer_pointer()
    out = scatter_blocks(pool, jnp.asarray(ids), jnp.asarray(blocks), impl=impl)
    assert pool.is_deleted()
    assert out.unsafe_buffer_pointer() == address
    assert_same_bytes(out, scatter_blocks_reference(pool_np, ids, blocks))


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_and_all_padding_ids(impl):
    rng = np.random.default_rng(7)
    pool, ids = pool_and_ids(rng, jnp.float32, SHAPES[0], shuffled_ids(rng))
    none = jnp.zeros((0,), jnp.int32)
    assert gather_blocks(jnp.asarray(pool), none, impl=impl).shape == (0,) + SHAPES[0]
    pad = jnp.full(ids.shape, -1, jnp.int32)
    assert not np.asarray(gather_blocks(jnp.asarray(pool), pad, impl=impl)).any()
    blocks = jnp.ones((len(ids),) + SHAPES[0], jnp.float32)
    assert_same_bytes(scatter_blocks(jnp.asarray(pool), pad, blocks, impl=impl), pool)


def test_tpu_steps_that_do_not_divide_the_ids():
    rng = np.random.default_rng(8)
    pool, ids = pool_and_ids(rng, jnp.float32, SHAPES[0], shuffled_ids(rng))
    assert len(ids) % 3  # the last grid step is partial
    blocks = random_bytes(rng, (len(ids),) + SHAPES[0], jnp.float32)
    out = gather_blocks(jnp.asarray(pool), jnp.asarray(ids), impl="pallas_tpu",
                        blocks_per_step=3)
    assert_same_bytes(out, gather_blocks_reference(pool, ids))
    out = scatter_blocks(jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(blocks),
                         impl="pallas_tpu", blocks_per_step=3)
    assert_same_bytes(out, scatter_blocks_reference(pool, ids, blocks))


@pytest.mark.parametrize("platform,kind", [("tpu", "tpu"), ("cuda", "gpu")])
@pytest.mark.parametrize("op", ["gather", "scatter"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_kernel_lowers_for_its_accelerator(platform, kind, op, dtype):
    fn = getattr(block_copy_pallas, f"{op}_blocks_{kind}")
    pool = jnp.zeros((NUM_BLOCKS,) + SHAPES[1], dtype)
    ids = jnp.zeros((5,), jnp.int32)
    args = (pool, ids) if op == "gather" else (pool, ids, jnp.zeros((5,) + SHAPES[1], dtype))
    text = lower_for(platform, functools.partial(fn, interpret=False), *shapes_of(*args))
    assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in text
    assert ("output_operand_alias" in text) == (op == "scatter")


@pytest.mark.parametrize("op,override,message", [
    ("gather", dict(ids=np.zeros(3, np.int64)), r"block_ids.dtype=int64 must be int32"),
    ("gather", dict(ids=np.zeros((3, 1), np.int32)), r"block_ids.shape=\(3, 1\) must have rank 1"),
    ("gather", dict(pool=np.zeros((7, 2, 3, 2, 8, 32))), r"kv_pages.shape=\(7, 2, 3, 2, 8, 32\)"),
    ("scatter", dict(blocks=np.zeros((2,) + SHAPES[0], np.float32)),
     r"blocks.shape=\(2, 2, 2, 2, 8, 32\) must be \(3, 2, 2, 2, 8, 32\)"),
    ("scatter", dict(blocks=np.zeros((3,) + SHAPES[0], np.int8)),
     r"blocks.dtype=int8 must equal kv_pages.dtype=float32"),
    ("scatter", dict(impl="triton"), r"impl='triton' is not a known implementation"),
    ("gather", dict(impl="pallas_gpu", interpret=False), r"cannot compile on backend 'cpu'"),
    ("gather", dict(ids=[0, 1, -1]), r"^block_ids must be an array \(jax or numpy\), got list$"),
    ("scatter", dict(blocks=np.zeros((3,) + SHAPES[0], np.float32).tolist()),
     r"^blocks must be an array \(jax or numpy\), got list$"),
])
def test_bad_arguments_raise(op, override, message):
    """Checked before anything runs (numpy inputs keep an int64 dtype to reject)."""
    args = dict(pool=np.zeros((NUM_BLOCKS,) + SHAPES[0], np.float32),
                ids=np.array([0, 1, -1], np.int32),
                blocks=np.zeros((3,) + SHAPES[0], np.float32), impl="xla", interpret=None)
    args.update(override)
    kw = dict(impl=args["impl"], interpret=args["interpret"])
    with pytest.raises(ValueError, match=message):
        if op == "gather":
            gather_blocks(args["pool"], args["ids"], **kw)
        else:
            scatter_blocks(args["pool"], args["ids"], args["blocks"], **kw)


@pytest.mark.parametrize("ids,message", [
    ([0, 7], r"block id 7 is outside the pool \[0, 7\)"),
    ([3, -1, 3], r"block id 3 appears more than once"),
])
def test_block_id_value_checks(ids, message):
    check_block_ids(np.array([6, -1, 0, 2]), num_blocks=NUM_BLOCKS)
    check_block_ids(np.array([3, 3, -1]), num_blocks=NUM_BLOCKS, distinct=False)  # a gather
    with pytest.raises(ValueError, match=message):
        check_block_ids(np.array(ids), num_blocks=NUM_BLOCKS)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_id_past_the_pool_is_padding_on_every_implementation(impl):
    # the checks (check_block_ids) are the caller's; past them, every implementation does what
    # XLA's does: a gather reads zeros, a scatter drops the row. The Triton kernels used to
    # clamp to the last block (a live block overwritten) and the TPU ones to fault.
    rng = np.random.default_rng(9)
    pool, _ = pool_and_ids(rng, jnp.float32, SHAPES[0], [])
    ids = np.array([1, NUM_BLOCKS, NUM_BLOCKS + 5], np.int32)
    out = np.asarray(gather_blocks(jnp.asarray(pool), jnp.asarray(ids), impl=impl))
    assert_same_bytes(out[0], pool[1])
    assert not out[1:].view(np.uint32).any()
    blocks = rng.standard_normal((3,) + SHAPES[0]).astype(np.float32)
    written = np.asarray(scatter_blocks(jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(blocks), impl=impl))
    np.testing.assert_array_equal(written[1], blocks[0])
    assert_same_bytes(np.delete(written, 1, axis=0), np.delete(pool, 1, axis=0))
    # the references define what the kernels compute: they raised IndexError there
    assert_same_bytes(gather_blocks_reference(jnp.asarray(pool), jnp.asarray(ids)), out)
    assert_same_bytes(scatter_blocks_reference(jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(blocks)), written)
