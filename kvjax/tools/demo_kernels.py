"""The demo's optional first section: every kernel against its reference on small inputs.

``python -m kvjax demo --kernel-checks`` runs ragged paged attention (decode and chunked
prefill mixed, GQA) with every implementation this machine can run (Pallas ones in interpret
mode off their accelerator), an in-place KV write, and a bit-exact block gather + scatter.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels.example_inputs import make_case

__all__ = ["kernel_checks"]

# Largest |out - reference| a float32 attention kernel may show on these small inputs: the
# kernel tests' float32 tolerance (tests/paged_attention_cases.py).
_FLOAT32_ATOL = 2e-5


def kernel_checks(out) -> int:
    """Runs every check, prints a table to ``out``, returns the number that failed."""
    rows = _attention_checks() + _copy_checks()
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'kernel check'.ljust(width)}  result  detail", file=out)
    for name, ok, detail in rows:
        print(f"{name.ljust(width)}  {'ok' if ok else 'FAIL':6}  {detail}", file=out)
    return sum(not ok for _, ok, _ in rows)


def _attention_checks():
    rows = []
    # One batch: two prefill chunks (one on top of cached KV), three decodes, one empty seq.
    shapes = {"xla": (8, 32), "pallas_gpu": (16, 32), "pallas_tpu": (16, 128)}
    for impl, (page_size, head_dim) in shapes.items():
        case = make_case(0, q_lens=[page_size + 3, 5, 1, 1, 1, 0],
                         kv_lens=[page_size + 3, 2 * page_size + 1, 1, page_size, 40, 0],
                         page_size=page_size, head_dim=head_dim, num_q_heads=4, num_kv_heads=2)
        start = time.perf_counter()
        out = pallas_kernels.paged_attention(*case.args(), layer=case.layer, impl=impl)
        ref = pallas_kernels.paged_attention_reference(*case.args(), layer=case.layer)
        err = float(jnp.max(jnp.abs(out - ref)))
        ok = bool(jnp.isfinite(out).all()) and err <= _FLOAT32_ATOL
        mode = "" if impl == pallas_kernels.resolve_impl(None) else ", interpret mode"
        rows.append((f"paged attention [{impl}{mode}] vs reference", ok,
                     f"max |err| {err:.1e} over {int(case.cu_q_lens[-1])} ragged tokens, "
                     f"{time.perf_counter() - start:.2f}s"))
    return rows


def _copy_checks():
    rng = np.random.default_rng(1)
    shape = (8, 2, 2, 2, 8, 32)  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    pool = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    before = np.array(pool, copy=True)  # a view would pin the buffer and block donation
    k = jnp.asarray(rng.standard_normal((3, 2, 32)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, 2, 32)), jnp.float32)
    slots = jnp.array([5 * 8 + 7, 2 * 8, -1], jnp.int32)  # last slot of block 5, first of 2
    new_pool = pallas_kernels.write_kv(pool, k, v, slots, layer=1)
    expected = pallas_kernels.write_kv_reference(before, k, v, slots, layer=1)
    written = np.array_equal(np.asarray(new_pool), np.asarray(expected))
    rows = [("write_kv: exactly the addressed slots, in place", written and pool.is_deleted(),
             f"input buffer donated: {pool.is_deleted()}")]
    ids = jnp.array([6, 1, 3], jnp.int32)
    blocks = pallas_kernels.gather_blocks(new_pool, ids)
    snapshot = np.asarray(new_pool)
    zeroed = new_pool.at[ids].set(0.0)
    restored = pallas_kernels.scatter_blocks(zeroed, ids, blocks)
    exact = np.array_equal(np.asarray(restored), snapshot)
    rows.append(("gather_blocks + scatter_blocks round trip", exact,
                 f"{blocks.shape[0]} blocks of {blocks[0].nbytes} bytes, bit-exact: {exact}"))
    return rows
