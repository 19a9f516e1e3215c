"""The engine's API: requests in, events out, errors named, metrics that add up."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from engine_cases import (
    BUCKETS,
    FETCH_ALWAYS,
    MAX_LEN,
    MODEL,
    PAGE,
    SCHEDULER,
    dense_greedy,
    make_engine,
    model,
    random_prompts,
)

from kvjax.metrics.compilations import CompileCount
from kvjax.metrics.registry import Metrics
from kvjax.serving.engine import Engine
from kvjax.serving.engine_config import EngineConfig
from kvjax.serving.engine_events import FinishEvent, RunSummary, TokenEvent
from kvjax.serving.miss_attribution import MissAttributor
from kvjax.serving.model import ModelConfig, load_weights, save_weights
from kvjax.serving.preset import build_engine_parts, pool_config
from kvjax.serving.sampling import SamplingBatch, SamplingParams, sample, sampling_batch
from kvjax.serving.scheduler_config import SchedulerConfig
from kvjax.serving.swap_store import SwapStore
from kvjax.text.canonicalize import CanonicalizeConfig
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig
from kvjax.tiers.page_pool import PagePool
from kvjax.tools.workload import WorkloadSpec


def _finishes(events):
    return {e.request_id: e for e in events if isinstance(e, FinishEvent)}


@pytest.fixture
def engine():
    with make_engine() as built:
        yield built


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one of prompt= .* or tokens="),
    (dict(prompt="hi", tokens=[1]), "exactly one of prompt="),
    (dict(tokens=[1, 256]), r"256"),
    (dict(tokens=[1] * 380, max_new_tokens=8), "needs 380 prompt \\+ 8 new tokens; max_model_len=384"),
    (dict(tokens=[1], sampling="greedy"), "must be a kvjax SamplingParams"),
    (dict(prompt=b"bytes"), "prompt must be a str, got bytes"),
    # refused before the request's token buffer is allocated (that raised MemoryError)
    (dict(tokens=[1], max_new_tokens=10**12), r"needs 1 prompt \+ 1000000000000 new tokens; max_model_len=384"),
    (dict(tokens=[1], max_new_tokens=0), r"max_new_tokens=0 must be an int >= 1"),
    (dict(tokens=[1, -1]), r"token id -1 at index 1 is out of range; expected 0 <= id < 256 \(vocab_size=256\)"),
    (dict(tokens=[1], stop_token_ids="ab"), r"stop_token_ids='ab' must be a collection of token ids"),
    (dict(tokens=[1], stop_token_ids=2), r"^stop_token_ids=2 must be a collection of token ids \(ints\), e.g. \[2\]$"),
    (dict(tokens=[1], stop_token_ids=[3, 256]), r"^stop_token_ids \(sorted\) \[3, 256\]: token id 256 at index 1 is "
                                                 r"out of range; expected 0 <= id < 256 \(vocab_size=256\)$"),
])
def test_bad_requests_are_refused_and_change_nothing(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("r", **kwargs)
    assert not engine.has_unfinished and engine.step() == []
    engine.check_invariants()


def test_a_closed_engine_refuses_requests_and_steps_by_name():
    """It used to go on serving from the device after its cache said every tier was cleared."""
    engine = make_engine()
    engine.add_request("a", tokens=[1, 2, 3], max_new_tokens=2)
    engine.close()
    with pytest.raises(ValueError, match=r"^request_id='b': this engine is closed \(close\(\) was called\)"):
        engine.add_request("b", tokens=[1, 2, 3])
    with pytest.raises(ValueError, match=r"^this engine is closed \(close\(\) was called\); step needs"):
        engine.step()
    with pytest.raises(ValueError, match=r"^this KVCache is closed"):
        engine.cache.admit([1, 2, 3, 4])
    engine.close()  # idempotent


def test_eviction_to_the_low_watermark_happens_once_when_scheduler_and_engine_both_ask():
    # the scheduler's evict_to_low_watermark and the engine's spill_ahead read the same target:
    # the engine evicts only what the scheduler has not, so the pool stops at the low mark
    pool = pool_config(MODEL, 8, 20)
    cache = KVCache(KVCacheConfig(pool=pool, host_bytes=64 * pool.bytes_per_block, vocab_size=MODEL.vocab_size))
    scheduler = SchedulerConfig(max_num_seqs=4, token_budget=64, max_prefill_chunk=32, evict_to_low_watermark=True)
    low = int(cache.allocator.low_watermark * cache.allocator.num_blocks)
    with Engine(model(0), cache, scheduler, EngineConfig(token_buckets=BUCKETS, spill_ahead=True)) as engine:
        rng = np.random.default_rng(0)
        evicted_below_low = []
        for i in range(5):
            engine.add_request(f"r{i}", tokens=rng.integers(0, 256, 40).astype(np.int32), max_new_tokens=1)
            while engine.has_unfinished:
                engine.step()
                used = cache.allocator.num_blocks - cache.allocator.num_free
                evicted_below_low.append(used < low and cache.stats.prefix.evicted_blocks > 0)
        assert cache.stats.prefix.evicted_blocks > 0 and not any(evicted_below_low)
        engine.check_invariants()


def test_a_top_k_past_int32_means_the_whole_vocabulary():
    # the router accepts any top_k >= 0; one past int32 used to fail the whole step
    batch = sampling_batch([(SamplingParams(temperature=1.0, top_k=2**63), 7, 0)], 2)
    assert batch.top_k.tolist() == [2**31 - 1, 0]


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("r", tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="request_id='r' is already queued or running"):
        engine.add_request("r", tokens=[4])


def test_events_stream_tokens_then_finish_then_summary(engine):
    prompt = np.arange(20, dtype=np.int32)
    engine.add_request("r", tokens=prompt, max_new_tokens=5)
    events = list(engine.run())
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [e.index for e in tokens] == [0, 1, 2, 3, 4]
    finish = events[-2]
    assert isinstance(finish, FinishEvent) and (finish.status, finish.reason) == ("finished", "length")
    assert [e.token_id for e in tokens] == finish.output_token_ids.tolist() == dense_greedy(prompt, 5)
    assert finish.text == engine.tokenizer.decode(finish.output_token_ids)
    summary = events[-1]
    assert isinstance(summary, RunSummary) and summary.num_finished == 1
    assert summary.metrics["latencies"]["ttft_seconds"]["count"] == 1
    assert summary.metrics["latencies"]["inter_token_seconds"]["count"] == 4
    assert summary.metrics["gauges"]["generated_tokens_per_second"] > 0


def test_a_run_without_a_summary_still_sets_the_throughput_gauge(engine):
    # the README's first snippet runs with summary=False and printed a rate of 0
    engine.add_request("r", tokens=np.arange(20, dtype=np.int32), max_new_tokens=3)
    list(engine.run(summary=False))
    assert engine.metrics.to_json()["gauges"]["generated_tokens_per_second"] > 0


def test_stop_token_ends_a_request_early(engine):
    prompt = np.arange(30, dtype=np.int32)
    first = dense_greedy(prompt, 1)[0]
    engine.add_request("r", tokens=prompt, max_new_tokens=8, stop_token_ids=[first])
    finish = _finishes(engine.run())["r"]
    assert (finish.reason, finish.output_token_ids.tolist()) == ("stop", [first])


def test_cancel_running_and_waiting_requests(engine):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 20).astype(np.int32) for _ in range(6)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", tokens=prompt, max_new_tokens=6)
    events = engine.step()  # r0..r3 admitted (max_num_seqs=4), r4 and r5 wait
    assert engine.cancel("r1") and engine.cancel("r5")
    assert not engine.cancel("r5") and not engine.cancel("nope")
    events += engine.run(summary=False)
    finishes = _finishes(events)
    assert {rid for rid, f in finishes.items() if f.status == "cancelled"} == {"r1", "r5"}
    for i in (0, 2, 3, 4):
        assert finishes[f"r{i}"].output_token_ids.tolist() == dense_greedy(prompts[i], 6)
    engine.check_invariants()
    engine.cache.check_invariants()
    assert engine.cache.num_sequences == 0


def test_full_queue_rejects_with_a_reason():
    scheduler = SchedulerConfig(max_num_seqs=4, token_budget=64, max_prefill_chunk=32, max_waiting=2)
    with make_engine(scheduler=scheduler) as engine:
        accepted = [engine.add_request(f"r{i}", tokens=[i + 1] * 10, max_new_tokens=2) for i in range(3)]
        finishes = _finishes(engine.run(summary=False))
        rejections = engine.metrics.to_json()["counters"]["rejections"]
    assert accepted == [True, True, False]
    assert finishes["r2"].status == "rejected"
    assert finishes["r2"].reason.startswith("waiting queue is full (2 requests, max_waiting=2)")
    assert rejections == 1


class _FailingDecode:
    """A plugged-in tokenizer whose decode fails on a rejected request's empty output."""

    vocab_size = MODEL.vocab_size

    def encode(self, text):
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids):
        if not len(ids):
            raise ValueError("nothing to decode")
        return "".join(map(chr, ids))


