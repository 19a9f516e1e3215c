"""Ragged paged attention in plain jnp, lowered by XLA: the fast path on CPU.

The batch is cut into *work items*: up to ``block_q`` consecutive query tokens of one
sequence. Each item gathers its sequence's pages ``pages_per_step`` at a time and keeps a
float32 online softmax (running max, denominator, accumulator). Two things make this fast
on CPU where a per-token formulation was not:

* a prefill chunk of ``q_len`` tokens gathers each page once per item instead of once per
  token (``block_q`` times fewer bytes moved), and its scores are one
  ``[block_q * group, pages_per_step * page_size]`` matmul per KV head, not ``block_q``
  matrix-vector products;
* the page loop is a ``while_loop`` bounded by the longest sequence actually in the batch, so
  a decode batch of short sequences does not pay for the table's width.

The number of items is static: ``cdiv(num_tokens, block_q) + max_num_seqs`` bounds it for
any ragged layout (each sequence wastes at most one partial item). Decode-heavy shapes
(``num_tokens <= 2 * max_num_seqs``) use ``block_q = 1``, where that bound is tight.

A quantized pool (:class:`~pallas_kernels.kv_format.QuantizedPages`) is dequantized tile by
tile as its pages are gathered: only ``pages_per_step`` pages per item are ever float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kv_format import is_quantized

__all__ = ["paged_attention_xla"]

# Upper bound on the gathered K/V per loop step, in bytes, to keep CPU working sets bounded.
_STEP_BYTES = 32 * 1024 * 1024
_PREFILL_BLOCK_Q = 16
_MAX_PAGES_PER_STEP = 8


@functools.partial(
    jax.jit,
    static_argnames=("layer", "sm_scale", "sliding_window", "soft_cap", "pages_per_step",
                     "block_q"))
def paged_attention_xla(
    q,  # [num_tokens, num_q_heads, head_dim]
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    block_tables,  # i32[max_num_seqs, pages_per_seq]
    seq_lens,  # i32[max_num_seqs]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    *,
    layer: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_step: int | None = None,
    block_q: int | None = None,
):
    for name, value in (("pages_per_step", pages_per_step), ("block_q", block_q)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive int or None")
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:  # nothing to attend (a gather from an empty q would not even trace)
        return jnp.zeros_like(q)
    max_num_seqs, pages_per_seq = block_tables.shape
    num_kv_heads, page_size = kv_pages.shape[3], kv_pages.shape[4]
    group = num_q_heads // num_kv_heads
    if block_q is None:
        block_q = 1 if num_tokens <= 2 * max_num_seqs else _PREFILL_BLOCK_Q
    num_items = -(-num_tokens // block_q) + (max_num_seqs if block_q > 1 else 0)
    if pages_per_step is None:
        # Each step gathers pages_per_step pages for every item whether or not they are
        # live, so a step as wide as the table made short sequences in a wide table pay for
        # all of it (a 16-sequence decode over a 128-page table: 99 ms instead of 8 ms).
        page_bytes = 2 * num_kv_heads * page_size * head_dim * 4
        pages_per_step = max(1, min(pages_per_seq, _MAX_PAGES_PER_STEP,
                                    _STEP_BYTES // max(1, num_items * page_bytes)))
    items = _work_items(cu_q_lens, seq_lens, num_seqs, num_items=num_items, block_q=block_q)
    seq, rows, live, pos = items  # [items], [items, bq], [items, bq], [items, bq]

    num_steps_max = -(-pages_per_seq // pages_per_step)
    tables = jnp.pad(block_tables, ((0, 0), (0, num_steps_max * pages_per_step - pages_per_seq)))
    tables = tables[seq]  # [items, padded_pages]
    max_len = jnp.max(jnp.where(jnp.arange(max_num_seqs) < num_seqs[0], seq_lens, 0))
    span = pages_per_step * page_size
    num_steps = (max_len + span - 1) // span

    # [items, kvh, bq * group, d]: one matmul operand per item and KV head.
    qi = q[jnp.clip(rows, 0, num_tokens - 1)].astype(jnp.float32) * sm_scale
    qi = qi.reshape(num_items, block_q, num_kv_heads, group, head_dim)
    qi = qi.transpose(0, 2, 1, 3, 4).reshape(num_items, num_kv_heads, block_q * group, head_dim)
    row_pos = jnp.repeat(pos, group, axis=1)  # [items, bq * group], matching qi's row order
    row_live = jnp.repeat(live, group, axis=1)
    if is_quantized(kv_pages):
        layer_data = kv_pages.data[:, layer]  # [num_blocks, 2, num_kv_heads, page_size, head_dim]
        layer_scales = kv_pages.scales[:, layer]  # [num_blocks, 2, num_kv_heads, page_size | 1]

        def load(ids):
            return layer_data[ids].astype(jnp.float32) * layer_scales[ids][..., None]
    else:
        layer_pages = kv_pages[:, layer]  # [num_blocks, 2, num_kv_heads, page_size, head_dim]

        def load(ids):
            return layer_pages[ids].astype(jnp.float32)

    def step(carry):
        i, m, l, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(tables, i * pages_per_step, pages_per_step, axis=1)
        kv = load(ids)  # [items, pps, 2, kvh, page, d] float32
        kv = kv.transpose(0, 2, 3, 1, 4, 5).reshape(num_items, 2, num_kv_heads, span, head_dim)
        # float32 operands at full precision: by default TPUs round them to bfloat16 passes
        # and recent GPUs to TF32 (the Pallas kernels ask for the same)
        logits = jnp.einsum("nkrd,nksd->nkrs", qi, kv[:, 0], precision=jax.lax.Precision.HIGHEST)
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        k_pos = i * span + jnp.arange(span)  # [span]
        mask = k_pos[None, None, :] <= row_pos[:, :, None]  # [items, rows, span]
        if sliding_window is not None:
            mask &= k_pos[None, None, :] > (row_pos - sliding_window)[:, :, None]
        mask &= row_live[:, :, None]
        logits = jnp.where(mask[:, None], logits, -jnp.inf)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 there to avoid inf - inf.
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(logits - shift[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - shift, -jnp.inf))
        # Zero V past seq_len too: those slots may hold anything (NaN in uninitialised
        # memory), and 0 * NaN would still poison the sum.
        visible = (k_pos[None, :] < jnp.max(jnp.where(row_live, row_pos + 1, 0), axis=1)[:, None])
        v = jnp.where(visible[:, None, :, None], kv[:, 1], 0.0)
        l = l * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("nkrs,nksd->nkrd", p, v, precision=jax.lax.Precision.HIGHEST)
        return i + 1, m_new, l, acc

    rows_per_item = block_q * group
    init = (
        jnp.int32(0),
        jnp.full((num_items, num_kv_heads, rows_per_item), -jnp.inf, jnp.float32),
        jnp.zeros((num_items, num_kv_heads, rows_per_item), jnp.float32),
        jnp.zeros((num_items, num_kv_heads, rows_per_item, head_dim), jnp.float32),
    )
    _, _, l, acc = jax.lax.while_loop(lambda c: c[0] < num_steps, step, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [items, kvh, bq * group, d]
    out = out.reshape(num_items, num_kv_heads, block_q, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(num_items * block_q, num_q_heads, head_dim).astype(q.dtype)
    # Dead rows are sent past the end and dropped; padding tokens keep their zeros.
    dest = jnp.where(live, rows, num_tokens).reshape(-1)
    return jnp.zeros_like(q).at[dest].set(out, mode="drop")


def _work_items(cu_q_lens, seq_lens, num_seqs, *, num_items: int, block_q: int):
    """Splits each live sequence's query tokens into blocks of ``block_q``.

    Returns per item its sequence, and per item row its token index, liveness and position.
    """
    max_num_seqs = seq_lens.shape[0]
    seq_ids = jnp.arange(max_num_seqs)
    q_lens = jnp.where(seq_ids < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)
    per_seq = (q_lens + block_q - 1) // block_q  # items of each sequence
    first = jnp.cumsum(per_seq) - per_seq  # index of each sequence's first item
    item = jnp.arange(num_items)
    seq = jnp.clip(jnp.searchsorted(first + per_seq, item, side="right"), 0, max_num_seqs - 1)
    j = item - first[seq]  # item index within its sequence
    offset = j[:, None] * block_q + jnp.arange(block_q)[None, :]  # [items, bq]
    live = (item < jnp.sum(per_seq))[:, None] & (offset < q_lens[seq][:, None])
    rows = cu_q_lens[seq][:, None] + offset
    pos = seq_lens[seq][:, None] - q_lens[seq][:, None] + offset
    return seq, rows, live, pos
