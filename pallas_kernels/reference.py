"""Plain array-math references for every kernel, accumulating in float32.

These are written for obviousness, not speed: they loop over sequences in Python on concrete
metadata and are not jittable. They use numpy's float32 arithmetic (the jnp API, eagerly):
eager jnp would compile a tiny program for every ragged shape, which made a test grid spend
seconds per case compiling the reference. Tests compare every implementation against them.

Pool layout (see :mod:`kvjax.tiers.page_pool` for why)::

    kv_pages  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]; [:, :, 0] is K

A quantized pool (:class:`~pallas_kernels.kv_format.QuantizedPages`) is dequantized to
float32 first: the references define what the quantized kernels compute, and tests compare
them against the float pool they came from for the quantization error itself.

Ragged batch convention shared by all paged-attention implementations:

* ``q``          ``[num_tokens, num_q_heads, head_dim]``; tokens of sequence ``s`` are rows
  ``cu_q_lens[s]:cu_q_lens[s + 1]``; rows past ``cu_q_lens[num_seqs]`` are padding.
* ``seq_lens``   ``i32[max_num_seqs]``: KV length of each sequence *including* this step's
  tokens (their K/V are written into the pages before attention runs).
* query token ``i`` of sequence ``s`` sits at position ``seq_lens[s] - q_len + i`` and attends
  to KV positions ``j <= pos`` (and ``j > pos - sliding_window`` when a window is given).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_format import QuantizedPages, dequantize, encode, is_quantized

__all__ = [
    "paged_attention_reference",
    "write_kv_reference",
    "gather_blocks_reference",
    "scatter_blocks_reference",
]


def paged_attention_reference(
    q,  # [num_tokens, num_q_heads, head_dim]
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    block_tables,  # i32[max_num_seqs, pages_per_seq]
    seq_lens,  # i32[max_num_seqs]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs=None,  # int or i32[1]; defaults to max_num_seqs
    *,
    layer: int,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
):
    """Ragged paged attention, one sequence at a time. Output rows of padding tokens are 0."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_pages.shape[3], kv_pages.shape[4]
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    tables = np.asarray(block_tables)
    lens = np.asarray(seq_lens)
    cu = np.asarray(cu_q_lens)
    n = len(lens) if num_seqs is None else int(np.asarray(num_seqs).reshape(-1)[0])

    q32 = np.asarray(q).astype(np.float32)
    pool = _float_pool(kv_pages)
    out = np.zeros((num_tokens, num_q_heads, head_dim), np.float32)
    for s in range(n):
        q_start, q_end, kv_len = int(cu[s]), int(cu[s + 1]), int(lens[s])
        q_len = q_end - q_start
        if q_len == 0:
            continue
        pages = tables[s, : -(-kv_len // page_size)]
        kv = pool[pages, layer].astype(np.float32)  # [n_pages, 2, kvh, page, d]
        kv = kv.transpose(1, 2, 0, 3, 4).reshape(2, num_kv_heads, -1, head_dim)[:, :, :kv_len]
        k = np.repeat(kv[0], group, axis=0)  # [num_q_heads, kv_len, head_dim]
        v = np.repeat(kv[1], group, axis=0)
        qs = q32[q_start:q_end].transpose(1, 0, 2)  # [num_q_heads, q_len, head_dim]
        logits = np.einsum("hqd,hkd->hqk", qs, k) * np.float32(scale)
        if soft_cap is not None:
            logits = np.float32(soft_cap) * np.tanh(logits / np.float32(soft_cap))
        q_pos = kv_len - q_len + np.arange(q_len)[:, None]
        k_pos = np.arange(kv_len)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        logits = np.where(mask[None], logits, -np.inf)
        # a row that sees no key (more new tokens than KV) is 0, as in every kernel, not NaN
        peak = np.where(mask.any(axis=-1)[None, :, None], logits.max(axis=-1, keepdims=True), 0.0)
        probs = np.exp(logits - peak)
        probs = probs / np.maximum(probs.sum(axis=-1, keepdims=True), np.finfo(np.float32).tiny)
        out[q_start:q_end] = np.einsum("hqk,hkd->hqd", probs, v).transpose(1, 0, 2)
    return jnp.asarray(out).astype(q.dtype)


def write_kv_reference(
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    k,  # [num_tokens, num_kv_heads, head_dim]
    v,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping,  # i32[num_tokens]; block_id * page_size + offset, negative = skip
    *,
    layer: int,
):
    """Returns a new pool with token ``t``'s K/V stored at slot ``slot_mapping[t]`` of ``layer``.

    A quantized pool gets each token quantized (see :func:`_write_quantized` for the rules).
    """
    if is_quantized(kv_pages):
        return _write_quantized(kv_pages, k, v, slot_mapping, layer=layer)
    pages = np.array(kv_pages)
    page_size = pages.shape[4]
    k_np, v_np = np.asarray(k).astype(pages.dtype), np.asarray(v).astype(pages.dtype)
    for t, slot in enumerate(np.asarray(slot_mapping)):
        if not 0 <= slot < pages.shape[0] * page_size:  # padding, or past the pool: dropped (copy_common.in_pool)
            continue
        block, offset = divmod(int(slot), page_size)
        pages[block, layer, 0, :, offset] = k_np[t]
        pages[block, layer, 1, :, offset] = v_np[t]
    return jnp.asarray(pages)


def _float_pool(kv_pages) -> np.ndarray:
    if is_quantized(kv_pages):
        return dequantize(np.asarray(kv_pages.data), np.asarray(kv_pages.scales))
    return np.asarray(kv_pages)


def _write_quantized(kv_pages, k, v, slot_mapping, *, layer: int):
    """Quantizing write, page by page.

    Per-token scales: each token's K (and V) row of each KV head gets its own scale.
    Per-page scales: for every page this call writes, the new scale (per K/V and head) is the
    larger of the page's old scale and what the new tokens need; the page's other slots are
    requantized with it; a page whose first written offset is 0 starts afresh (old scale
    treated as 0, other slots left as they were, they are past the sequence's end).
    """
    fmt = kv_pages.format
    data = np.array(kv_pages.data)
    scales = np.array(kv_pages.scales)
    page_size = data.shape[4]
    kv = np.stack([np.asarray(k, np.float32), np.asarray(v, np.float32)], axis=1)  # [T,2,h,d]
    slots = np.asarray(slot_mapping)
    by_block: dict[int, list[tuple[int, int]]] = {}
    for t, slot in enumerate(slots):
        if 0 <= slot < data.shape[0] * page_size:
            block, offset = divmod(int(slot), page_size)
            by_block.setdefault(block, []).append((t, offset))
    qmax = np.float32(fmt.qmax)
    for block, items in by_block.items():
        toks = [t for t, _ in items]
        offs = [o for _, o in items]
        rows = kv[toks]  # [n, 2, h, d]
        if fmt.granularity == "token":
            s = np.max(np.abs(rows), axis=-1) / qmax  # [n, 2, h]
            for i, o in enumerate(offs):
                scales[block, layer, :, :, o] = s[i]
                data[block, layer, :, :, o] = encode(rows[i], s[i][..., None], fmt)
            continue
        fresh = min(offs) == 0
        old = np.zeros_like(scales[block, layer, :, :, 0]) if fresh else scales[block, layer, :, :, 0]
        new = np.maximum(old, np.max(np.abs(rows), axis=(0, 3)) / qmax)  # [2, h]
        if not fresh:
            page = dequantize(data[block, layer], old[..., None])  # [2, h, page, d]
            data[block, layer] = encode(page, new[..., None, None], fmt)
        for i, o in enumerate(offs):
            data[block, layer, :, :, o] = encode(rows[i], new[..., None], fmt)
        scales[block, layer, :, :, 0] = new
    return QuantizedPages(jnp.asarray(data), jnp.asarray(scales))


def gather_blocks_reference(kv_pages, block_ids):
    """``[n, num_layers, 2, num_kv_heads, page_size, head_dim]``; rows of negative ids are 0.

    A quantized pool gives :class:`QuantizedPages` blocks (scale rows of padding ids are 0)."""
    if is_quantized(kv_pages):
        return jax.tree.map(lambda leaf: gather_blocks_reference(leaf, block_ids), kv_pages)
    pages = np.asarray(kv_pages)
    ids = np.asarray(block_ids)
    out = np.zeros((len(ids),) + pages.shape[1:], pages.dtype)
    for i, block in enumerate(ids):
        if 0 <= block < pages.shape[0]:  # padding or past the pool: a zero row
            out[i] = pages[block]
    return jnp.asarray(out)


def scatter_blocks_reference(kv_pages, block_ids, blocks):
    """Returns a new pool with ``blocks[i]`` stored in block ``block_ids[i]`` (negative: skip)."""
    if is_quantized(kv_pages):
        return jax.tree.map(lambda leaf, src: scatter_blocks_reference(leaf, block_ids, src),
                            kv_pages, blocks)
    pages = np.array(kv_pages)
    src = np.asarray(blocks)
    for i, block in enumerate(np.asarray(block_ids)):
        if 0 <= block < pages.shape[0]:  # padding or past the pool: skipped
            pages[block] = src[i]
    return jnp.asarray(pages)
