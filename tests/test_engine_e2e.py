"""End to end: the cache changes how much is computed, never what comes out.

Greedy tokens with the cache equal those without it (every request in its own namespace)
and those of the dense, uncached forward, for every workload kind; logits agree within
float32 tolerance; hits come from device, host and disk; preempted sequences (swapped or
recomputed) resume exactly.
"""

import concurrent.futures
import threading

import numpy as np
import pytest
from engine_cases import (
    ATOL,
    BLOCKS,
    BUCKETS,
    PAGE,
    dense_greedy,
    dense_logits,
    make_engine,
    random_prompts,
)

from kvjax.serving.engine_config import EngineConfig
from kvjax.serving.engine_events import FinishEvent, TokenEvent
from kvjax.serving.scheduler_config import SchedulerConfig
from kvjax.tiers.transfer import Priority, TransferEngine, TransferResult
from kvjax.tools.workload import WorkloadSpec, build_workload, drive

SPEC = WorkloadSpec(system_prompts=2, questions_per_system_prompt=3, conversations=2, turns_per_conversation=3,
                    few_shot_templates=1, queries_per_template=3, examples_per_template=2,
                    system_prompt_chars=48, max_new_tokens=6)


def _run(engine, requests):
    """Add ``(request_id, tokens, max_new, namespace)`` requests, run, return finish events."""
    for request_id, tokens, max_new, namespace in requests:
        engine.add_request(request_id, tokens=tokens, max_new_tokens=max_new, namespace=namespace)
    events = list(engine.run(summary=False))
    engine.check_invariants()
    return {e.request_id: e for e in events if isinstance(e, FinishEvent)}


@pytest.mark.parametrize("kind", ["system_prompt", "multi_turn", "few_shot"])
def test_cached_greedy_equals_uncached_and_dense(kind):
    sessions = [s for s in build_workload(SPEC) if s.kind == kind]
    cached, uncached = make_engine(), make_engine()
    with cached, uncached:
        hot = drive(cached, sessions)
        cold = drive(uncached, sessions, isolate=True)
        cached.check_invariants()
    assert hot.outputs.keys() == cold.outputs.keys()
    assert all(e.status == "finished" for e in hot.finishes.values())
    for request_id, finish in hot.finishes.items():
        np.testing.assert_array_equal(finish.output_token_ids, cold.outputs[request_id], err_msg=request_id)
        expected = dense_greedy(finish.prompt_token_ids, len(finish.output_token_ids))
        assert finish.output_token_ids.tolist() == expected, request_id
    hot_counters = cached.metrics.to_json()["counters"]
    cold_counters = uncached.metrics.to_json()["counters"]
    assert hot_counters["hit_tokens"]["device"] > 0 and sum(cold_counters["hit_tokens"].values()) == 0
    assert hot_counters["prefill_tokens"] < cold_counters["prefill_tokens"]


def test_logits_match_dense_forward():
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, 3 * PAGE + 2, [5, 11, 1, 20])
    events = []
    with make_engine(record_logits=True) as engine:
        for batch in (prompts[:1], prompts[1:]):  # the first request's pages are cached for the rest
            for prompt in batch:
                engine.add_request(f"r{len(prompt)}", tokens=prompt, max_new_tokens=4)
            events += engine.run(summary=False)
    finishes = {e.request_id: e for e in events if isinstance(e, FinishEvent)}
    assert sum(f.num_hit_tokens for f in finishes.values()) >= 3 * 3 * PAGE  # later requests hit the prefix
    for event in (e for e in events if isinstance(e, TokenEvent)):
        finish = finishes[event.request_id]
        sequence = np.concatenate([finish.prompt_token_ids, finish.output_token_ids[: event.index]])
        np.testing.assert_allclose(event.logits, dense_logits(sequence)[-1], atol=ATOL, rtol=ATOL)


def _evict_with_fillers(engine, rng, num_tokens):
    """Fill the device pool with unrelated requests so earlier pages leave the device."""
    fillers = [(f"fill{i}", rng.integers(0, 256, num_tokens).astype(np.int32), 1, "filler") for i in range(6)]
    _run(engine, fillers)