def test_a_tokenizer_whose_decode_fails_leaves_the_text_out_and_the_engine_running(caplog):
    """The rejected request's finish ran outside the step's guard: its decode's ValueError left
    the plan in flight, and every later step failed with "still in flight"."""
    scheduler = SchedulerConfig(max_num_seqs=4, token_budget=64, max_prefill_chunk=32, max_waiting=2)
    with make_engine(scheduler=scheduler, tokenizer=_FailingDecode()) as engine:
        accepted = [engine.add_request(f"r{i}", tokens=[i + 1] * 10, max_new_tokens=2) for i in range(3)]
        with caplog.at_level("ERROR", logger="kvjax.serving.engine"):
            finishes = _finishes(engine.run(summary=False))
        assert accepted == [True, True, False]
        assert finishes["r2"].status == "rejected" and finishes["r2"].text is None
        assert "could not decode request 'r2'" in caplog.text
        assert [finishes[f"r{i}"].output_token_ids.tolist() for i in (0, 1)] == [dense_greedy([1] * 10, 2),
                                                                                 dense_greedy([2] * 10, 2)]
        assert finishes["r0"].text == "".join(map(chr, finishes["r0"].output_token_ids))
        engine.add_request("after", tokens=[5] * 10, max_new_tokens=2)  # the engine still steps
        assert _finishes(engine.run(summary=False))["after"].output_token_ids.tolist() == dense_greedy([5] * 10, 2)
        engine.check_invariants()


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine):
    rng = np.random.default_rng(1)
    prompt, other = rng.integers(0, 256, 17).astype(np.int32), rng.integers(0, 256, 9).astype(np.int32)
    hot = SamplingParams(temperature=1.5, top_k=20, seed=7)
    engine.add_request("alone", tokens=prompt, max_new_tokens=12, sampling=hot)
    alone = _finishes(engine.run())["alone"].output_token_ids.tolist()
    engine.add_request("batched", tokens=prompt, max_new_tokens=12, sampling=hot)
    engine.add_request("neighbour", tokens=other, max_new_tokens=12)
    engine.add_request("top1", tokens=prompt, max_new_tokens=12, sampling=SamplingParams(temperature=2.0, top_k=1))
    finishes = _finishes(engine.run())
    assert finishes["batched"].output_token_ids.tolist() == alone
    assert alone != dense_greedy(prompt, 12)  # 12 draws at temperature 1.5 from 20 tokens: not greedy
    assert finishes["top1"].output_token_ids.tolist() == dense_greedy(prompt, 12)


