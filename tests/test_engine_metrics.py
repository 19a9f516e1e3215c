"""The engine's metrics tell the truth: scenarios whose true figures are known by construction
(requests rejected, sequences preempted, blocks copied to host, requests cancelled), compared
with what the metrics report."""

import dataclasses

import numpy as np
from engine_cases import BLOCKS, PAGE, SCHEDULER, dense_greedy, make_engine, random_prompts

from kvjax.cache.allocator import fragmentation
from kvjax.cache.cost_model import CostModel
from kvjax.serving.engine_events import FinishEvent
from kvjax.serving.scheduler_config import SchedulerConfig


def _finishes(events):
    return {e.request_id: e for e in events if isinstance(e, FinishEvent)}


def _fail_model_once(engine, when=lambda plan: True):
    """The model run of the first step whose plan satisfies ``when`` raises (the step aborts)."""
    plans, failed = [], []
    schedule, run = engine.scheduler.schedule, engine.runner.run

    def scheduled():
        plans.append(schedule())
        return plans[-1]

    def run_or_fail(*args, **kwargs):
        if not failed and when(plans[-1]):
            failed.append(plans[-1])
            raise RuntimeError("injected device error")
        return run(*args, **kwargs)

    engine.scheduler.schedule, engine.runner.run = scheduled, run_or_fail
    return failed


def _run_through_failures(engine):
    events = []
    while engine.has_unfinished:
        try:
            events += engine.step()
        except RuntimeError as error:
            assert "injected" in str(error)
    return events


def test_a_rejection_reported_by_an_aborted_step_is_counted():
    # the FinishEvent "rejected" went out, but the step aborted before on_step counted it
    with make_engine(scheduler=dataclasses.replace(SCHEDULER, max_waiting=1)) as engine:
        tokens = np.arange(20, dtype=np.int32)
        assert engine.add_request("queued", tokens=tokens, max_new_tokens=2)
        assert not engine.add_request("rejected", tokens=tokens + 1, max_new_tokens=2)  # the queue is full
        failed = _fail_model_once(engine)
        finishes = _finishes(_run_through_failures(engine))
        assert failed and failed[0].rejected  # the rejection came with the step that failed
        assert {rid: f.status for rid, f in finishes.items()} == {"queued": "finished", "rejected": "rejected"}
        assert engine.metrics.to_json()["counters"]["rejections"] == 1 == engine.scheduler.stats.rejected


def test_a_preemption_planned_by_an_aborted_step_is_counted():
    # the victim was preempted (it recomputes, its FinishEvent counts it) though the step aborted
    rng = np.random.default_rng(3)
    scheduler = SchedulerConfig(max_num_seqs=4, token_budget=64, max_prefill_chunk=32, preemption="recompute")
    with make_engine(scheduler=scheduler, num_blocks=24) as engine:
        for i in range(4):  # four sequences that grow to 10 pages each cannot all fit 24 blocks
            tokens = rng.integers(0, 256, 6 * PAGE + 3).astype(np.int32)
            engine.add_request(f"r{i}", tokens=tokens, max_new_tokens=3 * PAGE, namespace=f"own{i}")
        failed = _fail_model_once(engine, when=lambda plan: bool(plan.preempted))
        finishes = _finishes(_run_through_failures(engine))
        assert failed, "no step preempted"
        stats = engine.scheduler.stats
        preempted = sum(f.num_preemptions for f in finishes.values())
        assert preempted == stats.preempted_recompute + stats.preempted_swap
        assert engine.metrics.to_json()["counters"]["preemptions"] == preempted


def test_a_swap_in_of_an_aborted_step_is_not_counted():
    # the step that swapped a preempted request back in failed: the request recomputes, yet
    # its swap-in blocks stayed counted (no swap-in of them landed), and its admission twice
    rng = np.random.default_rng(3)
    scheduler = SchedulerConfig(max_num_seqs=4, token_budget=64, max_prefill_chunk=32, preemption="swap",
                                host_swap_blocks=64)  # fmt: skip
    with make_engine(scheduler=scheduler, num_blocks=24) as engine:
        prompts = [rng.integers(0, 256, 6 * PAGE + 3).astype(np.int32) for _ in range(4)]
        for i, tokens in enumerate(prompts):  # four sequences that grow to 10 pages each cannot all fit 24 blocks
            engine.add_request(f"r{i}", tokens=tokens, max_new_tokens=3 * PAGE, namespace=f"own{i}")
        plans, schedule = [], engine.scheduler.schedule
        engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
        failed = _fail_model_once(engine, when=lambda plan: bool(plan.swap_in))
        finishes = _finishes(_run_through_failures(engine))
        assert failed, "no step swapped in"
        stats = engine.scheduler.stats
        done = [plan for plan in plans if plan is not failed[0]]
        assert stats.swap_in_blocks == sum(len(plan.swap_in) for plan in done)
        assert stats.swap_out_blocks == sum(len(plan.swap_out) for plan in done)
        assert stats.admitted == 4 + sum(f.num_preemptions for f in finishes.values())
        for i, tokens in enumerate(prompts):
            assert finishes[f"r{i}"].output_token_ids.tolist() == dense_greedy(tokens, 3 * PAGE), i


