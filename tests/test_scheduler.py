"""Scheduler decisions on small scenarios: exact plans, victims, orders and reasons."""

import concurrent.futures
import re

import numpy as np
import pytest
from scheduler_cases import Clock, FakeEngine, kv_cache, reference_output

from kvjax.cache.cost_model import CostModel
from kvjax.cache.prefix_trie import Tier
from kvjax.serving.preemption import SwapSpace, choose_preemption
from kvjax.serving.request import Request, RequestStatus
from kvjax.serving.scheduler import Scheduler, SchedulerConfig
from kvjax.serving.wait_queue import WaitQueue, hit_rank
from kvjax.tiers.transfer import Priority, TransferEngine, TransferResult

VOCAB = 50


def make(num_blocks=32, page_size=4, *, high=0.9, low=0.7, host_blocks=0, **config):
    clock = Clock()
    cache = kv_cache(num_blocks, page_size, vocab_size=VOCAB, clock=clock, high=high, low=low, host_blocks=host_blocks)
    scheduler = Scheduler(cache, SchedulerConfig(**config))
    return scheduler, FakeEngine(scheduler, VOCAB), clock


def request(request_id, prompt, max_new_tokens=4, **kwargs):
    return Request(request_id, np.asarray(prompt, np.int32), max_new_tokens, **kwargs)


def chunks(seqs):
    return [(seq.request_id, seq.start, seq.num_tokens) for seq in seqs]


def drain(engine, max_steps=200):
    """Step until nothing is live; return {request id: finish reason} over the whole run."""
    finished = {}
    for _ in range(max_steps):
        if not engine.scheduler.has_unfinished:
            return finished
        finished.update(engine.step()[1])
        engine.scheduler.check_invariants()
    raise AssertionError("requests still live after max_steps")


def test_budget_split_between_decodes_and_chunked_prefill():
    scheduler, engine, _ = make(token_budget=8, max_num_seqs=4, max_prefill_chunk=4)
    for i in range(3):
        scheduler.add(request(f"d{i}", [i + 1, 2, 3], max_new_tokens=10))
    plan, _ = engine.step()
    assert chunks(plan.prefills) == [("d0", 0, 3), ("d1", 0, 3), ("d2", 0, 2)]  # budget 8 = 3 + 3 + 2
    scheduler.add(request("long", list(range(10, 20))))
    plan, _ = engine.step()
    # d2's last prompt token is a one-token step that samples: scheduled with the decodes (its
    # budget is reserved first), counted as the prefill token it is
    assert chunks(plan.decodes) == [("d0", 3, 1), ("d1", 3, 1)]
    assert chunks(plan.prefills) == [("d2", 2, 1), ("long", 0, 4)]  # 3 + 4 <= 8: the chunk cap binds
    assert scheduler.stats.prefill_tokens == 8 + 1 + 4 and scheduler.stats.decode_tokens == 2
    plan, _ = engine.step()
    assert chunks(plan.decodes) == [("d0", 4, 1), ("d1", 4, 1), ("d2", 3, 1)]
    assert chunks(plan.prefills) == [("long", 4, 4)]
    plan, _ = engine.step()
    assert chunks(plan.prefills) == [("long", 8, 2)] and plan.prefills[0].samples
    assert plan.num_tokens == 5
    scheduler.check_invariants()


def test_a_prompts_last_token_alone_is_counted_as_prefill():
    # chunked at 4, a 5-token prompt's last token runs alone, with the decodes: it is still a
    # prompt token, so prefill + hit tokens add up to the prompt and decodes to the rest
    scheduler, engine, _ = make(token_budget=8, max_num_seqs=2, max_prefill_chunk=4)
    scheduler.add(request("r", [1, 2, 3, 4, 5], max_new_tokens=3))
    drain(engine)
    assert scheduler.stats.prefill_tokens == 5 and scheduler.stats.decode_tokens == 2


@pytest.mark.parametrize("per_step", [0, 2])
def test_the_rank_refresh_rotation_forgets_requests_that_left(per_step):
    # ids of cancelled requests used to stay in the rotation (for good with 0 per step) and to
    # use up the quota of the waiting ones
    scheduler, engine, _ = make(max_num_seqs=1, rank_refresh_per_step=per_step)
    for i in range(40):
        scheduler.add(request(f"r{i}", [i + 1, 2, 3]))
        scheduler.cancel(f"r{i}")
    scheduler.add(request("live", [9, 9, 9]))
    for _ in range(3):
        engine.step()
        scheduler.check_invariants()
    assert len(scheduler._refresh) <= 1  # the rotation holds waiting requests only (here none left)


def test_decodes_always_scheduled_even_when_prefill_wants_the_budget():
    scheduler, engine, _ = make(token_budget=4, max_num_seqs=4, max_prefill_chunk=64)
    for i in range(4):
        scheduler.add(request(f"r{i}", [i + 1] * (1 + 8 * i), max_new_tokens=6))
    for _ in range(20):
        running_decodes = {rid for rid, r in scheduler.running.items() if not r.is_prefill}
        plan, _ = engine.step()
        # (a prompt's last token runs with the decodes, listed as a one-token prefill)
        assert running_decodes <= {seq.request_id for seq in plan.sequences if seq.num_tokens == 1}
        assert plan.num_tokens <= 4


