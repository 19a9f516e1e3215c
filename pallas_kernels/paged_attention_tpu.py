"""Ragged paged attention as a TPU (Mosaic) Pallas kernel.

Same semantics as :func:`pallas_kernels.reference.paged_attention_reference`; reached through
``pallas_kernels.paged_attention(..., impl="pallas_tpu")``.

How the work is laid out:

* The flattened query tokens are cut into aligned blocks of ``block_q`` tokens; the grid has one
  step per block. A block may hold the tail of one sequence, several whole decode sequences and
  the head of another: the step walks every sequence its tokens belong to (the range comes from
  a small schedule computed in XLA and prefetched into SMEM) and, for each, the pages that the
  block's tokens of that sequence can see (causal, and the sliding window when given).
* The pages stay in HBM (``memory_space=pl.ANY``). One DMA per page moves that page's
  ``[2, num_kv_heads, page_size, head_dim]`` tile of the layer, which the page-major pool keeps
  contiguous, into a double-buffered VMEM scratch: the pages of the next (sequence, page range)
  item are in flight while the current item is computed. Pages outside an item's visible range
  are not fetched at all.
* All KV heads are handled in one step. Queries are regrouped outside the kernel into
  ``[num_kv_heads, tokens * group, head_dim]`` (row = token * group + head-in-group) so one KV
  head's queries are one ``[block_q * group, head_dim]`` tile and one matmul covers the group.
* Softmax statistics and the accumulator live in float32 VMEM scratch. Logits of slots a row
  must not see become ``-inf`` and V rows past the last visible position are zeroed, so NaN in
  unowned pages, tail slots or stale buffer contents never reaches the output. Rows of padding
  tokens keep a zero denominator and come out as exactly 0.

Quantized pages (:class:`~pallas_kernels.kv_format.QuantizedPages`: int8 / float8 data, float32
scales) cross HBM as stored: a page's tile and its ``[2, num_kv_heads, page_size or 1]`` scales
are two DMAs into their own double-buffered VMEM slots and semaphores. In VMEM the tiles become
q's dtype (exactly: int8 and fp8 values are all bfloat16 values) and the scales go where they
cost least: K's onto the columns of the ``[rows, cols]`` logits, V's onto the probabilities.
A NaN K scale (unwritten slot, unowned page) only reaches a logit the mask drops; V scales
past the last visible position are zeroed before they meet the probabilities, and so are
float8 V rows (int8 holds no NaN).

TPU constraints (:func:`check_tpu_layout`, at trace time): ``head_dim`` a multiple of 128
(lanes); q float32 or bfloat16 (no float16 VPU arithmetic); ``page_size`` a multiple of the
pages' sublane tile: 8 rows for float32, 16 for bfloat16, 32 for int8 and fp8 (a sublane
holds 32-bit words, so four 8-bit rows pack into one: 8-bit tiles are (32, 128)). Then a
head's page is whole tiles and the ``[pages, page_size, head_dim] -> [cols, head_dim]`` merge
is free. Scales need no alignment of
their own: each DMA and load takes a page's whole ``[2, num_kv_heads, page_size or 1]``
(padded to (8, 128) tiles in VMEM); a head's row is picked by a sublane select (a dynamic
sublane offset would have to be tile-aligned) and a run's per-token rows are concatenated
along lanes (unaligned below 128-token pages, which Mosaic's concatenate handles by masking).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.copy_common import tpu_interpret_mode
from pallas_kernels.kv_format import is_quantized
from pallas_kernels.tpu_layout import (
    LANES,
    TARGET_COLS,
    check_tpu_layout,
    default_block_q,
    sublane_tile,
    vmem_limit,
)

__all__ = ["paged_attention_tpu", "check_tpu_layout"]

def paged_attention_tpu(
    q,  # [num_tokens, num_q_heads, head_dim]
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim], or QuantizedPages
    block_tables,  # i32[max_num_seqs, pages_per_seq]
    seq_lens,  # i32[max_num_seqs]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    *,
    layer: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
):
    """Ragged paged attention on a TPU core; ``[num_tokens, num_q_heads, head_dim]`` in q.dtype.

    Arguments are validated by :func:`pallas_kernels.paged_attention`; this adds the TPU layout
    checks of :func:`check_tpu_layout`. ``interpret=True`` runs the TPU interpreter
    (``pltpu.InterpretParams()``, which simulates DMAs and semaphores on CPU); an
    ``InterpretParams`` instance is passed through as is (e.g. with ``detect_races=True``).

    Tuning: ``block_q`` query tokens per grid step (``block_q * group`` must be a multiple of
    the sublane tile), ``pages_per_block`` pages per DMA batch and matmul,
    ``vmem_limit_bytes`` to override the scoped VMEM limit.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // kv_pages.shape[3]
    scales_dim = kv_pages.scales.shape[-1] if is_quantized(kv_pages) else None
    check_tpu_layout(q.dtype, page_size=kv_pages.shape[4], head_dim=head_dim, group=group,
                     block_q=block_q, pages_per_block=pages_per_block,
                     pages_dtype=kv_pages.dtype, scales_dim=scales_dim)
    if num_tokens == 0:
        return jnp.zeros_like(q)
    if block_q is None:
        block_q = default_block_q(num_tokens, group, sublane_tile(q.dtype))
    if pages_per_block is None:
        pages_per_block = max(1, TARGET_COLS // kv_pages.shape[4])
    pages_per_block = max(1, min(pages_per_block, block_tables.shape[1]))
    interpret = tpu_interpret_mode(interpret)  # an InterpretParams passes as it is
    return _paged_attention_tpu(
        q, kv_pages, block_tables, seq_lens, cu_q_lens, num_seqs, layer=layer,
        sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        interpret=interpret, block_q=block_q, pages_per_block=pages_per_block,
        vmem_limit_bytes=vmem_limit_bytes)


@functools.partial(
    jax.jit, static_argnames=("layer", "sm_scale", "sliding_window", "soft_cap", "interpret",
                              "block_q", "pages_per_block", "vmem_limit_bytes"))
def _paged_attention_tpu(q, kv_pages, block_tables, seq_lens, cu_q_lens, num_seqs, *, layer,
                         sm_scale, sliding_window, soft_cap, interpret, block_q,
                         pages_per_block, vmem_limit_bytes):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pages.shape[3]
    group = num_q_heads // num_kv_heads
    num_q_blocks = -(-num_tokens // block_q)
    rows = block_q * group
    # [num_kv_heads, padded_tokens * group, head_dim]: one KV head's queries are one tile.
    q_rows = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, num_q_blocks * block_q - num_tokens), (0, 0), (0, 0)))
    q_rows = q_rows.reshape(num_kv_heads, num_q_blocks * rows, head_dim)
    seq_bounds = _block_seq_bounds(cu_q_lens, num_seqs, num_q_blocks, block_q)

    kernel = functools.partial(
        _attention_kernel, layer=layer, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, block_q=block_q, group=group, pages_per_seq=block_tables.shape[1])
    q_spec = pl.BlockSpec((num_kv_heads, rows, head_dim), lambda i, *_: (0, i, 0))
    # The pool's arrays: the pages, and for a quantized pool their scales beside them. Each
    # gets two VMEM slots of pages_per_block pages and a DMA semaphore per slot.
    pool = (kv_pages.data, kv_pages.scales) if is_quantized(kv_pages) else (kv_pages,)
    bufs = tuple(pltpu.VMEM((2, pages_per_block) + leaf.shape[2:], leaf.dtype) for leaf in pool)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(num_q_blocks,),
        in_specs=[q_spec, tuple(pl.BlockSpec(memory_space=pl.ANY) for _ in pool)],
        out_specs=q_spec,
        scratch_shapes=[
            bufs,
            tuple(pltpu.SemaphoreType.DMA((2,)) for _ in pool),
            pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),  # running max, lane-copied
            pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),  # running denominator
            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),  # accumulator
        ])
    if vmem_limit_bytes is None:
        vmem_limit_bytes = vmem_limit(q.dtype, bufs, num_kv_heads, rows, head_dim)
    out_rows = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret,
    )(seq_bounds, block_tables.reshape(-1), seq_lens, cu_q_lens, q_rows, pool)
    out = out_rows.reshape(num_kv_heads, num_q_blocks * block_q, group, head_dim)
    return out.transpose(1, 0, 2, 3)[:num_tokens].reshape(num_tokens, num_q_heads, head_dim)


