"""write_kv: every implementation against the reference, byte for byte, and in place."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pool_cases import IMPLS, assert_same_bytes, lower_for, random_bytes, shapes_of

from pallas_kernels import check_slot_mapping, write_kv, write_kv_reference
from pallas_kernels.kv_write_pallas import write_kv_gpu, write_kv_tpu

NUM_BLOCKS, NUM_LAYERS = 6, 3
# The shape most tests share, so they reuse the grid's compiled programs (compiles dominate
# the runtime of these tests on CPU).
SMALL = dict(dtype=jnp.float32, page_size=4, head_dim=32, num_kv_heads=2)


def edge_slots(rng, page_size: int) -> np.ndarray:
    """Distinct slots (page_size >= 4) over shuffled blocks: offsets 0 and page_size-1, a run across a page boundary
    into a non-adjacent block, and padding (-1 and another negative) in the middle and end."""
    a, b, c = (int(x) for x in rng.permutation(NUM_BLOCKS)[:3])
    base = lambda block: block * page_size
    slots = [base(a) + page_size - 1, base(c), -1,  # last then first offset, far apart
             base(b) + page_size - 2, base(b) + page_size - 1, base(a) + 0,  # crosses b -> a
             base(c) + page_size // 2, -7, base(b), base(c) + page_size - 1, -1]
    slots = np.array(slots, np.int32)
    check_slot_mapping(slots, num_blocks=NUM_BLOCKS, page_size=page_size)
    return slots


def make_write(rng, *, dtype, page_size, head_dim, num_kv_heads):
    pool = random_bytes(rng, (NUM_BLOCKS, NUM_LAYERS, 2, num_kv_heads, page_size, head_dim), dtype)
    slots = edge_slots(rng, page_size)
    k = random_bytes(rng, (len(slots), num_kv_heads, head_dim), dtype)
    v = random_bytes(rng, (len(slots), num_kv_heads, head_dim), dtype)
    return pool, k, v, slots


def run(impl, pool, k, v, slots, *, layer, **tuning):
    return write_kv(jnp.asarray(pool), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                    layer=layer, impl=impl, **tuning)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("page_size,head_dim,num_kv_heads", [(4, 32, 2), (16, 96, 1)])
def test_matches_reference_bytes(impl, dtype, page_size, head_dim, num_kv_heads):
    rng = np.random.default_rng(page_size + head_dim)
    pool, k, v, slots = make_write(rng, dtype=dtype, page_size=page_size, head_dim=head_dim,
                                   num_kv_heads=num_kv_heads)
    out = run(impl, pool, k, v, slots, layer=1)
    assert_same_bytes(out, write_kv_reference(pool, k, v, slots, layer=1))


@pytest.mark.parametrize("impl", IMPLS)
def test_float8_e5m2_nan_payloads_survive(impl):
    """XLA's CPU backend rewrites e5m2 NaN bits when it stacks or scatters floats; the
    kernels move unsigned-integer views, so every payload survives."""
    rng = np.random.default_rng(9)
    pool, k, v, slots = make_write(rng, dtype=jnp.float8_e5m2, page_size=4, head_dim=32,
                                   num_kv_heads=2)
    assert np.isnan(k.astype(np.float32)).any()
    out = run(impl, pool, k, v, slots, layer=1)
    assert_same_bytes(out, write_kv_reference(pool, k, v, slots, layer=1))


@pytest.mark.parametrize("impl", IMPLS)
def test_changes_exactly_the_addressed_slots(impl):
    """Independent of the reference: the set of changed elements is exactly K and V of the
    live slots in the chosen layer, and they hold the tokens' rows."""
    rng = np.random.default_rng(1)
    _, k, v, slots = make_write(rng, **SMALL)
    k, v = (rng.standard_normal(x.shape).astype(np.float32) for x in (k, v))
    pool = np.full((NUM_BLOCKS, NUM_LAYERS, 2, 2, 4, 32), np.nan, np.float32)
    out = np.asarray(run(impl, pool, k, v, slots, layer=2))
    expected = np.zeros(out.shape, bool)
    for t, slot in enumerate(slots):
        if slot >= 0:
            block, offset = divmod(int(slot), 4)
            expected[block, 2, :, :, offset] = True
            np.testing.assert_array_equal(out[block, 2, 0, :, offset], k[t])
            np.testing.assert_array_equal(out[block, 2, 1, :, offset], v[t])
    np.testing.assert_array_equal(~np.isnan(out), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_writes_to_different_layers_compose(impl):
    rng = np.random.default_rng(2)
    pool, k, v, slots = make_write(rng, **SMALL)
    expected = write_kv_reference(write_kv_reference(pool, k, v, slots, layer=2),
                                  v, k, slots[::-1], layer=0)
    out = run(impl, pool, k, v, slots, layer=2)
    out = write_kv(out, jnp.asarray(v), jnp.asarray(k), jnp.asarray(slots[::-1]), layer=0,
                   impl=impl)
    assert_same_bytes(out, expected)


def test_tpu_steps_that_do_not_divide_the_tokens():
    rng = np.random.default_rng(3)
    pool, k, v, slots = make_write(rng, **SMALL)
    assert len(slots) % 4  # the last grid step is partial
    out = run("pallas_tpu", pool, k, v, slots, layer=1, tokens_per_step=4)
    assert_same_bytes(out, write_kv_reference(pool, k, v, slots, layer=1))


@pytest.mark.parametrize("impl", IMPLS)
def test_pool_is_updated_in_place(impl):
    """The caller's pool buffer is donated and the result lives in the same memory."""
    rng = np.random.default_rng(4)
    pool_np, k, v, slots = make_write(rng, **SMALL)
    pool = jnp.asarray(pool_np)
    address = pool.unsafe_buffer_pointer()
    out = write_kv(pool, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots), layer=1, impl=impl)
    assert pool.is_deleted()
    assert out.unsafe_buffer_pointer() == address
    assert_same_bytes(out, write_kv_reference(pool_np, k, v, slots, layer=1))