def test_hit_first_then_arrival_order():
    scheduler, engine, clock = make(max_num_seqs=1, aging_seconds=10.0)
    cached = list(range(1, 18))  # 4 full pages + 1 token
    scheduler.add(request("warm", cached, max_new_tokens=1))
    drain(engine)
    clock.now = 1.0
    scheduler.add(request("miss", [40, 41, 42, 43, 44]))
    clock.now = 2.0
    scheduler.add(request("hit", cached[:12] + [45]))  # 3 cached pages: rank 2
    scheduler.add(request("hit-later", cached[:8] + [46]))  # 2 cached pages: rank 2, later
    order = []
    while scheduler.has_unfinished:
        plan, _ = engine.step()
        order += [seq.request_id for seq in plan.sequences if seq.request_id not in order]
    assert order == ["hit", "hit-later", "miss"]
    assert scheduler.stats.hit_tokens == 12 + 8


@pytest.mark.parametrize("aging_seconds, admitted_at", [(0.0, 0), (1.0, 2), (1e6, None)])
def test_aging_admits_a_miss_starved_by_a_stream_of_hits(aging_seconds, admitted_at):
    scheduler, engine, clock = make(max_num_seqs=1, token_budget=8, aging_seconds=aging_seconds)
    shared = list(range(1, 10))  # 2 cached pages + 1 token: every hit has rank 2
    scheduler.add(request("warm", shared, max_new_tokens=1))
    drain(engine)
    scheduler.add(request("miss", [30, 31, 32], max_new_tokens=1))  # arrives at 0.0, rank 0
    steps = []
    for step in range(12):  # two hits arrive each second; one request runs per step
        clock.now += 1.0
        for copy in "ab":
            scheduler.add(request(f"hit{step}{copy}", shared[:8] + [step + 1], max_new_tokens=1))
        plan, _ = engine.step()
        steps += [step for seq in plan.sequences if seq.request_id == "miss"]
        scheduler.check_invariants()
    # With a seconds of aging per rank, hits arriving before 2a go ahead of "miss" (a tie at
    # 2a goes to the earlier queued): a=1 lets the two hits of t=1 go first.
    assert steps == ([] if admitted_at is None else [admitted_at])


def test_high_watermark_stops_admission_until_blocks_return():
    scheduler, engine, _ = make(num_blocks=10, high=0.5, low=0.3, max_num_seqs=8)
    scheduler.add(request("big", list(range(1, 17)), max_new_tokens=2))  # 4 blocks
    scheduler.add(request("small", [20, 21, 22, 23, 24], max_new_tokens=1))  # 2 blocks: 6 > 5
    plan, _ = engine.step()
    assert chunks(plan.prefills) == [("big", 0, 16)]
    assert "small" in scheduler.waiting and scheduler.get("small").status is RequestStatus.WAITING
    plan, finished = engine.step()  # big decodes its last token and finishes
    assert finished == {"big": "length"} and not plan.prefills
    plan, _ = engine.step()  # big's blocks are cached-unreferenced now: reclaimable, not held
    assert chunks(plan.prefills) == [("small", 0, 5)]


def test_cached_hits_no_sequence_holds_count_against_the_high_watermark():
    """Mapping a cached-unreferenced prefix makes its blocks held: admission counted only the
    new blocks, so a long cached conversation pushed the pool past the watermark (6 > 5)."""
    scheduler, engine, _ = make(num_blocks=10, high=0.5, low=0.3, max_num_seqs=8)
    prefix = list(range(1, 13))  # 3 full pages
    scheduler.add(request("first", prefix + [13], max_new_tokens=1))
    assert drain(engine) == {"first": "length"}
    assert engine.scheduler.cache.num_reclaimable == 3
    scheduler.add(request("runner", [30, 31, 32, 33], max_new_tokens=8))  # 1 block, then 2
    engine.step()
    engine.step()
    scheduler.add(request("hit", prefix + [40], max_new_tokens=1))  # 4 pages: 3 hits + 1 new
    plan, _ = engine.step()
    assert not plan.prefills and "hit" in scheduler.waiting  # 2 held + 1 new + 3 mapped = 6 > 5
    finished = {}
    while not plan.prefills:  # until the runner's blocks return
        plan, done = engine.step()
        finished.update(done)
    assert chunks(plan.prefills) == [("hit", 12, 1)]  # the prefix still hit
    finished.update(drain(engine))
    assert finished == {"runner": "length", "hit": "length"}


def test_lone_request_ignores_the_watermark():
    scheduler, engine, _ = make(num_blocks=10, high=0.2, low=0.1)
    scheduler.add(request("big", list(range(1, 33)), max_new_tokens=2))  # 8 blocks > 2
    assert drain(engine) == {"big": "length"}


def _two_decoders(**config):
    """A 6-block pool, 4-token pages: "old" (admitted first) and "new" fill 5 blocks."""
    scheduler, engine, _ = make(num_blocks=6, page_size=4, high=1.0, low=0.5, max_num_seqs=4, token_budget=16, **config)
    scheduler.add(request("old", list(range(1, 12)), max_new_tokens=8))  # 11 tokens: 3 blocks
    scheduler.add(request("new", list(range(20, 26)), max_new_tokens=8))  # 6 tokens: 2 blocks
    engine.step()
    return scheduler, engine