class _Span(NamedTuple):
    """What one sequence contributes to the current query block (int32 scalars)."""
    seq: jax.Array  # sequence index, clamped into the table
    q_start: jax.Array  # its first token row in q
    q_end: jax.Array  # one past its last token row
    offset: jax.Array  # position of token row t is t + offset
    active: jax.Array  # whether any of its tokens lie in this block
    pos_hi: jax.Array  # last KV position any of its tokens in this block can see
    page_lo: jax.Array  # first page (table column) a token in this block can see
    page_hi: jax.Array  # last such page; -1 when inactive


def _attention_kernel(
    seq_bounds_ref,  # i32[2 * num_q_blocks] (SMEM): [lo, hi) sequences per query block
    tables_ref,  # i32[max_num_seqs * pages_per_seq] (SMEM)
    lens_ref,  # i32[max_num_seqs] (SMEM)
    cu_ref,  # i32[max_num_seqs + 1] (SMEM)
    q_ref,  # [num_kv_heads, rows, head_dim] (VMEM), rows = block_q * group
    pool_refs,  # (pages[, scales]) (HBM):
    #   pages  [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    #   scales f32[num_blocks, num_layers, 2, num_kv_heads, page_size or 1] (quantized pools)
    out_ref,  # [num_kv_heads, rows, head_dim] (VMEM)
    bufs,  # (pages[, scales]) (VMEM), each [2 slots, pages_per_block] + a page's shape
    sems,  # (DMA[2][, DMA[2]]): one per slot and pool array
    m_ref,  # f32[num_kv_heads, rows, 128]
    l_ref,  # f32[num_kv_heads, rows, 128]
    acc_ref,  # f32[num_kv_heads, rows, head_dim]
    *, layer, sm_scale, sliding_window, soft_cap, block_q, group, pages_per_seq,
):
    """One query block: walks its (sequence, page run) items with the next item's pages in
    flight while the current one is computed, then writes every KV head's rows."""
    block = pl.program_id(0)
    first_token = block * block_q
    page_size, pages_per_block = bufs[0].shape[4], bufs[0].shape[1]
    span_of = functools.partial(
        _span, cu_ref, lens_ref, first_token=first_token, block_q=block_q, page_size=page_size,
        sliding_window=sliding_window)

    each_page_copy = functools.partial(
        _each_page_copy, tables_ref, pool_refs, bufs, sems, layer=layer,
        pages_per_seq=pages_per_seq)

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    seq_lo, seq_hi = seq_bounds_ref[2 * block], seq_bounds_ref[2 * block + 1]
    first = span_of(seq_lo)

    @pl.when(seq_lo < seq_hi)
    def _():
        each_page_copy(first, first.page_lo, 0, "start")

    def item(carry):
        # One item: a sequence and up to pages_per_block of its visible pages.
        seq, span, page0, slot = carry
        more = page0 + pages_per_block <= span.page_hi
        next_seq = jnp.where(more, seq, seq + 1)
        next_span = span_of(next_seq)
        next_page0 = jnp.where(more, page0 + pages_per_block, next_span.page_lo)

        @pl.when(next_seq < seq_hi)
        def _():
            each_page_copy(next_span, next_page0, 1 - slot, "start")

        each_page_copy(span, page0, slot, "wait")

        @pl.when(span.active)
        def _():
            _attend(q_ref, [buf.at[slot] for buf in bufs], m_ref, l_ref, acc_ref, span, page0,
                    first_token=first_token, group=group, sm_scale=sm_scale, soft_cap=soft_cap,
                    sliding_window=sliding_window)

        return next_seq, next_span, next_page0, 1 - slot

    lax.while_loop(lambda carry: carry[0] < seq_hi, item,
                   (seq_lo, first, first.page_lo, jnp.int32(0)))
    # Padding rows saw nothing: their accumulator is 0, and so is their output.
    l = l_ref[...]
    out_ref[...] = (acc_ref[...] / _lanes(jnp.where(l == 0.0, 1.0, l), out_ref.shape[2])).astype(
        out_ref.dtype)