def test_host_tier_hits_are_exact():
    rng = np.random.default_rng(1)
    first, again = random_prompts(rng, 12 * PAGE, [3, 6])
    with make_engine(host_bytes=BLOCKS * 8 * 1024) as engine:
        _run(engine, [("first", first, 3, "t")])
        _evict_with_fillers(engine, rng, 12 * PAGE)
        finish = _run(engine, [("again", again, 5, "t")])["again"]
    assert finish.hit_tokens_by_tier.get("host", 0) > 0, finish.hit_tokens_by_tier
    assert finish.output_token_ids.tolist() == dense_greedy(again, 5)


def test_disk_tier_hits_are_exact(tmp_path):
    rng = np.random.default_rng(2)
    first, again = random_prompts(rng, 12 * PAGE, [3, 6])
    with make_engine(host_bytes=BLOCKS * 8 * 1024, disk_dir=str(tmp_path), disk_bytes=1 << 26) as engine:
        _run(engine, [("first", first, 3, "t")])
        _evict_with_fillers(engine, rng, 12 * PAGE)
        assert engine.cache.flush(timeout=30)  # every host page gets its disk copy
        engine.cache.evict_host(BLOCKS * 8)  # ... and leaves host memory: disk is the only copy
        finish = _run(engine, [("again", again, 5, "t")])["again"]
    assert finish.hit_tokens_by_tier.get("disk", 0) > 0, finish.hit_tokens_by_tier
    assert finish.output_token_ids.tolist() == dense_greedy(again, 5)