def test_preemption_recompute_picks_the_newest_and_resumes_identically():
    scheduler, engine = _two_decoders(preemption="recompute")
    plan, _ = engine.step()  # old decodes position 11, new position 6
    plan, _ = engine.step()  # old needs a 4th block at position 12: 1 free -> fits
    assert not plan.preempted
    generated = None
    for _ in range(4):
        plan, _ = engine.step()
        if plan.preempted:
            generated = scheduler.get("new").output_token_ids.tolist()
            break
    assert list(plan.preempted) == ["new"] and plan.preempted["new"].startswith("recompute")
    victim = scheduler.get("new")
    assert victim.status is RequestStatus.WAITING and victim.num_computed_tokens == 0
    assert victim.num_tokens == 6 + len(generated) and victim.num_preemptions == 1
    assert [seq.request_id for seq in plan.decodes] == ["old"]
    finished = drain(engine)
    assert finished == {"old": "length", "new": "length"}
    assert victim.output_token_ids.tolist() == reference_output(range(20, 26), victim.namespace, 8, VOCAB)
    assert victim.output_token_ids.tolist()[: len(generated)] == generated


def test_preemption_swap_lists_blocks_and_swaps_back_in():
    scheduler, engine = _two_decoders(preemption="swap", host_swap_blocks=8)
    for _ in range(6):
        blocks = scheduler.running["new"].handle.block_table
        computed = scheduler.running["new"].num_computed_tokens
        plan, _ = engine.step()
        if plan.preempted:
            break
    assert plan.preempted["new"].startswith("swap")
    pages = -(-computed // 4)
    assert plan.swap_out == list(zip(blocks[:pages], range(pages)))
    victim = scheduler.get("new")
    assert victim.status is RequestStatus.SWAPPED and victim.swap_slots == list(range(pages))
    swapped_in = []
    while scheduler.has_unfinished:
        plan, _ = engine.step()
        swapped_in += plan.swap_in
        scheduler.check_invariants()
    hit_pages = victim.num_hit_tokens // 4
    assert [slot for slot, _ in swapped_in] == list(range(hit_pages, pages))
    assert victim.output_token_ids.tolist() == reference_output(range(20, 26), victim.namespace, 8, VOCAB)
    assert scheduler.stats.preempted_swap == 1 and scheduler.stats.swap_out_blocks == pages


def test_an_aborted_step_makes_the_requests_it_was_swapping_recompute():
    # the step's engine failed before (or while) it moved the blocks: the swap slots hold
    # nothing the request may read back, so it recomputes; the other requests just run again
    scheduler, engine = _two_decoders(preemption="swap", host_swap_blocks=8)
    for _ in range(6):
        plan = scheduler.schedule()
        if plan.swap_out:
            break
        scheduler.on_step_done(plan, engine.run(plan))
    assert plan.swap_out and list(plan.preempted) == ["new"]
    assert scheduler.stats.swap_out_blocks == len(plan.swap_out) > 0
    assert scheduler.abort_step(plan) == ["new"]  # never run: the engine moved nothing
    assert scheduler.stats.swap_out_blocks == 0  # no copy of them is used
    victim = scheduler.get("new")
    assert (victim.status, victim.swap_slots, victim.num_computed_tokens) == (RequestStatus.WAITING, [], 0)
    assert scheduler.in_flight is None and scheduler.stats.aborted_steps == 1
    with pytest.raises(ValueError, match=r"plan of step \d+ is not the step in flight"):
        scheduler.abort_step(plan)
    scheduler.check_invariants()
    while scheduler.has_unfinished:
        engine.step()  # asserts every KV it reads
        scheduler.check_invariants()
    assert victim.output_token_ids.tolist() == reference_output(range(20, 26), victim.namespace, 8, VOCAB)


def test_auto_preemption_recomputes_when_host_space_is_short():
    scheduler, engine = _two_decoders(preemption="auto", host_swap_blocks=1)
    reasons = {}
    for _ in range(8):
        reasons.update(engine.step()[0].preempted)
    assert reasons["new"].startswith("recompute: host swap space has 1 free blocks")


def test_prompt_that_can_never_fit_is_rejected_with_sizes():
    scheduler, engine, _ = make(num_blocks=8, page_size=4)
    rejected = Request("huge", np.ones(50, np.int32), 4)
    assert not scheduler.add(rejected)
    assert rejected.status is RequestStatus.REJECTED
    with pytest.raises(ValueError, match=r"request_id='huge' was just rejected"):
        scheduler.add(request("huge", [1] * 8))  # the id is taken until its rejection is reported
    assert rejected.finish_reason == "prompt of 50 tokens needs 13 blocks of 4 tokens; the device pool has 8"
    plan = scheduler.schedule()
    assert plan.rejected == {"huge": rejected.finish_reason}


def test_full_waiting_queue_rejects_new_requests():
    scheduler, _, _ = make(max_waiting=2)
    assert scheduler.add(request("a", [1])) and scheduler.add(request("b", [2]))
    late = request("c", [3])
    assert not scheduler.add(late)
    assert late.finish_reason == "waiting queue is full (2 requests, max_waiting=2); 0 running"


def test_cancellation_releases_blocks():
    scheduler, engine, _ = make(num_blocks=8)
    scheduler.add(request("a", list(range(1, 10)), max_new_tokens=20))
    scheduler.add(request("b", [5, 6]))
    engine.step()
    allocator = scheduler.cache.allocator
    assert allocator.num_referenced == 4
    plan = scheduler.schedule()
    assert scheduler.cancel("a") and scheduler.cancel("b")
    assert not scheduler.cancel("a") and not scheduler.cancel("never-added")
    assert scheduler.on_step_done(plan, {}) == {}  # cancelled mid-step: their tokens are ignored
    assert allocator.num_referenced == 0 and scheduler.cache.num_sequences == 0
    assert allocator.num_free + scheduler.cache.num_reclaimable == 8
    scheduler.check_invariants()


def test_cancel_waiting_and_swapped_requests_frees_their_slots():
    scheduler, engine = _two_decoders(preemption="swap", host_swap_blocks=8)
    while not scheduler.get("new").swap_slots:
        engine.step()
    assert scheduler.cancel("new") and scheduler.get("new") is None
    engine.step()
    scheduler.check_invariants()  # the swap space partition includes released slots


def test_fully_cached_prompt_recomputes_its_last_page_privately():
    scheduler, engine, _ = make(page_size=4)
    prompt = list(range(1, 9))  # exactly two pages
    scheduler.add(request("first", prompt, max_new_tokens=1))
    drain(engine)
    cached_blocks = scheduler.cache.match(prompt).blocks.tolist()
    scheduler.add(request("again", prompt, max_new_tokens=2))
    plan, _ = engine.step()
    (seq,) = plan.prefills
    assert (seq.start, seq.num_tokens) == (4, 4)  # page 0 hits; page 1 is recomputed
    assert seq.block_table[0] == cached_blocks[0] and seq.block_table[1] != cached_blocks[1]
    drain(engine)


def _host_only_prefix(*, high=1.0, max_num_seqs=1, host_blocks=16, **cache_kwargs):
    """A scheduler over an 8-block, 4-token-page tiered cache whose host hits are fetched, with
    ``cached`` (9 tokens) served once and its 2 full pages evicted to host only: (scheduler,
    engine, cache, cached)."""
    cache = kv_cache(8, 4, vocab_size=VOCAB, clock=Clock(), high=high, low=0.5, host_blocks=host_blocks,
                     cost_model=CostModel(recompute_seconds_per_token=1.0), **cache_kwargs)  # fmt: skip
    scheduler = Scheduler(cache, SchedulerConfig(max_num_seqs=max_num_seqs, token_budget=32, max_prefill_chunk=32))
    engine = FakeEngine(scheduler, VOCAB)
    cached = list(range(1, 10))
    scheduler.add(request("cached", cached, max_new_tokens=1))
    drain(engine)
    assert cache.flush(timeout=30) and len(cache.evict(8)) == 2  # its 2 full pages: on host only
    return scheduler, engine, cache, cached


def test_a_lone_decode_waiting_for_a_prefetchs_blocks_passes_the_invariant_check():
    # it waits a step (it is neither stopped nor scheduled) while a prefetch holds the blocks it
    # needs; check_invariants called that state "running decode was skipped"
    scheduler, engine, cache, cached = _host_only_prefix(host_blocks=8)
    grow = request("grow", list(range(10, 31)), max_new_tokens=11)  # 6 blocks, growing to 8
    scheduler.add(grow)
    engine.step()
    cache.prefetch(cached)  # takes the 2 free blocks until the fetch is applied
    assert cache.num_prefetching_blocks == 2 and cache.allocator.num_free == 0
    waited = 0
    for _ in range(6):
        plan = scheduler.schedule()
        scheduler.check_invariants()  # with the plan in flight
        waited += not plan.sequences
        assert not plan.rejected and scheduler.running.keys() == {"grow"}
        scheduler.on_step_done(plan, engine.run(plan))
    assert waited == 3  # 3 decodes filled its 6th block, then it waits
    while cache.num_prefetching_blocks:  # the prefetch lands: its pages are cached, reclaimable (the
        assert cache.wait_any(30)  # first transfer to end may be another: this engine never polls)
    assert drain(engine) == {"grow": "length"}
    assert grow.output_token_ids.tolist() == reference_output(range(10, 31), grow.namespace, 11, VOCAB)


def test_lone_request_blocked_by_pins_is_stopped_with_a_reason():
    scheduler, engine, _ = make(num_blocks=4, page_size=2, high=1.0)
    scheduler.add(request("pinned", [1, 2, 3, 4, 5], max_new_tokens=1))
    drain(engine)
    assert scheduler.cache.pin([1, 2, 3, 4]) == 4  # 2 blocks pinned
    grow = request("grow", [9, 9, 9], max_new_tokens=10)
    scheduler.add(grow)
    rejected = {}
    while scheduler.has_unfinished:
        rejected.update(engine.step()[0].rejected)
    reason = "stopped after 2 generated tokens: its 2 blocks and 2 pinned ones fill the 4-block pool"
    assert grow.status is RequestStatus.REJECTED and grow.finish_reason == reason == rejected["grow"]


def test_request_that_pins_leave_no_room_for_is_rejected_when_nothing_runs():
    scheduler, engine, _ = make(num_blocks=4, page_size=2, high=1.0)
    scheduler.add(request("pinned", [1, 2, 3, 4, 5], max_new_tokens=1))
    drain(engine)
    scheduler.cache.pin([1, 2, 3, 4])  # 2 of 4 blocks
    blocked = request("blocked", [7, 7, 7, 7, 7], max_new_tokens=1)  # 3 blocks
    scheduler.add(blocked)
    plan, _ = engine.step()
    reason = "request 'blocked' needs 3 free blocks; pins leave too few of the pool's 4"
    assert plan.rejected == {"blocked": reason} and blocked.status is RequestStatus.REJECTED
    assert not scheduler.has_unfinished


def test_prefetch_intent_for_host_only_pages_is_emitted_once():
    scheduler, engine, _ = make(num_blocks=8, page_size=4, max_num_seqs=1, host_blocks=8)
    prompt = list(range(1, 10))
    scheduler.add(request("warm", prompt, max_new_tokens=1))
    drain(engine)  # its full pages got host copies when they were committed (write-through)
    cache = scheduler.cache
    cache.evict(8)  # device copies gone, host copies stay indexed
    scheduler.add(request("busy", [40] * 9, max_new_tokens=3))
    engine.step()
    scheduler.add(request("wants", prompt[:8] + [30]))
    plan, _ = engine.step()
    (intent,) = plan.prefetch
    assert (intent.request_id, intent.first_page, intent.num_pages) == ("wants", 0, 2)
    assert intent.tiers.tolist() == [int(Tier.HOST)] * 2 and intent.token_ids.tolist() == prompt[:8]
    plan, _ = engine.step()
    assert plan.prefetch == []


def test_a_prefetch_intent_stops_at_the_pages_admission_maps():
    # a page-aligned prompt cached on host: admission maps all but its last page (the last
    # token is computed), so fetching that page up only held a device block for nothing
    scheduler, engine, _ = make(num_blocks=8, page_size=4, max_num_seqs=1, host_blocks=8)
    prompt = list(range(1, 13))  # exactly three pages
    scheduler.add(request("warm", prompt, max_new_tokens=2))
    drain(engine)
    cache = scheduler.cache
    assert cache.flush(timeout=30) and len(cache.evict(8)) == 3  # its pages: on host only
    scheduler.add(request("busy", [40] * 9, max_new_tokens=3))
    engine.step()
    scheduler.add(request("wants", prompt))
    plan, _ = engine.step()
    (intent,) = plan.prefetch
    assert (intent.request_id, intent.first_page, intent.num_pages) == ("wants", 0, 2)
    assert intent.token_ids.tolist() == prompt[:8] and len(intent.tiers) == 2
    scheduler.add(request("one-page", prompt[:4]))  # its only page is its last: nothing to fetch
    plan, _ = engine.step()
    assert plan.prefetch == []
    scheduler.check_invariants()


def _run_prefetches(cache, plan):
    """What the engine does with a plan's prefetch intents."""
    for intent in plan.prefetch:
        cache.prefetch(intent.token_ids, intent.namespace)


def test_a_prefetch_takes_the_room_the_high_watermark_leaves_and_the_rest_later():
    # two running requests hold 6 blocks of 8 (high watermark: 7); the waiting one has 2 pages
    # on host. Both pages were announced at once and took the free blocks past the watermark,
    # the headroom the running decodes grow into
    scheduler, engine, cache, cached = _host_only_prefix(high=0.875, max_num_seqs=2)
    scheduler.add(request("busy", [40] * 17, max_new_tokens=4))  # 5 blocks hold all 21 tokens
    scheduler.add(request("short", [41, 42], max_new_tokens=2))  # 1 block, gone after the next step
    engine.step()
    scheduler.add(request("wants", cached[:8] + [30], max_new_tokens=1))
    plan = scheduler.schedule()
    assert [(i.request_id, i.first_page, i.num_pages) for i in plan.prefetch] == [("wants", 0, 1)]
    assert plan.prefetch[0].token_ids.tolist() == cached[:4]
    _run_prefetches(cache, plan)
    assert scheduler.on_step_done(plan, engine.run(plan)) == {"short": "length"}
    assert cache.num_prefetching_blocks == 1
    plan, _ = engine.step()
    assert plan.prefetch == [] and not plan.preempted  # page 0 in flight, no room for page 1 yet
    while cache.num_prefetching_blocks:
        assert cache.wait_any(30)
    cache.poll()  # page 0 landed (cached); "short" left: room for page 1 and the hold on page 0
    plan = scheduler.schedule()
    assert [(i.request_id, i.first_page, i.num_pages) for i in plan.prefetch] == [("wants", 1, 1)]
    assert scheduler.waiting.peek().request_id == "wants"  # admission waits for the same room
    scheduler.on_step_done(plan, engine.run(plan))
    assert scheduler.cancel("wants")
    scheduler.check_invariants()


def test_a_prefetch_that_did_not_start_is_announced_again_and_one_in_flight_is_not():
    # the pool's free blocks were short when the intent was announced, so nothing moved; the
    # intent was never announced again, and the request lost its prefetch for good
    scheduler, engine, cache, cached = _host_only_prefix()
    scheduler.add(request("filler", list(range(10, 39)), max_new_tokens=1))  # 29 tokens: 7 pages stay cached
    drain(engine)
    scheduler.add(request("busy", [40] * 5, max_new_tokens=12))  # runs throughout: "wants" waits
    engine.step()
    assert cache.allocator.num_free == 0 and cache.num_reclaimable == 6  # cached pages fill the rest
    scheduler.add(request("wants", cached[:8] + [30], max_new_tokens=1))
    plan = scheduler.schedule()
    assert [(i.request_id, i.first_page, i.num_pages) for i in plan.prefetch] == [("wants", 0, 2)]
    _run_prefetches(cache, plan)  # no free block for it: no eviction for a guess, nothing starts
    assert cache.num_prefetching_blocks == 0
    scheduler.on_step_done(plan, engine.run(plan))
    assert len(cache.evict(4)) == 4  # free blocks now
    plan = scheduler.schedule()
    assert [(i.request_id, i.first_page, i.num_pages) for i in plan.prefetch] == [("wants", 0, 2)]
    _run_prefetches(cache, plan)
    assert cache.num_prefetching_blocks == 2  # started this time
    scheduler.on_step_done(plan, engine.run(plan))
    plan, _ = engine.step()
    assert plan.prefetch == []  # in flight: not duplicated
    while cache.num_prefetching_blocks:
        assert cache.wait_any(30)
    cache.poll()
    plan, _ = engine.step()
    assert plan.prefetch == []  # landed: on the device now
    assert cache.match(cached[:8]).num_device_blocks == 2
    scheduler.check_invariants()


def test_an_intent_cut_to_the_room_is_not_announced_again_for_disk_pages_past_the_cut(tmp_path):
    # page 0 on host, page 1 on disk only, room for one page and no free block: the intent
    # (page 0) starts nothing, and it was announced again every step because a prefetch of the
    # whole extent would restore page 1 from disk, which the cut intent never asks for
    cache = kv_cache(8, 4, vocab_size=VOCAB, clock=Clock(), high=0.875, low=0.5, host_blocks=16,
                     cost_model=CostModel(recompute_seconds_per_token=1.0), disk_dir=str(tmp_path),
                     disk_bytes=1 << 20, model_id="test")  # fmt: skip
    scheduler = Scheduler(cache, SchedulerConfig(max_num_seqs=2, token_budget=32, max_prefill_chunk=32))
    engine = FakeEngine(scheduler, VOCAB)
    cached = list(range(1, 10))
    scheduler.add(request("cached", cached, max_new_tokens=1))
    drain(engine)
    assert cache.flush(timeout=30) and len(cache.evict(8)) == 2 and cache.evict_host(1) == 1
    assert cache.lookup(cached).tiers.tolist() == [int(Tier.HOST | Tier.DISK), int(Tier.DISK)]
    scheduler.add(request("filler", list(range(20, 29)), max_new_tokens=1))  # 2 pages stay cached
    drain(engine)
    scheduler.add(request("busy", [40] * 21, max_new_tokens=3))  # 6 blocks: none free, room for 1
    engine.step()
    assert cache.allocator.num_free == 0 and cache.num_reclaimable == 2
    scheduler.add(request("wants", cached[:8] + [30], max_new_tokens=1))
    plan = scheduler.schedule()
    assert [(i.request_id, i.first_page, i.num_pages) for i in plan.prefetch] == [("wants", 0, 1)]
    _run_prefetches(cache, plan)  # page 0 is on host: no free block for it, nothing starts
    scheduler.on_step_done(plan, engine.run(plan))
    plan = scheduler.schedule()
    assert plan.prefetch == []  # nothing a prefetch of page 0 would start now
    scheduler.on_step_done(plan, engine.run(plan))
    scheduler.check_invariants()


class FailingFetches(TransferEngine):
    """The real transfer engine, except that host -> device fetches land nothing while ``fail``."""

    fail = True

    def fetch(self, slots, *, priority=Priority.DEMAND):
        inner = super().fetch(slots, priority=priority)
        if not self.fail:
            return inner
        failed = concurrent.futures.Future()
        inner.add_done_callback(lambda done: failed.set_result(
            TransferResult(done.result().link, 0, ok=False, error="injected")))  # fmt: skip
        return failed


def test_a_prefetch_whose_fetch_failed_is_announced_again():
    # the prefetch started and its fetch failed: the pages are still on host only, nothing
    # moves them, and the extent was never announced again
    scheduler, engine, cache, cached = _host_only_prefix(transfer_factory=FailingFetches)
    scheduler.add(request("busy", [40] * 5, max_new_tokens=8))  # runs throughout: "wants" waits
    engine.step()
    scheduler.add(request("wants", cached[:8] + [30], max_new_tokens=1))
    for fail in (True, False):  # the extent is announced, fetched and fails; announced again, and lands
        cache.transfer.fail = fail
        plan = scheduler.schedule()
        assert [(i.request_id, i.first_page, i.num_pages) for i in plan.prefetch] == [("wants", 0, 2)]
        _run_prefetches(cache, plan)
        scheduler.on_step_done(plan, engine.run(plan))
        while cache.num_prefetching_blocks:
            assert cache.wait_any(30)
        assert cache.poll().fetch_failures == fail
        assert cache.match(cached[:8]).num_device_blocks == (0 if fail else 2)
    plan, _ = engine.step()
    assert plan.prefetch == []
    scheduler.check_invariants()


def test_evict_target_above_the_high_watermark():
    scheduler, engine, _ = make(num_blocks=10, high=0.5, low=0.2, evict_to_low_watermark=True)
    scheduler.add(request("a", list(range(1, 25)), max_new_tokens=1))  # 6 blocks, then cached
    drain(engine)
    plan = scheduler.schedule()
    assert plan.evict_target == 4 and len(plan.evicted) == 4  # 6 occupied -> low mark of 2
    assert scheduler.cache.allocator.num_free == 8
    scheduler.on_step_done(plan, {})


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"max_num_seqs": 0}, "max_num_seqs=0 must be >= 1"),
        ({"token_budget": 8, "max_num_seqs": 16}, r"token_budget=8 must be >= max_num_seqs=16"),
        ({"max_prefill_chunk": 0}, "max_prefill_chunk=0 must be >= 1"),
        ({"aging_seconds": -1.0}, r"aging_seconds=-1.0 must be a finite number >= 0"),
        ({"aging_seconds": float("inf")}, r"aging_seconds=inf must be a finite"),
        ({"preemption": "drop"}, r"preemption='drop' is not one of \('auto', 'swap', 'recompute'\)"),
        ({"host_swap_blocks": -1}, "host_swap_blocks=-1 must be >= 0"),
        ({"max_waiting": 0}, "max_waiting=0 must be >= 1"),
        ({"rank_refresh_per_step": -1}, "rank_refresh_per_step=-1 must be >= 0"),
        ({"prefetch_window": -2}, "prefetch_window=-2 must be >= 0"),
        ({"max_prefill_chunk": 7.5}, r"max_prefill_chunk=7.5 must be an int"),  # TOML floats used to pass
        ({"max_num_seqs": True}, r"max_num_seqs=True must be an int"),
        ({"host_swap_blocks": "2"}, r"host_swap_blocks='2' must be an int"),
        ({"aging_seconds": "1"}, r"aging_seconds='1' must be a number of seconds"),
        ({"evict_to_low_watermark": 1}, r"evict_to_low_watermark=1 must be a bool"),
    ],
)
def test_config_validation_messages(settings, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**settings)


