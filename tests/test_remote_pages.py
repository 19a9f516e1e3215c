"""Pages between two caches, as two nodes move them: ``KVCache.export_pages`` on the owner
(from device, host and disk; quantized pools bit-exact; only to the namespace that computed
them) and ``KVCache.import_pages`` on the puller (host pages its next admission hits), and the
cost model's choice of how many pages to pull."""

import numpy as np
import pytest
from test_kv_cache import POOL, TIMEOUT, compute, hit_pages, hit_pages_and_tiers, make, prompt
from tier_cases import random_blocks, same_bits

from kvjax.cache.cost_model import CostModel
from kvjax.cache.trie_node import Tier
from kvjax.tiers.page_pool import PoolConfig


def stored(cache, export):
    """The export's payload as the puller's codec blocks."""
    payload = export.payload()
    assert payload.shape == (export.num_pages, cache.codec.block_nbytes) and payload.dtype == np.uint8
    return payload.view(cache.codec.dtype).reshape(export.num_pages, *cache.codec.block_shape)


def fastest_tier(bits):
    return "device" if bits & Tier.DEVICE else "host" if bits & Tier.HOST else "disk"


def test_pages_leave_from_every_tier_and_arrive_bit_exact(tmp_path):
    with make(disk_dir=tmp_path) as owner, make() as puller:
        tokens = prompt(21)  # 5 full pages
        kv = random_blocks(6, POOL.block_shape, seed=7)
        compute(owner, tokens, "t", kv)
        owner.evict(8)
        assert owner.flush(TIMEOUT) and owner.evict_host(2) == 2  # every page on disk, 3 on host too
        compute(owner, tokens[:5], "t", kv)  # page 0 back on device
        owner.poll()
        tiers = [fastest_tier(bits) for bits in owner.match(tokens, "t").tiers.tolist()]
        assert set(tiers) == {"device", "host", "disk"}, tiers
        export = owner.export_pages(tokens, "t", 0, 5)
        assert export.tiers == tiers and export.num_pages == 5
        compute(puller, tokens[:5], "t", kv)  # the puller holds page 0 itself
        assert puller.import_pages(tokens, "t", 0, stored(puller, export)) == 4
        assert puller.match(tokens, "t").tiers.tolist() == [Tier.DEVICE] + [Tier.HOST] * 4
        num_hit, got, by_tier = hit_pages_and_tiers(puller, tokens, "t")
        assert num_hit == 5 and by_tier["host"] == 16 and same_bits(got, kv[:5])
        puller.check_invariants()
        owner.check_invariants()


def test_device_pages_export_from_a_quantized_pool_bit_exact():
    pool = PoolConfig(num_blocks=8, num_layers=1, num_kv_heads=1, page_size=4, head_dim=8, dtype="float32",
                      kv_quant="int8")  # fmt: skip
    with make(pool) as owner, make(pool) as puller:
        tokens = prompt(13)
        handle = owner.admit(tokens, "t")
        kv = owner.pool.gather(handle.block_ids)  # whatever the pool holds: every bit must travel
        owner.commit(handle, tokens)
        owner.release(handle)
        export = owner.export_pages(tokens, "t", 0, 3)
        assert export.tiers == ["device"] * 3 and puller.codec.name.startswith("packed:")
        assert puller.import_pages(tokens, "t", 0, stored(puller, export)) == 3
        handle = puller.admit(tokens, "t")
        assert puller.wait_ready(handle, TIMEOUT) and handle.num_hit_tokens == 12
        got = puller.pool.gather(handle.block_ids[:3])
        assert same_bits(np.asarray(got.data), np.asarray(kv.data)[:3])
        assert same_bits(np.asarray(got.scales), np.asarray(kv.scales)[:3])
        puller.release(handle)


def test_a_node_exports_only_to_the_namespace_that_computed_the_pages():
    with make() as owner:
        tokens = prompt(13)
        compute(owner, tokens, "tenant-a", random_blocks(4, POOL.block_shape))
        assert owner.export_pages(tokens, "tenant-a", 0, 3).num_pages == 3
        assert owner.export_pages(tokens, "tenant-b", 0, 3).num_pages == 0
        assert owner.export_pages(tokens, "tenant-b", 0, 3).payload().shape == (0, owner.codec.block_nbytes)
        assert owner.export_pages(tokens, None, 0, 3).num_pages == 0
        assert owner.export_pages(prompt(13, start=1), "tenant-a", 0, 3).num_pages == 0  # other tokens
        assert owner.export_pages(tokens, "tenant-a", 3, 5).num_pages == 0  # past what it holds


def test_an_import_joins_only_right_after_the_cached_prefix():
    with make() as owner, make() as puller:
        tokens = prompt(17)
        kv = random_blocks(5, POOL.block_shape, seed=2)
        compute(owner, tokens, "t", kv)
        blocks = stored(puller, owner.export_pages(tokens, "t", 1, 3))
        assert puller.import_pages(tokens, "t", 1, blocks) == 0  # page 0 is not cached here: a gap
        compute(puller, tokens[:8], "t", kv)  # pages 0-1 computed here
        assert puller.import_pages(tokens, "t", 1, blocks) == 2  # page 1 is its own; 2-3 join
        assert puller.import_pages(tokens, "t", 1, blocks) == 0  # nothing new
        num_hit, got = hit_pages(puller, tokens, "t")
        assert num_hit == 4 and same_bits(got, kv[:4])
        puller.check_invariants()
        with pytest.raises(ValueError, match="3 pages from page 3 need 24 tokens; got 17"):
            puller.import_pages(tokens, "t", 3, blocks)
        with pytest.raises(ValueError, match="must be \\[n, \\*"):
            puller.import_pages(tokens, "t", 1, np.zeros(blocks.shape, np.float64))  # wrong dtype


def test_a_cache_without_a_host_tier_imports_nothing_but_still_exports():
    with make(host_blocks=0) as owner, make(host_blocks=0) as puller:
        tokens = prompt(9)
        compute(owner, tokens, "t", random_blocks(3, POOL.block_shape))
        export = owner.export_pages(tokens, "t", 0, 2)
        assert export.num_pages == 2
        assert puller.import_pages(tokens, "t", 0, stored(puller, export)) == 0


def test_cost_model_pulls_the_pages_that_save_the_most():
    model = CostModel(recompute_seconds_per_token=1e-3, recompute_seconds_per_token_position=0.0,
                      fetch_latency_seconds=0.0, host_bytes_per_second=1e12)  # fmt: skip
    # 4 ms of recompute per page against 10 ms of latency and 1 ms per page on the link
    assert model.remote_pages_to_fetch(0, 4, 8, 1000, latency_seconds=0.01, bytes_per_second=1e6) == 8
    assert model.remote_pages_to_fetch(0, 4, 3, 1000, latency_seconds=0.01, bytes_per_second=1e6) == 0
    assert model.remote_pages_to_fetch(0, 4, 8, 1000, latency_seconds=0.01, bytes_per_second=1e5) == 0  # 10 ms/page
    assert model.remote_seconds(8, 1000, latency_seconds=0.01, bytes_per_second=1e6) == pytest.approx(0.018)
    assert model.remote_seconds(0, 1000) == 0.0
    assert model.remote_pages_to_fetch(0, 4, 0, 1000) == 0
    with pytest.raises(ValueError, match="remote_bytes_per_second=0 must be > 0"):
        CostModel(remote_bytes_per_second=0)