class GatedFetches(TransferEngine):
    """The real transfer engine, except that host -> device fetches finish only once ``gate``
    is set, and fail (nothing lands) when ``fail`` is."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.fail, self.fetches = threading.Event(), False, 0

    def fetch(self, slots, *, priority=Priority.DEMAND):
        inner, gated = super().fetch(slots, priority=priority), concurrent.futures.Future()
        self.fetches += 1

        def finish():
            self.gate.wait(60)
            result = inner.result()
            gated.set_result(TransferResult(result.link, 0, ok=False, error="injected") if self.fail else result)

        threading.Thread(target=finish, daemon=True).start()
        return gated


@pytest.mark.parametrize("fail", [False, True], ids=["lands", "fails"])
def test_a_fetch_in_flight_holds_back_only_its_own_request(fail):
    """While one request's host hit is in flight, another runs its prefill and decodes; the
    fetching one starts when its KV lands (or, if the fetch failed, recomputes) and both
    generate what the dense forward does."""
    rng = np.random.default_rng(5)
    first, again = random_prompts(rng, 12 * PAGE, [3, 6])
    other = rng.integers(0, 256, 5 * PAGE).astype(np.int32)
    with make_engine(host_bytes=BLOCKS * 8 * 1024, transfer_factory=GatedFetches) as engine:
        transfer = engine.cache.transfer
        transfer.fail = fail
        _run(engine, [("first", first, 3, "t")])
        _evict_with_fillers(engine, rng, 12 * PAGE)
        while engine.cache.wait_any(5):  # host copies ready: the fetch is issued at admission,
            pass  # not after an offload still in flight (a loaded machine made that late)
        engine.add_request("again", tokens=again, max_new_tokens=5, namespace="t")
        engine.add_request("other", tokens=other, max_new_tokens=6, namespace="o")
        seen = []
        for _ in range(4):  # the other request's prefill and three decodes
            seen += engine.step()
            engine.check_invariants()
            assert list(engine.scheduler.fetching) == ["again"] and transfer.fetches == 1
        assert {e.request_id for e in seen if isinstance(e, TokenEvent)} == {"other"}
        assert sum(isinstance(e, TokenEvent) for e in seen) == 3
        transfer.gate.set()
        events = seen + list(engine.run(summary=False))
        engine.check_invariants()
    finished = {e.request_id: e for e in events if isinstance(e, FinishEvent)}
    assert finished["again"].output_token_ids.tolist() == dense_greedy(again, 5)
    assert finished["other"].output_token_ids.tolist() == dense_greedy(other, 6)
    host_hits = finished["again"].hit_tokens_by_tier.get("host", 0)
    assert (host_hits == 0) if fail else (host_hits >= 11 * PAGE), finished["again"].hit_tokens_by_tier


def test_a_new_engine_tells_another_namespaces_disk_blocks_from_never_seen_ones(tmp_path):
    """A restarted engine on the same disk directory has seen nothing in this process, yet its
    misses on pages another tenant left on disk count as ``other_namespace``, not ``never_seen``."""
    rng = np.random.default_rng(6)
    [shared] = random_prompts(rng, 12 * PAGE, [5])
    fresh = rng.integers(0, 256, 6 * PAGE + 3).astype(np.int32)
    tiers = dict(host_bytes=BLOCKS * 8 * 1024, disk_dir=str(tmp_path), disk_bytes=1 << 26)
    with make_engine(**tiers) as engine:
        _run(engine, [("a", shared, 2, "tenant-a")])
        engine.cache.evict(BLOCKS)
        assert engine.cache.flush(timeout=30)  # on disk, for the next process
    with make_engine(**tiers) as engine:  # the next process: a new cache and a new observer
        finished = _run(engine, [("b", shared, 2, "tenant-b"), ("c", fresh, 2, "tenant-b")])
    assert finished["b"].miss_tokens_by_cause == {"other_namespace": len(shared)}
    assert finished["c"].miss_tokens_by_cause == {"never_seen": len(fresh)}
    assert finished["b"].output_token_ids.tolist() == dense_greedy(shared, 2)


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_preempted_sequences_resume_exactly(preemption):
    rng = np.random.default_rng(3)
    # Four sequences that grow to 17 pages each cannot all fit 64 blocks: decodes preempt.
    prompts = [rng.integers(0, 256, 6 * PAGE + 3).astype(np.int32) for _ in range(4)]
    scheduler = SchedulerConfig(max_num_seqs=4, token_budget=64, max_prefill_chunk=32, preemption=preemption,
                                host_swap_blocks=64 if preemption == "swap" else 0)  # fmt: skip
    with make_engine(scheduler=scheduler) as engine:
        finishes = _run(engine, [(f"r{i}", p, 10 * PAGE, f"own{i}") for i, p in enumerate(prompts)])
        stats = engine.scheduler.stats
    assert getattr(stats, f"preempted_{preemption}") > 0
    assert sum(f.num_preemptions for f in finishes.values()) > 0
    for i, prompt in enumerate(prompts):
        assert finishes[f"r{i}"].output_token_ids.tolist() == dense_greedy(prompt, 10 * PAGE), i


def _engine_with_host_only_prompt(rng, *, max_num_seqs: int, num_pages: int):
    """An 8-block engine with a host tier whose fetches wait for ``cache.transfer.gate`` (closed
    on return: fetches stay in flight, holding their device blocks), after a prompt of
    ``num_pages`` full pages + 1 token was served and its pages evicted to host only:
    (engine, that prompt)."""
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, token_budget=64, max_prefill_chunk=32)
    engine = make_engine(host_bytes=32 * 8 * 1024, transfer_factory=GatedFetches, num_blocks=8, scheduler=scheduler,
                         config=EngineConfig(max_model_len=8 * PAGE, token_buckets=BUCKETS))  # fmt: skip
    cached = rng.integers(0, 256, num_pages * PAGE + 1).astype(np.int32)
    engine.cache.transfer.gate.set()
    _run(engine, [("seed", cached, 1, None)])
    assert len(engine.cache.evict(8)) == num_pages  # its pages now on host only
    while engine.cache.wait_any(5):  # their host copies are in
        pass
    engine.cache.transfer.gate.clear()
    return engine, cached


def test_a_prefetch_in_flight_holds_blocks_back_but_rejects_no_request():
    """A prefetch for a waiting request holds free blocks until its fetch lands. Counted as
    pinned, a lone running request that needed one more block was stopped, and the waiting
    one rejected; both wait now, and both finish as the dense forward does."""
    rng = np.random.default_rng(0)
    engine, cached = _engine_with_host_only_prompt(rng, max_num_seqs=1, num_pages=4)
    with engine:
        transfer = engine.cache.transfer
        running = rng.integers(0, 256, 17).astype(np.int32)  # grows to 7 of the 8 blocks
        engine.add_request("running", tokens=running, max_new_tokens=39)
        events = engine.step()
        waiting = np.concatenate([cached, [7]]).astype(np.int32)
        engine.add_request("waiting", tokens=waiting, max_new_tokens=2)  # waits (one sequence at a time); prefetched
        for _ in range(60):
            events += engine.step()
            if engine.cache.num_prefetching_blocks:
                break
        assert engine.cache.num_prefetching_blocks == 4
        for _ in range(20):  # "running" needs the prefetch's blocks by now: it waits, it is not stopped
            events += engine.step()
        generated = sum(isinstance(event, TokenEvent) and event.request_id == "running" for event in events)
        assert generated == 4 * PAGE - len(running) + 1  # it filled the 4 blocks the prefetch leaves it
        assert not any(isinstance(event, FinishEvent) and event.status == "rejected" for event in events)
        transfer.gate.set()
        events += list(engine.run(summary=False))
    finishes = {event.request_id: event for event in events if isinstance(event, FinishEvent)}
    assert {rid: finish.status for rid, finish in finishes.items()} == {"running": "finished", "waiting": "finished"}
    assert finishes["running"].output_token_ids.tolist() == dense_greedy(running, 39)
    assert finishes["waiting"].output_token_ids.tolist() == dense_greedy(waiting, 2)


def test_a_prefetch_leaves_the_running_decodes_their_headroom():
    """Two requests run, holding 6 of the 8 blocks (the high watermark is 7); one that arrives
    behind them has 2 pages on host. Its prefetch took both free blocks and held them while the
    fetch was in flight, so the first decode that needed a new block preempted the other
    running request. A prefetch takes only the room the watermark leaves (one page now, the
    rest later): nobody is preempted, and every request generates what the dense forward does."""
    rng = np.random.default_rng(7)
    engine, cached = _engine_with_host_only_prompt(rng, max_num_seqs=2, num_pages=2)
    with engine:
        transfer = engine.cache.transfer
        grows = rng.integers(0, 256, 3 * PAGE - 3).astype(np.int32)  # 3 blocks, a 4th after 4 tokens
        stays = rng.integers(0, 256, 2 * PAGE + 1).astype(np.int32)  # 3 blocks throughout
        engine.add_request("grows", tokens=grows, max_new_tokens=PAGE)
        engine.add_request("stays", tokens=stays, max_new_tokens=PAGE - 1)
        events = engine.step()  # both admitted: 6 blocks held
        waiting = np.concatenate([cached, [7]]).astype(np.int32)
        engine.add_request("waiting", tokens=waiting, max_new_tokens=2)  # waits: two sequences at a time
        for _ in range(60):
            events += engine.step()
            if {"grows", "stays"} <= {e.request_id for e in events if isinstance(e, FinishEvent)}:
                break
        transfer.gate.set()
        events += list(engine.run(summary=False))
        engine.check_invariants()
    finishes = {event.request_id: event for event in events if isinstance(event, FinishEvent)}
    assert {rid: finish.status for rid, finish in finishes.items()} == dict.fromkeys(
        ["grows", "stays", "waiting"], "finished")
    assert engine.metrics.to_json()["counters"].get("preemptions", 0) == 0
    assert sum(finish.num_preemptions for finish in finishes.values()) == 0
    assert finishes["grows"].output_token_ids.tolist() == dense_greedy(grows, PAGE)
    assert finishes["stays"].output_token_ids.tolist() == dense_greedy(stays, PAGE - 1)
    assert finishes["waiting"].output_token_ids.tolist() == dense_greedy(waiting, 2)
