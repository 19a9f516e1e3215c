"""Ragged paged attention as a Pallas kernel lowered through Triton (GPU).

Same semantics as :func:`pallas_kernels.reference.paged_attention_reference`; see
:mod:`pallas_kernels.paged_attention` for the public entry point.

How the work is cut:

* A *work item* is one block of ``block_q`` consecutive query tokens of one sequence. The
  wrapper lists the work items of the ragged batch (``i32[num_work, 5]``) in plain jnp before
  the kernel; the list has a static length, a bound on the work any ragged layout of
  ``num_tokens`` tokens can need (see :func:`num_work_items`), so a decode batch gets one item
  per sequence instead of ``cdiv(num_tokens, block_q)`` per sequence.
* Grid ``(num_work, num_kv_heads, num_splits)``. A program loads the work item's tokens times
  the ``group = num_q_heads // num_kv_heads`` query heads sharing its KV head as one
  ``[block_q * group, head_dim]`` matrix, so every K/V page is read once per group, not once
  per query head (``group`` times fewer bytes, the cost that bounds decode).
* It walks only the pages inside the causal / sliding-window range of its tokens,
  ``pages_per_compute_block`` pages per step, keeping a float32 online softmax.
* Split-K (flash-decoding): with ``num_splits > 1`` each program takes a contiguous share of
  the item's page steps and writes unnormalised partials ``(m, l, acc)``; a small jnp step
  combines them. Few long sequences then still fill all SMs.

Triton constraints (checked at trace time with a ``ValueError``): every loaded tile has a
power-of-two size and a tensor-core dot needs each dimension >= 16, so ``head_dim`` and
``page_size`` are powers of two, ``head_dim >= 16`` and ``page_size * pages_per_compute_block
>= 16``; the query group is padded to a power of two inside.

NaN safety: unowned pages, slots past ``seq_len`` and table entries past a sequence's last page
may hold anything. Table entries past the last page are replaced by block 0 before any load,
logits of invisible keys become ``-inf`` (so NaN keys drop out) and V rows at or past
``seq_len`` are zeroed (``0 * NaN`` would still poison the sum).

Quantized pools (:class:`~pallas_kernels.kv_format.QuantizedPages`, int8 / fp8 data with
float32 scales per token or per page): the kernel loads the quantized tiles (the bytes decode
is bound by) and the step's scales, ``[pages, page_size or 1]`` per page id. The tiles are
converted to the query's dtype *without* their scales and the dots run on the tensor cores
as for a bfloat16 pool: every int8 and fp8 value is exactly a bfloat16 (and float16 and
float32) value, so the conversion loses nothing, while a float32 dot of dequantized tiles
would run on the FMA units (or as TF32 at half the bfloat16 rate, with tiles twice as large in
registers) and make the small decode dots, not the bytes, the bound. The scales are applied
outside the dots, in float32: a K scale multiplies its logit column (folded with
``sm_scale``, so no more multiplies than the float path) and a V scale its probability column
before the ``p . v`` dot; a per-page scale is broadcast over the page's tokens. NaN safety as
above, plus: V scales past ``seq_len`` are replaced by 0 (a NaN scale times ``p = 0`` is
NaN), and int8 V tiles skip the zeroing (an int8 value is never NaN). With a float16 query
``p * v_scale`` could fall below float16's normal range (fp8_e5m2 scales are ~1e-5), so that
case runs the ``p . v`` dot in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.copy_common import triton_params
from pallas_kernels.kv_format import is_quantized
from pallas_kernels.paged_attention_gpu_plan import (
    Plan,
    combine_splits,
    group_rows,
    make_plan,
    ungroup_rows,
    work_items,
)

__all__ = ["paged_attention_gpu"]

# Launch defaults. Three stages let Triton's pipeliner also prefetch the block-table entries
# that the next K/V gather depends on (seen in the TTGIR of an sm_90 build: the table loads
# become async copies too), at no extra shared memory over two stages.
_NUM_WARPS = 4
_NUM_STAGES = 3


@functools.partial(
    jax.jit,
    static_argnames=("layer", "sm_scale", "sliding_window", "soft_cap", "interpret", "max_q_len",
                     "block_q", "pages_per_compute_block", "num_splits", "num_warps",
                     "num_stages"))
def paged_attention_gpu(
    q,  # [num_tokens, num_q_heads, head_dim]
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim] or QuantizedPages
    block_tables,  # i32[max_num_seqs, pages_per_seq]
    seq_lens,  # i32[max_num_seqs]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    *,
    layer: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    max_q_len: int | None = None,
    block_q: int | None = None,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = _NUM_WARPS,
    num_stages: int = _NUM_STAGES,
):
    """Ragged paged attention on a GPU (or under ``interpret=True`` anywhere).

    Tuning (all static):

    * ``max_q_len``: an upper bound on every sequence's query length in this batch (tokens);
      the engine passes its bucket, e.g. 1 for a decode-only batch. Defaults to ``num_tokens``
      (always safe). A bound that is too small leaves tokens uncomputed.
    * ``block_q``: query tokens per program (power of two); ``block_q * group`` rows must
      reach 16. Default: 16 rows when the batch looks like decode (``max_q_len == 1`` or
      ``num_tokens <= max_num_seqs``), 64 rows otherwise.
    * ``pages_per_compute_block``: pages per inner step (power of two); default 32 KiB of K
      (128 tokens of bfloat16 at head_dim 128); as many tokens for a quantized pool of the
      same query dtype, since its tiles are converted to that dtype in registers.
    * ``num_splits``: split-K factor; default fills about 4 programs per SM (1 in interpret).
    * ``num_warps`` / ``num_stages``: Triton launch and software-pipelining depth.
    """
    if q.shape[0] == 0:  # an empty batch (the plan's bounds need a token)
        return jnp.zeros(q.shape, q.dtype)
    plan = make_plan(q, kv_pages, block_tables, interpret=interpret, max_q_len=max_q_len,
                 block_q=block_q, pages_per_compute_block=pages_per_compute_block,
                 num_splits=num_splits)
    num_q_heads = q.shape[1]
    work = work_items(cu_q_lens, seq_lens, num_seqs, plan)
    q_rows = group_rows(q, plan)  # [num_kv_heads, num_tokens * group_pad, head_dim]
    outs = _call_kernel(
        work, block_tables, q_rows, kv_pages, plan, layer=layer, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret,
        num_warps=num_warps, num_stages=num_stages)
    out_rows = outs[0] if plan.num_splits == 1 else combine_splits(*outs)
    live_tokens = cu_q_lens[num_seqs[0]]
    return ungroup_rows(out_rows, plan, live_tokens, num_q_heads).astype(q.dtype)


def _call_kernel(work, tables, q_rows, kv_pages, plan: Plan, *, layer, sm_scale, sliding_window,
                 soft_cap, interpret, num_warps, num_stages):
    """Builds the grid and BlockSpecs and runs the kernel; returns its outputs."""
    num_kv_heads, num_rows, head_dim = q_rows.shape
    num_blocks, page_size = kv_pages.shape[0], kv_pages.shape[4]
    splits = plan.num_splits
    quantized = is_quantized(kv_pages)
    data = kv_pages.data if quantized else kv_pages
    full = lambda shape: pl.BlockSpec(shape, lambda w, h, k: (0,) * len(shape))
    # The pool goes in twice, as K and as V of one layer and KV head: each ref is then a
    # [num_blocks, page_size, head_dim] stack of contiguous tiles that a page id gathers from.
    pages_spec = lambda kv: pl.BlockSpec(
        (num_blocks, None, None, None, page_size, head_dim),
        lambda w, h, k: (0, layer, kv, h, 0, 0))
    in_specs = [
        full(work.shape),
        full(tables.shape),
        pl.BlockSpec((None, num_rows, head_dim), lambda w, h, k: (h, 0, 0)),
        pages_spec(0),
        pages_spec(1),
    ]
    operands = [work, tables, q_rows, data, data]
    if quantized:
        # Likewise the scales: K's and V's [num_blocks, page_size or 1] of the layer and head.
        scales_spec = lambda kv: pl.BlockSpec(
            (num_blocks, None, None, None, kv_pages.scales.shape[-1]),
            lambda w, h, k: (0, layer, kv, h, 0))
        in_specs += [scales_spec(0), scales_spec(1)]
        operands += [kv_pages.scales, kv_pages.scales]
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype)]
        out_specs = [pl.BlockSpec((None, num_rows, head_dim), lambda w, h, k: (h, 0, 0))]
    else:
        part = (splits, num_kv_heads, num_rows)
        out_shape = [jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, num_rows, head_dim), lambda w, h, k: (k, h, 0, 0)),
                     pl.BlockSpec((None, None, num_rows), lambda w, h, k: (k, h, 0)),
                     pl.BlockSpec((None, None, num_rows), lambda w, h, k: (k, h, 0))]
    kernel = functools.partial(
        _kernel, plan=plan, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        quantized=quantized)
    return pl.pallas_call(
        kernel,
        grid=(plan.num_work, num_kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=triton_params(num_warps, num_stages),
        name="kvjax_ragged_paged_attention",
    )(*operands)


def _kernel(
    work_ref,  # i32[num_work, 5]
    tables_ref,  # i32[max_num_seqs, pages_per_seq]
    q_ref,  # [num_tokens * group_pad, head_dim] of this KV head
    k_ref,  # [num_blocks, page_size, head_dim] of this layer and KV head
    v_ref,  # [num_blocks, page_size, head_dim]
    *refs,  # [quantized: K, V scales f32[num_blocks, page_size or 1]], then the outputs:
    #        out [rows, d], or partial acc [rows, d], m [rows], l [rows]
    plan: Plan,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    quantized: bool,
):
    scale_refs, out_refs = (refs[:2], refs[2:]) if quantized else ((), refs)
    w, split = pl.program_id(0), pl.program_id(2)
    seq, first_row, n_tokens = work_ref[w, 0], work_ref[w, 1], work_ref[w, 2]
    first_pos, kv_len = work_ref[w, 3], work_ref[w, 4]
    rows = plan.rows
    token = lax.div(lax.iota(jnp.int32, rows), plan.group_pad)  # token of each row, in the item
    row_live = token < n_tokens
    row_pos = first_pos + token
    row_slice = pl.ds(first_row * plan.group_pad, rows)
    live_2d = jnp.broadcast_to(row_live[:, None], (rows, q_ref.shape[-1]))
    q = plgpu.load(q_ref.at[row_slice], mask=live_2d, other=0)

    # Pages that hold keys some live row can see: [page_lo, page_hi), cut into steps of
    # pages_per_block pages, and this split's contiguous share of the steps.
    ps, pps = plan.page_size, plan.pages_per_block
    key_lo = jnp.int32(0)
    if sliding_window is not None:
        key_lo = jnp.maximum(first_pos - sliding_window + 1, 0)
    page_lo = lax.div(key_lo, ps)
    page_hi = lax.div(first_pos + n_tokens + ps - 1, ps)
    n_steps = jnp.where(n_tokens > 0, lax.div(page_hi - page_lo + pps - 1, pps), 0)
    per_split = lax.div(n_steps + plan.num_splits - 1, plan.num_splits)
    step_lo = split * per_split
    step_hi = jnp.minimum(step_lo + per_split, n_steps)

    step = functools.partial(
        _attend_step, q=q, row_pos=row_pos, seq=seq, kv_len=kv_len, page_lo=page_lo,
        tables_ref=tables_ref, k_ref=k_ref, v_ref=v_ref, scale_refs=scale_refs, plan=plan,
        sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap)
    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    m, l, acc = lax.fori_loop(step_lo, step_hi, step, init)

    if plan.num_splits == 1:
        [o_ref] = out_refs
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        plgpu.store(o_ref.at[row_slice], out.astype(o_ref.dtype), mask=live_2d)
    else:
        acc_ref, m_ref, l_ref = out_refs
        plgpu.store(acc_ref.at[row_slice], acc, mask=live_2d)
        plgpu.store(m_ref.at[row_slice], m, mask=row_live)
        plgpu.store(l_ref.at[row_slice], l, mask=row_live)


def _attend_step(i, carry, *, q, row_pos, seq, kv_len, page_lo, tables_ref, k_ref, v_ref,
                 scale_refs, plan: Plan, sm_scale, sliding_window, soft_cap):
    """One online-softmax step over ``pages_per_block`` pages starting at step ``i``."""
    m, l, acc = carry
    ps, pps = plan.page_size, plan.pages_per_block
    block_k = ps * pps
    head_dim = q.shape[-1]
    first_page = page_lo + i * pps
    # Entries past the sequence's last page (or past the table) may hold anything: read block
    # 0 there instead; its keys lie past kv_len and are masked below.
    owned = first_page + lax.iota(jnp.int32, pps) < lax.div(kv_len + ps - 1, ps)
    page_ids = plgpu.load(tables_ref.at[seq, pl.ds(first_page, pps)], mask=owned, other=0)
    k = k_ref[page_ids].reshape(block_k, head_dim)
    v = v_ref[page_ids].reshape(block_k, head_dim)
    key_pos = first_page * ps + lax.iota(jnp.int32, block_k)
    in_seq = key_pos < kv_len

    column_scale, v_scale, pv_dtype = sm_scale, None, v.dtype
    zero_v = True
    if scale_refs:  # quantized tiles: see the module docstring for the dtypes and scales
        k_scale, v_scale = (_key_scales(ref, page_ids, plan) for ref in scale_refs)
        zero_v = not jnp.issubdtype(v.dtype, jnp.integer)  # fp8 slots may hold NaN
        pv_dtype = jnp.float32 if q.dtype == jnp.float16 else q.dtype
        k, v = k.astype(q.dtype), v.astype(pv_dtype)  # exact, unscaled
        column_scale = (k_scale * sm_scale)[None, :]
    logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_precision(q.dtype),
                             preferred_element_type=jnp.float32) * column_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    visible = key_pos[None, :] <= row_pos[:, None]
    if sliding_window is not None:
        visible &= key_pos[None, :] > row_pos[:, None] - sliding_window
    logits = jnp.where(visible, logits, -jnp.inf)

    m_new = jnp.maximum(m, logits.max(axis=1))
    # A row that has seen no visible key keeps m = -inf; shift by 0 there (no inf - inf).
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(logits - shift[:, None])
    alpha = jnp.exp(m - shift)
    l = l * alpha + p.sum(axis=1)
    if zero_v:
        v = jnp.where(in_seq[:, None], v, jnp.zeros_like(v))
    p_v = p
    if v_scale is not None:  # where, not a product: a NaN scale past kv_len times 0 is NaN
        p_v = p * jnp.where(in_seq, v_scale, 0.0)[None, :]
    pv = lax.dot_general(p_v.astype(pv_dtype), v, (((1,), (0,)), ((), ())),
                         precision=_precision(pv_dtype), preferred_element_type=jnp.float32)
    return m_new, l, acc * alpha[:, None] + pv


def _key_scales(scale_ref, page_ids, plan: Plan):
    """float32[block_k]: each key's scale; a per-page scale is broadcast over its page."""
    scales = scale_ref[page_ids]  # [pages_per_block, page_size or 1]
    full = jnp.broadcast_to(scales, (plan.pages_per_block, plan.page_size))
    return full.reshape(plan.pages_per_block * plan.page_size)


def _precision(dtype):
    # float32 operands get IEEE dots; TF32 would round them to 10 mantissa bits.
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None