def test_after_warmup_serving_builds_nothing_not_even_tier_moves_or_swaps():
    """Warm-up builds the model step for every token bucket and every tier move and swap for
    every transfer bucket; then host fetches of several sizes and swaps build nothing."""
    # A pool shape no other test uses, so every executable here is this test's own.
    metrics = Metrics()
    pool = pool_config(MODEL, PAGE, 40)
    cache = KVCache(KVCacheConfig(pool=pool, vocab_size=256, host_bytes=40 * pool.bytes_per_block,
                                  cost_model=FETCH_ALWAYS, transfer_buckets=(2, 8)))  # fmt: skip
    config = EngineConfig(max_model_len=MAX_LEN, token_buckets=(64,))
    scheduler = dataclasses.replace(SCHEDULER, host_swap_blocks=8)
    rng = np.random.default_rng(3)
    with Engine(model(), cache, scheduler, config, metrics=metrics) as engine:
        built = engine.warmup()
        # step (and the sampler, unless an earlier test built it); 2 buckets x (out, in)
        assert built >= 1 + 2 * 2 and engine.runner.compilations in (1, 2)
        count = CompileCount()
        prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (3 * PAGE + 1, 9 * PAGE + 2)]
        for i, tokens in enumerate(prompts):
            engine.add_request(f"first{i}", tokens=tokens, max_new_tokens=2)
        list(engine.run())
        engine.cache.evict(40)  # their pages move to host
        for i, tokens in enumerate(prompts):  # 3 pages (bucket 8), then 9 (8 + a bucket of 2)
            engine.add_request(f"again{i}", tokens=tokens, max_new_tokens=2)
            list(engine.run())
        engine.swap_store.swap_in(list(zip(range(3), range(3))))  # 3 blocks: one bucket of 8
        assert engine.cache.stats.fetched_host_blocks == 12
        assert count.value == 0
        assert metrics.to_json()["counters"]["compilations"] == built


