"""Pallas implementations of :func:`gather_blocks` / :func:`scatter_blocks` (GPU and TPU).

A block of the page-major pool, ``kv_pages[b]``, is one contiguous run of
``num_layers * 2 * num_kv_heads * page_size * head_dim`` elements, so both backends move
it as a flat run of bits whatever its dtype (a float8_e5m2 pool goes through as unsigned
integers, see :func:`copy_common.on_bits`):

* GPU (Triton): the pool is viewed as ``[num_blocks, block_elems]`` (a free reshape) and one
  program copies one power-of-two chunk of one block (Triton vectors must be powers of two;
  ``block_elems`` always has a power-of-two divisor, at worst 2). Scatter aliases the pool.
* TPU (Mosaic): block ids are scalar-prefetched into SMEM, pool and blocks stay in HBM
  (``pl.ANY``), and every block is a single HBM->HBM DMA. Gather fills a padding row by
  DMA from a one-block zero buffer; scatter aliases the pool. A grid step keeps
  ``blocks_per_step`` DMAs in flight.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.copy_common import (
    in_pool,
    largest_pow2_divisor,
    on_bits,
    run_copies,
    tpu_interpret_mode,
    triton_params,
)

__all__ = ["gather_blocks_gpu", "scatter_blocks_gpu", "gather_blocks_tpu", "scatter_blocks_tpu"]

# Bytes one Triton program copies: large enough to amortise the launch of a program,
# small enough to stay in registers with a few warps.
_GPU_CHUNK_BYTES = 16 * 1024


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
@on_bits(0)
def gather_blocks_gpu(kv_pages, block_ids, *, interpret: bool, num_warps: int = 4):
    num_blocks, block_shape = kv_pages.shape[0], kv_pages.shape[1:]
    n = block_ids.shape[0]
    block_elems, chunk = _flat_chunking(kv_pages)
    out = pl.pallas_call(
        functools.partial(_gather_kernel_gpu, chunk=chunk),
        grid=(n, block_elems // chunk),
        out_shape=jax.ShapeDtypeStruct((n, block_elems), kv_pages.dtype),
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps),
    )(block_ids, kv_pages.reshape(num_blocks, block_elems))
    return out.reshape((n,) + tuple(block_shape))


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"), donate_argnums=(0,))
@on_bits(0, 2)
def scatter_blocks_gpu(kv_pages, block_ids, blocks, *, interpret: bool, num_warps: int = 4):
    num_blocks = kv_pages.shape[0]
    block_elems, chunk = _flat_chunking(kv_pages)
    out = pl.pallas_call(
        functools.partial(_scatter_kernel_gpu, chunk=chunk),
        grid=(block_ids.shape[0], block_elems // chunk),
        out_shape=jax.ShapeDtypeStruct((num_blocks, block_elems), kv_pages.dtype),
        input_output_aliases={2: 0},  # operands: block_ids, blocks, pool
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps),
    )(block_ids, blocks.reshape(-1, block_elems), kv_pages.reshape(num_blocks, block_elems))
    return out.reshape(kv_pages.shape)


@functools.partial(jax.jit, static_argnames=("interpret", "blocks_per_step"))
@on_bits(0)
def gather_blocks_tpu(kv_pages, block_ids, *, interpret: bool, blocks_per_step: int = 8):
    n = block_ids.shape[0]
    out_shape = jax.ShapeDtypeStruct((n,) + tuple(kv_pages.shape[1:]), kv_pages.dtype)
    # The DMA source of a padding row; one block of zeros is cheap next to the copies.
    zero_block = jnp.zeros(kv_pages.shape[1:], kv_pages.dtype)
    return _tpu_call(
        functools.partial(_gather_kernel_tpu, blocks_per_step=blocks_per_step, n=n),
        block_ids, kv_pages, zero_block, out_shape=out_shape, aliases={},
        blocks_per_step=blocks_per_step, interpret=interpret)


@functools.partial(
    jax.jit, static_argnames=("interpret", "blocks_per_step"), donate_argnums=(0,))
@on_bits(0, 2)
def scatter_blocks_tpu(
    kv_pages, block_ids, blocks, *, interpret: bool, blocks_per_step: int = 8,
):
    out_shape = jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype)
    return _tpu_call(
        functools.partial(_scatter_kernel_tpu, blocks_per_step=blocks_per_step,
                          n=block_ids.shape[0]),
        block_ids, blocks, kv_pages, out_shape=out_shape,
        aliases={2: 0},  # operands: block_ids, blocks, pool
        blocks_per_step=blocks_per_step, interpret=interpret)


def _flat_chunking(kv_pages) -> tuple[int, int]:
    """``(block_elems, chunk)``: a block's element count and a power-of-two divisor of it."""
    block_elems = math.prod(kv_pages.shape[1:])
    cap = max(1, _GPU_CHUNK_BYTES // jnp.dtype(kv_pages.dtype).itemsize)
    return block_elems, largest_pow2_divisor(block_elems, cap)


def _gather_kernel_gpu(ids_ref, pool_ref, out_ref, *, chunk: int):
    row, part = pl.program_id(0), pl.program_id(1)
    block = ids_ref[row]
    cols = pl.ds(pl.multiple_of(part * chunk, chunk), chunk)
    live = in_pool(block, pool_ref.shape[0])

    @pl.when(live)
    def _copy():
        out_ref[row, cols] = pool_ref[block, cols]

    @pl.when(jnp.logical_not(live))
    def _zero():
        out_ref[row, cols] = jnp.zeros((chunk,), out_ref.dtype)


def _scatter_kernel_gpu(ids_ref, blocks_ref, pool_in_ref, pool_ref, *, chunk: int):
    del pool_in_ref  # the same buffer as pool_ref (aliased)
    row, part = pl.program_id(0), pl.program_id(1)
    block = ids_ref[row]
    cols = pl.ds(pl.multiple_of(part * chunk, chunk), chunk)

    @pl.when(in_pool(block, pool_ref.shape[0]))
    def _copy():
        pool_ref[block, cols] = blocks_ref[row, cols]


def _tpu_call(kernel, block_ids, *operands, out_shape, aliases, blocks_per_step, interpret):
    """A TPU ``pallas_call`` with ids in SMEM, every array in HBM and one DMA semaphore."""
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(pl.cdiv(block_ids.shape[0], blocks_per_step),),
        in_specs=[any_spec] * len(operands),
        out_specs=any_spec,
        scratch_shapes=[pltpu.SemaphoreType.DMA],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=tpu_interpret_mode(interpret),
    )(block_ids, *operands)


