"""Writing this step's new K/V into their pages of one layer of the pool, in place.

Token ``t``'s K and V go to slot ``slot_mapping[t] = block_id * page_size + offset`` of
``layer``; a negative slot is padding and writes nothing. Nothing else in the pool changes
(except, in a pool with per-page scales, the other slots of a touched page, requantized when
its scale grows: see :mod:`pallas_kernels.kv_format`).
The pool buffer is donated and updated in place (every implementation aliases it to the
output), so a serving loop never allocates a second pool: use the returned array and drop
the one passed in, whose buffer now belongs to the result.

>>> import jax.numpy as jnp
>>> from pallas_kernels import write_kv
>>> kv_pages = jnp.zeros((4, 2, 2, 1, 8, 16), jnp.float32)  # 4 blocks of 8 tokens, 2 layers
>>> k = v = jnp.ones((3, 1, 16), jnp.float32)
>>> slots = jnp.array([8, 9, -1], jnp.int32)  # block 1, offsets 0 and 1; third token is padding
>>> kv_pages = write_kv(kv_pages, k, v, slots, layer=1)
>>> float(kv_pages[1, 1, :, :, :2].sum()), float(kv_pages.sum())
(64.0, 64.0)

A quantized pool (:class:`~pallas_kernels.kv_format.QuantizedPages`) takes float K/V and
quantizes them on the way in, scales included. With per-token scales the new rows are
quantized in jnp (fused by XLA into their producer), the chosen implementation's write
kernel moves the quantized rows and an XLA scatter their scales; per-page scales need a read-modify-write of
each touched page (see :mod:`pallas_kernels.kv_format`), done by XLA on every backend.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.backend import resolve_impl, resolve_interpret
from pallas_kernels.copy_common import on_bits
from pallas_kernels.kv_format import QuantizedPages, encode, is_quantized, quantize
from pallas_kernels.validation import check_kv_write_args

__all__ = ["write_kv", "write_kv_xla", "write_kv_quantized_xla"]


def write_kv(
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    k,  # [num_tokens, num_kv_heads, head_dim]
    v,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping,  # i32[num_tokens]; block_id * page_size + offset, negative = padding
    *,
    layer: int,
    impl: str | None = None,
    interpret: bool | None = None,
    **tuning,
):
    """Returns the pool with each token's K/V stored at its slot of ``layer``; donates the pool.

    Slots must be distinct and inside the pool (``check_slot_mapping`` checks a concrete
    mapping on the host); two tokens on one slot leave either one's values. With no tokens
    the pool comes back as it was, not donated. ``impl`` picks
    the implementation (see :mod:`pallas_kernels.backend`); ``tuning`` passes
    implementation-specific sizes through (``tokens_per_step`` for ``pallas_tpu``).
    """
    check_kv_write_args(kv_pages, k, v, slot_mapping, layer=layer)
    impl = resolve_impl(impl)
    interpret = resolve_interpret(impl, interpret)
    if k.shape[0] == 0:
        return kv_pages
    if is_quantized(kv_pages):
        if impl == "xla" or kv_pages.format.granularity == "page":
            return write_kv_quantized_xla(kv_pages, k, v, slot_mapping, layer=int(layer))
        return _write_quantized_rows(kv_pages, k, v, slot_mapping, layer=int(layer), impl=impl,
                                     interpret=interpret, **tuning)
    if impl == "xla":
        return write_kv_xla(kv_pages, k, v, slot_mapping, layer=int(layer), **tuning)
    from pallas_kernels import kv_write_pallas

    fn = kv_write_pallas.write_kv_gpu if impl == "pallas_gpu" else kv_write_pallas.write_kv_tpu
    return fn(kv_pages, k, v, slot_mapping, layer=int(layer), interpret=interpret, **tuning)


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


def _block_offset(slot_mapping, num_blocks: int, page_size: int):
    """Each slot's block and offset; a negative index would wrap around, so padding slots are
    sent past the pool, where ``mode="drop"`` skips them."""
    block = jnp.where(slot_mapping >= 0, slot_mapping // page_size, num_blocks)
    return block, slot_mapping % page_size


def _quantize_rows(k, v, fmt):
    """Per-token quantization of this step's rows: data ``[T, 2, h, d]``, scales ``[T, 2, h]``
    (each row is its own one-token "page")."""
    kv = jnp.stack([k, v], axis=1)[:, :, :, None, :]  # [T, 2, h, 1, d]
    data, scale = quantize(kv, dataclasses.replace(fmt, granularity="token"))
    return data[:, :, :, 0], scale[..., 0]


@functools.partial(jax.jit, static_argnames=("layer", "impl", "interpret", "tuning"),
                   donate_argnums=(0,))
def _write_quantized_rows_jit(kv_pages, k, v, slot_mapping, *, layer, impl, interpret, tuning):
    from pallas_kernels import kv_write_pallas

    fn = kv_write_pallas.write_kv_gpu if impl == "pallas_gpu" else kv_write_pallas.write_kv_tpu
    data, scale = _quantize_rows(k, v, kv_pages.format)
    new_data = fn(kv_pages.data, data[:, 0], data[:, 1], slot_mapping, layer=layer,
                  interpret=interpret, **dict(tuning))
    # The scales are 1/head_dim of the bytes: an XLA scatter in this donating jit writes them
    # in place (a head_dim-1 view for the kernel would relayout the whole array on TPU).
    return QuantizedPages(new_data, _set_scales(kv_pages.scales, slot_mapping, layer, scale))


def _write_quantized_rows(kv_pages, k, v, slot_mapping, *, layer, impl, interpret, **tuning):
    return _write_quantized_rows_jit(kv_pages, k, v, slot_mapping, layer=layer, impl=impl,
                                     interpret=interpret, tuning=tuple(sorted(tuning.items())))


@functools.partial(jax.jit, static_argnames=("layer",), donate_argnums=(0,))
def write_kv_quantized_xla(kv_pages, k, v, slot_mapping, *, layer: int):
    """Quantizing write in XLA: scatters of quantized rows (and, per page, rescaled pages)."""
    fmt = kv_pages.format
    data, scales = kv_pages.data, kv_pages.scales
    num_blocks, page_size = data.shape[0], data.shape[4]
    block, offset = _block_offset(slot_mapping, num_blocks, page_size)
    if fmt.granularity == "token":
        rows, row_scale = _quantize_rows(k, v, fmt)
        data = _set_rows(data, block, layer, offset, rows)
        return QuantizedPages(data, _set_scales(scales, slot_mapping, layer, row_scale))

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
    pages = jnp.where(fresh[..., None, None], pages, requantized)
    data = data.at[block, layer].set(pages, mode="drop")
    data = _set_rows(data, block, layer, offset, encode(kv, new[..., None], fmt))
    scales = scales.at[block, layer, :, :, 0].set(new, mode="drop")
    return QuantizedPages(data, scales)


def _set_scales(scales, slot_mapping, layer, row_scale):
    """Per-token scales ``[T, 2, h]`` into their slots; padding slots are dropped."""
    num_blocks, page_size = scales.shape[0], scales.shape[4]
    block, offset = _block_offset(slot_mapping, num_blocks, page_size)
    return scales.at[block, layer, :, :, offset].set(row_scale, mode="drop")


@on_bits(0, 4)
def _set_rows(data, block, layer, offset, rows):
    return data.at[block, layer, :, :, offset].set(rows, mode="drop")
