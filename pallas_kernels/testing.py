"""Builds ragged paged-attention cases that make stray reads visible.

Shared by the tests of every implementation and by ``python -m kvjax demo``. A case has:

* page ids drawn from a shuffled pool, so no implementation can assume contiguous pages;
* every page no live sequence owns filled with NaN, and so are the slots past ``seq_len`` in
  a sequence's last page: reading either turns the output into NaN;
* unused block-table entries (past a sequence's last page, and whole padding rows) pointing at
  a NaN page rather than 0, for the same reason;
* padding query rows and padding sequences past ``num_seqs``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

__all__ = ["Case", "make_case", "assert_matches_reference", "GRID", "TOLERANCES", "DECODE",
           "PREFILL_EDGES"]

# Absolute/relative tolerance per dtype against the float32 reference.
TOLERANCES = {
    jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5),
    jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
    jnp.dtype(jnp.float16): dict(atol=2e-3, rtol=2e-3),
}


@dataclasses.dataclass
class Case:
    q: jnp.ndarray  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jnp.ndarray  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    block_tables: jnp.ndarray  # i32[max_num_seqs, pages_per_seq]
    seq_lens: jnp.ndarray  # i32[max_num_seqs]
    cu_q_lens: jnp.ndarray  # i32[max_num_seqs + 1]
    num_seqs: jnp.ndarray  # i32[1]
    layer: int

    def args(self):
        return (self.q, self.kv_pages, self.block_tables, self.seq_lens, self.cu_q_lens,
                self.num_seqs)


def make_case(
    seed: int,
    *,
    q_lens,
    kv_lens,
    dtype=jnp.float32,
    page_size: int = 8,
    head_dim: int = 32,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    num_layers: int = 2,
    layer: int = 1,
    pages_per_seq: int | None = None,
    pad_seqs: int = 1,
    pad_tokens: int = 3,
    spare_pages: int = 2,
) -> Case:
    """One ragged batch: sequence ``s`` has ``q_lens[s]`` new tokens and ``kv_lens[s]`` KV."""
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    assert (q_lens <= kv_lens).all()
    pages_needed = -(-kv_lens // page_size)
    if pages_per_seq is None:
        pages_per_seq = max(1, int(pages_needed.max(initial=0)) + 1)
    num_blocks = int(pages_needed.sum()) + spare_pages + 1
    perm = rng.permutation(num_blocks)
    nan_page = int(perm[-1])  # never owned by a sequence

    shape = (num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim)
    pages = np.full(shape, np.nan, np.float32)
    max_num_seqs = len(q_lens) + pad_seqs
    tables = np.full((max_num_seqs, pages_per_seq), nan_page, np.int32)
    cursor = 0
    for s, (n_pages, kv_len) in enumerate(zip(pages_needed, kv_lens)):
        ids = perm[cursor:cursor + n_pages]
        cursor += n_pages
        tables[s, :n_pages] = ids
        for j, block in enumerate(ids):
            filled = min(page_size, kv_len - j * page_size)
            pages[block, :, :, :, :filled] = rng.standard_normal(
                (num_layers, 2, num_kv_heads, filled, head_dim))
    seq_lens = np.zeros(max_num_seqs, np.int32)
    seq_lens[: len(kv_lens)] = kv_lens
    cu = np.zeros(max_num_seqs + 1, np.int32)
    cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1 :] = cu[len(q_lens)]
    num_tokens = int(cu[-1]) + pad_tokens
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    return Case(
        q=jnp.asarray(q, dtype),
        kv_pages=jnp.asarray(pages, dtype),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(seq_lens),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.array([len(q_lens)], jnp.int32),
        layer=layer,
    )


def DECODE(page_size: int):
    """Decode lengths around page boundaries, including an empty sequence."""
    kv = [1, page_size - 1, page_size, page_size + 1, 3 * page_size + 2]
    return [1] * len(kv) + [0], kv + [0]


def PREFILL_EDGES(page_size: int):
    """A ragged mix: full prefill, a chunk on top of cached KV, decodes, an empty sequence."""
    q_lens = [page_size + 1, 5, 1, 0, 1, page_size]
    kv_lens = [page_size + 1, 2 * page_size + 3, page_size, 0, 1, 4 * page_size]
    return q_lens, kv_lens


def assert_matches_reference(case: Case, out, **attn_kwargs) -> None:
    """Compares ``out`` with the float32 reference; padding rows must be exactly 0."""
    from pallas_kernels import paged_attention_reference

    ref = paged_attention_reference(*case.args(), layer=case.layer, **attn_kwargs)
    out32 = np.asarray(jnp.asarray(out, jnp.float32))
    ref32 = np.asarray(jnp.asarray(ref, jnp.float32))
    assert out.shape == ref.shape and out.dtype == case.q.dtype
    assert np.isfinite(out32).all(), "NaN/inf in output: a stray read of an unused page or slot"
    live = int(np.asarray(case.cu_q_lens)[int(case.num_seqs[0])])
    np.testing.assert_array_equal(out32[live:], 0.0)
    np.testing.assert_allclose(out32, ref32, **TOLERANCES[jnp.dtype(case.q.dtype)])


# The grid every implementation runs: (dtype, page_size, head_dim, num_q_heads, num_kv_heads).
GRID = [
    (jnp.float32, 8, 32, 4, 2),
    (jnp.float32, 16, 64, 8, 1),
    (jnp.float32, 8, 128, 2, 2),
    (jnp.bfloat16, 16, 64, 4, 2),
    (jnp.bfloat16, 8, 128, 8, 2),
]