def test_a_config_that_is_not_a_scheduler_config_is_refused():
    # a dict (a parsed config section) raised AttributeError: 'dict' object has no attribute ...
    cache = kv_cache(8, 4, vocab_size=VOCAB, clock=Clock())
    message = r"config=\{'max_num_seqs': 4\} must be a SchedulerConfig \(SchedulerConfig.from_dict builds one"
    with pytest.raises(ValueError, match=message + r" from a mapping\) or None"):
        Scheduler(cache, {"max_num_seqs": 4})


def test_config_from_dict():
    assert SchedulerConfig.from_dict({"max_num_seqs": 8, "token_budget": 64}) == SchedulerConfig(8, 64)
    with pytest.raises(ValueError, match=r"unknown scheduler config keys \['budget'\]; expected some of"):
        SchedulerConfig.from_dict({"budget": 3})


@pytest.mark.parametrize(
    "args, message",
    [
        (("", [1], 1), "request_id='' must be a non-empty str"),
        (("r", [1], 0), "max_new_tokens=0 must be an int >= 1"),
        (("r", [], 1), "request 'r' has an empty prompt"),
        (("r", [[1]], 1), r"tokens must be 1-D"),
    ],
)
def test_request_validation_messages(args, message):
    with pytest.raises(ValueError, match=message):
        Request(args[0], np.asarray(args[1]), args[2])


