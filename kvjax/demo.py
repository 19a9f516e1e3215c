"""``python -m kvjax demo``: a tour of the kernels and the prefix cache on a small pool.

It checks, and prints, that

1. ragged paged attention (decode + chunked prefill mixed, GQA, NaN in every unowned page)
   matches the float32 reference with every implementation this machine can run;
2. the KV write lands in place (the pool buffer is donated, not copied) and a block gather
   followed by a scatter is bit-exact;
3. the tiny Flax model on the page pool, serving requests that share a system prompt through
   :class:`kvjax.prefix_cache.PrefixCache`, produces the same greedy tokens as an uncached
   dense forward while prefilling only the tokens the cache did not hold.

Exits non-zero if any check fails.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from kvjax.model import BatchInputs, ModelConfig, Transformer
from kvjax.prefix_cache import PrefixCache
from pallas_kernels.testing import TOLERANCES, make_case

__all__ = ["run_demo"]


def run_demo(out=sys.stdout) -> int:
    """Runs every check, prints a table, returns the number of failed checks."""
    rows: list[tuple[str, bool, str]] = []
    print(f"kvjax demo on {jax.default_backend()} "
          f"(default impl: {pallas_kernels.resolve_impl(None)})", file=out)
    rows += _attention_checks()
    rows += _copy_checks()
    rows += _cache_checks()
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'check'.ljust(width)}  result  detail", file=out)
    for name, ok, detail in rows:
        print(f"{name.ljust(width)}  {'ok' if ok else 'FAIL':6}  {detail}", file=out)
    failed = sum(not ok for _, ok, _ in rows)
    print(f"\n{len(rows) - failed} passed, {failed} failed", file=out)
    return failed


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
        ok = bool(jnp.isfinite(out).all()) and err <= TOLERANCES[jnp.dtype(jnp.float32)]["atol"]
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


def _cache_checks():
    cfg = ModelConfig(num_layers=2, d_model=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
                      mlp_dim=128)
    model, page_size, num_blocks = Transformer(cfg), 8, 32
    cache = PrefixCache(num_blocks, page_size, vocab_size=cfg.vocab_size)
    pool = jnp.zeros((num_blocks, cfg.num_layers, 2, cfg.num_kv_heads, page_size, cfg.head_dim))
    rng = np.random.default_rng(2)
    system = rng.integers(0, 256, 3 * page_size + 2)
    prompts = [np.concatenate([system, rng.integers(0, 256, n)]).astype(np.int32)
               for n in (5, 9, 12, 3)]
    same, computed, total, hit = True, 0, 0, 0
    for prompt in prompts:
        handle = cache.admit(prompt, "demo-tenant")
        tokens, pool, n_computed = _greedy(model, pool, handle, prompt, cache, page_size, steps=4)
        cache.release(handle)
        uncached = _greedy_dense(model, prompt, steps=4)
        same &= tokens == uncached
        computed += n_computed
        total += len(prompt)
        hit += handle.num_hit_tokens
    cache.check_invariants()
    return [
        ("tiny model: cached greedy tokens == uncached", same,
         f"{len(prompts)} requests sharing a {len(system)}-token system prompt"),
        ("prefix cache: prefill tokens computed", computed < total,
         f"{computed} of {total} prompt tokens ({hit} served from cached pages)"),
    ]


_BUCKET = 32


@nnx.jit
def _paged_step(model, batch, pool):
    return model(batch, pool)


@nnx.jit
def _dense_step(model, tokens):
    return model.forward_dense(tokens)


def _greedy(model, pool, handle, prompt, cache, page_size, steps):
    """Prefill what the cache lacks (in chunks of _BUCKET), then greedy-decode ``steps``."""
    seq = list(prompt)
    start, computed, generated = handle.num_hit_tokens, 0, []
    while len(generated) < steps:
        end = min(len(seq), start + _BUCKET)
        logits, pool = _paged_step(model, _batch(seq, start, end, handle.block_table,
                                                 page_size), pool)
        computed += end - start if start < len(prompt) else 0
        if end == len(seq):
            generated.append(int(jnp.argmax(logits[end - start - 1])))
            seq.append(generated[-1])
            cache.commit(handle, seq[:end])
            if not cache.extend(handle, 1):
                raise RuntimeError("demo pool too small")
        start = end
    return generated, pool, computed


def _greedy_dense(model, prompt, steps):
    seq = list(prompt)
    padded_len = 64  # causal: trailing padding cannot change earlier logits; one compile
    assert len(prompt) + steps <= padded_len
    for _ in range(steps):
        padded = np.zeros(padded_len, np.int32)
        padded[: len(seq)] = seq
        logits = _dense_step(model, jnp.asarray(padded))
        seq.append(int(jnp.argmax(logits[len(seq) - 1])))
    return seq[len(prompt):]


def _batch(seq, start, end, block_table, page_size):
    n = end - start
    pad = lambda values, fill: np.array(list(values) + [fill] * (_BUCKET - n), np.int32)
    positions = range(start, end)
    table = np.zeros((1, 16), np.int32)
    table[0, : len(block_table)] = block_table
    return BatchInputs(
        tokens=jnp.asarray(pad(seq[start:end], 0)),
        positions=jnp.asarray(pad(positions, 0)),
        slot_mapping=jnp.asarray(pad((block_table[p // page_size] * page_size + p % page_size
                                      for p in positions), -1)),
        block_tables=jnp.asarray(table), seq_lens=jnp.array([end], jnp.int32),
        cu_q_lens=jnp.array([0, n], jnp.int32), num_seqs=jnp.array([1], jnp.int32))


def add_subcommand(subparsers) -> None:
    """Registers ``python -m kvjax demo``."""
    parser = subparsers.add_parser("demo", help="tour of the kernels and the cache on a small pool")
    parser.set_defaults(func=lambda args: 1 if run_demo() else 0)
