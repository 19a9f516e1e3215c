"""The TPU (Mosaic) kernels exported for TPU on a machine that has none.

``jax.export`` runs the real Pallas -> Mosaic lowering (block-shape rules, supported
primitives, SMEM / VMEM / HBM memory spaces, DMAs and semaphores, scalar prefetch) and
serializes the Mosaic module into one ``tpu_custom_call``, the artifact a TPU deployment
ships. What it cannot check: Mosaic's vector-layout passes and the final compile, which run
inside the TPU compiler on the chip (for the quantized kernels: the unaligned lane
concatenation of per-token scales and the float8 -> float32 conversions, which TPU
generations without fp8 support may reject there).
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import backend, gather_blocks, scatter_blocks, write_kv
from pallas_kernels.block_copy_pallas import gather_blocks_tpu, scatter_blocks_tpu
from pallas_kernels.kv_format import KVFormat, QuantizedPages
from pallas_kernels.kv_write_pallas import write_kv_tpu
from pallas_kernels.paged_attention_tpu import paged_attention_tpu

_S = jax.ShapeDtypeStruct
_I32 = jnp.int32


def _export_for_tpu(fn, *args, kernels: int = 1):
    """Exports ``fn(*args)`` for TPU and checks it holds exactly ``kernels`` Mosaic kernels."""
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
    assert exported.platforms == ("tpu",)
    assert exported.mlir_module().count("stablehlo.custom_call @tpu_custom_call") == kernels
    return exported


def _attention_args(dtype, *, page_size, head_dim, num_q_heads, num_kv_heads, num_tokens,
                    max_num_seqs, pages_per_seq, num_blocks=256, num_layers=2):
    return (
        _S((num_tokens, num_q_heads, head_dim), dtype),
        _S((num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim), dtype),
        _S((max_num_seqs, pages_per_seq), _I32),
        _S((max_num_seqs,), _I32),
        _S((max_num_seqs + 1,), _I32),
        _S((1,), _I32),
    )


ATTENTION_CASES = {
    # A decode batch: one token per sequence, GQA group 4.
    "decode_f32": (dict(dtype=jnp.float32, page_size=16, head_dim=128, num_q_heads=8,
                        num_kv_heads=2, num_tokens=64, max_num_seqs=64, pages_per_seq=32), {}),
    # Chunked prefill mixed with decodes, window and soft-cap, a token count no block divides.
    "mixed_bf16_window_softcap": (
        dict(dtype=jnp.bfloat16, page_size=16, head_dim=128, num_q_heads=32, num_kv_heads=8,
             num_tokens=500, max_num_seqs=16, pages_per_seq=64),
        dict(sliding_window=100, soft_cap=30.0)),
    # head_dim 256 (two lane tiles), one KV head, explicit tuning.
    "wide_head_tuned": (
        dict(dtype=jnp.bfloat16, page_size=32, head_dim=256, num_q_heads=8, num_kv_heads=1,
             num_tokens=96, max_num_seqs=8, pages_per_seq=16),
        dict(block_q=32, pages_per_block=2)),
    # Big enough that the kernel raises the scoped VMEM limit.
    "many_heads_f32": (dict(dtype=jnp.float32, page_size=16, head_dim=256, num_q_heads=64,
                            num_kv_heads=16, num_tokens=256, max_num_seqs=4, pages_per_seq=64),
                       {}),
}


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_paged_attention_exports_for_tpu(name):
    shapes, options = ATTENTION_CASES[name]
    args = _attention_args(**shapes)
    fn = functools.partial(paged_attention_tpu, layer=1, sm_scale=0.1, interpret=False,
                           **options)
    exported = _export_for_tpu(fn, *args)
    (out,) = exported.out_avals
    assert (out.shape, out.dtype) == (args[0].shape, args[0].dtype)


def test_big_head_counts_ask_for_more_vmem():
    """Page slots, q/out blocks and float32 statistics of 16 KV heads pass Mosaic's 16 MiB
    default scoped VMEM here: the kernel must ask for more, and no more than a TPU has."""
    shapes, options = ATTENTION_CASES["many_heads_f32"]
    fn = functools.partial(paged_attention_tpu, layer=1, sm_scale=0.1, interpret=False,
                           **options)
    text = _export_for_tpu(fn, *_attention_args(**shapes)).mlir_module()
    # The kernel's custom-call config spells the scoped VMEM limit as "size".
    (limit,) = map(int, re.findall(r"\\22size\\22: (\d+)", text))
    assert 16 * 1024 * 1024 < limit <= 64 * 1024 * 1024


def test_small_kernels_keep_the_default_vmem_limit():
    shapes, options = ATTENTION_CASES["decode_f32"]
    fn = functools.partial(paged_attention_tpu, layer=1, sm_scale=0.1, interpret=False,
                           **options)
    text = _export_for_tpu(fn, *_attention_args(**shapes)).mlir_module()
    assert not re.findall(r"\\22size\\22:", text)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kv_write_exports_for_tpu(dtype):
    pool = _S((64, 2, 2, 4, 16, 128), dtype)
    k = _S((24, 4, 128), dtype)
    fn = functools.partial(write_kv_tpu, layer=1, interpret=False)
    exported = _export_for_tpu(fn, pool, k, k, _S((24,), _I32))
    assert exported.out_avals[0].shape == pool.shape


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_block_copy_exports_for_tpu(dtype):
    pool = _S((64, 2, 2, 4, 16, 128), dtype)
    ids = _S((5,), _I32)
    gathered = _export_for_tpu(functools.partial(gather_blocks_tpu, interpret=False), pool, ids)
    assert gathered.out_avals[0].shape == (5,) + pool.shape[1:]
    blocks = _S((5,) + pool.shape[1:], dtype)
    scattered = _export_for_tpu(functools.partial(scatter_blocks_tpu, interpret=False),
                                pool, ids, blocks)
    assert scattered.out_avals[0].shape == pool.shape


def _quantized(pool, fmt: KVFormat) -> QuantizedPages:
    return QuantizedPages(_S(pool.shape, fmt.storage_dtype),
                          _S(fmt.scales_shape(pool.shape), jnp.float32))


def _tensor_type(aval) -> str:
    """How StableHLO spells ``aval``'s type, e.g. ``tensor<4x8xi8>``."""
    names = {"int8": "i8", "float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2", "float32": "f32",
             "bfloat16": "bf16"}
    return f"tensor<{'x'.join(map(str, aval.shape))}x{names[jnp.dtype(aval.dtype).name]}>"


