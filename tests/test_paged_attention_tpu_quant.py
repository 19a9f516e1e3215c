"""The TPU (Mosaic) kernels on quantized pools (int8, fp8 e4m3/e5m2 pages with per-token or
per-page float32 scales), under the TPU interpreter, against the references.

Attention is checked two ways (:func:`paged_attention_cases.assert_quantized_matches`): at the
float tolerance against the reference on the dequantized pool, and within the format's error
bound against the reference on the float pool it came from. Unowned pages and slots past
``seq_len`` hold NaN scales (and NaN fp8 data, or int8's largest code in a partly filled page
with a per-page scale), so a stray read shows. The interpreter costs one compile (seconds)
per shape and static option, so each format meets decode and chunked prefill in one compiled
shape, and q dtypes and page sizes alternate over the formats instead of multiplying them.
The KV write and the block copies run through ``impl="pallas_tpu"``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from paged_attention_cases import DECODE, PREFILL_EDGES, assert_quantized_matches
from pool_cases import assert_same_bytes, check_quantized_block_copies

from pallas_kernels import paged_attention, write_kv, write_kv_reference
from pallas_kernels.example_inputs import make_case, quantize_case
from pallas_kernels.kv_format import QUANT_FORMATS, KVFormat, QuantizedPages, dequantize, quantize
from pallas_kernels.paged_attention_tpu import paged_attention_tpu
from pallas_kernels.tpu_layout import check_tpu_layout

_TPU = dict(impl="pallas_tpu", interpret=True)


def _fixed_shape_case(seed, lengths, *, page_size, dtype, max_seqs=7, pages_per_seq=5,
                      num_blocks=14, **kw):
    """``lengths(page_size)`` in a batch of fixed shapes, so DECODE and PREFILL_EDGES share
    one compile; GQA: 4 query heads over 2 KV heads, head_dim 128 (one lane tile)."""
    q_lens, kv_lens = lengths(page_size)
    num_tokens = 2 * page_size + 16  # PREFILL_EDGES has 2 * page_size + 8 tokens
    pages = sum(-(-kv // page_size) for kv in kv_lens)
    return make_case(seed, q_lens=q_lens, kv_lens=kv_lens, dtype=dtype, page_size=page_size,
                     head_dim=128, num_q_heads=4, num_kv_heads=2, pages_per_seq=pages_per_seq,
                     pad_seqs=max_seqs - len(q_lens), pad_tokens=num_tokens - sum(q_lens),
                     spare_pages=num_blocks - 1 - pages, **kw)


# Every format and granularity once; float32 and bfloat16 queries (the two dot dtypes) and
# page sizes 32 (4 pages a step: per-token scales concatenated along lanes) and 64 (2 pages)
# alternate so each meets int8 and fp8. One point adds a window that starts past page 0 and
# a soft-cap (K's scales must enter the logits before the cap).
WINDOW = dict(sliding_window=40, soft_cap=2.0, block_q=16)
GRID = list(zip(QUANT_FORMATS, [jnp.float32, jnp.bfloat16, jnp.bfloat16, jnp.float32,
                                jnp.float32, jnp.bfloat16], [32, 32, 64, 32, 32, 64],
                [{}, {}, {}, WINDOW, {}, {}]))


@pytest.mark.parametrize("fmt,dtype,page_size,options", GRID, ids=[
    f"{f.name()}-{jnp.dtype(d).name}-page{p}{'-window' if o else ''}" for f, d, p, o in GRID])
def test_decode_and_chunked_prefill_match_references(fmt, dtype, page_size, options):
    attn_kwargs = {k: v for k, v in options.items() if k != "block_q"}
    for seed, lengths in enumerate([DECODE, PREFILL_EDGES]):
        case = _fixed_shape_case(seed, lengths, page_size=page_size, dtype=dtype)
        quant = quantize_case(case, fmt)
        out = paged_attention(*quant.args(), layer=quant.layer, **options, **_TPU)
        assert_quantized_matches(case, quant, out, **attn_kwargs)


def test_no_races_between_page_and_scale_dmas():
    """Pages and scales on their own semaphores, one page per step (no lane concatenation)."""
    case = make_case(6, q_lens=[21, 4, 0, 1], kv_lens=[21, 70, 33, 40], page_size=32,
                     head_dim=128)
    quant = quantize_case(case, KVFormat("fp8_e5m2", "page"))
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
    out = paged_attention_tpu(*quant.args(), layer=quant.layer, sm_scale=0.125,
                              interpret=params, block_q=8, pages_per_block=1)
    assert_quantized_matches(case, quant, out, sm_scale=0.125)


@pytest.mark.parametrize("layout,match", [
    (dict(pages_dtype=jnp.int8, page_size=16, scales_dim=16),
     r"page_size=16 must be a multiple of 32 for int8 pages on TPU"),
    (dict(pages_dtype=jnp.float8_e4m3fn, page_size=48, scales_dim=1),
     r"page_size=48 must be a multiple of 32 for float8_e4m3fn pages"),
    (dict(pages_dtype=jnp.int8, page_size=32, scales_dim=8),
     r"scales last dim=8 must be page_size=32 \(per token\) or 1 \(per page\)"),
    (dict(pages_dtype=jnp.int4, page_size=64, scales_dim=1),
     r"quantized pages of dtype=int4 are not supported by the TPU kernel"),
    (dict(pages_dtype=jnp.int8, page_size=32),
     r"pages dtype=int8 must equal q dtype=float32 \(a quantized pool is passed as "
     r"QuantizedPages"),
])
def test_check_tpu_layout_rejects_quantized_layouts(layout, match):
    with pytest.raises(ValueError, match=match):
        check_tpu_layout(jnp.float32, head_dim=128, group=2, **layout)


def test_paged_attention_rejects_8bit_pages_of_16_tokens():
    case = make_case(7, q_lens=[1], kv_lens=[3], page_size=16, head_dim=128)
    quant = quantize_case(case, KVFormat("fp8_e5m2", "token"))
    with pytest.raises(ValueError, match=r"page_size=16 must be a multiple of 32 for "
                                         r"float8_e5m2 pages on TPU"):
        paged_attention(*quant.args(), layer=quant.layer, **_TPU)


def _step(data, fmt) -> np.ndarray:
    """The spacing of the storage format at each stored code (1 for int8)."""
    if fmt.quant == "int8":
        return np.ones(data.shape, np.float32)
    info = jnp.finfo(fmt.storage_dtype)
    exponent = np.floor(np.log2(np.maximum(np.abs(data.astype(np.float32)),
                                           np.float32(info.smallest_normal))))
    return np.exp2(exponent - info.nmant).astype(np.float32)


@pytest.mark.parametrize("quant", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_per_token_write_matches_reference(quant):
    """Scales within 1e-6, dequantized values within one step of the format, and every other
    byte of the pool (other slots, the other layer, a NaN-scaled page) unchanged."""
    fmt, rng = KVFormat(quant, "token"), np.random.default_rng(8)
    num_blocks, page_size, slots = 5, 32, np.array([33, -1, 0, 127, 64, 31], np.int32)
    data, scales = quantize(rng.standard_normal((num_blocks, 2, 2, 2, page_size, 128)), fmt)
    scales[4] = np.nan  # a page nothing writes
    pool = QuantizedPages(jnp.asarray(data), jnp.asarray(scales))
    k = (3 * rng.standard_normal((len(slots), 2, 128))).astype(np.float32)
    v = rng.standard_normal((len(slots), 2, 128)).astype(jnp.bfloat16)
    expect = write_kv_reference(pool, k, v, jnp.asarray(slots), layer=1)
    out = write_kv(jax.tree.map(jnp.copy, pool), jnp.asarray(k), jnp.asarray(v),
                   jnp.asarray(slots), layer=1, **_TPU)
    written = np.zeros((num_blocks, 2, page_size), bool)  # [block, layer, offset]
    written[slots[slots >= 0] // page_size, 1, slots[slots >= 0] % page_size] = True
    by_slot = lambda x: np.moveaxis(np.asarray(x), 4, 2)  # [block, layer, offset, 2, heads..]
    want_scales = by_slot(expect.scales)[written][..., None]
    np.testing.assert_allclose(by_slot(out.scales)[written][..., None], want_scales, rtol=1e-6)
    got = by_slot(dequantize(np.asarray(out.data), np.asarray(out.scales)))[written]
    want_codes = by_slot(expect.data)[written]
    error = np.abs(got - want_codes.astype(np.float32) * want_scales)
    assert (error <= _step(want_codes, fmt) * want_scales * (1 + 1e-6)).all()
    for leaf_out, leaf_in in ((out.data, pool.data), (out.scales, pool.scales)):
        assert_same_bytes(by_slot(leaf_out)[~written], by_slot(leaf_in)[~written])


def test_block_copies_move_pages_and_scales_bit_exactly():
    """Any bit pattern of the data (e5m2 NaN payloads included) and of the scales moves, data
    and scales together; a padding id gathers zero data and zero scales, and scatter skips it.
    (Both granularities' scale shapes are exported for TPU in test_tpu_lowering.py.)"""
    check_quantized_block_copies(KVFormat("fp8_e5m2", "token"), (5, 2, 2, 2, 32, 128),
                                 [3, -1, 0, 4], seed=9, **_TPU)
