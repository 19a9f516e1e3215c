"""Ragged paged attention over the kvjax page pool: one call for decode and chunked prefill.

The batch is ragged: sequence ``s`` contributes ``cu_q_lens[s+1] - cu_q_lens[s]`` query tokens
(1 for decode, many for a prefill chunk), causal with respect to their positions in the
sequence. GQA (``num_q_heads`` a multiple of ``num_kv_heads``), float32 / bfloat16 / float16,
an optional sliding window and an optional logit soft-cap. See :mod:`pallas_kernels.reference`
for the exact semantics and :mod:`kvjax.tiers.page_pool` for the pool layout.

>>> import jax.numpy as jnp, numpy as np
>>> from pallas_kernels import paged_attention
>>> kv_pages = jnp.ones((4, 1, 2, 1, 8, 16), jnp.float32)  # 4 blocks of 8 tokens, 1 layer
>>> q = jnp.ones((3, 2, 16), jnp.float32)  # 3 tokens: a 2-token prefill chunk + 1 decode
>>> out = paged_attention(q, kv_pages, block_tables=jnp.array([[0, 1], [2, 3]], jnp.int32),
...                       seq_lens=jnp.array([2, 9], jnp.int32),
...                       cu_q_lens=jnp.array([0, 2, 3], jnp.int32), layer=0)
>>> out.shape
(3, 2, 16)
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels.dispatch import select
from pallas_kernels.validation import check_paged_attention_args

__all__ = ["paged_attention"]


def paged_attention(
    q,  # [num_tokens, num_q_heads, head_dim]
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    block_tables,  # i32[max_num_seqs, pages_per_seq]
    seq_lens,  # i32[max_num_seqs], KV length including this step's tokens
    cu_q_lens,  # i32[max_num_seqs + 1], query_start_loc
    num_seqs=None,  # i32[1], live sequences; None = all rows of block_tables
    *,
    layer: int,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    impl: str | None = None,
    interpret: bool | None = None,
    **tuning,
):
    """Attention of ragged query tokens over their sequences' pages in one layer of the pool.

    Returns ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``; padding rows (past
    ``cu_q_lens[num_seqs]``) are zero. ``sm_scale`` defaults to ``1/sqrt(head_dim)``.
    ``impl`` picks the implementation (see :mod:`pallas_kernels.dispatch`); ``tuning`` passes
    implementation-specific block sizes through.
    """
    check_paged_attention_args(
        q, kv_pages, block_tables, seq_lens, cu_q_lens, num_seqs, layer=layer,
        sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=sm_scale)
    if num_seqs is None:  # after the checks: they name a block_tables that is not an array
        num_seqs = jnp.array([block_tables.shape[0]], jnp.int32)
    attend = select("paged_attention", impl, interpret, tuning)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    return attend(q, kv_pages, block_tables, seq_lens, cu_q_lens, num_seqs, layer=int(layer),
                  sm_scale=scale, sliding_window=None if sliding_window is None else int(sliding_window),
                  soft_cap=None if soft_cap is None else float(soft_cap), **tuning)