@pytest.mark.parametrize(
    "tokens, message",
    [
        ({"a": np.int64(3), "b": 10**400}, r"token 1000.* for request 'b' is out of range"),  # numpy + huge int
        ({"a": np.uint64(3), "b": -1}, r"token -1 for request 'b' is out of range"),
        ({"a": 1.0, "b": 10**400}, r"token 1.0 for request 'a' must be an integer"),  # float + huge int
        ({"a": 10**400, "b": 1.0}, r"token 1.0 for request 'b' must be an integer"),
    ],
)
def test_sampled_tokens_whose_sum_overflows_are_named(tokens, message):
    """The type probe sums the tokens: an OverflowError there is a token error, not a crash."""
    scheduler, _, _ = make()
    scheduler.add(request("a", [1, 2], max_new_tokens=2))
    scheduler.add(request("b", [3, 4], max_new_tokens=2))
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match=message):
        scheduler.on_step_done(plan, tokens)
    scheduler.check_invariants()
    assert scheduler.on_step_done(plan, {"a": 1, "b": 2}) == {}


def test_add_and_step_protocol_errors_change_nothing():
    scheduler, engine, _ = make()
    scheduler.add(request("a", [1, 2], max_new_tokens=2))
    with pytest.raises(ValueError, match="request_id='a' is already queued or running"):
        scheduler.add(request("a", [3]))
    with pytest.raises(ValueError, match=r"token id 99 at index 1 is out of range; expected 0 <= id < 50"):
        scheduler.add(request("b", [1, 99]))
    assert scheduler.num_waiting == 1 and scheduler.get("b") is None
    plan = scheduler.schedule()
    with pytest.raises(RuntimeError, match="step 0 is still in flight; call on_step_done first"):
        scheduler.schedule()
    with pytest.raises(ValueError, match=r"missing \['a'\], unexpected \[\]"):
        scheduler.on_step_done(plan, {})
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['zz'\]"):
        scheduler.on_step_done(plan, {"a": 1, "zz": 2})
    with pytest.raises(ValueError, match=r"token 50 for request 'a' is out of range; expected 0 <= id < 50"):
        scheduler.on_step_done(plan, {"a": 50})
    with pytest.raises(ValueError, match=r"token 1.0 for request 'a' must be an integer"):
        scheduler.on_step_done(plan, {"a": 1.0})
    with pytest.raises(ValueError, match=r"token 'x' for request 'a' must be an integer"):
        scheduler.on_step_done(plan, {"a": "x"})
    with pytest.raises(ValueError, match="plan of step 7 is not the step in flight"):
        scheduler.on_step_done(type(plan)(7), {})
    scheduler.check_invariants()
    assert scheduler.on_step_done(plan, {"a": np.int64(3)}) == {}  # numpy ints are fine
    assert scheduler.get("a").output_token_ids.tolist() == [3]
    done = Request("a2", np.asarray([1], np.int32), 1)
    done.status = RequestStatus.FINISHED
    with pytest.raises(ValueError, match="request 'a2' is finished; expected a new request"):
        scheduler.add(done)



