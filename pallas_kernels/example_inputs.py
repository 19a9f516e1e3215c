"""Example inputs for ragged paged attention, built so that a stray read is visible.

The kernel tests, ``python -m kvjax demo --kernel-checks`` and ``benchmarks/bench_kv_quant.py``
check a kernel against :func:`pallas_kernels.paged_attention_reference` on these inputs. A
:class:`Case` from :func:`make_case` has:

* page ids drawn from a shuffled pool, so no implementation can assume contiguous pages;
* every page no live sequence owns filled with NaN, and so are the slots past ``seq_len`` in
  a sequence's last page: reading either turns the output into NaN;
* unused block-table entries (past a sequence's last page, and whole padding rows) pointing at
  a NaN page rather than 0, for the same reason;
* padding query rows and padding sequences past ``num_seqs``.

:func:`quantize_case` turns its pool into a quantized one with the same property.

>>> from pallas_kernels import paged_attention
>>> case = make_case(0, q_lens=[3, 1], kv_lens=[3, 10])  # a prefill and a decode
>>> out = paged_attention(*case.args(), layer=case.layer)
>>> out.shape, bool(jnp.isfinite(out).all())
((7, 4, 32), True)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_format import KVFormat, QuantizedPages, quantize

__all__ = ["Case", "make_case", "quantize_case"]


@dataclasses.dataclass
class Case:
    """One ragged batch for :func:`pallas_kernels.paged_attention`; ``args()`` in call order."""

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
    if q_lens.shape != kv_lens.shape or (q_lens > kv_lens).any():
        raise ValueError(f"q_lens={q_lens.tolist()} must not exceed kv_lens={kv_lens.tolist()}, "
                         "sequence by sequence")
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


def quantize_case(case: Case, fmt: KVFormat) -> Case:
    """``case`` with its pool quantized to ``fmt``, stray reads still visible.

    Scales of everything the float pool held as NaN (unowned pages, slots past ``seq_len``)
    are NaN, so reading them poisons the output as before. With per-page scales a partly
    filled page has a finite scale; its unused slots get NaN data in the fp8 formats and the
    format's largest value in int8 (no NaN there), which a stray read turns into a large error.
    """
    pages = np.asarray(jnp.asarray(case.kv_pages, jnp.float32))
    nan = np.isnan(pages)
    data, scales = quantize(np.nan_to_num(pages), fmt)
    if fmt.granularity == "token":
        scales = np.where(nan.any(axis=-1), np.float32(np.nan), scales)
    else:
        scales = np.where(nan.all(axis=(-1, -2))[..., None], np.float32(np.nan), scales)
        poison = np.nan if fmt.quant != "int8" else fmt.qmax
        data = np.where(nan, np.asarray(poison, np.float32).astype(data.dtype), data)
    pool = QuantizedPages(jnp.asarray(data), jnp.asarray(scales, jnp.float32))
    return dataclasses.replace(case, kv_pages=pool)
