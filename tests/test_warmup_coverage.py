"""After ``Engine.warmup()`` serving builds no executable, whatever the configuration and the
workload: the model step on every token bucket, sampled and greedy; tier moves of every size
(device -> host -> disk and back), swaps, quantized pools, lossy offload, prefetches, remote
page imports and exports, cancellations.

One pool shape no other test uses (36 blocks, 5 sequences per step), so every executable
these tests build is their own and one another test built earlier cannot hide a miss. Each
configuration asserts that its workload really went through the paths it names (fetches,
disk hits, swaps...), so a zero count never comes from a path not taken.
"""

import dataclasses

import numpy as np
import pytest
from engine_cases import FETCH_ALWAYS, MAX_LEN, MODEL, PAGE, model

from kvjax.metrics.compilations import CompileCount
from kvjax.serving.engine import Engine
from kvjax.serving.engine_config import EngineConfig
from kvjax.serving.preset import pool_config
from kvjax.serving.sampling import SamplingParams
from kvjax.serving.scheduler_config import SchedulerConfig
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig

BLOCKS = 36
SCHEDULER = SchedulerConfig(max_num_seqs=5, token_budget=64, max_prefill_chunk=32, preemption="recompute")
# 1 token, one page exactly, a page +-1, up to 17 pages: fetches of 1 to 17 blocks
LENGTHS = (1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE, 3 * PAGE + 5, 5 * PAGE, 9 * PAGE + 2, 17 * PAGE)
SAMPLED = SamplingParams(temperature=1.0, top_k=8, seed=3)

CONFIGS = {  # name -> (pool kwargs, cache kwargs; a host tier of 2x the pool unless host_bytes is given)
    "device": ({}, {"host_bytes": 0}),
    "host": ({}, {}),
    "disk": ({}, {"host_bytes": 8, "disk_bytes": 64 << 20}),  # 8 host blocks: most pages end on disk
    "int8_pool": ({"kv_quant": "int8"}, {}),
    "lossy_int8": ({}, {"offload_quant": "int8"}),
    "swap": ({}, {"host_bytes": 0}),  # no host tier: a preempted sequence's evicted pages come back by swap only
    "remote": ({}, {}),
}


def _engine(name: str, tmp_path) -> Engine:
    pool_kwargs, cache_kwargs = CONFIGS[name]
    pool = pool_config(MODEL, PAGE, BLOCKS, **pool_kwargs)
    cache_kwargs = {"host_bytes": 2 * BLOCKS, **cache_kwargs}
    cache_kwargs["host_bytes"] *= pool.bytes_per_block
    if "disk_bytes" in cache_kwargs:
        cache_kwargs["disk_dir"] = str(tmp_path / "disk")
    cache = KVCache(KVCacheConfig(pool=pool, vocab_size=MODEL.vocab_size, cost_model=FETCH_ALWAYS, **cache_kwargs))
    scheduler = SCHEDULER
    if name == "swap":
        scheduler = dataclasses.replace(SCHEDULER, preemption="swap", host_swap_blocks=BLOCKS)
    return Engine(model(), cache, scheduler, EngineConfig(max_model_len=MAX_LEN, token_buckets=(16, 64)))


def _serve(engine: Engine, tag: str, prompts, *, max_new_tokens=2, cancel=(), sampled=()) -> None:
    """All of ``prompts`` at once; ``cancel``: indices cancelled after the first step."""
    for i, tokens in enumerate(prompts):
        engine.add_request(f"{tag}{i}", tokens=tokens, max_new_tokens=max_new_tokens,
                           sampling=SAMPLED if i in sampled else None)  # fmt: skip
    if cancel:
        engine.step()
        for i in cancel:
            engine.cancel(f"{tag}{i}")
    list(engine.run(summary=False))


def _evict_all(engine: Engine, *, to_disk: bool) -> None:
    """Every cached device page down a tier (and on to disk, leaving host empty)."""
    engine.cache.evict(BLOCKS)
    if to_disk:
        assert engine.cache.flush()
        engine.cache.evict_host(2 * BLOCKS)
    engine.cache.poll()