def test_copies_to_host_reported_to_an_aborted_step_are_counted():
    # the step's TierReport (spills, fetch latencies, failures) was taken from the cache, then dropped
    rng = np.random.default_rng(1)
    with make_engine(host_bytes=BLOCKS * 8 * 1024) as engine:
        engine.add_request("first", tokens=rng.integers(0, 256, 6 * PAGE).astype(np.int32), max_new_tokens=2)
        list(engine.run(summary=False))
        engine.cache.evict(BLOCKS)  # write-back: its 6 full pages get host copies
        while engine.cache.wait_any(5):  # the copies finish; the next step's poll reports them
            pass
        engine.add_request("next", tokens=rng.integers(0, 256, 2 * PAGE).astype(np.int32), max_new_tokens=2)
        failed = _fail_model_once(engine)
        _run_through_failures(engine)
        assert failed
        copied = engine.cache.stats.offloaded_blocks
        assert copied == 6
        spilled = engine.metrics.to_json()["counters"]["spilled_blocks"]
        assert spilled == {"device_to_host": copied, "host_to_disk": 0}


def test_gauges_follow_cancellations_of_the_last_requests():
    # a step with no request left returns before on_step: the gauges kept the cancelled requests
    with make_engine() as engine:
        for i in range(3):
            engine.add_request(f"r{i}", tokens=np.arange(30, dtype=np.int32) + i, max_new_tokens=20)
        engine.step()
        gauges = engine.metrics.to_json()["gauges"]
        assert (gauges["running_sequences"], gauges["queued_requests"]) == (3, 0)
        for i in range(3):
            assert engine.cancel(f"r{i}")
        assert {f.status for f in _finishes(engine.run(summary=False)).values()} == {"cancelled"}
        gauges = engine.metrics.to_json()["gauges"]
        assert (gauges["running_sequences"], gauges["queued_requests"]) == (0, 0)
        assert gauges["pool_occupancy_ratio"]["device"] == engine.cache.occupancy()["device"]


class _Clock:
    """An engine clock that moves only when the test says so (seconds)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_latencies_on_an_injected_clock_run_from_arrival_and_stop_at_the_last_token():
    # request_seconds ("arrival to its last token") of a cancelled request ran to its cancellation
    clock = _Clock()
    with make_engine(clock=clock) as engine:
        engine.add_request("done", tokens=np.arange(20, dtype=np.int32), max_new_tokens=2)
        engine.add_request("cancelled", tokens=np.arange(20, dtype=np.int32) + 1, max_new_tokens=50)
        clock.now = 3.0  # both waited 3 s in the queue
        engine.step()  # prefill: first tokens at 3 s
        clock.now = 5.0
        events = engine.step()  # second tokens at 5 s: "done" finishes
        clock.now = 105.0
        assert engine.cancel("cancelled")  # 100 s after its last token
        events += engine.step()
        finishes = _finishes(events)
        assert {rid: f.request_seconds for rid, f in finishes.items()} == {"done": 5.0, "cancelled": 5.0}
        assert {rid: f.ttft_seconds for rid, f in finishes.items()} == {"done": 3.0, "cancelled": 3.0}
        latencies = engine.metrics.to_json()["latencies"]
        assert (latencies["request_seconds"]["count"], latencies["request_seconds"]["max"]) == (2, 5.0)
        assert (latencies["ttft_seconds"]["count"], latencies["ttft_seconds"]["p50"]) == (2, 3.0)
        assert (latencies["queue_seconds"]["count"], latencies["queue_seconds"]["max"]) == (2, 3.0)
        assert (latencies["inter_token_seconds"]["count"], latencies["inter_token_seconds"]["p99"]) == (2, 2.0)


def test_a_prompt_seen_before_in_full_still_misses_its_last_page():
    # the documented definition (kvjax.metrics.registry): hit + miss tokens = prompt tokens, and
    # the last page, never served from cache, is a miss under never_seen when every page before hit
    prompt = np.arange(3 * PAGE, dtype=np.int32)
    with make_engine() as engine:
        for rid in ("first", "again"):
            engine.add_request(rid, tokens=prompt, max_new_tokens=2)
            finish = _finishes(engine.run(summary=False))[rid]
        assert (finish.hit_tokens_by_tier, finish.miss_tokens_by_cause) == ({"device": 2 * PAGE}, {"never_seen": PAGE})
        snapshot = engine.metrics.to_json()
        counters, rates = snapshot["counters"], snapshot["rates"]
        assert sum(counters["hit_tokens"].values()) + sum(counters["miss_tokens"].values()) == 2 * len(prompt)
        assert sum(counters["hit_blocks"].values()) + sum(counters["miss_blocks"].values()) == 2 * 3
        assert rates["token_hit_rate"] == rates["block_hit_rate"] == 2 * PAGE / (2 * len(prompt))


def test_host_pages_recomputed_instead_of_fetched_miss_as_recomputed():
    """Pages the cache held on host but computed anyway (recomputing was cheaper, or their fetch
    failed) missed as "evicted", or "never_seen" in a new process: no cause said the KV was there."""
    rng = np.random.default_rng(1)
    first, again = random_prompts(rng, 12 * PAGE, [3, 6])
    never_fetch = CostModel(recompute_seconds_per_token=0.0)  # recomputing always costs less
    with make_engine(host_bytes=64 * 8 * 1024, cost_model=never_fetch) as engine:
        for request_id, prompt, namespace in [("first", first, "t")] + [
                (f"fill{i}", rng.integers(0, 256, 12 * PAGE).astype(np.int32), "filler") for i in range(6)]:
            engine.add_request(request_id, tokens=prompt, max_new_tokens=1, namespace=namespace)
            list(engine.run(summary=False))
        assert engine.cache.match(again, "t").num_hit_blocks == 12  # every prefix page is cached ...
        engine.add_request("again", tokens=again, max_new_tokens=2, namespace="t")
        finish = _finishes(engine.run(summary=False))["again"]
        recomputed = engine.cache.stats.recompute_chosen_blocks
    device = finish.hit_tokens_by_tier.get("device", 0)
    assert recomputed == 12 - device // PAGE > 0 and "host" not in finish.hit_tokens_by_tier  # ... not fetched
    assert finish.miss_tokens_by_cause == {"recomputed": len(again) - device}
    assert finish.output_token_ids.tolist() == dense_greedy(again, 2)


class _WalkCounter(dict):
    """The device index's live sequences, counting every walk over them."""

    def __init__(self, *args):
        super().__init__(*args)
        self.walks = 0

    def values(self):
        self.walks += 1
        return super().values()

    def items(self):
        self.walks += 1
        return super().items()

    def __iter__(self):
        self.walks += 1
        return super().__iter__()