def test_canonicalization_reports_changes_and_turns_variants_into_hits():
    config = EngineConfig(max_model_len=MAX_LEN, token_buckets=BUCKETS)
    system = "System: answer in one word.\r\nBe  brief.\r\n" * 3
    variant = system.replace("\r\n", "\n").replace("  ", " ")
    with make_engine(config=config, canonicalize=CanonicalizeConfig()) as engine:
        engine.add_request("a", prompt=system + "Q: one?", max_new_tokens=2)
        first = _finishes(engine.run())["a"]
        engine.add_request("b", prompt=variant + "Q: two?", max_new_tokens=2)
        second = _finishes(engine.run())["b"]
    assert {c.rule for c in first.canonical_changes} == {"line_endings", "collapse_spaces"}
    assert second.canonical_changes == ()
    assert second.num_hit_tokens >= PAGE * ((len(variant) - 1) // PAGE) - PAGE
    with make_engine(config=config) as engine:  # off by default: the variant shares nothing past "System..."
        engine.add_request("a", prompt=system + "Q: one?", max_new_tokens=2)
        assert _finishes(engine.run())["a"].canonical_changes == ()
        engine.add_request("b", prompt=variant + "Q: two?", max_new_tokens=2)
        assert _finishes(engine.run())["b"].num_hit_tokens < len("System: answer in one word.")


def test_misses_are_attributed_to_namespace_and_template(engine):
    prompt = "Order 17. " + "System: you label things. " * 4
    engine.add_request("a", prompt=prompt, max_new_tokens=2, namespace="tenant-a")
    list(engine.run())
    engine.add_request("b", prompt=prompt, max_new_tokens=2, namespace="tenant-b")
    b = _finishes(engine.run())["b"]
    engine.add_request("c", prompt=prompt.replace("you label", "you tag"), max_new_tokens=2, namespace="tenant-a")
    c = _finishes(engine.run())["c"]
    engine.add_request("d", prompt=prompt.replace("17", "42"), max_new_tokens=2, namespace="tenant-a")
    d = _finishes(engine.run())["d"]
    assert b.num_hit_tokens == 0 and b.miss_tokens_by_cause == {"other_namespace": len(prompt)}
    assert c.hit_tokens_by_tier == {"device": 2 * PAGE} and set(c.miss_tokens_by_cause) == {"never_seen"}  # new text
    assert d.hit_tokens_by_tier == {} and d.miss_tokens_by_cause == {"different_template": len(prompt)}
    counters = engine.metrics.to_json()["counters"]
    assert counters["miss_tokens"]["other_namespace"] == len(prompt)
    looked_up = sum(len(f.prompt_token_ids) for f in (b, c, d)) + len(prompt)
    assert sum(counters["miss_tokens"].values()) + sum(counters["hit_tokens"].values()) == looked_up


def test_miss_attributor_tells_evicted_from_never_seen():
    attributor = MissAttributor(page_size=4)
    seen = np.arange(12, dtype=np.int32)
    assert attributor.attribute(seen, "a", 0) == {"never_seen": (12, 3)}
    attributor.remember(seen, "a")
    # Pages 0-1 were seen (evicted now, since they missed); the last page is always computed
    # and takes the cause of the first missed page.
    assert attributor.attribute(seen, "a", 0) == {"evicted": (12, 3)}
    assert attributor.attribute(seen, "a", 4) == {"evicted": (8, 2)}
    assert attributor.attribute(seen, "a", 8) == {"never_seen": (4, 1)}  # every mappable page hit
    assert attributor.attribute(seen, "b", 0) == {"other_namespace": (12, 3)}
    changed = np.concatenate([seen[:4], seen[4:] + 1])
    assert attributor.attribute(changed, "a", 4, fingerprint="f") == {"never_seen": (8, 2)}
    attributor.remember(seen, "a", fingerprint="f")
    assert attributor.attribute(changed, "a", 4, fingerprint="f") == {"different_template": (8, 2)}


def test_miss_attributor_puts_recomputed_pages_before_refused_lossy_ones():
    # the plan's order: hits, lower-tier pages computed anyway, then the lossy pages the match
    # stopped at (refused pages used to be counted from right after the hits)
    attributor = MissAttributor(page_size=2)
    tokens = np.arange(11, dtype=np.int32)  # 5 mappable pages, the tail page holds the last token
    causes = attributor.attribute(tokens, "a", 2, refused_pages=2, recomputed_pages=1)
    assert causes == {"recomputed": (2 + 1, 2), "lossy_refused": (4, 2), "never_seen": (2, 1)}


def test_miss_attributor_forgets_the_least_recently_seen():
    attributor = MissAttributor(page_size=2, max_pages=2)
    attributor.remember(np.array([1, 2, 3, 4], np.int32), "a")
    attributor.remember(np.array([9, 9], np.int32), "a")  # pushes out page [1, 2], keeps [3, 4] after it
    causes = attributor.attribute(np.array([1, 2, 3, 4, 5], np.int32), "a", 0)
    assert causes == {"never_seen": (3, 2), "evicted": (2, 1)}
    with pytest.raises(ValueError, match="page_size=0 and max_pages=1 must be >= 1"):
        MissAttributor(page_size=0, max_pages=1)


def test_metrics_export_prometheus_and_json(engine):
    pytest.importorskip("prometheus_client")
    for i, prompt in enumerate(random_prompts(np.random.default_rng(2), 2 * PAGE, [3, 4])):
        engine.add_request(f"r{i}", tokens=prompt, max_new_tokens=3)
    list(engine.run())
    text = engine.metrics.prometheus_text()
    for name in ("kvjax_ttft_seconds{quantile=\"0.5\"}", "kvjax_prefill_tokens_total", "kvjax_compilations_total",
                 "kvjax_pool_fragmentation_ratio", "kvjax_miss_tokens_total{cause=\"never_seen\"}"):
        assert name in text
    snapshot = engine.metrics.to_json()
    assert snapshot["latencies"]["ttft_seconds"]["count"] == 2
    assert snapshot["counters"]["decode_tokens"] == 2 * 2  # 3 tokens each, the first from the prefill


def test_engine_refuses_a_pool_that_does_not_fit():
    cache = KVCache(KVCacheConfig(pool=pool_config(MODEL, PAGE, 32), vocab_size=256))
    wrong = PagePool(pool_config(MODEL, 16, 256))
    with pytest.raises(ValueError, match=r"cache \(page_size, num_blocks\)=\(8, 32\) must match the pool's \(16, 256\)"):
        Engine(model(), cache, pool=wrong)
    other_model = PagePool(pool_config(dataclasses.replace(MODEL, num_layers=3), PAGE, 32))
    with pytest.raises(ValueError, match=r"pool \(num_layers, num_kv_heads, head_dim\)=\(3, "):
        Engine(model(), cache, pool=other_model)



def test_prompt_ids_past_the_models_vocabulary_are_refused_when_the_cache_has_none():
    # a cache without vocab_size let ids past the model's 256 through: the embedding lookup read
    # them as other tokens and the request "finished" with made-up output
    cache = KVCache(KVCacheConfig(pool=pool_config(MODEL, PAGE, 32)))
    with Engine(model(), cache, SCHEDULER, EngineConfig(max_model_len=MAX_LEN, token_buckets=BUCKETS)) as engine:
        with pytest.raises(ValueError, match=r"token id 300 at index 1 is out of range; expected 0 <= id < 256 "
                                             r"\(vocab_size=256\)"):  # fmt: skip
            engine.add_request("r", tokens=[1, 300], max_new_tokens=2)
        assert not engine.has_unfinished and engine.scheduler.num_waiting == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheduler_config={"max_num_seqs": 4}), r"scheduler_config=\{'max_num_seqs': 4\} must be a SchedulerConfig"),
    (dict(scheduler_config={}), r"scheduler_config=\{\} must be a SchedulerConfig"),  # was silently the defaults
    (dict(config={"max_model_len": 64}), r"config=\{'max_model_len': 64\} must be an? EngineConfig \(EngineConfig"),
])
def test_settings_that_are_not_config_objects_are_refused(kwargs, message):
    # a dict raised AttributeError on its first field read ({} for the scheduler: its defaults ran)
    cache = KVCache(KVCacheConfig(pool=pool_config(MODEL, PAGE, 32), vocab_size=256))
    with pytest.raises(ValueError, match=message):
        Engine(model(), cache, **kwargs)