def _each_page_copy(tables_ref, pool_refs, bufs, sems, span: _Span, page0, slot, action,
                    *, layer, pages_per_seq):
    """Starts (or waits for) the DMAs of each page of one item (its tile, and its scales in a
    quantized pool) into page slot ``slot``.

    Only pages the block can see are fetched; the other positions of the slot keep stale data
    that the masks in :func:`_attend` never let through.
    """
    def page_copy(j, carry):
        page = page0 + j

        @pl.when(span.active & (page <= span.page_hi))
        def _():
            col = span.seq * pages_per_seq + jnp.minimum(page, pages_per_seq - 1)
            # Clamped so a bad table entry cannot send a DMA outside the pool.
            block_id = jnp.clip(tables_ref[col], 0, pool_refs[0].shape[0] - 1)
            for hbm, buf, sem in zip(pool_refs, bufs, sems):
                copy = pltpu.make_async_copy(hbm.at[block_id, layer], buf.at[slot, j],
                                             sem.at[slot])
                getattr(copy, action)()

        return carry

    lax.fori_loop(0, bufs[0].shape[1], page_copy, None)


def _span(cu_ref, lens_ref, seq, *, first_token, block_q, page_size, sliding_window) -> _Span:
    seq = jnp.minimum(seq, lens_ref.shape[0] - 1)  # a loop's look-ahead may step past the end
    q_start, q_end = cu_ref[seq], cu_ref[seq + 1]
    offset = lens_ref[seq] - q_end
    row_lo = jnp.maximum(first_token, q_start)
    row_hi = jnp.minimum(first_token + block_q, q_end) - 1
    active = row_lo <= row_hi
    pos_hi = jnp.maximum(row_hi + offset, 0)
    page_hi = jnp.where(active, lax.div(pos_hi, page_size), -1)
    if sliding_window is None:
        page_lo = jnp.int32(0)
    else:
        page_lo = lax.div(jnp.maximum(row_lo + offset - (sliding_window - 1), 0), page_size)
    return _Span(seq, q_start, q_end, offset, active, pos_hi, page_lo, page_hi)