@pytest.mark.parametrize("arrival_time", ["0.5", float("nan"), float("inf"), True])
def test_an_arrival_time_that_is_not_a_finite_number_is_refused_and_changes_nothing(arrival_time):
    # a str raised deep in the waiting queue after the request was registered (live for good,
    # never queued); a NaN was queued under a key that compares false with every other
    scheduler, engine, _ = make()
    bad = request("bad", [1, 2], arrival_time=arrival_time)
    with pytest.raises(ValueError, match=rf"request 'bad' has arrival_time={re.escape(repr(arrival_time))}; "
                                         r"expected None or a finite number of seconds"):  # fmt: skip
        scheduler.add(bad)
    assert not scheduler.has_unfinished and scheduler.num_waiting == 0
    scheduler.check_invariants()
    assert scheduler.add(request("bad", [1, 2], arrival_time=3))  # the id is free, an int is seconds
    assert drain(engine) == {"bad": "length"}


def test_a_request_or_step_result_of_the_wrong_type_is_refused_by_name():
    scheduler, engine, _ = make()
    with pytest.raises(ValueError, match=r"request=\('r', \[1, 2\]\) must be a kvjax Request"):
        scheduler.add(("r", [1, 2]))
    assert scheduler.add(request("r", [1, 2]))
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match=r"new_tokens=\[3\] must be a mapping of request id -> sampled token id"):
        scheduler.on_step_done(plan, [3])
    assert scheduler.in_flight is plan  # nothing changed: the step can still be reported
    scheduler.on_step_done(plan, {"r": 3})
    scheduler.check_invariants()

