"""Plain array-math references for every kernel, accumulating in float32.

These are written for obviousness, not speed: they loop over sequences in Python on concrete
metadata and are not jittable. They use numpy's float32 arithmetic (the jnp API, eagerly):
eager jnp would compile a tiny program for every ragged shape, which made a test grid spend
seconds per case compiling the reference. Tests compare every implementation against them.

Pool layout (see :mod:`kvjax.page_pool` for why)::

    kv_pages  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]; [:, :, 0] is K

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

import jax.numpy as jnp
import numpy as np

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
    pool = np.asarray(kv_pages)
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
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = probs / probs.sum(axis=-1, keepdims=True)
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
    """Returns a new pool with token ``t``'s K/V stored at slot ``slot_mapping[t]`` of ``layer``."""
    pages = np.array(kv_pages)
    page_size = pages.shape[4]
    k_np, v_np = np.asarray(k).astype(pages.dtype), np.asarray(v).astype(pages.dtype)
    for t, slot in enumerate(np.asarray(slot_mapping)):
        if slot < 0:
            continue
        block, offset = divmod(int(slot), page_size)
        pages[block, layer, 0, :, offset] = k_np[t]
        pages[block, layer, 1, :, offset] = v_np[t]
    return jnp.asarray(pages)


def gather_blocks_reference(kv_pages, block_ids):
    """``[n, num_layers, 2, num_kv_heads, page_size, head_dim]``; rows of negative ids are 0."""
    pages = np.asarray(kv_pages)
    ids = np.asarray(block_ids)
    out = np.zeros((len(ids),) + pages.shape[1:], pages.dtype)
    for i, block in enumerate(ids):
        if block >= 0:
            out[i] = pages[block]
    return jnp.asarray(out)


def scatter_blocks_reference(kv_pages, block_ids, blocks):
    """Returns a new pool with ``blocks[i]`` stored in block ``block_ids[i]`` (negative: skip)."""
    pages = np.array(kv_pages)
    src = np.asarray(blocks)
    for i, block in enumerate(np.asarray(block_ids)):
        if block >= 0:
            pages[block] = src[i]
    return jnp.asarray(pages)