def _attend(q_ref, slot_refs, m_ref, l_ref, acc_ref, span: _Span, page0, *, first_token, group,
            sm_scale, soft_cap, sliding_window):
    """Folds one item (a sequence, a run of its pages) into every KV head's running softmax."""
    num_kv_heads, rows, head_dim = q_ref.shape
    kv_slot = slot_refs[0]  # [pages_per_block, 2, num_kv_heads, page_size, head_dim]
    scale_slot = slot_refs[1] if len(slot_refs) > 1 else None  # [.., num_kv_heads, page or 1]
    pages_per_block, page_size = kv_slot.shape[0], kv_slot.shape[3]
    cols = pages_per_block * page_size
    row_ids = lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
    token = first_token + (row_ids if group == 1 else lax.div(row_ids, group))
    q_pos = token + span.offset
    kv_pos = page0 * page_size + lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    visible = (token >= span.q_start) & (token < span.q_end) & (kv_pos <= q_pos)
    if sliding_window is not None:
        visible &= kv_pos > q_pos - sliding_window
    # V rows no token here can see are zeroed: 0 * NaN would otherwise poison the sum.
    v_pos = page0 * page_size + lax.broadcasted_iota(jnp.int32, (cols, head_dim), 0)
    v_valid = v_pos <= span.pos_hi
    col_valid = page0 * page_size + lax.broadcasted_iota(jnp.int32, (1, cols), 1) <= span.pos_hi
    compute = q_ref.dtype

    def head(h, carry):
        k = _converted(kv_slot[:, 0, h].reshape(cols, head_dim), compute)
        v = kv_slot[:, 1, h].reshape(cols, head_dim)
        if jnp.issubdtype(v.dtype, jnp.floating):
            # Select in float32: older TPUs have no bfloat16 VPU ops.
            v = jnp.where(v_valid, v.astype(jnp.float32), 0.0)
        v = _converted(v, compute)  # int8 holds no NaN: its zero V scales are enough
        k_cols = v_cols = None
        if scale_slot is not None:
            k_cols = _column_scales(scale_slot, 0, h, page_size)
            v_cols = jnp.where(col_valid, _column_scales(scale_slot, 1, h, page_size), 0.0)
        _online_softmax_step(q_ref[h], k, v, visible, m_ref.at[h], l_ref.at[h], acc_ref.at[h],
                             sm_scale=sm_scale, soft_cap=soft_cap, k_cols=k_cols, v_cols=v_cols)
        return carry

    lax.fori_loop(0, num_kv_heads, head, None)