# --- the parts: queue order, preemption choice, swap space ------------------------------------


def test_hit_rank_is_a_log2_bucket_of_hit_pages():
    assert [hit_rank(pages) for pages in (0, 1, 2, 3, 4, 7, 8, 1000)] == [0, 1, 2, 2, 3, 3, 4, 10]


def test_wait_queue_orders_by_rank_and_arrival_with_urgent_first():
    queue = WaitQueue(aging_seconds=2.0)
    records = {}
    for request_id, arrival, rank in [("early-miss", 0.0, 0), ("hit", 3.0, 2), ("late-hit", 5.0, 2), ("tie", 4.0, 0)]:
        records[request_id] = request(request_id, [1], arrival_time=arrival)
        records[request_id].hit_rank = rank
        queue.push(records[request_id])
    # keys (arrival - 2 s * rank): early-miss 0, hit -1, late-hit 1, tie 4
    assert [r.request_id for r in queue.best(4)] == ["hit", "early-miss", "late-hit", "tie"]
    preempted = request("preempted", [1], arrival_time=9.0)
    queue.push(preempted, urgent=True)
    assert queue.peek() is preempted and queue.is_urgent("preempted")
    assert queue.remove("hit") is records["hit"] and queue.remove("hit") is None
    records["tie"].hit_rank = 3  # key 4 - 6 = -2: re-keyed ahead of the others
    queue.push(records["tie"])
    assert [queue.pop().request_id for _ in range(len(queue))] == ["preempted", "tie", "early-miss", "late-hit"]
    assert queue.pop() is None
    queue.check_invariants()