def test_each_cancellation_sets_exact_gauges_without_walking_the_live_sequences():
    # cancel refreshed the gauges by walking every running sequence (fragmentation): cancelling
    # them all was quadratic. The figures after each cancellation are recomputed here from the
    # requests themselves.
    rng = np.random.default_rng(5)
    scheduler = SchedulerConfig(max_num_seqs=12, token_budget=64, max_prefill_chunk=32, max_waiting=256)
    with make_engine(scheduler=scheduler) as engine:
        for i in range(60):  # prompts of 1-5 tokens: last pages filled to different depths
            tokens = rng.integers(0, 256, int(rng.integers(1, 6))).astype(np.int32)
            assert engine.add_request(f"r{i}", tokens=tokens, max_new_tokens=int(rng.integers(8, 20)),
                                      namespace=f"own{i}")  # fmt: skip
        finished = set()
        for _ in range(3):  # prefills and decodes: sequences of different lengths
            finished |= set(_finishes(engine.step()))
        running = set(engine.scheduler.running)
        waiting = {f"r{i}" for i in range(60)} - running - finished
        assert len(running) == 12 and len(waiting) > 40 and not finished
        index = engine.cache.index
        index._handles = live = _WalkCounter(index._handles)
        page = engine.cache.page_size
        for rid in rng.permutation(sorted(running | waiting)):
            assert engine.cancel(rid)
            running.discard(rid), waiting.discard(rid)
            handles = [engine.scheduler.get(r).handle for r in sorted(running)]
            gauges = engine.metrics.to_json()["gauges"]
            assert (gauges["running_sequences"], gauges["queued_requests"]) == (len(running), len(waiting))
            assert gauges["pool_fragmentation_ratio"] == fragmentation(
                [h.num_tokens for h in handles], [len(h.block_ids) for h in handles], page)
            allocator = engine.cache.allocator
            assert gauges["pool_occupancy_ratio"]["device"] == (allocator.num_blocks - allocator.num_free) / BLOCKS
        assert live.walks == 0  # no cancellation walked the live sequences
        index._handles = dict(index._handles)
        engine.cache.check_invariants()
        assert {f.status for f in _finishes(engine.run(summary=False)).values()} <= {"cancelled", "finished"}


def test_occupancy_is_exported_for_the_tiers_the_cache_has_and_from_the_start(tmp_path):
    # an engine without host and disk tiers exported their occupancy as 0.0, as if they were there and empty
    with make_engine() as engine:
        assert engine.metrics.to_json()["gauges"]["pool_occupancy_ratio"] == {"device": 0.0, "host": None, "disk": None}
        lines = [line for line in engine.metrics.prometheus_text().splitlines()
                 if line.startswith("kvjax_pool_occupancy_ratio")]  # fmt: skip
        assert lines == ['kvjax_pool_occupancy_ratio{tier="device"} 0.0']
    with make_engine(host_bytes=BLOCKS * 8 * 1024, disk_dir=str(tmp_path), disk_bytes=1 << 20) as engine:
        occupancy = engine.metrics.to_json()["gauges"]["pool_occupancy_ratio"]
        assert occupancy == {"device": 0.0, "host": 0.0, "disk": 0.0}
