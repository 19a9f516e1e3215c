"""PagePool (in-place updates of one pool array) and build_batch (bucketed int32 metadata)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from pool_cases import assert_same_bytes

from kvjax.tiers.kv_cache import KVCache, KVCacheConfig
from kvjax.tiers.page_pool import (
    BatchMetadata,
    Buckets,
    PagePool,
    PoolConfig,
    bucket,
    build_batch,
)
from pallas_kernels import (
    gather_blocks_reference,
    paged_attention,
    paged_attention_reference,
    scatter_blocks_reference,
    write_kv_reference,
)

CONFIG = PoolConfig(num_blocks=8, num_layers=2, num_kv_heads=2, page_size=4, head_dim=16,
                    dtype="float32")


# ---- PoolConfig ---------------------------------------------------------------------------

def test_config_sizes():
    cfg = PoolConfig(num_blocks=10, num_layers=32, num_kv_heads=8, page_size=16, head_dim=128)
    assert cfg.dtype == "bfloat16"
    assert cfg.block_shape == (32, 2, 8, 16, 128)
    assert cfg.bytes_per_block == 32 * 2 * 8 * 16 * 128 * 2 == 2 * 2**20
    assert cfg.pool_bytes == 10 * cfg.bytes_per_block


def test_config_from_dict_and_canonical_dtype():
    values = dict(num_blocks=4, num_layers=1, num_kv_heads=1, page_size=8, head_dim=32,
                  dtype=jnp.float16)
    assert PoolConfig.from_dict(values) == PoolConfig(**{**values, "dtype": "float16"})


@pytest.mark.parametrize("values,message", [
    (dict(num_blocks=0), r"num_blocks=0 must be a positive int"),
    (dict(page_size=16.0), r"page_size=16.0 must be a positive int"),
    (dict(head_dim=True), r"head_dim=True must be a positive int"),
    (dict(dtype="float33"), r"dtype='float33' is not a dtype jax.numpy knows"),
    (dict(pages=3), r"unknown pool config keys \['pages'\]; expected some of \['num_blocks'"),
])
def test_config_errors(values, message):
    base = dict(num_blocks=4, num_layers=1, num_kv_heads=1, page_size=8, head_dim=32)
    with pytest.raises(ValueError, match=message):
        PoolConfig.from_dict({**base, **values})


# ---- PagePool -----------------------------------------------------------------------------

def test_pool_starts_zeroed_with_the_requested_sharding():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pool = PagePool(CONFIG, sharding=sharding)
    assert pool.kv_pages.shape == CONFIG.shape and pool.kv_pages.dtype == jnp.float32
    assert pool.kv_pages.sharding == sharding
    assert not np.asarray(pool.kv_pages).any()


def test_updates_happen_in_place_and_old_references_die():
    pool = PagePool(CONFIG)
    first = pool.kv_pages
    address = first.unsafe_buffer_pointer()
    kv = jnp.ones((3, 2, 16), jnp.float32)
    pool.write(kv, kv, [0, 5, -1], layer=1)
    assert first.is_deleted()
    pool.scatter([7, -1], jnp.full((2,) + CONFIG.block_shape, 2.0))
    assert pool.kv_pages.unsafe_buffer_pointer() == address
    blocks = np.asarray(pool.gather([7, 0, 1, -1]))
    assert (blocks[0] == 2.0).all() and not blocks[3].any()
    assert (blocks[1, 1, :, :, 0] == 1.0).all() and (blocks[2, 1, :, :, 1] == 1.0).all()
    assert blocks[1].sum() == blocks[2].sum() == 2 * 2 * 16  # only those slots changed
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(first)


def test_setting_the_result_of_a_jitted_step():
    pool = PagePool(CONFIG)
    step = jax.jit(lambda pages: pages.at[3].add(1.0), donate_argnums=0)
    result = step(pool.kv_pages)
    with pytest.raises(RuntimeError, match=r"the pool's array was donated .* set pool.kv_pages"):
        pool.check_invariants()  # the loop forgot to hand the result back
    pool.kv_pages = result
    pool.check_invariants()
    assert np.asarray(pool.gather([3]))[0].min() == 1.0
    with pytest.raises(ValueError, match=r"new kv_pages \(8, 2, 2, 2, 4, 16\) bfloat16 must match"):
        pool.kv_pages = pool.kv_pages.astype(jnp.bfloat16)


@pytest.mark.parametrize("call,message", [
    (lambda p: p.write(*_kv(2), [0, 32], layer=0), r"slot 32 is outside the pool of 32 slots"),
    (lambda p: p.write(*_kv(2), [3, 3], layer=0), r"slot 3 is written more than once"),
    (lambda p: p.write(*_kv(2), [0, 1], layer=2), r"layer=2 is out of range for num_layers=2"),
    (lambda p: p.gather([8]), r"block id 8 is outside the pool \[0, 8\)"),
    (lambda p: p.scatter([1, 1], jnp.zeros((2,) + CONFIG.block_shape)),
     r"block id 1 appears more than once"),
    (lambda p: p.scatter([1], jnp.zeros((1, 2))), r"blocks.shape=\(1, 2\) must be"),
])
def test_bad_input_raises_and_leaves_the_pool_alone(call, message):
    pool = PagePool(CONFIG)
    before = pool.kv_pages
    with pytest.raises(ValueError, match=message):
        call(pool)
    assert pool.kv_pages is before and not before.is_deleted()


def _kv(num_tokens):
    kv = jnp.ones((num_tokens, CONFIG.num_kv_heads, CONFIG.head_dim), jnp.float32)
    return kv, kv


class PoolMachine(RuleBasedStateMachine):
    """Random writes and scatters against a numpy model of the pool, checked byte for byte.
    Shapes are fixed (padding with -1) so the kernels compile once."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(CONFIG)
        self.model = np.zeros(CONFIG.shape, np.float32)
        self.address = self.pool.kv_pages.unsafe_buffer_pointer()
        self.rng = np.random.default_rng(0)

    @rule(slots=st.lists(st.integers(-1, 31), min_size=6, max_size=6), layer=st.integers(0, 1))
    def write(self, slots, layer):
        slots = [s if s < 0 or slots.index(s) == i else -1 for i, s in enumerate(slots)]
        k, v = (self.rng.standard_normal((6, 2, 16)).astype(np.float32) for _ in range(2))
        self.pool.write(jnp.asarray(k), jnp.asarray(v), slots, layer=layer)
        self.model = np.asarray(write_kv_reference(self.model, k, v, np.array(slots), layer=layer))

    @rule(ids=st.lists(st.integers(-1, 7), min_size=3, max_size=3))
    def scatter(self, ids):
        ids = [b if b < 0 or ids.index(b) == i else -1 for i, b in enumerate(ids)]
        blocks = self.rng.standard_normal((3,) + CONFIG.block_shape).astype(np.float32)
        self.pool.scatter(ids, jnp.asarray(blocks))
        self.model = np.asarray(scatter_blocks_reference(self.model, np.array(ids), blocks))

    @rule(ids=st.lists(st.integers(-1, 7), min_size=3, max_size=3))
    def gather(self, ids):
        assert_same_bytes(self.pool.gather(ids), gather_blocks_reference(self.model, ids))

    @invariant()
    def pool_matches_model(self):
        self.pool.check_invariants()
        assert self.pool.kv_pages.unsafe_buffer_pointer() == self.address
        assert_same_bytes(self.pool.kv_pages, self.model)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=8, stateful_step_count=6, deadline=None)