def test_tiny_preset_wires_model_scheduler_and_tiers():
    parts = build_engine_parts("tiny")
    parts["cache"].close()
    assert parts["model"].cfg.d_model == 128 and parts["config"].token_buckets == (32, 256)
    assert parts["scheduler_config"].max_num_seqs == 16
    assert parts["cache"].config.host_bytes == 2 << 20 and parts["cache"].config.disk_dir is None
    assert (parts["cache"].pool.config.page_size, parts["cache"].pool.config.num_blocks) == (16, 256)
    assert build_engine_parts("tiny", tiers=False)["cache"].config.host_bytes == 0


def test_preset_loads_saved_weights(tmp_path):
    preset = tmp_path / "small.toml"
    fields = "\n".join(f"{k} = {getattr(MODEL, k)!r}".replace("'", '"') for k in MODEL.__dataclass_fields__)
    preset.write_text(f"[model]\n{fields}\n[cache]\npage_size = {PAGE}\nnum_blocks = 16\n")
    save_weights(model(seed=3), tmp_path / "weights")
    loaded = build_engine_parts(str(preset), weights=str(tmp_path / "weights"))["model"]
    fresh = build_engine_parts(str(preset))["model"]
    np.testing.assert_array_equal(loaded.embed.embedding[...], model(seed=3).embed.embedding[...])
    assert not np.array_equal(fresh.embed.embedding[...], model(seed=3).embed.embedding[...])


