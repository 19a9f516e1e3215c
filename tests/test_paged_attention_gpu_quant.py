"""The GPU (Triton-lowered Pallas) kernels on quantized pools (int8, fp8 e4m3/e5m2 pages with
per-token or per-page float32 scales) against the references.

Attention is checked two ways (:func:`paged_attention_cases.assert_quantized_matches`): at the
float tolerance against the reference on the dequantized pool, and within the format's error
bound against the reference on the float pool it came from. Unowned pages and slots past
``seq_len`` hold NaN scales (and NaN fp8 data), so a stray read shows. The KV write and the
block copies run through ``impl="pallas_gpu"``. Off a GPU everything runs in interpret mode;
on a GPU it compiles (``benchmarks/gpu_check.sh`` runs this file there).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_attention_cases import DECODE, PREFILL_EDGES, assert_quantized_matches
from pool_cases import assert_same_bytes, check_quantized_block_copies

import pallas_kernels.paged_attention_gpu as gpu_module
from pallas_kernels import (
    paged_attention,
    paged_attention_reference,
    write_kv,
    write_kv_reference,
)
from pallas_kernels.example_inputs import make_case, quantize_case
from pallas_kernels.kv_format import (
    QUANT_FORMATS,
    KVFormat,
    QuantizedPages,
    dequantize,
    quantize,
    relative_error,
)

ON_GPU = jax.default_backend() == "gpu"
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _attend(case, **kw):
    return paged_attention(*case.args(), layer=case.layer, impl="pallas_gpu",
                           interpret=not ON_GPU, **kw)


def _ragged_case(seed, page_size, dtype, **kw):
    """DECODE and PREFILL_EDGES in one batch (one compile covers both), GQA 8 over 2 heads."""
    (dq, dkv), (pq, pkv) = DECODE(page_size), PREFILL_EDGES(page_size)
    return make_case(seed, q_lens=dq + pq, kv_lens=dkv + pkv, dtype=dtype, page_size=page_size,
                     num_q_heads=8, num_kv_heads=2, **kw)


# Every format and granularity once; float32 and bfloat16 queries (the two dot dtypes) and
# split-K alternate so each meets int8 and fp8 without multiplying interpret-mode compiles.
GRID = [(fmt, dtype, splits) for fmt, dtype, splits in zip(
    QUANT_FORMATS, [jnp.bfloat16, jnp.float32, jnp.float32, jnp.bfloat16, jnp.bfloat16,
                    jnp.float32], [2, 1, 2, 1, 1, 2])]


@pytest.mark.parametrize("fmt,dtype,num_splits", GRID, ids=[
    f"{f.name()}-{jnp.dtype(d).name}-splits{s}" for f, d, s in GRID])
def test_matches_dequantized_and_float_reference(fmt, dtype, num_splits):
    case = _ragged_case(20, 8, dtype, head_dim=32)
    quant = quantize_case(case, fmt)
    assert_quantized_matches(case, quant, _attend(quant, num_splits=num_splits))


def test_float16_decode_with_tiny_fp8_e5m2_scales():
    """e5m2 scales (~1e-5) times probabilities fall below float16's normal range; the kernel
    takes the p . v dot in float32 there. Small V (x 1/64) makes the scales smaller still, and
    the outputs so small that float16's absolute tolerance would hide a 5% error: the norm
    against the dequantized reference must stay within one float16 rounding."""
    q_lens, kv_lens = DECODE(16)
    case = make_case(21, q_lens=q_lens, kv_lens=kv_lens, page_size=16, head_dim=64,
                     num_q_heads=4, num_kv_heads=1, dtype=jnp.float16)
    case.kv_pages = case.kv_pages.at[:, :, 1].multiply(1 / 64)
    quant = quantize_case(case, KVFormat("fp8_e5m2", "token"))
    out = _attend(quant, max_q_len=1, num_splits=2)
    assert_quantized_matches(case, quant, out)
    exact = paged_attention_reference(*quant.args(), layer=quant.layer)
    assert relative_error(out, exact) <= 2.0**-10


def test_sliding_window_and_soft_cap_per_page_scales():
    """The window starts past page 0, so the first page a program reads is not block 0."""
    case = make_case(22, q_lens=[9, 1, 4], kv_lens=[9, 30, 20], num_q_heads=4, num_kv_heads=2)
    quant = quantize_case(case, KVFormat("fp8_e4m3", "page"))
    kw = dict(sliding_window=9, soft_cap=2.0)
    assert_quantized_matches(case, quant, _attend(quant, num_splits=3, **kw), **kw)


def _quantized_pool(rng, fmt, shape):
    """A quantized pool of random K/V whose never-written pages hold NaN scales."""
    data, scales = quantize(rng.standard_normal(shape).astype(np.float32), fmt)
    scales[-1] = np.nan  # block num_blocks - 1: untouched by every write below
    return QuantizedPages(jnp.asarray(data), jnp.asarray(scales))


@pytest.mark.parametrize("fmt", [KVFormat(q, "token") for q in ("int8", "fp8_e4m3", "fp8_e5m2")],
                         ids=KVFormat.name)
def test_quantized_write_matches_reference(fmt):
    """Per-token quantizing write: scales to 1e-6, values within one step of the format,
    every other byte of the pool (other slots, layers, the NaN page) unchanged."""
    rng = np.random.default_rng(23)
    num_blocks, page_size = 5, 8
    pool = _quantized_pool(rng, fmt, (num_blocks, 2, 2, 2, page_size, 32))
    slots = np.array([9, -1, 0, 31, 17, 7], np.int32)  # a padding token; four blocks
    k = (3 * rng.standard_normal((len(slots), 2, 32))).astype(np.float32)
    v = rng.standard_normal((len(slots), 2, 32)).astype(jnp.bfloat16)
    expect = write_kv_reference(pool, k, v, jnp.asarray(slots), layer=1)
    out = write_kv(jax.tree.map(jnp.copy, pool), jnp.asarray(k), jnp.asarray(v),
                   jnp.asarray(slots), layer=1, impl="pallas_gpu", interpret=not ON_GPU)
    written = np.zeros((num_blocks, 2, page_size), bool)  # [block, layer, offset]
    for slot in slots[slots >= 0]:
        written[slot // page_size, 1, slot % page_size] = True
    sel = lambda x: np.moveaxis(np.asarray(x), 4, 2)  # [block, layer, offset, 2, heads, ...]
    np.testing.assert_allclose(sel(out.scales)[written], sel(expect.scales)[written], rtol=1e-6)
    got = sel(dequantize(np.asarray(out.data), np.asarray(out.scales)))[written]
    want_data = sel(expect.data)[written]
    want = want_data.astype(np.float32) * sel(expect.scales)[written][..., None]
    step = _step(want_data, fmt) * sel(expect.scales)[written][..., None]
    assert (np.abs(got - want) <= step * (1 + 1e-6)).all()
    for leaf_out, leaf_in in ((out.data, pool.data), (out.scales, pool.scales)):
        assert_same_bytes(sel(leaf_out)[~written], sel(leaf_in)[~written])


def _step(data, fmt) -> np.ndarray:
    """The spacing of the storage format at each stored value (1 for int8)."""
    if fmt.quant == "int8":
        return np.ones(data.shape, np.float32)
    info = jnp.finfo(fmt.storage_dtype)
    y = np.abs(data.astype(np.float32))
    exponent = np.floor(np.log2(np.maximum(y, np.float32(info.smallest_normal))))
    return np.exp2(exponent - info.nmant).astype(np.float32)


@pytest.mark.parametrize("fmt", [KVFormat("fp8_e5m2", "token"), KVFormat("int8", "page")],
                         ids=KVFormat.name)
def test_quantized_block_copies_are_bit_exact(fmt):
    """Gather and scatter move data and scales together, any bit pattern (NaN payloads
    included) of either; a padding id gives zero data and zero scales."""
    check_quantized_block_copies(fmt, (6, 2, 2, 2, 8, 32), [4, -1, 0, 5, 2], seed=24,
                                 impl="pallas_gpu", interpret=not ON_GPU)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the other tests compile the kernel for real")
@pytest.mark.parametrize("fmt", QUANT_FORMATS, ids=KVFormat.name)
def test_quantized_pool_lowers_to_bfloat16_tensor_core_dots(fmt, monkeypatch):
    """Lowering for an H200 without a GPU: the Triton module loads the quantized tiles in their
    storage dtype and converts them straight to bfloat16 for both dots (no float32 dot)."""
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    lowering = pytest.importorskip("jax._src.pallas.triton.lowering")
    if not hasattr(lowering, "lower_jaxpr_to_triton_module"):
        pytest.skip("this JAX lowers Pallas to Triton differently")
    h200 = gpu_info.GpuInfo(gpu_version=gpu_info.GpuVersion.H200, arch_name="9.0",
                            compute_capability=90)
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda *a, **k: h200)
    results = []
    lower = lowering.lower_jaxpr_to_triton_module

    def spy(*args, **kwargs):
        results.append(lower(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", spy)
    case = make_case(25, q_lens=[1] * 6, kv_lens=[40, 3, 17, 64, 1, 9], page_size=16,
                     head_dim=64, num_q_heads=8, num_kv_heads=2, dtype=jnp.bfloat16,
                     pad_seqs=2, pad_tokens=2, pages_per_seq=64)
    quant = quantize_case(case, fmt)
    fn = jax.jit(lambda *a: gpu_module.paged_attention_gpu(
        *a, layer=1, sm_scale=0.1, soft_cap=3.0, sliding_window=20, pages_per_compute_block=8))
    text = fn.trace(*quant.args()).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "grid_x = 8 : i32, grid_y = 2 : i32, grid_z = 4 : i32" in text
    [result] = results
    if not hasattr(getattr(result, "module", None), "operation"):
        pytest.skip("this JAX's Triton lowering result has no MLIR module to read")
    ttir = result.module.operation.get_asm()
    storage = {"int8": "xi8", "fp8_e4m3": "xf8E4M3FN", "fp8_e5m2": "xf8E5M2"}[fmt.quant]
    # K and V tiles: 8 pages of 16 tokens x 64, loaded quantized, each converted once.
    assert ttir.count(f"tensor<8x16x64{storage}>") >= 2
    casts = re.findall(rf"(arith.sitofp|tt.fp_to_fp) %\w+ : tensor<128x64{storage}> (to|->) "
                       r"tensor<128x64xbf16>", ttir)
    assert len(casts) == 2, casts
    dots = [line for line in ttir.splitlines() if "tt.dot" in line]
    assert len(dots) == 2 and all(line.count("xbf16>") == 2 for line in dots), dots
    per_key = "8x16xf32" if fmt.granularity == "token" else "8x1xf32"
    assert ttir.count(f"tensor<{per_key}>") >= 2  # the K and V scales of the step's pages
