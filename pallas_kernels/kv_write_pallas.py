"""Pallas implementations of :func:`pallas_kernels.write_kv`: GPU (Triton) and TPU (Mosaic).

Both alias the pool to the output (``input_output_aliases``) and run under a jit that
donates it, so the pool is written where it lies and never copied. They move bits, never
convert values (a float8_e5m2 pool goes through as unsigned integers, see
:func:`copy_common.on_bits`).

* GPU: one program per (token, KV head) stores that head's K and V rows (``head_dim``
  elements each) at the token's slot. Triton needs power-of-two vectors, so a ``head_dim``
  that is not one is moved in power-of-two pieces (96 = 64 + 32).
* TPU: the slot mapping is scalar-prefetched into SMEM; the pool, K and V stay in HBM
  (``pl.ANY``) and each token is one DMA of its ``[2, num_kv_heads, 1, head_dim]`` K/V
  straight into its slot, strided over heads. A grid step starts the DMAs of
  ``tokens_per_step`` tokens, then waits for them, which bounds the DMAs in flight.

Into a quantized pool (:class:`~pallas_kernels.kv_format.QuantizedPages`) with per-token
scales, :func:`write_kv_quantized_gpu` / :func:`write_kv_quantized_tpu` quantize the new rows
in jnp (fused by XLA into their producer), the kernel above moves the quantized rows and an
XLA scatter their scales. Per-page scales need a read-modify-write of each touched page (see
:mod:`pallas_kernels.kv_format`): XLA does that on every backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.copy_common import (
    in_pool,
    on_bits,
    pow2_pieces,
    run_copies,
    tpu_interpret_mode,
    triton_params,
)
from pallas_kernels.kv_format import QuantizedPages
from pallas_kernels.kv_write_xla import quantize_rows, set_row_scales, write_kv_quantized_xla

__all__ = ["write_kv_gpu", "write_kv_tpu", "write_kv_quantized_gpu", "write_kv_quantized_tpu"]


@functools.partial(
    jax.jit, static_argnames=("layer", "interpret", "num_warps"), donate_argnums=(0,))
@on_bits(0, 1, 2)
def write_kv_gpu(
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    k,  # [num_tokens, num_kv_heads, head_dim]
    v,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping,  # i32[num_tokens]
    *,
    layer: int,
    interpret: bool,
    num_warps: int = 1,
):
    num_tokens, num_kv_heads, head_dim = k.shape
    kernel = functools.partial(
        _write_kernel_gpu, layer=layer, page_size=kv_pages.shape[4], head_dim=head_dim)
    return pl.pallas_call(
        kernel,
        grid=(num_tokens, num_kv_heads),
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
        input_output_aliases={3: 0},
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps),
    )(slot_mapping, k, v, kv_pages)


@functools.partial(
    jax.jit, static_argnames=("layer", "interpret", "tokens_per_step"), donate_argnums=(0,))
@on_bits(0, 1, 2)
def write_kv_tpu(
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    k,  # [num_tokens, num_kv_heads, head_dim]
    v,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping,  # i32[num_tokens]
    *,
    layer: int,
    interpret: bool,
    tokens_per_step: int = 32,
):
    num_tokens = k.shape[0]
    # K and V of a token land in one strided window of the pool; stacking them here (a copy
    # of only this step's tokens) makes that one DMA per token instead of two.
    kv = jnp.stack([k, v], axis=1)[:, :, :, None, :]  # [num_tokens, 2, num_kv_heads, 1, head_dim]
    kernel = functools.partial(
        _write_kernel_tpu, layer=layer, page_size=kv_pages.shape[4],
        tokens_per_step=tokens_per_step, num_tokens=num_tokens)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(pl.cdiv(num_tokens, tokens_per_step),),
        in_specs=[any_spec, any_spec],
        out_specs=any_spec,
        scratch_shapes=[pltpu.SemaphoreType.DMA],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
        input_output_aliases={2: 0},  # operands: slot_mapping, kv, kv_pages
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=tpu_interpret_mode(interpret),
    )(slot_mapping, kv, kv_pages)


def write_kv_quantized_gpu(kv_pages, k, v, slot_mapping, *, layer: int, interpret: bool,
                           **tuning):
    """Quantizing write into a ``QuantizedPages`` pool; :func:`write_kv_gpu` moves the rows."""
    return _write_quantized(write_kv_gpu, kv_pages, k, v, slot_mapping, layer=layer,
                            interpret=interpret, tuning=tuning)


def write_kv_quantized_tpu(kv_pages, k, v, slot_mapping, *, layer: int, interpret: bool,
                           **tuning):
    """Quantizing write into a ``QuantizedPages`` pool; :func:`write_kv_tpu` moves the rows."""
    return _write_quantized(write_kv_tpu, kv_pages, k, v, slot_mapping, layer=layer,
                            interpret=interpret, tuning=tuning)


def _write_quantized(write_rows, kv_pages, k, v, slot_mapping, *, layer, interpret, tuning):
    if kv_pages.format.granularity == "page":
        return write_kv_quantized_xla(kv_pages, k, v, slot_mapping, layer=layer)
    return _write_quantized_rows(write_rows, kv_pages, k, v, slot_mapping, layer=layer,
                                 interpret=interpret, tuning=tuple(sorted(tuning.items())))


@functools.partial(jax.jit, static_argnums=(0,),
                   static_argnames=("layer", "interpret", "tuning"), donate_argnums=(1,))
def _write_quantized_rows(write_rows, kv_pages, k, v, slot_mapping, *, layer, interpret,
                          tuning):
    data, scale = quantize_rows(k, v, kv_pages.format)
    new_data = write_rows(kv_pages.data, data[:, 0], data[:, 1], slot_mapping, layer=layer,
                          interpret=interpret, **dict(tuning))
    # The scales are 1/head_dim of the bytes: an XLA scatter in this donating jit writes them
    # in place (a head_dim-1 view for the kernel would relayout the whole array on TPU).
    return QuantizedPages(new_data, set_row_scales(kv_pages.scales, slot_mapping, layer, scale))


def _write_kernel_gpu(
    slots_ref, k_ref, v_ref, pool_in_ref, pool_ref, *, layer: int, page_size: int, head_dim: int,
):
    del pool_in_ref  # the same buffer as pool_ref (aliased)
    token, head = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[token]

    @pl.when(in_pool(slot, pool_ref.shape[0] * page_size))
    def _store():
        block, offset = jax.lax.div(slot, page_size), jax.lax.rem(slot, page_size)
        for start, size in pow2_pieces(head_dim):
            cols = pl.ds(start, size)
            pool_ref[block, layer, 0, head, offset, cols] = k_ref[token, head, cols]
            pool_ref[block, layer, 1, head, offset, cols] = v_ref[token, head, cols]


def _write_kernel_tpu(
    slots_ref,  # SMEM i32[num_tokens]
    kv_hbm,  # [num_tokens, 2, num_kv_heads, 1, head_dim]
    pool_in_hbm,  # aliased to pool_hbm
    pool_hbm,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    sem,
    *,
    layer: int,
    page_size: int,
    tokens_per_step: int,
    num_tokens: int,
):
    del pool_in_hbm
    first = pl.program_id(0) * tokens_per_step

    def copies(i):
        token = jnp.minimum(first + i, num_tokens - 1)  # the last step may run past the end
        slot = slots_ref[token]
        num_slots = pool_hbm.shape[0] * page_size
        live = (first + i < num_tokens) & in_pool(slot, num_slots)
        # Truncating div/rem of a non-negative slot: floor division would add sign logic.
        slot = jnp.clip(slot, 0, num_slots - 1)
        block, offset = jax.lax.div(slot, page_size), jax.lax.rem(slot, page_size)
        dst = pool_hbm.at[block, layer, :, :, pl.ds(offset, 1)]  # [2, num_kv_heads, 1, head_dim]
        return [(live, pltpu.make_async_copy(kv_hbm.at[token], dst, sem))]

    run_copies(tokens_per_step, copies)

