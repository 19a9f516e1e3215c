"""KVCache: the pool, the trie and the tiers as one cache (targeted tests)."""

import numpy as np
import pytest

from kvjax.fetch_cost import FetchCostModel
from kvjax.kv_cache import KVCache, KVCacheConfig
from kvjax.page_pool import PoolConfig

POOL = PoolConfig(num_blocks=8, num_layers=1, num_kv_heads=1, page_size=4, head_dim=8, dtype="float32")
ALWAYS_FETCH = FetchCostModel(seconds_per_token=1.0)


def prompt(n, start=0):
    return np.arange(start, start + n, dtype=np.int32)


def test_host_hit_after_device_eviction_is_bit_exact():
    config = KVCacheConfig(pool=POOL, host_bytes=4 * POOL.bytes_per_block, cost_model=ALWAYS_FETCH)
    with KVCache(config) as cache:
        tokens = prompt(17)
        handle = cache.admit(tokens)
        content = np.random.default_rng(0).standard_normal((5, *POOL.block_shape)).astype(np.float32)
        cache.pool.scatter(handle.block_ids, content)
        assert cache.commit(handle, tokens) == 4
        cache.release(handle)
        assert len(cache.evict(8)) == 4
        again = cache.admit(tokens)
        assert cache.wait_ready(again, timeout=10)
        assert again.num_hit_tokens == 16
        np.testing.assert_array_equal(np.asarray(cache.pool.gather(again.block_ids[:4])), content[:4])
        cache.check_invariants()