def test_preset_rejects_unknown_sections_keys(tmp_path):
    preset = tmp_path / "bad.toml"
    preset.write_text("[model]\nnum_layers = 1\n[cache]\npage_size = 8\nnum_blocks = 8\n[tiers]\nhost_gb = 1\n")
    with pytest.raises(ValueError, match=r"unknown \[cache\]/\[tiers\] keys \['host_gb'\]"):
        build_engine_parts(str(preset))
    preset.write_text("[model]\nnum_layers = 1\n[cache]\npage_size = 8\nnum_blocks = 8\n[engine]\nturbo = true\n")
    with pytest.raises(ValueError, match=r"unknown engine config keys \['turbo'\]"):
        build_engine_parts(str(preset))
    preset.write_text("[model]\nnum_layers = 1\n[cache]\nnum_blocks = 8\n")  # a KeyError traceback before
    with pytest.raises(ValueError, match=r"the \[cache\] section lacks \['page_size'\]; it needs page_size and num_"):
        build_engine_parts(str(preset))
    preset.write_text("[model]\nnum_layers = 1\n[cache]\npage_size = 8\nnum_blocks = 8\n"
                      f"[tiers]\nhost_bytes = 0\ndisk_dir = '{tmp_path}'\n")  # the disk tier was dropped silently
    with pytest.raises(ValueError, match=r"\[tiers\] disk_dir=.* needs host_bytes > 0"):
        build_engine_parts(str(preset))
    preset.write_text("[model]\nnum_layers = 1\n")
    with pytest.raises(ValueError, match=r"has no \[cache\] section"):
        build_engine_parts(str(preset), cache_options={"kv_quant": "int8"})
    with pytest.raises(ValueError, match=r"cache_options='int8' must be a mapping of \[cache\] keys"):
        build_engine_parts("tiny", cache_options="int8")
    with pytest.raises(ValueError, match=r"kv_quant='int4' is not a known format"):
        build_engine_parts("tiny", cache_options={"kv_quant": "int4"})


