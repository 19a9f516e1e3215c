"""The XLA path of ragged paged attention against the float32 reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_attention_cases import DECODE, GRID, PREFILL_EDGES, assert_matches_reference

from pallas_kernels import paged_attention, paged_attention_reference
from pallas_kernels.example_inputs import make_case


@pytest.mark.parametrize("dtype,page_size,head_dim,num_q_heads,num_kv_heads", GRID)
@pytest.mark.parametrize("lengths", [DECODE, PREFILL_EDGES])
def test_matches_reference(dtype, page_size, head_dim, num_q_heads, num_kv_heads, lengths):
    q_lens, kv_lens = lengths(page_size)
    case = make_case(0, q_lens=q_lens, kv_lens=kv_lens, dtype=dtype, page_size=page_size,
                     head_dim=head_dim, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    out = paged_attention(*case.args(), layer=case.layer, impl="xla")
    assert_matches_reference(case, out)


@pytest.mark.parametrize("sliding_window,soft_cap", [(3, None), (None, 5.0), (9, 2.0), (1, None)])
def test_window_and_soft_cap(sliding_window, soft_cap):
    case = make_case(1, q_lens=[9, 1, 4], kv_lens=[9, 30, 20])
    kw = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    out = paged_attention(*case.args(), layer=case.layer, impl="xla", **kw)
    assert_matches_reference(case, out, **kw)


@pytest.mark.parametrize("pages_per_step,block_q", [(1, 1), (2, 4), (3, 16), (2, 3)])
def test_tiling_does_not_change_result(pages_per_step, block_q):
    case = make_case(2, q_lens=[1, 7, 1, 12], kv_lens=[25, 7, 8, 30], page_size=4)
    out = paged_attention(*case.args(), layer=case.layer, impl="xla",
                          pages_per_step=pages_per_step, block_q=block_q)
    assert_matches_reference(case, out)


def test_long_context_and_custom_scale():
    case = make_case(3, q_lens=[1, 16], kv_lens=[500, 300], page_size=16, head_dim=64)
    out = paged_attention(*case.args(), layer=case.layer, impl="xla", sm_scale=0.05)
    assert_matches_reference(case, out, sm_scale=0.05)


def test_an_empty_batch_gives_an_empty_output_at_any_block_q():
    # block_q > 1 gathered from the empty q (a TypeError when tracing)
    case = make_case(0, q_lens=[0, 0], kv_lens=[4, 0], pad_tokens=0)
    for block_q in (1, 4):
        assert paged_attention(*case.args(), layer=case.layer, impl="xla", block_q=block_q).shape == case.q.shape


def test_a_row_that_sees_no_key_is_zero_in_the_reference_and_the_kernels():
    # more new tokens than KV: the first row sees nothing; the reference gave NaN, the kernels 0
    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.standard_normal((2, 1, 2, 1, 8, 16)), jnp.float32)
    args = (jnp.asarray(rng.standard_normal((3, 1, 16)), jnp.float32), pool, jnp.array([[0, 1]], jnp.int32),
            jnp.array([2], jnp.int32), jnp.array([0, 3], jnp.int32))  # fmt: skip
    reference = np.asarray(paged_attention_reference(*args, layer=0))
    assert (reference[0] == 0).all() and np.isfinite(reference).all()
    np.testing.assert_allclose(np.asarray(paged_attention(*args, layer=0, impl="xla")), reference, atol=1e-6)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_float32_attention_asks_for_full_precision_matmuls(platform):
    # without it TPUs round float32 to bfloat16 passes and recent GPUs to TF32
    shape, i32 = jax.ShapeDtypeStruct, jnp.int32
    args = (shape((8, 4, 128), jnp.float32), shape((16, 1, 2, 2, 16, 128), jnp.float32), shape((4, 4), i32),
            shape((4,), i32), shape((5,), i32), shape((1,), i32))  # fmt: skip
    attention = jax.jit(functools.partial(paged_attention, layer=0, sm_scale=0.1, impl="xla"))
    module = jax.export.export(attention, platforms=[platform])(*args).mlir_module()
    dots = [line for line in module.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 2 and all("precision = [HIGHEST, HIGHEST]" in line for line in dots)


def test_num_seqs_zero_gives_all_zero_output():
    case = make_case(4, q_lens=[2, 1], kv_lens=[4, 6])
    case.num_seqs = jnp.array([0], jnp.int32)
    out = paged_attention(*case.args(), layer=case.layer, impl="xla")
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_attention_depends_on_the_right_pages():
    """Swapping two sequences' tables swaps their outputs (the kernel follows the table)."""
    case = make_case(5, q_lens=[1, 1], kv_lens=[10, 10], pad_seqs=0, pad_tokens=0)
    q = jnp.concatenate([case.q[:1], case.q[:1]])
    out = paged_attention(q, *case.args()[1:], layer=case.layer, impl="xla")
    swapped = paged_attention(q, case.kv_pages, case.block_tables[::-1], *case.args()[3:],
                              layer=case.layer, impl="xla")
    assert not np.allclose(out[0], out[1])
    np.testing.assert_allclose(swapped[0], out[1], rtol=1e-6)


@pytest.mark.parametrize("tuning,message", [
    (dict(block_q=0), r"block_q=0 must be a positive int or None"),
    (dict(pages_per_step=-2), r"pages_per_step=-2 must be a positive int or None"),
    (dict(block_q=2.5), r"block_q=2.5 must be a positive int or None"),
])
def test_bad_tuning_is_refused(tuning, message):
    case = make_case(6, q_lens=[2], kv_lens=[5])
    with pytest.raises(ValueError, match=message):
        paged_attention(*case.args(), layer=case.layer, impl="xla", **tuning)