QUANT_GRID = [KVFormat(q, g) for q in ("int8", "fp8_e4m3", "fp8_e5m2") for g in ("token", "page")]


@pytest.mark.parametrize("fmt", QUANT_GRID, ids=KVFormat.name)
def test_quantized_paged_attention_exports_for_tpu(fmt):
    """Decode over quantized pages (float32 or bfloat16 queries): the Mosaic kernel takes the
    pool's stored bytes and scales as they are, with no dequantized copy of the pool in XLA."""
    dtype = jnp.bfloat16 if fmt.granularity == "token" else jnp.float32
    args = list(_attention_args(dtype, page_size=32, head_dim=128, num_q_heads=8,
                                num_kv_heads=2, num_tokens=64, max_num_seqs=64,
                                pages_per_seq=32))
    float_pool = args[1]
    args[1] = _quantized(float_pool, fmt)
    fn = functools.partial(paged_attention_tpu, layer=1, sm_scale=0.1, interpret=False,
                           soft_cap=30.0)
    exported = _export_for_tpu(fn, *args)
    (out,) = exported.out_avals
    assert (out.shape, out.dtype) == (args[0].shape, dtype)
    text = exported.mlir_module()
    (call,) = [line for line in text.splitlines() if "@tpu_custom_call" in line]
    assert f"{_tensor_type(args[1].data)}, {_tensor_type(args[1].scales)})" in call
    for float_dtype in (jnp.float32, jnp.bfloat16):
        assert _tensor_type(_S(float_pool.shape, float_dtype)) not in text


@pytest.fixture
def tpu_kernels_compile_here(monkeypatch):
    """The public kernels refuse a compiled Pallas TPU kernel off a TPU (they run the
    interpreter instead); ``jax.export`` traces for TPU on this machine, so the backend check
    is told the TPU kernels are native here."""
    monkeypatch.setitem(backend._NATIVE_BACKEND, "pallas_tpu", jax.default_backend())


@pytest.mark.parametrize("quant", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_quantized_per_token_write_exports_for_tpu(quant, tpu_kernels_compile_here):
    """``write_kv`` on a per-token quantized pool: rows quantized in XLA, the quantized rows
    through the Mosaic write kernel, their scales by an XLA scatter; no reshape of the whole
    scales pool (which on TPU would relayout it on every call)."""
    pool = _quantized(_S((64, 2, 2, 4, 32, 128), jnp.float32), KVFormat(quant, "token"))
    k = _S((24, 4, 128), jnp.bfloat16)
    fn = functools.partial(write_kv, layer=1, impl="pallas_tpu", interpret=False)
    exported = _export_for_tpu(fn, pool, k, k, _S((24,), _I32), kernels=1)
    assert "64x2x2x4x32x1xf32" not in exported.mlir_module()  # no head_dim-1 view of the pool
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [
        (pool.data.shape, pool.data.dtype), (pool.scales.shape, jnp.float32)]


@pytest.mark.parametrize("fmt", [KVFormat("int8", "page"), KVFormat("fp8_e4m3", "token"),
                                 KVFormat("fp8_e5m2", "page")], ids=KVFormat.name)
def test_quantized_block_copy_exports_for_tpu(fmt, tpu_kernels_compile_here):
    """Gather and scatter of quantized blocks: one Mosaic copy for the pages, one for the
    scales."""
    pool = _quantized(_S((64, 2, 2, 4, 32, 128), jnp.float32), fmt)
    ids = _S((5,), _I32)
    kw = dict(impl="pallas_tpu", interpret=False)
    gathered = _export_for_tpu(functools.partial(gather_blocks, **kw), pool, ids, kernels=2)
    blocks = jax.tree.map(lambda leaf: _S((5,) + leaf.shape[1:], leaf.dtype), pool)
    assert [(a.shape, a.dtype) for a in gathered.out_avals] == [
        (leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(blocks)]
    scattered = _export_for_tpu(functools.partial(scatter_blocks, **kw), pool, ids, blocks,
                                kernels=2)
    assert [(a.shape, a.dtype) for a in scattered.out_avals] == [
        (leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(pool)]