def _export_all(engine: Engine, prompts) -> None:
    """Every prompt's cached pages offered to another node, from whichever tier holds them."""
    for tokens in prompts:
        engine.cache.export_pages(tokens, None, 0, len(tokens) // PAGE).payload()


def _workload(engine: Engine, name: str, rng: np.random.Generator) -> None:
    prompts = [rng.integers(0, MODEL.vocab_size, n).astype(np.int32) for n in LENGTHS]
    for n in (1, 2, 3, 5):  # batches of 1 to 5 misses, greedy and sampled
        _serve(engine, f"miss{n}_", prompts[:n], max_new_tokens=n, sampled={n - 1})
    _serve(engine, "device_hits", prompts[3:8], cancel=(1,), sampled={0})
    _serve(engine, "long", prompts[8:])
    _export_all(engine, prompts)
    if name == "swap":  # 5 sequences of 6 pages and 5 more each: 55+ blocks of 36
        long_prompts = [rng.integers(0, MODEL.vocab_size, 6 * PAGE + i).astype(np.int32) for i in range(5)]
        _serve(engine, "swap", long_prompts, max_new_tokens=5 * PAGE)
    if not engine.cache.config.tiered:
        return
    for to_disk in (False, True) if engine.cache.disk_tier is not None else (False,):
        _evict_all(engine, to_disk=to_disk)
        _export_all(engine, prompts)
        for i, tokens in enumerate(prompts):  # fetches of 0 to 17 blocks, one at a time
            _evict_all(engine, to_disk=to_disk)
            _serve(engine, f"lower{to_disk}_{i}_", [tokens], sampled={0} if i % 2 else ())
        _evict_all(engine, to_disk=to_disk)  # several fetches in one step, one of them cancelled
        _serve(engine, f"lower{to_disk}_batch", prompts[1:6], cancel=(2,))
        _evict_all(engine, to_disk=to_disk)
        for tokens in prompts[4:8]:  # prefetches of 2 to 10 blocks, then their admissions
            engine.cache.prefetch(tokens)
        _serve(engine, f"prefetched{to_disk}", prompts[4:8])


def _remote_import(engine: Engine, source: KVCache, rng: np.random.Generator) -> int:
    """Pages exported by ``source`` (another node's cache) imported into ``engine``'s cache,
    then served from there; exports of every size too. Returns the pages imported."""
    imported = 0
    for n in (1, 2, 5, 17):
        tokens = rng.integers(0, MODEL.vocab_size, n * PAGE + 3).astype(np.int32)
        handle = source.admit(tokens)
        source.commit(handle, tokens)
        source.release(handle)
        export = source.export_pages(tokens, None, 0, n)
        blocks = export.payload().view(source.codec.dtype).reshape(-1, *source.codec.block_shape)
        imported += engine.cache.import_pages(tokens, None, 0, blocks)
        _serve(engine, f"remote{n}_", [tokens])
    return imported


@pytest.mark.parametrize("name", list(CONFIGS))
def test_serving_builds_nothing_after_warmup(name, tmp_path):
    rng = np.random.default_rng(sorted(CONFIGS).index(name))
    source = _engine("host", tmp_path).cache if name == "remote" else None  # built (its pool) before counting
    with _engine(name, tmp_path) as engine:
        engine.warmup()
        if source is not None:
            source.warmup()
        count = CompileCount()
        _workload(engine, name, rng)
        imported = _remote_import(engine, source, rng) if source is not None else 0
        built = count.value
        engine.check_invariants()
        stats, scheduled = engine.cache.stats, engine.scheduler.stats
    if source is not None:
        source.close()
    assert built == 0, f"{name}: {built} executables built after warm-up"
    # the paths named were taken
    assert scheduled.cancelled >= 1 and scheduled.hit_tokens > 0
    if name not in ("device", "swap"):
        assert stats.fetched_host_blocks > (0 if name == "disk" else BLOCKS) and stats.prefetches > 0
    if name == "disk":
        assert stats.fetched_disk_blocks > 0 and stats.spilled_blocks > 0
    if name == "lossy_int8":
        assert stats.lossy_hit_blocks > 0
    if name == "swap":
        assert scheduled.preempted_swap > 0 and scheduled.swap_in_blocks > 0, scheduled
    if name == "remote":
        assert imported == 1 + 2 + 5 + 17
