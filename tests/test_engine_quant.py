"""End to end with quantized pages: the cache still changes how much is computed, not what
comes out, and the quantized model stays close to the float one.

With a quantized pool a cache hit reads the same quantized KV a recomputation would have
written, so cached and uncached greedy tokens must agree exactly (per-token scales: a
token's stored K/V depends only on that token). Against the float, dense forward only
closeness holds: logits within a bound set by the format's precision.
"""

import numpy as np
import pytest
from engine_cases import PAGE, dense_greedy, dense_logits, make_engine, random_prompts

from kvjax.serving.engine_events import FinishEvent, TokenEvent
from kvjax.tools.workload import WorkloadSpec, build_workload, drive
from pallas_kernels.kv_format import QuantizedPages

SPEC = WorkloadSpec(system_prompts=2, questions_per_system_prompt=3, conversations=1, turns_per_conversation=2,
                    few_shot_templates=1, queries_per_template=2, examples_per_template=2,
                    system_prompt_chars=48, max_new_tokens=6)


@pytest.mark.parametrize("kv_quant", ["int8", "fp8_e4m3"])
def test_cached_greedy_equals_uncached_with_quantized_pages(kv_quant):
    sessions = build_workload(SPEC)
    cached, uncached = make_engine(kv_quant=kv_quant), make_engine(kv_quant=kv_quant)
    with cached, uncached:
        assert isinstance(cached.pool.kv_pages, QuantizedPages)
        hot = drive(cached, sessions)
        cold = drive(uncached, sessions, isolate=True)
        cached.check_invariants()
    assert hot.outputs.keys() == cold.outputs.keys()
    for request_id, finish in hot.finishes.items():
        assert finish.status == "finished"
        np.testing.assert_array_equal(finish.output_token_ids, cold.outputs[request_id], err_msg=request_id)
    hits = cached.metrics.to_json()["counters"]["hit_tokens"]["device"]
    assert hits > 0


@pytest.mark.parametrize("kv_quant,kv_scale,bound", [("int8", "token", 0.02), ("int8", "page", 0.03),
                                                      ("fp8_e5m2", "token", 0.15)])
def test_quantized_logits_stay_close_to_the_float_forward(kv_quant, kv_scale, bound):
    rng = np.random.default_rng(3)
    prompts = random_prompts(rng, 2 * PAGE + 3, [4, 9])
    with make_engine(kv_quant=kv_quant, kv_scale=kv_scale, record_logits=True) as engine:
        for prompt in prompts:
            engine.add_request(f"r{len(prompt)}", tokens=prompt, max_new_tokens=3)
        events = list(engine.run(summary=False))
    finishes = {e.request_id: e for e in events if isinstance(e, FinishEvent)}
    errors = []
    for event in (e for e in events if isinstance(e, TokenEvent)):
        finish = finishes[event.request_id]
        sequence = np.concatenate([finish.prompt_token_ids, finish.output_token_ids[: event.index]])
        exact = dense_logits(sequence)[-1]
        errors.append(np.linalg.norm(event.logits - exact) / np.linalg.norm(exact))
    assert len(errors) == 6 and max(errors) <= bound and min(errors) > 0  # quantized, yet close


def _host_hit_run(rng, request_accept_lossy=None, **engine_kwargs):
    """Serve a prompt, push its pages to host with fillers, serve a sibling prompt; returns the
    sibling's finish event, its prompt and the engine's lossy-hit counter."""
    first, again = random_prompts(rng, 12 * PAGE, [3, 6])
    with make_engine(host_bytes=64 * 8 * 1024, record_logits=True, **engine_kwargs) as engine:
        for request_id, prompt, max_new, namespace in [("first", first, 3, "t")] + [
                (f"fill{i}", rng.integers(0, 256, 12 * PAGE).astype(np.int32), 1, "filler") for i in range(6)]:
            engine.add_request(request_id, tokens=prompt, max_new_tokens=max_new, namespace=namespace)
            list(engine.run(summary=False))
        engine.add_request("again", tokens=again, max_new_tokens=5, namespace="t",
                           accept_lossy=request_accept_lossy)
        finish = [e for e in engine.run(summary=False) if isinstance(e, FinishEvent)][0]
        engine.check_invariants()
        return finish, again, engine.cache.stats


def test_host_hits_of_a_quantized_pool_equal_recomputing_them():
    finish, again, _ = _host_hit_run(np.random.default_rng(1), kv_quant="int8")
    assert finish.hit_tokens_by_tier.get("host", 0) > 0, finish.hit_tokens_by_tier
    with make_engine(kv_quant="int8") as fresh:  # no cache to hit: recomputes the same prefix
        fresh.add_request("again", tokens=again, max_new_tokens=5, namespace="t")
        cold = [e for e in fresh.run(summary=False) if isinstance(e, FinishEvent)][0]
    assert finish.output_token_ids.tolist() == cold.output_token_ids.tolist()


def test_lossy_offload_hits_are_counted_and_can_be_refused():
    lossy, _, stats = _host_hit_run(np.random.default_rng(1), offload_quant="int8")
    assert lossy.hit_tokens_by_tier.get("host", 0) > 0 and stats.lossy_hit_blocks > 0
    exact, again, stats = _host_hit_run(np.random.default_rng(1), offload_quant="int8", accept_lossy=False)
    assert exact.hit_tokens_by_tier.get("host", 0) == 0 and stats.refused_lossy_blocks > 0
    # Every prompt page was cached, lossily, and refused: that is the whole miss (the tail
    # page, which is always computed, takes the cause of the page before it).
    assert stats.refused_lossy_blocks == 12 and exact.miss_tokens_by_cause == {"lossy_refused": len(again)}
    assert "lossy_refused" not in lossy.miss_tokens_by_cause
    assert exact.output_token_ids.tolist() == dense_greedy(again, 5)  # recomputed: exact


def test_one_request_can_refuse_lossy_hits_the_cache_accepts():
    exact, again, stats = _host_hit_run(np.random.default_rng(1), request_accept_lossy=False, offload_quant="int8")
    assert exact.hit_tokens_by_tier.get("host", 0) == 0 and stats.refused_lossy_blocks == 12
    assert exact.output_token_ids.tolist() == dense_greedy(again, 5)
    with make_engine() as engine, pytest.raises(ValueError, match="accept_lossy='no' must be None or a bool"):
        engine.add_request("r", tokens=again, accept_lossy="no")
