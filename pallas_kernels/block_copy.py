"""Copying whole blocks (every layer's K and V of one page) out of and into the pool.

The tiers' offload path gathers the blocks it spills into one dense array and ships that
to host memory; a fetch scatters blocks back into freshly allocated pool blocks. In the
page-major pool a block is one contiguous region, so each block moves as one copy.

* :func:`gather_blocks` returns ``[n, num_layers, 2, num_kv_heads, page_size, head_dim]``;
  a negative id gives a row of zeros, so callers can pad ``n`` up to a bucket and keep one
  compiled program.
* :func:`scatter_blocks` stores ``blocks[i]`` into block ``block_ids[i]`` in place (the pool
  is donated); negative ids are skipped. Ids must be distinct.

Any dtype moves bit-exactly (these are byte copies: int8 and float8 pools included). A
quantized pool (:class:`~pallas_kernels.kv_format.QuantizedPages`) moves its pages and their
scales together: ``gather_blocks`` returns ``QuantizedPages`` blocks and ``scatter_blocks``
takes them; the scales go through the same kernel as the pages (the kernels copy whole
blocks whatever their rank, so the scales are never reshaped).

>>> import jax.numpy as jnp
>>> from pallas_kernels import gather_blocks, scatter_blocks
>>> kv_pages = jnp.arange(4 * 2 * 2 * 1 * 8 * 16, dtype=jnp.float32).reshape(4, 2, 2, 1, 8, 16)
>>> blocks = gather_blocks(kv_pages, jnp.array([3, -1], jnp.int32))
>>> blocks.shape, float(blocks[1].sum())
((2, 2, 2, 1, 8, 16), 0.0)
>>> kv_pages = scatter_blocks(kv_pages, jnp.array([0, -1], jnp.int32), blocks)
>>> bool((kv_pages[0] == kv_pages[3]).all())
True
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.backend import resolve_impl, resolve_interpret
from pallas_kernels.copy_common import on_bits
from pallas_kernels.kv_format import QuantizedPages, is_quantized
from pallas_kernels.validation import check_block_copy_args

__all__ = ["gather_blocks", "scatter_blocks", "gather_blocks_xla", "scatter_blocks_xla"]


def gather_blocks(
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    block_ids,  # i32[n]; negative = padding (a zero row)
    *,
    impl: str | None = None,
    interpret: bool | None = None,
    **tuning,
):
    """Returns ``kv_pages[block_ids]`` with zero rows for negative ids; the pool is unchanged."""
    check_block_copy_args(kv_pages, block_ids)
    impl = _resolve(impl)
    interpret = resolve_interpret(impl, interpret)
    if is_quantized(kv_pages):
        return QuantizedPages(*(_gather(leaf, block_ids, impl, interpret, tuning)
                                for leaf in (kv_pages.data, kv_pages.scales)))
    return _gather(kv_pages, block_ids, impl, interpret, tuning)


def scatter_blocks(
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    block_ids,  # i32[n]; distinct; negative = skip
    blocks,  # [n, num_layers, 2, num_kv_heads, page_size, head_dim]
    *,
    impl: str | None = None,
    interpret: bool | None = None,
    **tuning,
):
    """Returns the pool with ``blocks[i]`` in block ``block_ids[i]``; donates the pool."""
    check_block_copy_args(kv_pages, block_ids, blocks)
    impl = _resolve(impl)
    interpret = resolve_interpret(impl, interpret)
    if block_ids.shape[0] == 0:
        return kv_pages
    if is_quantized(kv_pages):
        return QuantizedPages(*(_scatter(leaf, block_ids, src, impl, interpret, tuning)
                                for leaf, src in ((kv_pages.data, blocks.data),
                                                  (kv_pages.scales, blocks.scales))))
    return _scatter(kv_pages, block_ids, blocks, impl, interpret, tuning)


def _gather(pages, block_ids, impl, interpret, tuning):
    """One array's gather (any rank: the kernels copy whole blocks as flat bytes)."""
    if block_ids.shape[0] == 0:
        return jnp.zeros((0,) + tuple(pages.shape[1:]), pages.dtype)
    if impl == "xla":
        return gather_blocks_xla(pages, block_ids, **tuning)
    from pallas_kernels import block_copy_pallas as kernels

    fn = kernels.gather_blocks_gpu if impl == "pallas_gpu" else kernels.gather_blocks_tpu
    return fn(pages, block_ids, interpret=interpret, **tuning)


def _scatter(pages, block_ids, blocks, impl, interpret, tuning):
    """One array's scatter into the donated ``pages`` (any rank)."""
    if impl == "xla":
        return scatter_blocks_xla(pages, block_ids, blocks, **tuning)
    from pallas_kernels import block_copy_pallas as kernels

    fn = kernels.scatter_blocks_gpu if impl == "pallas_gpu" else kernels.scatter_blocks_tpu
    return fn(pages, block_ids, blocks, interpret=interpret, **tuning)


@jax.jit
@on_bits(0)
def gather_blocks_xla(kv_pages, block_ids):
    """One XLA gather; padding ids read out of bounds, which ``mode="fill"`` turns into 0."""
    return kv_pages.at[_padding_past_end(block_ids, kv_pages.shape[0])].get(
        mode="fill", fill_value=0)


@functools.partial(jax.jit, donate_argnums=(0,))
@on_bits(0, 2)
def scatter_blocks_xla(kv_pages, block_ids, blocks):
    """One XLA scatter into the donated pool; padding ids land out of bounds and are dropped."""
    return kv_pages.at[_padding_past_end(block_ids, kv_pages.shape[0])].set(blocks, mode="drop")


def _resolve(impl: str | None) -> str:
    # On GPU the default is XLA's gather/scatter rather than the Triton kernel: both are
    # plain copies of contiguous blocks, bound by memory bandwidth, and XLA's needs no custom
    # call. Not yet timed on a GPU: benchmarks/bench_pool_layout.py --impls compares them.
    return "xla" if impl is None and resolve_impl(None) == "pallas_gpu" else resolve_impl(impl)


def _padding_past_end(ids, num_blocks: int):
    # jnp indexing wraps negative indices; padding must not alias the last blocks.
    return jnp.where(ids >= 0, ids, num_blocks)