@pytest.mark.parametrize("build, message", [
    (lambda: SamplingParams(temperature=-1.0), "temperature=-1.0 must be a finite number >= 0"),
    (lambda: SamplingParams(top_k=-1), r"top_k=-1 must be an int >= 0 \(0: no limit\)"),
    (lambda: SamplingParams(seed=2**32), r"seed=4294967296 must be None or an int in \[0, 2\*\*32\)"),
    (lambda: EngineConfig(max_model_len=1), "max_model_len=1 must be None or an int >= 2"),
    (lambda: EngineConfig(seed=-1), r"seed=-1 must be an int in \[0, 2\*\*32\)"),
    (lambda: EngineConfig(canonicalize="yes"), "canonicalize='yes' must be a bool"),
    (lambda: EngineConfig(template_chars=0), "template_chars=0 must be an int >= 1"),
    (lambda: EngineConfig(template_chars=True), "template_chars=True must be an int >= 1"),
    (lambda: EngineConfig(seed=True), r"seed=True must be an int in \[0, 2\*\*32\)"),
    (lambda: WorkloadSpec(max_new_tokens=0), "max_new_tokens=0 must be >= 1"),
    (lambda: EngineConfig(token_buckets="32"), r"token_buckets='32' must be a sequence of ints"),
    (lambda: EngineConfig(token_buckets=64), r"token_buckets=64 must be a sequence of ints"),
    (lambda: EngineConfig(impl="cuda"), r"^impl='cuda' is not a known implementation; expected one of \('xla',"),
    (lambda: EngineConfig.from_dict({"impl": "triton"}), r"^impl='triton' is not a known implementation"),
    (lambda: WorkloadSpec(tenants=()), "tenants must name at least one tenant"),
    (lambda: SwapStore(PagePool(pool_config(MODEL, PAGE, 4)), 0), r"num_slots=0 must be >= 1"),
    (lambda: make_engine(config=EngineConfig(token_buckets=(48,))),
     r"token_buckets=\(48,\) must be ascending powers of two, the last >= token_budget=64"),
])
def test_settings_are_validated(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_weights_errors_name_the_directory(tmp_path, monkeypatch):
    save_weights(model(), tmp_path / "w")
    with pytest.raises(ValueError, match="already exists; expected a new path"):
        save_weights(model(), tmp_path / "w")
    with pytest.raises(ValueError, match="does not exist"):
        load_weights(MODEL, tmp_path / "missing")
    # A restore that fails part-way leaves orbax's reads pending on a closed event loop
    # ("RuntimeError: Event loop is closed" later in the suite): shapes are checked first.
    import orbax.checkpoint as ocp

    def no_restore(*args, **kwargs):
        raise AssertionError("restore must not start on a checkpoint that does not fit")

    monkeypatch.setattr(ocp.StandardCheckpointer, "restore", no_restore)
    wider = ModelConfig(num_layers=2, d_model=32, num_q_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
    with pytest.raises(ValueError, match=r"do not fit the model config .*: parameter 'embed/embedding' is "
                                         r"\(256, 64\) there, the config needs \(256, 32\)"):
        load_weights(wider, tmp_path / "w")


def test_top_k_sampling_draws_only_the_k_largest():
    logits = jnp.tile(jnp.array([0.0, 3.0, -1.0, 2.9, 1.0]), (64, 1))
    params = SamplingBatch(temperature=jnp.full(64, 50.0), top_k=jnp.full(64, 2, jnp.int32),
                           seed=jnp.arange(64, dtype=jnp.uint32), index=jnp.zeros(64, jnp.int32))
    drawn = np.asarray(sample(logits, params))
    assert set(drawn.tolist()) == {1, 3}  # at temperature 50 both are drawn; nothing else ever is
    greedy = np.asarray(sample(logits, dataclasses.replace(params, temperature=jnp.zeros(64))))
    assert (greedy == 1).all()
    # ties at the k-th logit: every tie used to be drawn (top_k=1 picked among tied maxima)
    tied = jnp.tile(jnp.array([0.0, 3.0, 3.0, 1.0, 3.0]), (64, 1))
    for k, allowed in ((1, {1}), (2, {1, 2}), (4, {1, 2, 3, 4})):
        drawn = np.asarray(sample(tied, dataclasses.replace(params, top_k=jnp.full(64, k, jnp.int32))))
        assert set(drawn.tolist()) == allowed  # the k largest, ties taken in index order as argmax does


def test_a_step_that_fails_counts_for_nothing_and_the_engine_steps_on(engine, monkeypatch):
    # the plan stayed in flight: every later step raised, even for new requests
    tokens = np.arange(20, dtype=np.int32) % 256
    engine.add_request("a", tokens=tokens, max_new_tokens=4)
    run, calls = engine.runner.run, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("transient device error")
        return run(*args, **kwargs)
    monkeypatch.setattr(engine.runner, "run", fails_once)
    prefill_before = engine.scheduler.stats.prefill_tokens
    with pytest.raises(RuntimeError, match="transient device error"):
        engine.step()
    assert engine.scheduler.in_flight is None and engine.scheduler.stats.aborted_steps == 1
    assert engine.scheduler.stats.prefill_tokens == prefill_before  # its scheduled work was given back
    engine.add_request("b", tokens=[1, 2, 3], max_new_tokens=2)
    finishes = {e.request_id: e for e in engine.run(summary=False) if isinstance(e, FinishEvent)}
    assert finishes["a"].output_token_ids.tolist() == dense_greedy(tokens, 4)
    assert finishes["b"].output_token_ids.tolist() == dense_greedy(np.array([1, 2, 3], np.int32), 2)
    engine.check_invariants()
