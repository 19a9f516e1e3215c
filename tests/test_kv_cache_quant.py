"""KVCache with quantized pools and lossy offload: the block codecs at the device <-> host edge.

Quantized pools (int8 with token and page scales, fp8 e4m3 and e5m2): blocks go device ->
host -> disk and back bit-exact, data and scales; a warm restart serves them; a directory
written with one codec is not read with another. Lossy offload of a float pool: values come
back within the format's error bound, the trie marks them lossy, ``accept_lossy=False``
recomputes them, and the default stays lossless. Capacities count the codec's bytes. The swap
store moves quantized blocks bit-exact. Bad configurations get a message naming the value.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_cache_cases import MemoryDisk, serve_from_each_tier
from paged_attention_cases import QUANT_ERROR_BOUNDS
from tier_cases import random_blocks, same_bits

from kvjax.cache.cost_model import CostModel
from kvjax.cache.trie_node import Tier
from kvjax.serving.swap_store import SwapStore
from kvjax.tiers.block_codec import IdentityCodec, make_codec
from kvjax.tiers.host_pool import HostPool
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig
from kvjax.tiers.page_pool import PagePool, PoolConfig
from pallas_kernels.kv_format import FORMATS, QuantizedPages, relative_error

SHAPE = dict(num_blocks=8, num_layers=2, num_kv_heads=2, page_size=4, head_dim=8)
FLOAT_POOL = PoolConfig(**SHAPE, dtype="float32")
ALWAYS_FETCH = CostModel(recompute_seconds_per_token=1.0)
TIMEOUT = 30.0
TOKENS = np.arange(9, dtype=np.int32)  # two full pages and one token (always computed)


def quant_pool(quant, scale="token"):
    return PoolConfig(**SHAPE, dtype="bfloat16", kv_quant=quant, kv_scale=scale)


def make(pool, *, host_blocks=8, disk_dir=None, **options):
    """A KVCache whose host holds ``host_blocks`` blocks as its codec stores them."""
    codec = make_codec(pool, options.get("offload_quant"), options.get("offload_scale", "token"))
    cache_keys = {"disk_tier", "transfer_factory"}
    config = KVCacheConfig(pool=pool, host_bytes=host_blocks * codec.block_nbytes, cost_model=ALWAYS_FETCH,
                           disk_dir=None if disk_dir is None else str(disk_dir),
                           disk_bytes=0 if disk_dir is None else 1 << 26,
                           **{k: v for k, v in options.items() if k not in cache_keys})  # fmt: skip
    return KVCache(config, **{k: v for k, v in options.items() if k in cache_keys})


def random_quantized(pool, n, seed=0):
    """``[n]`` blocks of ``pool``'s format: random data bits (NaN patterns included) and
    random positive scales, so only a bit-exact path reproduces them."""
    fmt = pool.kv_format
    data = random_blocks(n, pool.block_shape, fmt.storage_dtype.name, seed)
    rng = np.random.default_rng(seed + 1)
    scales = rng.uniform(1e-3, 2.0, (n, *fmt.scales_shape(pool.block_shape))).astype(np.float32)
    return QuantizedPages(data, scales)


def compute(cache, tokens, blocks, *, accept_lossy=None):
    """Admit, wait, write ``blocks`` into the pages that did not hit, commit, release; returns
    (hit pages, lossy flags of the hits)."""
    handle = cache.admit(tokens, accept_lossy=accept_lossy)
    assert handle is not None and cache.wait_ready(handle, TIMEOUT)
    first = handle.num_hit_tokens // cache.page_size
    if first < len(handle.block_ids):
        cache.pool.scatter(handle.block_ids[first:], jax.tree.map(lambda x: x[first : len(handle.block_ids)], blocks))
    cache.commit(handle, tokens)
    lossy = cache.admission_report(handle).lossy_pages
    cache.release(handle)
    return first, lossy


def hit_kv(cache, tokens, **admit_options):
    """(hit pages, their KV as numpy leaves, lossy flags) of a fresh admission (released)."""
    handle = cache.admit(tokens, **admit_options)
    assert cache.wait_ready(handle, TIMEOUT)
    num_hit = handle.num_hit_tokens // cache.page_size
    kv = jax.tree.map(np.asarray, cache.pool.gather(handle.block_ids[:num_hit])) if num_hit else None
    lossy = cache.admission_report(handle).lossy_pages
    cache.release(handle)
    return num_hit, kv, lossy


def same_leaves(a, b) -> bool:
    return all(same_bits(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


QUANT_CASES = [("int8", "token", "write_back"), ("int8", "page", "write_through"),
               ("fp8_e4m3", "token", "selective"), ("fp8_e5m2", "token", "write_back"),
               ("fp8_e5m2", "page", "write_through")]  # fmt: skip


# --- quantized pools: bit-exact through every tier ----------------------------------------------


@pytest.mark.parametrize("quant, scale, write_policy", QUANT_CASES)
def test_quantized_blocks_round_trip_device_host_disk_bit_exact(tmp_path, quant, scale, write_policy):
    pool = quant_pool(quant, scale)
    blocks = random_quantized(pool, 3, seed=len(quant))
    with make(pool, disk_dir=tmp_path, write_policy=write_policy, selective_min_hits=1) as cache:
        assert cache.host_pool.block_nbytes == pool.bytes_per_block  # data + scales, nothing more
        compute(cache, TOKENS, blocks)
        # Every write policy has a host copy by the first eviction (selective: after one hit).
        served = serve_from_each_tier(cache, TOKENS, hit_kv, timeout=TIMEOUT)
    for tier, (num_hit, kv, lossy) in served.items():
        assert num_hit == 2 and same_leaves(kv, blocks[:2]), tier
        assert not lossy.any(), tier


def test_quantized_pool_warm_restart_serves_the_disk_directory(tmp_path):
    pool = quant_pool("int8", "page")
    blocks = random_quantized(pool, 3, seed=7)
    with make(pool, disk_dir=tmp_path, write_policy="write_through") as cache:
        compute(cache, TOKENS, blocks)
        assert cache.flush(TIMEOUT)
    with make(pool, disk_dir=tmp_path) as reopened:
        assert reopened.disk_tier.stats().recovered_segments >= 1
        assert reopened.match(TOKENS).tiers.tolist() == [Tier.DISK] * 2  # found by key
        num_hit, kv, lossy = hit_kv(reopened, TOKENS)
        assert num_hit == 2 and same_leaves(kv, blocks[:2]) and not lossy.any()
        reopened.check_invariants()


@pytest.mark.parametrize("reader", [
    dict(pool=quant_pool("fp8_e4m3")),  # same bytes per block, other bits: must never be read
    dict(pool=PoolConfig(**SHAPE, dtype="bfloat16"), offload_quant="int8"),  # same layout, lossy
    # Same format and row bytes, other block layout (1 layer x 4 heads): another model's KV.
    dict(pool=PoolConfig(**{**SHAPE, "num_layers": 1, "num_kv_heads": 4}, dtype="bfloat16", kv_quant="int8")),
])  # fmt: skip
def test_a_directory_written_with_one_codec_is_a_miss_for_another(tmp_path, reader):
    writer = quant_pool("int8")
    with make(writer, disk_dir=tmp_path, write_policy="write_through") as cache:
        compute(cache, TOKENS, random_quantized(writer, 3))
        assert cache.flush(TIMEOUT)
    with make(disk_dir=tmp_path, **reader) as other:
        stats = other.disk_tier.stats()
        assert stats.codec_mismatch_segments == stats.skipped_segments >= 1 and len(other.disk_tier) == 0
        assert other.match(TOKENS).num_hit_blocks == 0
        assert other.admit(TOKENS).num_hit_tokens == 0
    with make(writer, disk_dir=tmp_path) as same:  # the files were left alone
        assert same.match(TOKENS).num_hit_blocks == 2


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([(q, g) for q in FORMATS for g in ("token", "page")]), st.integers(0, 2**32 - 1))
def test_packed_blocks_round_trip_through_the_host_bit_exact(fmt, seed):
    """Any data bits and any scale bits (NaN payloads, infinities, subnormals, both signs):
    encode, a host slot, decode give back every bit of data and scales."""
    pool = quant_pool(*fmt)
    codec = make_codec(pool)
    blocks = random_quantized(pool, 3, seed=seed % 1000)
    scale_bits = random_blocks(3, pool.kv_format.scales_shape(pool.block_shape), "uint32", seed)
    blocks = QuantizedPages(jnp.asarray(blocks.data), jnp.asarray(scale_bits.view(np.float32)))
    host = HostPool(codec.block_shape, codec.dtype, 4)
    host.write(np.array([2, 0, 3]), codec.encode(blocks))
    back = codec.decode(host.to_device(np.array([2, 0, 3]), 4))
    assert same_leaves(jax.tree.map(lambda x: np.asarray(x)[:3], back), blocks)


def test_swap_store_moves_quantized_blocks_bit_exact():
    pool_config = quant_pool("fp8_e5m2", "page")
    pool = PagePool(pool_config)
    blocks = random_quantized(pool_config, 3, seed=3)
    pool.scatter([1, 4, 6], blocks)
    swap = SwapStore(pool, num_slots=3)
    assert swap.host.capacity_bytes == 3 * pool_config.bytes_per_block
    swap.swap_out([(1, 0), (4, 2), (6, 1)])
    pool.scatter([1, 4, 6], random_quantized(pool_config, 3, seed=9))  # the blocks are reused
    swap.swap_in([(0, 7), (2, 0), (1, 3)])
    assert same_leaves(jax.tree.map(np.asarray, pool.gather([7, 0, 3])), blocks)


# --- lossy offload of a float pool -----------------------------------------------------------------


@pytest.mark.parametrize("quant", list(FORMATS))
def test_lossy_offload_comes_back_within_the_format_bound_and_marked_lossy(quant):
    blocks = np.random.default_rng(1).normal(size=(3, *FLOAT_POOL.block_shape)).astype(np.float32)
    with make(FLOAT_POOL, offload_quant=quant) as cache:
        assert cache.codec.lossy and cache.host_pool.block_nbytes < FLOAT_POOL.bytes_per_block
        compute(cache, TOKENS, blocks)
        num_hit, kv, lossy = hit_kv(cache, TOKENS)
        assert num_hit == 2 and same_bits(kv, blocks[:2]) and not lossy.any()  # device: exact
        cache.evict(8)
        assert cache.match(TOKENS).lossy.tolist() == [True, True]
        num_hit, kv, lossy = hit_kv(cache, TOKENS)
        assert num_hit == 2 and lossy.tolist() == [True, True]
        assert 0 < relative_error(kv, blocks[:2]) <= QUANT_ERROR_BOUNDS[quant]
        match = cache.match(TOKENS)  # fetched into the device: still lossy there
        assert match.num_device_blocks == 2 and match.lossy.tolist() == [True, True]
        assert cache.stats.lossy_hit_blocks == 2
        cache.check_invariants()


def test_accept_lossy_false_recomputes_lossy_pages_and_the_exact_copy_takes_over():
    blocks = np.random.default_rng(2).normal(size=(3, *FLOAT_POOL.block_shape)).astype(np.float32)
    with make(FLOAT_POOL, offload_quant="fp8_e4m3", accept_lossy=False) as cache:
        compute(cache, TOKENS, blocks)
        cache.evict(8)
        assert cache.match(TOKENS).lossy.all()
        cache.prefetch(TOKENS)  # lossy pages are not worth moving for this caller
        assert cache.match(TOKENS).num_device_blocks == 0
        hits, lossy = compute(cache, TOKENS, blocks)  # refused: recomputed, written exact
        assert hits == 0 and cache.stats.refused_lossy_blocks == 2 and cache.stats.fetched_host_blocks == 0
        match = cache.match(TOKENS)
        assert match.num_device_blocks == 2 and not match.lossy.any()
        num_hit, kv, lossy = hit_kv(cache, TOKENS)  # the recomputed copy serves exact hits
        assert num_hit == 2 and same_bits(kv, blocks[:2]) and not lossy.any()
        cache.check_invariants()


def lossy_on_device(cache, tokens, blocks):
    """Compute ``tokens``, evict them to host (lossy) and fetch them back; return the device
    blocks of the lossy copy."""
    compute(cache, tokens, blocks)
    cache.evict(8)
    num_hit, _, lossy = hit_kv(cache, tokens)
    match = cache.match(tokens)
    assert num_hit == match.num_device_blocks == 2 and lossy.all() and match.lossy.all()
    return match.blocks


@pytest.mark.parametrize("pinned", [False, True])
def test_a_refusing_recompute_replaces_a_lossy_device_copy(pinned):
    blocks = np.random.default_rng(5).normal(size=(3, *FLOAT_POOL.block_shape)).astype(np.float32)
    with make(FLOAT_POOL, offload_quant="int8") as cache:
        lossy_blocks = lossy_on_device(cache, TOKENS, blocks)
        if pinned:  # a pin keeps the pages on device, not the blocks: it moves to the exact copy
            assert cache.pin(TOKENS) == 8
        refused, hits = [], []
        for _ in range(3):
            hit, lossy = compute(cache, TOKENS, blocks, accept_lossy=False)
            hits.append(hit)
            refused.append(cache.stats.refused_lossy_blocks)
            assert not lossy.any()
            cache.check_invariants()
        assert hits == [0, 2, 2] and refused == [2, 2, 2]  # before the fix: [0, 0, 0], [2, 4, 6]
        match = cache.match(TOKENS)
        assert match.num_device_blocks == 2 and not match.lossy.any()
        assert match.tiers.tolist() == [Tier.DEVICE | Tier.HOST] * 2  # the lossy host copy remains
        assert not set(match.blocks.tolist()) & set(lossy_blocks.tolist())
        assert all(cache.allocator.is_free(b) for b in lossy_blocks.tolist())  # no reference left
        num_hit, kv, lossy = hit_kv(cache, TOKENS)  # accepting requests get the exact copy too
        assert num_hit == 2 and same_bits(kv, blocks[:2]) and not lossy.any()
        if pinned:
            assert cache.evict(8) == [] and cache.match(TOKENS).num_device_blocks == 2
            cache.unpin(TOKENS)
        cache.evict(8)  # the device copy goes; the host copy is still the lossy one
        assert cache.match(TOKENS).lossy.tolist() == [True, True]
        num_hit, kv, lossy = hit_kv(cache, TOKENS)
        assert num_hit == 2 and lossy.all() and 0 < relative_error(kv, blocks[:2]) <= QUANT_ERROR_BOUNDS["int8"]
        cache.check_invariants()


def test_a_lossy_device_copy_another_sequence_holds_is_not_replaced():
    blocks = np.random.default_rng(6).normal(size=(3, *FLOAT_POOL.block_shape)).astype(np.float32)
    with make(FLOAT_POOL, offload_quant="int8") as cache:
        lossy_blocks = lossy_on_device(cache, TOKENS, blocks)
        holder = cache.admit(TOKENS)  # maps the lossy copy and keeps it while it runs
        assert holder.block_ids[:2].tolist() == lossy_blocks.tolist()
        hit, lossy = compute(cache, TOKENS, blocks, accept_lossy=False)
        assert hit == 0 and not lossy.any()
        match = cache.match(TOKENS)  # still the lossy copy, in the same blocks
        assert match.lossy.all() and match.blocks.tolist() == lossy_blocks.tolist()
        cache.check_invariants()
        num_hit, _, _ = hit_kv(cache, TOKENS, accept_lossy=False)  # refused again, still correct
        assert num_hit == 0 and cache.stats.refused_lossy_blocks == 4
        held = jax.tree.map(np.asarray, cache.pool.gather(holder.block_ids[:2]))
        assert 0 < relative_error(held, blocks[:2]) <= QUANT_ERROR_BOUNDS["int8"]  # untouched
        cache.release(holder)
        hits = [compute(cache, TOKENS, blocks, accept_lossy=False)[0] for _ in range(2)]
        assert hits == [0, 2] and cache.stats.refused_lossy_blocks == 6  # now replaced
        num_hit, kv, lossy = hit_kv(cache, TOKENS, accept_lossy=False)
        assert num_hit == 2 and same_bits(kv, blocks[:2]) and not lossy.any()
        cache.check_invariants()


def test_trie_replace_refuses_a_locked_node_and_changes_nothing():
    blocks = np.random.default_rng(8).normal(size=(3, *FLOAT_POOL.block_shape)).astype(np.float32)
    with make(FLOAT_POOL, offload_quant="int8") as cache:
        lossy_blocks = lossy_on_device(cache, TOKENS, blocks)
        holder = cache.admit(TOKENS)
        node = holder._tail
        with pytest.raises(RuntimeError, match=r"node at page 0 \(node.on_device=True, node.lock=1, 2 pages\) "
                                               r"cannot take 2 new blocks"):  # fmt: skip
            cache.trie.replace(node, np.array([6, 7]), 0.0)
        assert node.lock == 1 and node.blocks.tolist() == lossy_blocks.tolist() and node.page_lossy().all()
        cache.release(holder)
        cache.check_invariants()


def test_a_refusing_recompute_replaces_a_node_with_lossy_and_exact_pages_whole():
    tokens = np.arange(13, dtype=np.int32)  # three full pages and one token
    blocks = np.random.default_rng(7).normal(size=(4, *FLOAT_POOL.block_shape)).astype(np.float32)
    with make(FLOAT_POOL, offload_quant="int8") as cache:
        lossy_on_device(cache, tokens[:9], blocks)
        exact = blocks.copy()
        exact[2] += 1.0  # page 2 computed on top of lossy pages 0, 1: not what an exact run writes
        hits, _ = compute(cache, tokens, exact)
        assert hits == 2 and cache.match(tokens).lossy.tolist() == [True, True, False]
        hits, _ = compute(cache, tokens, blocks, accept_lossy=False)  # cut before page 0
        assert hits == 0
        num_hit, kv, lossy = hit_kv(cache, tokens, accept_lossy=False)  # every page replaced
        assert num_hit == 3 and same_bits(kv, blocks[:3]) and not lossy.any()
        cache.check_invariants()


def test_pages_computed_over_a_replaced_lossy_node_are_never_served_as_exact():
    """Two branches computed over lossy pages 0, 1: a refusing recompute along one replaces
    0, 1 and its own page 2; the other branch's page 2' (flagged exact, computed over the lossy
    KV) then sat below exact pages, and a refusing request got it as exact KV."""
    a = np.arange(13, dtype=np.int32)
    b = np.concatenate([np.arange(8), np.arange(100, 105)]).astype(np.int32)
    blocks = np.random.default_rng(7).normal(size=(4, *FLOAT_POOL.block_shape)).astype(np.float32)
    with make(FLOAT_POOL, offload_quant="int8") as cache:
        lossy_on_device(cache, a[:9], blocks)  # pages 0, 1: a lossy copy on device
        tainted = blocks.copy()
        tainted[2] += 1.0  # page 2 (and b's 2') computed over lossy 0, 1
        assert compute(cache, a, tainted)[0] == 2 and compute(cache, b, tainted)[0] == 2
        assert compute(cache, a, blocks, accept_lossy=False)[0] == 0  # replaces 0, 1 and a's page 2
        assert cache.match(b).lossy.tolist() == [False, False, True]
        num_hit, kv, lossy = hit_kv(cache, b, accept_lossy=False)  # stops before 2'
        assert num_hit == 2 and same_bits(kv, blocks[:2]) and not lossy.any()
        num_hit, _, lossy = hit_kv(cache, b)  # a request that accepts lossy KV still hits it, as lossy
        assert num_hit == 3 and lossy.tolist() == [False, False, True]
        cache.check_invariants()


def test_accept_lossy_per_admission_and_a_cut_inside_the_prefix():
    tokens = np.arange(13, dtype=np.int32)  # three full pages and one token
    blocks = np.random.default_rng(3).normal(size=(4, *FLOAT_POOL.block_shape)).astype(np.float32)
    with make(FLOAT_POOL, offload_quant="int8") as cache:  # config default: accept
        compute(cache, tokens[:9], blocks)  # pages 0, 1
        cache.evict(8)
        hits, lossy = compute(cache, tokens, blocks)  # pages 0, 1 fetched (lossy), page 2 computed
        assert hits == 2 and lossy.tolist() == [True, True]
        assert cache.match(tokens).lossy.tolist() == [True, True, False]
        num_hit, _, lossy = hit_kv(cache, tokens)
        assert num_hit == 3 and lossy.tolist() == [True, True, False]
        num_hit, _, _ = hit_kv(cache, tokens, accept_lossy=False)  # stops before page 0
        assert num_hit == 0 and cache.stats.refused_lossy_blocks == 3
        cache.check_invariants()


def test_default_config_is_lossless():
    config = KVCacheConfig(pool=FLOAT_POOL, host_bytes=1 << 20)
    assert config.offload_quant is None and config.accept_lossy
    blocks = random_blocks(3, FLOAT_POOL.block_shape, seed=4)  # NaN and inf patterns included
    with make(FLOAT_POOL) as cache:
        assert isinstance(cache.codec, IdentityCodec) and not cache.trie.lossy_offload
        assert cache.host_pool.block_shape == FLOAT_POOL.block_shape
        compute(cache, TOKENS, blocks)
        cache.evict(8)
        assert not cache.match(TOKENS).lossy.any()
        num_hit, kv, lossy = hit_kv(cache, TOKENS, accept_lossy=False)
        assert num_hit == 2 and same_bits(kv, blocks[:2]) and not lossy.any()


# --- capacities ---------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [dict(offload_quant="int8"), dict(offload_quant="fp8_e5m2", offload_scale="page")])
def test_host_holds_more_blocks_for_the_same_bytes_by_the_compression_ratio(options):
    pool = PoolConfig(num_blocks=16, num_layers=1, num_kv_heads=1, page_size=4, head_dim=32, dtype="float32")
    elements = math.prod(pool.block_shape)  # K and V of one page: 256 float32 = 1 KiB
    scales = 2 * 4 if options.get("offload_scale", "token") == "token" else 2  # per token/page, K and V
    stored = elements * 1 + 4 * scales  # one byte per element plus float32 scales
    budget = 4 * pool.bytes_per_block  # four float32 blocks
    tokens = np.arange(4 * 15 + 1, dtype=np.int32)  # 15 full pages
    blocks = np.ones((16, *pool.block_shape), np.float32)
    results = {}
    for name, extra in (("raw", {}), ("compressed", options)):
        config = KVCacheConfig(pool=pool, host_bytes=budget, cost_model=ALWAYS_FETCH, write_policy="write_through", **extra)
        with KVCache(config) as cache:
            compute(cache, tokens, blocks)
            assert cache.flush(TIMEOUT)
            results[name] = cache.stats.host_blocks
    assert results["raw"] == 4
    assert results["compressed"] == budget // stored  # 14 (token scales) or 15 (page scales)
    assert results["compressed"] >= 3.5 * results["raw"]


# --- bad configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("pool, values, message", [
    (FLOAT_POOL, dict(offload_quant="int4"), r"offload_quant='int4' is not a known format; expected 'none' or one of \('int8'"),
    (FLOAT_POOL, dict(offload_scale="page"), r"offload_scale='page' needs offload_quant set to a format; offload_quant=None"),
    (FLOAT_POOL, dict(offload_quant="int8", host_bytes=0), r"offload_quant='int8' compresses pages leaving the device and needs a host tier; got host_bytes=0"),
    (FLOAT_POOL, dict(offload_quant="int8", offload_scale="block"), r"offload_scale='block' must be one of \('token', 'page'\)"),
    (quant_pool("int8"), dict(offload_quant="fp8_e4m3"), r"offload_quant='fp8_e4m3' needs a float pool; this pool is quantized already \(kv_quant='int8'\)"),
    (FLOAT_POOL, dict(accept_lossy="yes"), r"accept_lossy='yes' must be a bool"),
])  # fmt: skip
def test_bad_offload_config_is_rejected_with_a_message(pool, values, message):
    with pytest.raises(ValueError, match=message):
        KVCacheConfig(pool=pool, **{"host_bytes": 1 << 20, **values})


def test_offload_quant_none_spellings_and_from_dict():
    config = KVCacheConfig.from_dict({"pool": FLOAT_POOL, "host_bytes": 1024, "offload_quant": "none"})
    assert config.offload_quant is None
    config = KVCacheConfig.from_dict({"pool": FLOAT_POOL, "host_bytes": 1024, "offload_quant": "fp8_e5m2",
                                      "offload_scale": "page"})  # fmt: skip
    layout = "x".join(str(d) for d in config.pool.block_shape)
    assert make_codec(config.pool, config.offload_quant, config.offload_scale).name == f"lossy:fp8_e5m2/page:{layout}"


def test_accept_lossy_must_be_a_bool_and_a_bad_one_changes_nothing():
    with make(FLOAT_POOL, offload_quant="int8") as cache:
        for call in (cache.admit, cache.prefetch):
            with pytest.raises(ValueError, match=r"accept_lossy='no' must be True, False or None"):
                call(TOKENS, accept_lossy="no")
        assert cache.num_sequences == 0 and cache.stats.prefix.admitted == 0
        cache.check_invariants()


def test_a_given_disk_tier_must_store_the_codec_blocks():
    pool = quant_pool("int8")
    disk = MemoryDisk(pool.block_shape, "int8", capacity_blocks=4)  # the pool's shape, not the codec's
    with pytest.raises(ValueError, match=r"disk_tier stores blocks .* this cache's codec stores \(\(\d+,\), dtype\('uint8'\), 'packed:int8/token:[\dx]+'\)"):
        make(pool, disk_tier=disk)
    codec = make_codec(pool)
    with make(pool, disk_tier=MemoryDisk(codec.block_shape, codec.dtype, capacity_blocks=4)) as cache:
        cache.check_invariants()


def test_codec_rows_are_the_pool_bytes_per_block_and_pack_data_then_scales():
    pool = quant_pool("fp8_e4m3", "page")
    codec = make_codec(pool)
    blocks = random_quantized(pool, 2, seed=5)
    rows = np.asarray(codec.encode(jax.tree.map(jnp.asarray, blocks)))
    assert rows.shape == (2, pool.bytes_per_block) and rows.dtype == np.uint8
    data_nbytes = math.prod(pool.block_shape)
    assert same_bits(rows[:, :data_nbytes], np.asarray(blocks.data).view(np.uint8).reshape(2, -1))
    assert same_bits(rows[:, data_nbytes:], np.asarray(blocks.scales).view(np.uint8).reshape(2, -1))


def test_fetch_from_disk_survives_making_host_room_that_splits_the_pages_node():
    """Regression: the job located its disk page, then made host room; evicting the host-only
    page after it split their node, and the job recorded its host copy on the dropped half."""
    pool = quant_pool("int8")
    codec = make_codec(pool)
    tokens = np.arange(13, dtype=np.int32)  # pages 0, 1, 2 and one token
    blocks = random_quantized(pool, 4, seed=11)
    disk = MemoryDisk(codec.block_shape, codec.dtype, capacity_blocks=8)
    with make(pool, host_blocks=2, disk_tier=disk, write_policy="write_through", high_watermark=1.0) as cache:
        compute(cache, tokens[:5], blocks)  # page 0, with a host copy
        assert cache.flush(TIMEOUT)  # ... and a disk copy
        compute(cache, tokens, blocks)  # pages 1, 2 extend page 0's node; their host copies push page 0's out
        assert cache.transfer.wait_idle(TIMEOUT)
        cache.poll()  # the copies are ready (no spill: the host is not above its high watermark)
        assert cache.match(tokens).tiers.tolist() == [Tier.DEVICE | Tier.DISK] + [Tier.DEVICE | Tier.HOST] * 2
        cache.evict(8)
        # Page 0 from disk needs a host slot. Host room is taken leaves first: page 2's copy
        # (the node's last page) goes alone, page 1's would have dropped page 2 with it; and
        # page 2 reaches disk before its host copy goes (no page leaves host unsaved for room).
        num_hit, kv, _ = hit_kv(cache, tokens[:5])
        assert num_hit == 1 and same_leaves(kv, blocks[:1])
        assert cache.match(tokens).tiers.tolist() == [Tier.DEVICE | Tier.HOST | Tier.DISK, Tier.HOST, Tier.DISK]
        assert cache.stats.pressure_spilled_blocks == 1 and cache.stats.lost_host_blocks == 0
        cache.check_invariants()
        cache.evict_host(1)  # page 0's copy goes alone (on device and disk); page 1's would drop page 2
        assert cache.match(tokens).tiers.tolist() == [Tier.DEVICE | Tier.DISK, Tier.HOST, Tier.DISK]
        cache.check_invariants()
