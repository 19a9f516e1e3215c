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

import jax.numpy as jnp

from pallas_kernels.dispatch import select
from pallas_kernels.kv_format import QuantizedPages, is_quantized
from pallas_kernels.validation import check_block_copy_args

__all__ = ["gather_blocks", "scatter_blocks"]


def gather_blocks(
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    block_ids,  # i32[n]; negative = padding (a zero row)
    *,
    impl: str | None = None,
    interpret: bool | None = None,
    **tuning,
):
    """Returns ``kv_pages[block_ids]`` with zero rows for negative ids; the pool is unchanged.

    ``impl`` picks the implementation (see :mod:`pallas_kernels.dispatch`; on GPU the default
    is XLA's gather); ``tuning`` passes implementation-specific sizes through.
    """
    check_block_copy_args(kv_pages, block_ids)
    gather = select("gather_blocks", impl, interpret, tuning)

    def gather_leaf(pages):  # any rank: the kernels copy whole blocks as flat bits
        if block_ids.shape[0] == 0:
            return jnp.zeros((0,) + tuple(pages.shape[1:]), pages.dtype)
        return gather(pages, block_ids, **tuning)

    if is_quantized(kv_pages):
        return QuantizedPages(gather_leaf(kv_pages.data), gather_leaf(kv_pages.scales))
    return gather_leaf(kv_pages)


def scatter_blocks(
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    block_ids,  # i32[n]; distinct; negative = skip
    blocks,  # [n, num_layers, 2, num_kv_heads, page_size, head_dim]
    *,
    impl: str | None = None,
    interpret: bool | None = None,
    **tuning,
):
    """Returns the pool with ``blocks[i]`` in block ``block_ids[i]``; donates the pool.

    With no ids the pool comes back as it was, not donated. ``impl`` and ``tuning`` as for
    :func:`gather_blocks`.
    """
    check_block_copy_args(kv_pages, block_ids, blocks)
    scatter = select("scatter_blocks", impl, interpret, tuning)
    if block_ids.shape[0] == 0:
        return kv_pages
    if is_quantized(kv_pages):
        return QuantizedPages(scatter(kv_pages.data, block_ids, blocks.data, **tuning),
                              scatter(kv_pages.scales, block_ids, blocks.scales, **tuning))
    return scatter(kv_pages, block_ids, blocks, **tuning)
