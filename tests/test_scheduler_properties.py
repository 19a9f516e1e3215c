"""Stateful property test: random arrivals, cancellations, pins, tier copies, steps and failed
steps on a tiny pool, with check_invariants() after every step and a modelled page pool behind
the plans.

The fake engine (scheduler_cases) checks every KV position a scheduled sequence attends to,
so a plan that maps a block holding other tokens' KV (a stale hit, a block reused too early,
a swap that copied the wrong block) fails at once. Every finished request's output must equal
an uncached, unpreempted run's, so preemption and resumption keep exact token bookkeeping.
When arrivals stop, every request must end (finished, rejected or cancelled) within a bound.
"""

import itertools

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from scheduler_cases import Clock, FakeEngine, kv_cache, reference_output

from kvjax.cache.cost_model import CostModel
from kvjax.cache.prefix_trie import Tier
from kvjax.serving.request import Request, RequestStatus
from kvjax.serving.scheduler import Scheduler, SchedulerConfig

VOCAB = 5
STORIES = ((0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1), (1, 1, 2, 2, 3, 3, 4, 4, 0, 0, 1, 1))
prompt_st = st.one_of(
    st.builds(lambda story, cut, tail: list(story[:cut]) + tail, st.sampled_from(STORIES),
              st.integers(1, 12), st.lists(st.integers(0, VOCAB - 1), max_size=3)),  # fmt: skip
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),  # sometimes longer than the pool
)
DRAIN_STEPS = 600


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 10),
        page_size=st.sampled_from([1, 2, 2, 4]),
        high=st.sampled_from([0.5, 0.8, 1.0, 1.0]),
        max_num_seqs=st.integers(1, 5),
        extra_budget=st.integers(0, 6),
        max_prefill_chunk=st.integers(1, 6),
        preemption=st.sampled_from(["auto", "swap", "recompute"]),
        host_swap_blocks=st.sampled_from([0, 4, 16]),
        aging_seconds=st.sampled_from([0.0, 0.5, 5.0]),
        evict=st.booleans(),
        refresh=st.integers(0, 3),
        window=st.integers(0, 3),
    )
    def setup(self, num_blocks, page_size, high, max_num_seqs, extra_budget, max_prefill_chunk, preemption,
              host_swap_blocks, aging_seconds, evict, refresh, window):  # fmt: skip
        self.clock = Clock()
        # Swap and recompute cost about the same (2 MiB blocks at 20 GB/s in this pool's bytes,
        # 8 * page_size a block), so "auto" takes both branches.
        cost_model = CostModel(recompute_seconds_per_token=1e-4 if preemption == "auto" else 5e-5,
                               recompute_seconds_per_token_position=0.0, fetch_latency_seconds=1e9,
                               host_bytes_per_second=2e10 * 8 * page_size / (2 << 20))  # fmt: skip
        cache = kv_cache(num_blocks, page_size, vocab_size=VOCAB, clock=self.clock, high=high, low=high / 2,
                         host_blocks=num_blocks, cost_model=cost_model)  # fmt: skip
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs, token_budget=max_num_seqs + extra_budget, max_prefill_chunk=max_prefill_chunk,
            aging_seconds=aging_seconds, preemption=preemption, host_swap_blocks=host_swap_blocks,
            max_waiting=12, rank_refresh_per_step=refresh, prefetch_window=window, evict_to_low_watermark=evict,
        )  # fmt: skip
        self.scheduler = Scheduler(cache, config)
        self.engine = FakeEngine(self.scheduler, VOCAB)
        self.ids = itertools.count()
        self.requests: dict[str, Request] = {}  # every request ever added
        self.pins: list[list[int]] = []

    # --- arrivals and departures -------------------------------------------------------------

    @rule(prompts=st.lists(prompt_st, min_size=1, max_size=3), namespace=st.sampled_from(["a", "a", "b"]),
          max_new_tokens=st.integers(1, 8), stop=st.booleans())  # fmt: skip
    def add(self, prompts, namespace, max_new_tokens, stop):
        for prompt in prompts:
            request = Request(f"r{next(self.ids)}", np.asarray(prompt, np.int32), max_new_tokens,
                              namespace=namespace, stop_token_ids=(0,) if stop else ())  # fmt: skip
            self.requests[request.request_id] = request
            accepted = self.scheduler.add(request)
            assert accepted == (request.status is RequestStatus.WAITING)
            if not accepted:
                assert request.status is RequestStatus.REJECTED and request.finish_reason

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 100))
    def cancel(self, index):
        request = list(self.requests.values())[index % len(self.requests)]
        was_live = self.scheduler.get(request.request_id) is request
        assert self.scheduler.cancel(request.request_id) == was_live
        if was_live:
            assert request.status is RequestStatus.CANCELLED and request.handle is None

    @rule(seconds=st.sampled_from([0.1, 1.0, 10.0]))
    def wait(self, seconds):
        self.clock.now += seconds

    # --- the cache under the scheduler ----------------------------------------------------------

    @precondition(lambda self: self.requests)
    @rule(evict=st.integers(0, 10))
    def evict_to_host(self, evict):
        """Eviction keeps pages indexed off device: write-through gave every committed page a host copy."""
        self.scheduler.cache.evict(evict)

    @precondition(lambda self: self.requests and len(self.pins) < 2)
    @rule(index=st.integers(0, 100))
    def pin(self, index):
        request = list(self.requests.values())[index % len(self.requests)]
        tokens = request.prompt_token_ids.tolist()
        if self.scheduler.cache.pin(tokens, request.namespace):
            self.pins.append((tokens, request.namespace))

    @precondition(lambda self: self.pins)
    @rule()
    def unpin(self):
        tokens, namespace = self.pins.pop()
        self.scheduler.cache.unpin(tokens, namespace)

    # --- steps ------------------------------------------------------------------------------------

    @rule(num_steps=st.integers(1, 4), cancel_mid_step=st.integers(-1, 10))
    def step(self, num_steps, cancel_mid_step):
        for _ in range(num_steps):
            self._step(cancel_mid_step)
            cancel_mid_step = -1

    @rule(ran=st.sampled_from(["nothing", "swap_out", "everything"]))
    def failed_step(self, ran):
        """The engine fails part way through a step (``ran`` is what it got done): nothing of
        the step counts, and the final outputs (checked by ``drain``) are still exact."""
        plan = self.scheduler.schedule()
        self.scheduler.check_invariants()
        self._check_plan_reports(plan)
        self._fail(plan, ran)

    @rule()
    def drain(self):
        """Arrivals stop: every request must end within DRAIN_STEPS steps."""
        for _ in range(DRAIN_STEPS):
            if not self.scheduler.has_unfinished:
                break
            self._step(-1)
        assert not self.scheduler.has_unfinished, f"{self.scheduler.num_running} running, " \
            f"{self.scheduler.num_waiting} waiting after {DRAIN_STEPS} steps"
        for request in self.requests.values():
            assert request.status.is_done and request.handle is None and not request.swap_slots
            expected = reference_output(request.prompt_token_ids, request.namespace, request.max_new_tokens,
                                        VOCAB, request.stop_token_ids)  # fmt: skip
            assert request.output_token_ids.tolist() == expected[: request.num_output_tokens]

    @invariant()
    def consistent(self):
        self.scheduler.check_invariants()

    def teardown(self):
        if hasattr(self, "scheduler"):
            self.drain()

    # --- helpers ----------------------------------------------------------------------------------

    def _step(self, cancel_mid_step):
        scheduler = self.scheduler
        plan = scheduler.schedule()
        scheduler.check_invariants()  # with the plan in flight: budget, decodes, block coverage
        self._check_plan_reports(plan)
        if 0 <= cancel_mid_step < len(plan.sequences):
            scheduler.cancel(plan.sequences[cancel_mid_step].request_id)
        for kind in ("swap_out", "swap_in", "prefetch", "preempted", "rejected", "evicted"):
            if getattr(plan, kind):
                event(kind)  # shown by --hypothesis-show-statistics: the run covers these paths
        tokens = self.engine.run(plan, self.requests)
        finished = scheduler.on_step_done(plan, tokens)
        for request_id, reason in finished.items():
            self._check_finished(self.requests[request_id], reason)
        scheduler.check_invariants()


    def _fail(self, plan, ran):
        """Nothing of ``plan`` counts: a request it was swapping out or in recomputes (its
        slots or blocks may hold a partial copy), the rest run again."""
        scheduler, engine = self.scheduler, self.engine
        if ran == "swap_out":
            for block, slot in plan.swap_out:
                engine.host[slot] = list(engine.pool[block])
        elif ran == "everything":  # the model wrote its KV; its tokens never came back
            engine.run(plan, self.requests)
        swap_in_blocks = {block for _, block in plan.swap_in}
        swapping = {request_id for request_id, reason in plan.preempted.items() if reason.startswith("swap")}
        swapping |= {request_id for request_id, request in scheduler.running.items()
                     if swap_in_blocks & set(request.handle.block_ids.tolist())}  # fmt: skip
        redo = scheduler.abort_step(plan)
        assert set(redo) == swapping and scheduler.in_flight is None
        for request_id in redo:
            request = self.requests[request_id]
            assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
            assert not request.swap_slots and request.handle is None
        if redo:
            event("aborted a swap")
        scheduler.check_invariants()

    def _check_plan_reports(self, plan):
        for request_id, reason in plan.rejected.items():
            request = self.requests[request_id]
            assert request.status is RequestStatus.REJECTED and request.finish_reason == reason
        for request_id in plan.preempted:
            assert self.requests[request_id].status in (RequestStatus.WAITING, RequestStatus.SWAPPED)
        cache = self.scheduler.cache
        for intent in plan.prefetch:
            match = cache.match(intent.token_ids, intent.namespace)
            tiers = match.tiers[intent.first_page : intent.first_page + intent.num_pages]
            assert match.num_device_blocks == intent.first_page and len(tiers) == intent.num_pages
            assert not (tiers & int(Tier.DEVICE)).any() and (tiers & int(Tier.HOST)).all()

    def _check_finished(self, request, reason):
        assert request.status is RequestStatus.FINISHED and request.handle is None
        expected = reference_output(request.prompt_token_ids, request.namespace, request.max_new_tokens,
                                    VOCAB, request.stop_token_ids)  # fmt: skip
        assert request.output_token_ids.tolist() == expected
        assert reason == ("stop" if expected[-1] in request.stop_token_ids else "length")


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestScheduler = SchedulerMachine.TestCase