def _online_softmax_step(q, k, v, visible, m_ref, l_ref, acc_ref, *, sm_scale, soft_cap,
                         k_cols=None, v_cols=None):
    """One flash-attention update of ``[rows, cols]`` logits; statistics stay in float32.

    ``k_cols`` / ``v_cols`` (f32[1, cols]) are the dequantization scales of K's and V's
    columns, applied to the logits and to the probabilities.
    """
    # float32 inputs would otherwise be rounded to bfloat16 passes on the MXU.
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
    logits = logits * (sm_scale if k_cols is None else sm_scale * k_cols)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(visible, logits, -jnp.inf)  # also drops NaN read from unowned slots
    m_block = logits.max(axis=1, keepdims=True)  # [rows, 1]
    p = jnp.exp(logits - _finite_or_zero(m_block))  # rows that see nothing here: all 0
    m_prev = m_ref[...]  # [rows, 128], every lane holds the row's value
    m_new = jnp.maximum(m_prev, m_block)
    shift = _finite_or_zero(m_new)
    alpha = jnp.exp(m_prev - shift)  # rescales what was accumulated so far
    beta = jnp.exp(m_block - shift)  # rescales this block's p, taken relative to m_block
    m_ref[...] = m_new
    l_ref[...] = alpha * l_ref[...] + beta * p.sum(axis=1, keepdims=True)
    p_v = p if v_cols is None else p * v_cols
    pv = lax.dot_general(p_v.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    head_dim = acc_ref.shape[1]
    acc_ref[...] = _lanes(alpha, head_dim) * acc_ref[...] + _lanes(beta, head_dim) * pv


def _converted(x, dtype):
    """``x`` in ``dtype``; 8-bit pages go through float32, which every TPU converts from."""
    if x.dtype == dtype:
        return x
    return x.astype(jnp.float32).astype(dtype)


def _column_scales(scale_slot, kv: int, h, page_size: int):
    """f32[1, pages * page_size]: the scale of each column (KV slot) of head ``h``'s K or V.

    ``scale_slot`` is ``[pages, 2, num_kv_heads, page_size or 1]`` with the heads on sublanes:
    a head is picked by a select and a sublane sum (a dynamic sublane index would need a
    tile-aligned offset), then each page's lanes are laid side by side.
    """
    scales = scale_slot[:, kv]  # [pages, num_kv_heads, page_size or 1]
    heads = lax.broadcasted_iota(jnp.int32, scales.shape, 1)
    scales = jnp.sum(jnp.where(heads == h, scales, 0.0), axis=1, keepdims=True)
    pieces = [jnp.broadcast_to(scales[j], (1, page_size)) for j in range(scales.shape[0])]
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)


def _finite_or_zero(x):
    return jnp.where(x == -jnp.inf, 0.0, x)


def _lanes(x, width: int):
    """Widens a lane-replicated ``[..., rows, 128]`` array to ``[..., rows, width]``."""
    return x if width == x.shape[-1] else jnp.concatenate([x] * (width // x.shape[-1]), axis=-1)


def _block_seq_bounds(cu_q_lens, num_seqs, num_q_blocks: int, block_q: int):
    """i32[2 * num_q_blocks]: per query block, ``[lo, hi)`` of the live sequences it touches."""
    first = jnp.arange(num_q_blocks, dtype=jnp.int32)[:, None] * block_q
    live = jnp.arange(cu_q_lens.shape[0] - 1)[None, :] < num_seqs[0]
    lo = jnp.sum(live & (cu_q_lens[None, 1:] <= first), axis=1, dtype=jnp.int32)
    hi = jnp.sum(live & (cu_q_lens[None, :-1] < first + block_q), axis=1, dtype=jnp.int32)
    return jnp.stack([lo, hi], axis=1).reshape(-1)