def _gather_kernel_tpu(ids_ref, pool_hbm, zero_hbm, out_hbm, sem, *, blocks_per_step, n):
    first = pl.program_id(0) * blocks_per_step

    def copies(i):
        row = jnp.minimum(first + i, n - 1)  # the last step may run past the end
        block = ids_ref[row]
        live = first + i < n
        held = in_pool(block, pool_hbm.shape[0])
        from_pool = pltpu.make_async_copy(pool_hbm.at[jnp.clip(block, 0, pool_hbm.shape[0] - 1)], out_hbm.at[row],
                                          sem)  # fmt: skip
        from_zero = pltpu.make_async_copy(zero_hbm, out_hbm.at[row], sem)
        return [(live & held, from_pool), (live & jnp.logical_not(held), from_zero)]

    run_copies(blocks_per_step, copies)


def _scatter_kernel_tpu(ids_ref, blocks_hbm, pool_in_hbm, pool_hbm, sem, *, blocks_per_step, n):
    del pool_in_hbm  # the same buffer as pool_hbm (aliased)
    first = pl.program_id(0) * blocks_per_step

    def copies(i):
        row = jnp.minimum(first + i, n - 1)
        block = ids_ref[row]
        live = (first + i < n) & in_pool(block, pool_hbm.shape[0])
        return [(live, pltpu.make_async_copy(blocks_hbm.at[row], pool_hbm.at[jnp.clip(block, 0, pool_hbm.shape[0] - 1)],
                                             sem))]

    run_copies(blocks_per_step, copies)
