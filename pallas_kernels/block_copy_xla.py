"""XLA implementations of :func:`pallas_kernels.gather_blocks` / :func:`scatter_blocks`.

One XLA gather or scatter over the block axis of the pool (any rank: a quantized pool's
scales go through the same functions as its pages). They move bits, never convert values
(see :func:`copy_common.on_bits`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.copy_common import on_bits

__all__ = ["gather_blocks_xla", "scatter_blocks_xla"]


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


def _padding_past_end(ids, num_blocks: int):
    # jnp indexing wraps negative indices; padding must not alias the last blocks.
    return jnp.where(ids >= 0, ids, num_blocks)
