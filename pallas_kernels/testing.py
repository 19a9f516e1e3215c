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

from pallas_kernels.kv_format import KVFormat, QuantizedPages, quantize

__all__ = ["Case", "make_case", "assert_matches_reference", "GRID", "TOLERANCES", "DECODE",
           "PREFILL_EDGES", "quantize_case", "assert_quantized_matches", "QUANT_ERROR_BOUNDS",
           "QUANT_FORMATS"]

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


# Every quantized format and granularity.
QUANT_FORMATS = [KVFormat(q, g) for q in ("int8", "fp8_e4m3", "fp8_e5m2") for g in ("token", "page")]

# Bound on ||out_quantized - out_float|| / ||out_float|| for attention over standard-normal K/V
# (the float reference of the unquantized pool against the quantized kernel). Set from the
# formats' precision, with room: int8 keeps ~8 bits, e4m3 3 mantissa bits, e5m2 2. Measured
# on the test grid: about 0.6% / 2.8% / 5.6% (benchmarks/bench_kv_quant.py prints them).
QUANT_ERROR_BOUNDS = {"int8": 0.02, "fp8_e4m3": 0.06, "fp8_e5m2": 0.12}


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


def assert_quantized_matches(float_case: Case, quant_case: Case, out, **attn_kwargs) -> float:
    """Checks a quantized kernel's ``out`` two ways and returns its relative error.

    * against the reference on the dequantized pool, at the float32 tolerance (the kernel
      computes exactly what the format stores);
    * against the reference on the original float pool, within the format's
      :data:`QUANT_ERROR_BOUNDS` (the quantization error is what the format promises).
    """
    from pallas_kernels import paged_attention_reference
    from pallas_kernels.kv_format import relative_error

    assert_matches_reference(quant_case, out, **attn_kwargs)
    exact = paged_attention_reference(*float_case.args(), layer=float_case.layer, **attn_kwargs)
    live = int(np.asarray(float_case.cu_q_lens)[int(float_case.num_seqs[0])])
    err = relative_error(out[:live], exact[:live])
    bound = QUANT_ERROR_BOUNDS[quant_case.kv_pages.format.quant]
    assert err <= bound, f"relative error {err:.4f} > {bound} for {quant_case.kv_pages.format}"
    return err
