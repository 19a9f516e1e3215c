"""XLA implementations of :func:`pallas_kernels.write_kv`: scatters into the donated pool.

* :func:`write_kv_xla`: a float pool, one scatter of every token's K/V rows.
* :func:`write_kv_quantized_xla`: a :class:`~pallas_kernels.kv_format.QuantizedPages` pool,
  either granularity. Per-token scales: the rows are quantized in jnp and scattered with their
  scales. Per-page scales: each touched page is read, requantized when its scale grows, and
  written back (see :mod:`pallas_kernels.kv_format`); every backend runs this one.

:func:`quantize_rows` and :func:`set_row_scales` are shared with the Pallas quantized writes
(:mod:`pallas_kernels.kv_write_pallas`), whose kernels move the rows but not the scales.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.copy_common import on_bits
from pallas_kernels.kv_format import QuantizedPages, encode, quantize

__all__ = ["write_kv_xla", "write_kv_quantized_xla", "quantize_rows", "set_row_scales"]


@functools.partial(jax.jit, static_argnames=("layer",), donate_argnums=(0,))
@on_bits(0, 1, 2)
def write_kv_xla(kv_pages, k, v, slot_mapping, *, layer: int):
    """One XLA scatter of ``[num_tokens, 2, num_kv_heads, head_dim]`` rows into the pool."""
    num_blocks, page_size = kv_pages.shape[0], kv_pages.shape[4]
    block, offset = _block_offset(slot_mapping, num_blocks, page_size)
    kv = jnp.stack([k, v], axis=1)  # [num_tokens, 2, num_kv_heads, head_dim]
    # The advanced indices (block, layer, offset) are split by slices, so numpy rules put
    # the token axis first: the update is exactly kv's [num_tokens, 2, num_kv_heads, head_dim].
    return kv_pages.at[block, layer, :, :, offset].set(kv, mode="drop")


@functools.partial(jax.jit, static_argnames=("layer",), donate_argnums=(0,))
def write_kv_quantized_xla(kv_pages, k, v, slot_mapping, *, layer: int):
    """Quantizing write in XLA: scatters of quantized rows (and, per page, rescaled pages)."""
    fmt = kv_pages.format
    data, scales = kv_pages.data, kv_pages.scales
    num_blocks, page_size = data.shape[0], data.shape[4]
    block, offset = _block_offset(slot_mapping, num_blocks, page_size)
    if fmt.granularity == "token":
        rows, row_scale = quantize_rows(k, v, fmt)
        data = _set_rows(data, block, layer, offset, rows)
        return QuantizedPages(data, set_row_scales(scales, slot_mapping, layer, row_scale))

    kv = jnp.stack([k, v], axis=1).astype(jnp.float32)  # [T, 2, h, d]
    live = slot_mapping >= 0
    # Per touched page: its first written offset (0 = a fresh page) and the new rows' max.
    first = jnp.full((num_blocks + 1,), page_size, jnp.int32).at[block].min(
        jnp.where(live, offset, page_size))[block]
    amax = jnp.zeros((num_blocks + 1,) + kv.shape[1:3], jnp.float32).at[block].max(
        jnp.max(jnp.abs(kv), axis=-1))[block]  # [T, 2, h]
    fresh = (first == 0)[:, None, None]
    safe_block = jnp.minimum(block, num_blocks - 1)
    old = jnp.where(fresh, 0.0, scales[safe_block, layer, :, :, 0])  # [T, 2, h]
    new = jnp.maximum(old, amax / fmt.qmax)
    pages = data[safe_block, layer]  # [T, 2, h, page, d]: each token's page, repeats alike
    requantized = encode(pages.astype(jnp.float32) * old[..., None, None],
                         new[..., None, None], fmt)
    data = _set_pages_and_rows(data, block, layer, offset, fresh, requantized,
                               encode(kv, new[..., None], fmt))
    scales = scales.at[block, layer, :, :, 0].set(new, mode="drop")
    return QuantizedPages(data, scales)


def quantize_rows(k, v, fmt):
    """Per-token quantization of this step's rows: data ``[T, 2, h, d]``, scales ``[T, 2, h]``
    (each row is its own one-token "page")."""
    kv = jnp.stack([k, v], axis=1)[:, :, :, None, :]  # [T, 2, h, 1, d]
    data, scale = quantize(kv, dataclasses.replace(fmt, granularity="token"))
    return data[:, :, :, 0], scale[..., 0]


def set_row_scales(scales, slot_mapping, layer, row_scale):
    """Per-token scales ``[T, 2, h]`` into their slots; padding slots are dropped."""
    num_blocks, page_size = scales.shape[0], scales.shape[4]
    block, offset = _block_offset(slot_mapping, num_blocks, page_size)
    return scales.at[block, layer, :, :, offset].set(row_scale, mode="drop")


def _block_offset(slot_mapping, num_blocks: int, page_size: int):
    """Each slot's block and offset; a negative index would wrap around, so padding slots are
    sent past the pool, where ``mode="drop"`` skips them."""
    block = jnp.where(slot_mapping >= 0, slot_mapping // page_size, num_blocks)
    return block, slot_mapping % page_size


@on_bits(0, 4)
def _set_rows(data, block, layer, offset, rows):
    return data.at[block, layer, :, :, offset].set(rows, mode="drop")


@on_bits(0, 5, 6)
def _set_pages_and_rows(data, block, layer, offset, fresh, requantized, rows):
    """Each touched page of ``layer``: ``requantized``, or as it was where ``fresh`` (its
    other slots lie past the sequence's end), then this step's ``rows``. On bits, like
    :func:`_set_rows`: a float8_e5m2 page copied as floats got every NaN byte of the pool
    rewritten, in blocks and layers the write never touched."""
    safe_block = jnp.minimum(block, data.shape[0] - 1)
    pages = jnp.where(fresh[..., None, None], data[safe_block, layer], requantized)
    data = data.at[block, layer].set(pages, mode="drop")
    return data.at[block, layer, :, :, offset].set(rows, mode="drop")