def test_wait_queue_without_aging_bonus_is_first_come_first_served():
    queue = WaitQueue(aging_seconds=0.0)
    for i, rank in enumerate([0, 5, 3]):
        queued = request(f"r{i}", [1], arrival_time=float(i))
        queued.hit_rank = rank
        queue.push(queued)
    assert [queue.pop().request_id for _ in range(3)] == ["r0", "r1", "r2"]


@pytest.mark.parametrize(
    "mode, tokens, free_slots, chosen, reason",
    [
        ("auto", 64, 8, "swap", r"swap \(swap 4 blocks ~0.8 ms vs recompute 64 tokens ~3.2 ms\)"),
        ("auto", 64, 3, "recompute", r"recompute: host swap space has 3 free blocks"),
        ("auto", 4, 8, "recompute", r"recompute \(swap 1 blocks ~0.2 ms vs recompute 4 tokens ~0.2 ms\)"),
        ("swap", 4, 8, "swap", r"swap \(swap 1 blocks"),
        ("recompute", 64, 8, "recompute", r"recompute \(.*; mode=recompute\)"),
        ("swap", 0, 8, "recompute", r"recompute \(swap 0 blocks"),
    ],
)
def test_choose_preemption_by_cost_and_room(mode, tokens, free_slots, chosen, reason):
    costs = CostModel(recompute_seconds_per_token=5e-5, recompute_seconds_per_token_position=0.0,
                      host_bytes_per_second=2e10)
    got, why = choose_preemption(mode, costs, 2_000_000, tokens, 16, free_slots)
    assert got == chosen
    assert re.match(reason, why), why


def test_choose_preemption_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match=r"preemption mode='evict' is not one of \('auto', 'swap', 'recompute'\)"):
        choose_preemption("evict", CostModel(), 1 << 20, 4, 16, 0)


def test_swap_space_reuses_released_slots_only_after_flush():
    space = SwapSpace(4)
    assert space.allocate(3) == [0, 1, 2] and space.allocate(2) is None
    space.release([0, 1])
    assert space.allocate(2) is None and space.num_free == 1  # released, not yet reusable
    space.flush()
    assert sorted(space.allocate(3)) == [0, 1, 3]
    space.check_invariants([[0, 1, 3], [2]])
    with pytest.raises(RuntimeError, match="swap slots leak or repeat"):
        space.check_invariants([[0, 1, 3]])
    with pytest.raises(ValueError, match="num_slots=-1 must be >= 0"):
        SwapSpace(-1)


def test_a_requests_stop_token_ids_may_come_as_a_generator():
    # read once: the check that they are ids consumed a generator and left none
    assert Request("r", np.array([1, 2], np.int32), 2, stop_token_ids=(t for t in [5, 7])).stop_token_ids == {5, 7}
