"""Quantized pages (int8 / fp8 with scales): the format, the references, the XLA kernels, the
page pool. The Pallas GPU and TPU kernels have their own quantized test files."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from paged_attention_cases import DECODE, GRID, PREFILL_EDGES, assert_quantized_matches
from pool_cases import check_quantized_block_copies

import pallas_kernels
from kvjax.tiers.page_pool import PagePool, PoolConfig
from pallas_kernels import kv_format as kf
from pallas_kernels.example_inputs import make_case, quantize_case
from pallas_kernels.kv_format import QUANT_FORMATS, KVFormat, QuantizedPages

# Mantissa bits of each format: a normal value rounds to within half an ulp, 2^-(m+1).
_MANTISSA = {"fp8_e4m3": 3, "fp8_e5m2": 2}
_IDS = [f.name() for f in QUANT_FORMATS]


def _rng_kv(seed, shape, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale


# --- the format -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANT_FORMATS, ids=_IDS)
def test_quantize_round_trip_error_is_within_the_format_precision(fmt):
    x = _rng_kv(0, (3, 2, 8, 32)) * np.exp(_rng_kv(1, (3, 2, 8, 1)))  # rows of varied magnitude
    data, scales = kf.quantize(x, fmt)
    assert data.dtype == fmt.storage_dtype and scales.dtype == np.float32
    assert scales.shape == fmt.scales_shape(x.shape)
    back = kf.dequantize(data, scales)
    step = np.broadcast_to(scales[..., None], x.shape)
    if fmt.quant == "int8":
        bound = 0.5 * step * (1 + 1e-5)  # round to nearest integer step
    else:
        # Relative half-ulp for normal values, plus the subnormal spacing near zero.
        tiny = float(jnp.finfo(fmt.storage_dtype).smallest_subnormal)
        bound = np.abs(x) * 2.0 ** -(_MANTISSA[fmt.quant] + 1) * (1 + 1e-5) + step * tiny
    assert (np.abs(back - x) <= bound).all()
    # The scale maps the largest magnitude it covers onto the format's largest value.
    axes = (-1,) if fmt.granularity == "token" else (-2, -1)
    np.testing.assert_allclose(
        scales.reshape(scales.shape[:-1] + (-1,)).max(-1) * fmt.qmax,
        np.abs(x).max(axis=axes).reshape(scales.shape[:-1] + (-1,)).max(-1), rtol=1e-6)


# Finite values (|x| in [1e-30, 2^100], or 0), so that every scale is a normal float32: a
# subnormal one (amax under qmax * 2^-126) is flushed to 0 by XLA's CPU backend (the row
# stores zeros, an error under 1e-33), and near float32's max int8's 127 * scale rounds to inf.
_FINITE = st.floats(-2.0**100, 2.0**100, allow_nan=False, width=32).map(lambda x: 0.0 if abs(x) < 1e-30 else x)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(QUANT_FORMATS), hnp.arrays(np.float32, (2, 2, 4, 8), elements=_FINITE))
def test_any_finite_rows_round_trip_within_one_step_of_their_scale(fmt, x):
    data, scales = kf.quantize(jnp.asarray(x), fmt)  # jnp: the kernels' arithmetic
    data, scales = np.asarray(data), np.asarray(scales)
    back = np.asarray(kf.dequantize(data, scales))
    step = np.broadcast_to(scales[..., None], x.shape)
    assert np.isfinite(scales).all() and (scales >= 0).all() and np.isfinite(back).all()
    axes = (-1,) if fmt.granularity == "token" else (-2, -1)
    amax = np.abs(x).max(axis=axes)
    np.testing.assert_allclose(scales.reshape(amax.shape) * np.float32(fmt.qmax), amax, rtol=1e-6)
    slack = np.abs(x) * 2.0**-21  # float32 rounding of x / scale and of data * scale
    if fmt.quant == "int8":
        assert np.abs(data.astype(np.int32)).max() <= 127  # symmetric: never -128
        bound = 0.5 * step * (1 + 1e-5) + slack
    else:
        tiny = float(jnp.finfo(fmt.storage_dtype).smallest_subnormal)
        bound = np.abs(x) * 2.0 ** -(_MANTISSA[fmt.quant] + 1) * (1 + 1e-5) + step * tiny + slack
    assert (np.abs(back - x) <= bound).all()
    np.testing.assert_array_equal(back[x == 0], 0.0)


@pytest.mark.parametrize("fmt", QUANT_FORMATS[::2], ids=_IDS[::2])
def test_zero_rows_get_zero_scale_and_dequantize_to_zero(fmt):
    x = np.zeros((2, 4, 16), np.float32)
    data, scales = kf.quantize(jnp.asarray(x), fmt)
    assert (np.asarray(scales) == 0).all()
    np.testing.assert_array_equal(np.asarray(kf.dequantize(data, scales)), 0.0)


@pytest.mark.parametrize("quant", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_encode_saturates_values_beyond_the_scale(quant):
    fmt = KVFormat(quant)
    out = kf.encode(jnp.array([1e9, -1e9, 3.0]), jnp.float32(1.0), fmt)
    back = np.asarray(out.astype(jnp.float32))
    np.testing.assert_array_equal(back[:2], [fmt.qmax, -fmt.qmax])
    assert np.isfinite(back).all()


def test_format_and_pool_config_reject_unknown_names():
    with pytest.raises(ValueError, match="quant='int4' is not a known format"):
        KVFormat("int4")
    with pytest.raises(ValueError, match="granularity='tensor' must be one of"):
        KVFormat("int8", "tensor")
    with pytest.raises(ValueError, match=r"quant=\['int8'\] is not a known format"):
        KVFormat(["int8"])
    with pytest.raises(ValueError, match=r"granularity=\['page'\] must be one of"):
        KVFormat("int8", ["page"])
    with pytest.raises(ValueError, match="quant='int4'"):
        PoolConfig(4, 1, 1, 8, 16, "float32", kv_quant="int4")
    assert PoolConfig(4, 1, 1, 8, 16, "float32", kv_quant="none").kv_quant is None
    with pytest.raises(ValueError, match="kv_scale='page' needs kv_quant set to a format; kv_quant='none'"):
        PoolConfig(4, 1, 1, 8, 16, "float32", kv_quant="none", kv_scale="page")
    with pytest.raises(ValueError, match=r"kv_scale='row' must be one of \('token', 'page'\)"):
        PoolConfig(4, 1, 1, 8, 16, "float32", kv_quant="int8", kv_scale="row")


@pytest.mark.parametrize("quant,scale,data_bytes", [
    ("int8", "token", 1), ("fp8_e4m3", "page", 1), (None, "token", 2)])
def test_bytes_per_block_counts_data_and_scales(quant, scale, data_bytes):
    cfg = PoolConfig(4, 32, 8, 16, 128, "bfloat16", kv_quant=quant, kv_scale=scale)
    elements = 32 * 2 * 8 * 16 * 128
    scale_count = {"token": 32 * 2 * 8 * 16, "page": 32 * 2 * 8}[scale] if quant else 0
    assert cfg.bytes_per_block == elements * data_bytes + 4 * scale_count
    if quant:
        fmt = cfg.kv_format
        assert cfg.bytes_per_block == pytest.approx(
            elements * fmt.bytes_per_element(head_dim=128, page_size=16))


def test_quantized_pages_index_the_block_axis_of_data_and_scales():
    pages = kf.quantize_pool(jnp.asarray(_rng_kv(2, (5, 1, 2, 1, 4, 8))), KVFormat("int8"))
    part = pages[jnp.array([4, 1])]
    np.testing.assert_array_equal(np.asarray(part.data), np.asarray(pages.data)[[4, 1]])
    np.testing.assert_array_equal(np.asarray(part.scales), np.asarray(pages.scales)[[4, 1]])
    assert part.format == KVFormat("int8", "token") and pages.nbytes == 5 * (64 + 4 * 8)


# --- attention ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANT_FORMATS, ids=_IDS)
@pytest.mark.parametrize("lens", [PREFILL_EDGES(8), DECODE(8)], ids=["prefill", "decode"])
def test_xla_attention_on_quantized_pages(fmt, lens):
    case = make_case(3, q_lens=lens[0], kv_lens=lens[1])
    qcase = quantize_case(case, fmt)
    out = pallas_kernels.paged_attention(*qcase.args(), layer=qcase.layer, impl="xla")
    assert_quantized_matches(case, qcase, out)


# Every format at two grid points (rotating, so each grid point meets several formats), and
# float16 queries (not in GRID) on one format of each family.
_GRID_CASES = ([(GRID[(i + j) % len(GRID)], f) for i, f in enumerate(QUANT_FORMATS) for j in (0, 2)]
               + [((jnp.float16, 8, 64, 4, 2), QUANT_FORMATS[0]), ((jnp.float16, 16, 32, 8, 2), QUANT_FORMATS[3])])


@pytest.mark.parametrize("grid_point,fmt", _GRID_CASES,
                         ids=[f"{jnp.dtype(g[0]).name}-p{g[1]}-d{g[2]}-h{g[3]}/{g[4]}-{f.name()}"
                              for g, f in _GRID_CASES])
def test_xla_attention_on_quantized_pages_over_the_grid(grid_point, fmt):
    dtype, page, head_dim, hq, hkv = grid_point
    q_lens, kv_lens = PREFILL_EDGES(page)
    case = make_case(4, q_lens=q_lens, kv_lens=kv_lens, dtype=dtype, page_size=page,
                     head_dim=head_dim, num_q_heads=hq, num_kv_heads=hkv)
    qcase = quantize_case(case, fmt)
    out = pallas_kernels.paged_attention(*qcase.args(), layer=qcase.layer, impl="xla")
    assert out.dtype == jnp.dtype(dtype)
    assert_quantized_matches(case, qcase, out)


def test_xla_quantized_attention_with_window_and_soft_cap():
    case = make_case(5, q_lens=[9, 1, 4], kv_lens=[20, 17, 30])
    qcase = quantize_case(case, KVFormat("int8", "page"))
    kwargs = dict(sliding_window=7, soft_cap=3.0)
    out = pallas_kernels.paged_attention(*qcase.args(), layer=qcase.layer, impl="xla", **kwargs)
    assert_quantized_matches(case, qcase, out, **kwargs)


# --- writes ---------------------------------------------------------------------------------


def _fresh_pool(fmt, num_blocks=6, layers=2, heads=2, page=8, dim=16, fill=np.nan):
    """A quantized pool whose every slot is garbage (NaN scales), as after reuse."""
    shape = (num_blocks, layers, 2, heads, page, dim)
    data = jnp.zeros(shape, fmt.storage_dtype)
    scales = jnp.full(fmt.scales_shape(shape), fill, jnp.float32)
    return QuantizedPages(data, scales)


def _append_writes(fmt, chunks, seed=0, page=8, scale_of=None):
    """Writes one sequence's tokens chunk by chunk (pages 3, 0, 5 in order) through the XLA
    kernel and the reference; returns both pools and the float K/V written."""
    blocks = [3, 0, 5]
    pool_x = _fresh_pool(fmt, page=page)
    pool_r = _fresh_pool(fmt, page=page)
    written, pos = [], 0
    for i, n in enumerate(chunks):
        mag = 1.0 if scale_of is None else scale_of(i)
        k = jnp.asarray(_rng_kv(seed + 2 * i, (n, 2, 16), mag))
        v = jnp.asarray(_rng_kv(seed + 2 * i + 1, (n, 2, 16), mag))
        slots = np.array([blocks[p // page] * page + p % page for p in range(pos, pos + n)],
                         np.int32)
        slots = jnp.asarray(np.concatenate([slots, [-1]]).astype(np.int32))  # one padding row
        k = jnp.concatenate([k, jnp.full((1, 2, 16), jnp.nan)])
        v = jnp.concatenate([v, jnp.full((1, 2, 16), jnp.nan)])
        pool_r = pallas_kernels.write_kv_reference(pool_r, k, v, slots, layer=1)
        pool_x = pallas_kernels.write_kv(pool_x, k, v, slots, layer=1, impl="xla")
        written.append((np.asarray(k[:-1]), np.asarray(v[:-1])))
        pos += n
    return pool_x, pool_r, written, blocks, pos


def _token_rows(pool, blocks, length, page=8, layer=1):
    """Dequantized ``[length, 2, heads, dim]`` rows of one sequence, and their scales."""
    deq = np.asarray(kf.dequantize_pool(pool))
    scales = np.asarray(pool.scales)
    rows, row_scales = [], []
    for p in range(length):
        b, o = blocks[p // page], p % page
        rows.append(deq[b, layer, :, :, o])
        row_scales.append(scales[b, layer, :, :, o if scales.shape[-1] > 1 else 0])
    return np.stack(rows), np.stack(row_scales)


@pytest.mark.parametrize("fmt", QUANT_FORMATS, ids=_IDS)
def test_xla_quantizing_write_matches_the_reference(fmt):
    # A prefill chunk crossing a page boundary, then decode steps, then a chunk.
    pool_x, pool_r, written, blocks, n = _append_writes(fmt, [11, 1, 1, 1, 6])
    rows_x, scales_x = _token_rows(pool_x, blocks, n)
    rows_r, scales_r = _token_rows(pool_r, blocks, n)
    np.testing.assert_allclose(scales_x, scales_r, rtol=1e-6)
    # The kernel and the reference may round a value differently (division order), but by at
    # most one step of the format at that value.
    step = scales_r[..., None]
    if fmt.quant == "int8":
        tol = step * 1.01
    else:
        tiny = float(jnp.finfo(fmt.storage_dtype).smallest_subnormal)
        tol = np.abs(rows_r) * 2.0 ** -_MANTISSA[fmt.quant] * 1.01 + 2 * step * tiny
    assert (np.abs(rows_x - rows_r) <= tol).all()
    exact = np.concatenate([np.stack([k, v], 1) for k, v in written])
    # Every written token is within its format's precision of what was written.
    assert kf.relative_error(rows_x, exact) < {"int8": 0.01, "fp8_e4m3": 0.05,
                                                "fp8_e5m2": 0.1}[fmt.quant]
    # Nothing outside the written slots changed: untouched blocks keep their NaN scales.
    untouched = [b for b in range(6) if b not in blocks]
    assert np.isnan(np.asarray(pool_x.scales)[untouched]).all()
    assert np.isnan(np.asarray(pool_x.scales)[:, 0]).all()  # layer 0 never written


def _small_then_big(fmt):
    """Three tokens, then one 100x larger, written in two calls: the stored rows, their
    scales and the exact rows ``[4, 2, heads, dim]``."""
    pool, _, written, blocks, n = _append_writes(fmt, [3, 1], scale_of=lambda i: 1.0 if i == 0 else 100.0)
    rows, scales = _token_rows(pool, blocks, n)
    return rows, scales, np.concatenate([np.stack([k, v], 1) for k, v in written])


def test_per_page_scale_grows_and_requantizes_earlier_tokens():
    # Small tokens first, then one 100x larger: the page scale must grow to cover it.
    rows, scales, exact = _small_then_big(KVFormat("int8", "page"))
    big = np.abs(exact[3]).max(axis=-1)  # [2, heads]
    np.testing.assert_allclose(scales[0], big / 127, rtol=1e-6)
    np.testing.assert_allclose(scales[3], scales[0])
    # Early tokens now carry the big scale's error (<= one step after two roundings).
    assert (np.abs(rows[:3] - exact[:3]) <= scales[:3, ..., None] * 1.01).all()


def test_per_token_scales_leave_earlier_tokens_untouched():
    rows, _, exact = _small_then_big(KVFormat("int8", "token"))
    assert kf.relative_error(rows[:3], exact[:3]) < 0.01


def test_a_page_written_from_offset_zero_drops_its_stale_scale():
    fmt = KVFormat("int8", "page")
    pool = _fresh_pool(fmt, fill=1e6)  # a reused block: finite, huge old scale
    k = v = jnp.asarray(_rng_kv(7, (2, 2, 16)))
    slots = jnp.array([2 * 8, 2 * 8 + 1], jnp.int32)
    pool = pallas_kernels.write_kv(pool, k, v, slots, layer=0, impl="xla")
    np.testing.assert_allclose(np.asarray(pool.scales)[2, 0, 0, :, 0],
                               np.abs(np.asarray(k)).max(axis=(0, 2)) / 127, rtol=1e-6)


@pytest.mark.parametrize("fmt", QUANT_FORMATS[1::2], ids=_IDS[1::2])
def test_per_page_write_leaves_every_other_byte_of_the_pool_as_it_was(fmt):
    # Random bytes everywhere: every float8 NaN payload, both signs. A float8_e5m2 per-page
    # write used to copy pages as floats and rewrote the NaN bytes of the whole pool.
    shape = (5, 2, 2, 2, 4, 16)
    bits = np.random.default_rng(3).integers(0, 256, shape, np.uint8)
    scales = np.random.default_rng(4).uniform(0.1, 1.0, fmt.scales_shape(shape)).astype(np.float32)
    pool = QuantizedPages(jnp.asarray(bits.view(fmt.storage_dtype)), jnp.asarray(scales))
    k = v = jnp.asarray(_rng_kv(5, (2, 2, 16)))
    # block 2 offset 1: its page is requantized; block 3 offset 0: a fresh page, whose other
    # slots (past the sequence's end) stay as they were
    out = pallas_kernels.write_kv(pool, k, v, jnp.array([2 * 4 + 1, 3 * 4], jnp.int32), layer=1, impl="xla")
    changed = np.asarray(out.data).view(np.uint8) != bits
    changed[2, 1] = False
    changed[3, 1, :, :, 0] = False
    assert not changed.any(), np.argwhere(changed)[:5]


@pytest.mark.parametrize("fmt", QUANT_FORMATS[:2], ids=_IDS[:2])
def test_quantizing_write_donates_the_pool(fmt):
    pool = _fresh_pool(fmt, fill=0.0)
    data = pool.data
    k = v = jnp.ones((2, 2, 16))
    new = pallas_kernels.write_kv(pool, k, v, jnp.array([0, 9], jnp.int32), layer=0, impl="xla")
    assert data.is_deleted() and isinstance(new, QuantizedPages)


def test_written_then_attended_equals_reference_on_what_was_stored():
    fmt = KVFormat("fp8_e4m3", "token")
    pool_x, _, _, blocks, n = _append_writes(fmt, [13, 1])
    q = jnp.asarray(_rng_kv(9, (1, 4, 16)))
    args = (q, pool_x, jnp.array([blocks], jnp.int32), jnp.array([n], jnp.int32),
            jnp.array([0, 1], jnp.int32))
    out = pallas_kernels.paged_attention(*args, layer=1, impl="xla")
    ref = pallas_kernels.paged_attention_reference(*args, layer=1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


# --- block copies ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANT_FORMATS, ids=_IDS)
def test_gather_and_scatter_move_pages_and_scales_bit_exactly(fmt):
    check_quantized_block_copies(fmt, (6, 2, 2, 2, 8, 16), [4, -1, 1, 0], seed=11, impl="xla")


# --- bad input ------------------------------------------------------------------------------


def test_validation_names_the_bad_quantized_input():
    case = make_case(0, q_lens=[1], kv_lens=[5])
    qcase = quantize_case(case, KVFormat("int8"))
    pool = qcase.kv_pages
    rest = qcase.args()[2:]
    bad_scales = QuantizedPages(pool.data, pool.scales[..., :3])
    with pytest.raises(ValueError, match=r"kv_pages.scales.shape=.* must be"):
        pallas_kernels.paged_attention(case.q, bad_scales, *rest, layer=1)
    half = QuantizedPages(pool.data, pool.scales.astype(jnp.float16))
    with pytest.raises(ValueError, match="scales.dtype=float16 must be float32"):
        pallas_kernels.paged_attention(case.q, half, *rest, layer=1)
    with pytest.raises(ValueError, match=r"kv_pages.dtype=int8 must equal .*QuantizedPages"):
        pallas_kernels.paged_attention(case.q, pool.data, *rest, layer=1)
    not_quant = QuantizedPages(jnp.zeros(pool.shape, jnp.float32), pool.scales)
    with pytest.raises(ValueError, match=r"kv_pages.data.dtype=float32 must be one of"):
        pallas_kernels.paged_attention(case.q, not_quant, *rest, layer=1)
    ids = jnp.array([0], jnp.int32)
    with pytest.raises(ValueError, match="blocks is a ArrayImpl but kv_pages is a QuantizedPages"):
        pallas_kernels.scatter_blocks(pool, ids, jnp.zeros((1,) + pool.shape[1:], jnp.int8))
    k = jnp.ones((1, 2, 32), jnp.int32)
    with pytest.raises(ValueError, match="k.dtype=int32 must be one of"):
        pallas_kernels.write_kv(pool, k, k, jnp.array([0], jnp.int32), layer=0)


# --- the page pool --------------------------------------------------------------------------


def test_page_pool_holds_and_guards_a_quantized_pool():
    cfg = PoolConfig(6, 2, 2, 8, 16, "float32", kv_quant="fp8_e5m2", kv_scale="page")
    pool = PagePool(cfg)
    assert isinstance(pool.kv_pages, QuantizedPages)
    assert pool.kv_pages.scales.shape == (6, 2, 2, 2, 1) and cfg.storage_dtype == "float8_e5m2"
    k = jnp.asarray(_rng_kv(12, (3, 2, 16)))
    pool.write(k, k, [8, 9, 10], layer=1)
    pool.check_invariants()
    blocks = pool.gather([1])
    assert isinstance(blocks, QuantizedPages)
    pool.scatter([4], blocks)
    np.testing.assert_array_equal(np.asarray(pool.kv_pages.data[4]).view(np.uint8),
                                  np.asarray(pool.kv_pages.data[1]).view(np.uint8))
    with pytest.raises(ValueError, match="is a ArrayImpl but the pool's format is fp8_e5m2/page"):
        pool.kv_pages = jnp.zeros(cfg.shape, jnp.float32)
    with pytest.raises(ValueError, match="scales"):
        pool.kv_pages = QuantizedPages(pool.kv_pages.data, jnp.zeros((6, 2, 2, 2, 8)))
    # bfloat16 scales of the right shape were taken, and failed only at the next kernel call
    with pytest.raises(ValueError, match="scales dtype bfloat16 must be float32"):
        pool.kv_pages = QuantizedPages(pool.kv_pages.data, pool.kv_pages.scales.astype(jnp.bfloat16))
    pool.check_invariants()  # the rejected assignments left the pool as it was
