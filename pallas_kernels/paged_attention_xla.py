"""Ragged paged attention in plain jnp, lowered by XLA: the fast path on CPU.

Every query token walks the pages of its own sequence in steps of ``pages_per_step`` pages,
keeping a float32 online softmax (running max, denominator and accumulator). The loop runs
only as many steps as the longest sequence in the batch needs (a ``while_loop`` with a
traced bound), so a decode batch of short sequences does not pay for the table's width.
Gathering pages per token costs as many bytes as the attention math itself touches
(``num_kv_heads / num_q_heads`` of it), so it does not change the asymptotics.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["paged_attention_xla"]

# Upper bound on the gathered K/V per loop step, in bytes, to keep CPU working sets bounded.
_STEP_BYTES = 32 * 1024 * 1024


@functools.partial(
    jax.jit, static_argnames=("layer", "sm_scale", "sliding_window", "soft_cap", "pages_per_step"))
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
):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_pages.shape[3], kv_pages.shape[4]
    group = num_q_heads // num_kv_heads
    pages_per_seq = block_tables.shape[1]
    if pages_per_step is None:
        page_bytes = 2 * num_kv_heads * page_size * head_dim * 4
        pages_per_step = max(1, min(pages_per_seq, _STEP_BYTES // max(1, num_tokens * page_bytes)))
    num_steps_max = -(-pages_per_seq // pages_per_step)
    padded_tables = jnp.pad(
        block_tables, ((0, 0), (0, num_steps_max * pages_per_step - pages_per_seq)))

    # Per token: its sequence, its position, whether it is a real token.
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right") - 1, 0, block_tables.shape[0] - 1)
    live = tok < cu_q_lens[num_seqs[0]]
    kv_len = jnp.where(live, seq_lens[seq], 0)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_len - q_len + (tok - cu_q_lens[seq])  # [num_tokens]
    tables = padded_tables[seq]  # [num_tokens, padded_pages]
    max_len = jnp.max(jnp.where(jnp.arange(seq_lens.shape[0]) < num_seqs[0], seq_lens, 0))
    num_steps = (max_len + pages_per_step * page_size - 1) // (pages_per_step * page_size)

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    layer_pages = kv_pages[:, layer]  # [num_blocks, 2, num_kv_heads, page_size, head_dim]
    span = pages_per_step * page_size

    def step(carry):
        i, m, l, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(tables, i * pages_per_step, pages_per_step, axis=1)
        kv = layer_pages[ids].astype(jnp.float32)  # [tokens, pps, 2, kvh, page, d]
        kv = kv.transpose(0, 2, 3, 1, 4, 5).reshape(num_tokens, 2, num_kv_heads, span, head_dim)
        logits = jnp.einsum("tkgd,tksd->tkgs", qg, kv[:, 0])
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        k_pos = i * span + jnp.arange(span)  # [span]
        mask = k_pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > (pos - sliding_window)[:, None]
        mask &= live[:, None]
        logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 there to avoid inf - inf.
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(logits - shift[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - shift, -jnp.inf))
        l = l * alpha + p.sum(axis=-1)
        # Zero V where masked too: slots past seq_len may hold anything (NaN in uninitialised
        # memory), and 0 * NaN would still poison the sum.
        v = jnp.where(mask[:, None, :, None], kv[:, 1], 0.0)
        acc = acc * alpha[..., None] + jnp.einsum("tkgs,tksd->tkgd", p, v)
        return i + 1, m_new, l, acc

    init = (
        jnp.int32(0),
        jnp.full((num_tokens, num_kv_heads, group), -jnp.inf, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, _, l, acc = jax.lax.while_loop(lambda c: c[0] < num_steps, step, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