# ---- build_batch --------------------------------------------------------------------------

def naive_slots(block_tables, seq_lens, q_lens, page_size):
    slots = []
    for table, kv_len, q_len in zip(block_tables, seq_lens, q_lens):
        for pos in range(kv_len - q_len, kv_len):
            slots.append(table[pos // page_size] * page_size + pos % page_size)
    return slots


@st.composite
def ragged_batches(draw):
    num_seqs = draw(st.integers(0, 11))
    seq_lens = draw(st.lists(st.integers(0, 40), min_size=num_seqs, max_size=num_seqs))
    q_lens = [draw(st.integers(0, n)) for n in seq_lens]
    tables = [draw(st.lists(st.integers(0, 99), min_size=-(-n // 4), max_size=-(-n // 4) + 2))
              for n in seq_lens]
    return tables, seq_lens, q_lens


@settings(max_examples=60, deadline=None)
@given(ragged_batches())
def test_build_batch_properties(batch):
    tables, seq_lens, q_lens = batch
    meta = build_batch(tables, seq_lens, q_lens, page_size=4, num_blocks=100)
    n, live = len(seq_lens), sum(q_lens)
    max_seqs, pages = meta.block_tables.shape
    assert max_seqs == bucket(n, 8) and max_seqs >= n
    assert pages == bucket(max([-(-s // 4) for s in seq_lens], default=0), 4)
    assert meta.slot_mapping.shape == meta.positions.shape == (bucket(live, 16),)
    assert all(a.dtype == np.int32 for a in meta)
    assert meta.num_seqs.tolist() == [n]
    np.testing.assert_array_equal(meta.seq_lens, seq_lens + [0] * (max_seqs - n))
    np.testing.assert_array_equal(np.diff(meta.cu_q_lens), q_lens + [0] * (max_seqs - n))
    assert meta.slot_mapping[:live].tolist() == naive_slots(tables, seq_lens, q_lens, 4)
    assert (meta.slot_mapping[live:] == -1).all()
    assert meta.positions[:live].tolist() == [p for s, q in zip(seq_lens, q_lens)
                                              for p in range(s - q, s)]
    for s, (table, kv_len) in enumerate(zip(tables, seq_lens)):
        used = -(-kv_len // 4)
        assert meta.block_tables[s, :used].tolist() == table[:used]
    assert (meta.block_tables[n:] == 0).all()


def test_batches_within_a_bucket_share_shapes_and_one_compile():
    traces = []

    @jax.jit
    def step(meta: BatchMetadata):
        traces.append(1)  # runs only while tracing
        return meta.seq_lens.sum() + (meta.slot_mapping >= 0).sum()

    small = build_batch([[1], [2, 3]], [3, 6], [3, 1], page_size=4)
    large = build_batch([[4], [5, 6], [7], [0, 9, 8]], [1, 8, 2, 12], [1, 5, 2, 4], page_size=4)
    assert [a.shape for a in small] == [a.shape for a in large]
    assert int(step(small)) == 9 + 4 and int(step(large)) == 23 + 12
    assert len(traces) == 1
    step(build_batch([[1]] * 9, [1] * 9, [1] * 9, page_size=4))  # 9 sequences: next bucket
    assert len(traces) == 2


def test_built_batch_drives_write_and_attention():
    """The padded metadata feeds write_kv and paged_attention directly, and padding does not
    change the result: same output as the reference on the unpadded batch."""
    cfg = PoolConfig(num_blocks=16, num_layers=1, num_kv_heads=2, page_size=4, head_dim=16,
                     dtype="float32")
    pool = PagePool(cfg)
    tables, seq_lens, q_lens = [[5, 2, 9], [11], [0, 14]], [10, 3, 5], [10, 1, 2]
    meta = pool.build_batch(tables, seq_lens, q_lens)
    rng = np.random.default_rng(0)
    num_tokens = meta.slot_mapping.shape[0]
    q, k, v = (jnp.asarray(rng.standard_normal((num_tokens, h, 16)), jnp.float32)
               for h in (4, 2, 2))
    pool.write(k, v, meta.slot_mapping, layer=0)
    out = paged_attention(q, pool.kv_pages, *meta[:4], layer=0)
    live = sum(q_lens)
    exact = build_batch(tables, seq_lens, q_lens, page_size=4,
                        buckets=Buckets(min_num_seqs=1, min_pages_per_seq=1, min_num_tokens=1))
    expected = paged_attention_reference(q[:live], pool.kv_pages, *exact[:4], layer=0)
    np.testing.assert_allclose(out[:live], expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("args,message", [
    (([[1]], [3, 4], [1, 1]), r"len\(block_tables\)=1, len\(seq_lens\)=2 and len\(q_lens\)=2"),
    (([[1]], [3], [4]), r"q_lens\[0\]=4 must be within \[0, seq_lens\[0\]=3\]"),
    (([[1]], [3], [-1]), r"q_lens\[0\]=-1 must be within"),
    (([[1, 2]], [9], [1]), r"block_tables\[0\] has 2 blocks, too few for seq_lens\[0\]=9"),
    (([[1, 16]], [8], [1]), r"block_tables\[0\]\[1\]=16 is not a block of the pool \[0, 16\)"),
    (([[-3]], [1], [1]), r"block_tables\[0\]\[0\]=-3 is not a block of the pool"),
])
def test_build_batch_errors(args, message):
    with pytest.raises(ValueError, match=message):
        build_batch(*args, page_size=4, num_blocks=16)


def test_bucket_and_bucket_policy():
    assert [bucket(n, 4) for n in (0, 1, 4, 5, 8, 9, 100)] == [4, 4, 4, 8, 8, 16, 128]
    with pytest.raises(ValueError, match=r"min_num_tokens=0 must be a positive int"):
        Buckets(min_num_tokens=0)


def test_an_unknown_impl_is_refused_when_the_pool_is_built():
    """A misspelled impl used to fail only at the first write, with sequences already admitted."""
    with pytest.raises(ValueError, match=r"^impl='cuda' is not a known implementation; expected one of"):
        PagePool(CONFIG, impl="cuda")
    with pytest.raises(ValueError, match=r"^impl='triton' is not a known implementation"):
        KVCache(KVCacheConfig(pool=CONFIG), impl="triton")
