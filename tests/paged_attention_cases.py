"""The kernel tests' harness: tolerances, parameter grids, length patterns and the checks
against the float32 reference.

The inputs themselves come from :mod:`pallas_kernels.example_inputs` (shuffled pages, NaN in
everything no sequence owns), which the demo and the benchmarks use too.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels import paged_attention_reference
from pallas_kernels.example_inputs import Case
from pallas_kernels.kv_format import relative_error

__all__ = ["TOLERANCES", "GRID", "DECODE", "PREFILL_EDGES", "QUANT_ERROR_BOUNDS",
           "assert_matches_reference", "assert_quantized_matches"]

# Absolute/relative tolerance per dtype against the float32 reference.
TOLERANCES = {
    jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5),
    jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
    jnp.dtype(jnp.float16): dict(atol=2e-3, rtol=2e-3),
}

# Bound on ||out_quantized - out_float|| / ||out_float|| for attention over standard-normal K/V
# (the float reference of the unquantized pool against the quantized kernel). Set from the
# formats' precision, with room: int8 keeps ~8 bits, e4m3 3 mantissa bits, e5m2 2. Measured
# on the test grid: about 0.6% / 2.8% / 5.6% (benchmarks/bench_kv_quant.py prints them).
QUANT_ERROR_BOUNDS = {"int8": 0.02, "fp8_e4m3": 0.06, "fp8_e5m2": 0.12}

# The grid every implementation runs: (dtype, page_size, head_dim, num_q_heads, num_kv_heads).
GRID = [
    (jnp.float32, 8, 32, 4, 2),
    (jnp.float32, 16, 64, 8, 1),
    (jnp.float32, 8, 128, 2, 2),
    (jnp.bfloat16, 16, 64, 4, 2),
    (jnp.bfloat16, 8, 128, 8, 2),
]


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
    ref = paged_attention_reference(*case.args(), layer=case.layer, **attn_kwargs)
    out32 = np.asarray(jnp.asarray(out, jnp.float32))
    ref32 = np.asarray(jnp.asarray(ref, jnp.float32))
    assert out.shape == ref.shape and out.dtype == case.q.dtype
    assert np.isfinite(out32).all(), "NaN/inf in output: a stray read of an unused page or slot"
    live = int(np.asarray(case.cu_q_lens)[int(case.num_seqs[0])])
    np.testing.assert_array_equal(out32[live:], 0.0)
    np.testing.assert_allclose(out32, ref32, **TOLERANCES[jnp.dtype(case.q.dtype)])


def assert_quantized_matches(float_case: Case, quant_case: Case, out, **attn_kwargs) -> float:
    """Checks a quantized kernel's ``out`` two ways and returns its relative error.

    * against the reference on the dequantized pool, at the float32 tolerance (the kernel
      computes exactly what the format stores);
    * against the reference on the original float pool, within the format's
      :data:`QUANT_ERROR_BOUNDS` (the quantization error is what the format promises).
    """
    assert_matches_reference(quant_case, out, **attn_kwargs)
    exact = paged_attention_reference(*float_case.args(), layer=float_case.layer, **attn_kwargs)
    live = int(np.asarray(float_case.cu_q_lens)[int(float_case.num_seqs[0])])
    err = relative_error(out[:live], exact[:live])
    bound = QUANT_ERROR_BOUNDS[quant_case.kv_pages.format.quant]
    assert err <= bound, f"relative error {err:.4f} > {bound} for {quant_case.kv_pages.format}"
    return err