@pytest.mark.parametrize("impl", IMPLS)
def test_all_padding_and_no_tokens_leave_the_pool_unchanged(impl):
    rng = np.random.default_rng(5)
    pool, k, v, _ = make_write(rng, **SMALL)
    assert_same_bytes(run(impl, pool, k, v, np.full(len(k), -1, np.int32), layer=1), pool)
    assert_same_bytes(run(impl, pool, k[:0], v[:0], np.zeros(0, np.int32), layer=1), pool)


def test_write_kv_inside_a_jitted_step():
    """The serving loop calls write_kv inside its own jit; layers are static there."""
    rng = np.random.default_rng(6)
    pool, k, v, slots = make_write(rng, **SMALL)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(kv_pages, k, v, slots):
        for layer in range(NUM_LAYERS):
            kv_pages = write_kv(kv_pages, k, v, slots, layer=layer)
        return kv_pages

    expected = pool
    for layer in range(NUM_LAYERS):
        expected = write_kv_reference(expected, k, v, slots, layer=layer)
    assert_same_bytes(step(jnp.asarray(pool), k, v, slots), expected)


@pytest.mark.parametrize("platform,fn,marker", [
    ("tpu", write_kv_tpu, "tpu_custom_call"),
    ("cuda", write_kv_gpu, "__gpu$xla.gpu.triton"),
])
def test_kernel_lowers_for_its_accelerator(platform, fn, marker):
    """The Mosaic / Triton lowering accepts the kernel (bf16, head_dim 96 = 64 + 32) and
    aliases the pool to the output."""
    rng = np.random.default_rng(7)
    pool, k, v, slots = make_write(rng, dtype=jnp.bfloat16, page_size=16, head_dim=96,
                                   num_kv_heads=2)
    text = lower_for(platform, functools.partial(fn, layer=1, interpret=False),
                     *shapes_of(pool, k, v, slots))
    assert marker in text
    assert "output_operand_alias" in text


@pytest.mark.parametrize("override,message", [
    (dict(layer=3), r"layer=3 is out of range for num_layers=3"),
    (dict(layer=jnp.int32(0)), r"must be a Python int"),
    (dict(k=np.zeros((11, 2, 16), np.float32)), r"k.shape=\(11, 2, 16\) must be \[num_tokens"),
    (dict(v=np.zeros((11, 2, 32), np.float16)), r"v.dtype=float16 must equal kv_pages.dtype"),
    (dict(v=np.zeros((10, 2, 32), np.float32)), r"k.shape=\(11, 2, 32\) must equal v.shape"),
    (dict(slots=np.zeros(11, np.int64)), r"slot_mapping.dtype=int64 must be int32"),
    (dict(slots=np.zeros(10, np.int32)), r"slot_mapping.shape=\(10,\) must be \(11,\)"),
    (dict(pool=np.zeros((6, 3, 4, 32), np.float32)), r"kv_pages.shape=\(6, 3, 4, 32\) must be"),
    (dict(impl="cuda"), r"impl='cuda' is not a known implementation"),
    (dict(impl="pallas_tpu", interpret=False), r"cannot compile on backend 'cpu'"),
    (dict(slots=list(range(11))), r"^slot_mapping must be an array \(jax or numpy\), got list$"),
    (dict(k=np.zeros((11, 2, 32), np.float32).tolist()), r"^k must be an array \(jax or numpy\), got list$"),
    (dict(layer=True), r"^layer=True must be a Python int"),
])
def test_bad_arguments_raise(override, message):
    """Checked before anything runs (numpy inputs keep an int64 dtype to reject)."""
    rng = np.random.default_rng(8)
    pool, k, v, slots = make_write(rng, **SMALL)
    args = dict(pool=pool, k=k, v=v, slots=slots, layer=1, impl="xla", interpret=None)
    args.update(override)
    with pytest.raises(ValueError, match=message):
        write_kv(args["pool"], args["k"], args["v"], args["slots"], layer=args["layer"],
                 impl=args["impl"], interpret=args["interpret"])


@pytest.mark.parametrize("impl", IMPLS)
def test_a_slot_past_the_pool_is_dropped_on_every_implementation(impl):
    # as XLA's scatter drops it; the Triton kernel used to write it into the last block
    rng = np.random.default_rng(5)
    pool, k, v, _ = make_write(rng, **SMALL)
    slots = np.array([2, NUM_BLOCKS * 4, NUM_BLOCKS * 4 + 3, -1] + [-1] * (len(k) - 4), np.int32)
    out = np.asarray(run(impl, pool, k, v, slots, layer=1))
    expected = pool.copy()
    expected[0, 1, 0, :, 2], expected[0, 1, 1, :, 2] = k[0], v[0]
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    assert_same_bytes(write_kv_reference(pool, k, v, slots, layer=1), out)  # the reference raised IndexError
