"""Scheduler: which tokens of which requests the next model step computes, and what moves.

Each ``schedule()`` fills one step under a token budget, in this order:

1. decodes: every running request in decode gets its one token (the budget is at least
   ``max_num_seqs``, so decode never starves). A decode that crosses into a new page extends
   its blocks; when the pool cannot supply one, the most recently admitted running request
   is preempted (possibly the one growing), swapped to host or dropped for recompute as the
   cost model says (see ``preemption``), until the extension fits.
2. prefill chunks of running requests still prefilling, in admission order, up to
   ``max_prefill_chunk`` tokens each. A request whose cached prefix is still being fetched
   from host or disk is skipped until ``KVCache.is_ready`` says the KV has landed (the others
   run meanwhile); if part of the fetch failed, it recomputes from the last page that
   arrived.
3. admissions (none in a step that preempted) from the waiting queue in hit-first-with-aging
   order (see ``scheduler_queue``): preempted requests first, then by cached-prefix rank and
   waiting time. Admission stops
   when the budget or ``max_num_seqs`` is used up, or when admitting the next request would
   push the blocks held by running sequences past the pool's high watermark (unless nothing
   runs: then anything that fits goes). The queue head is never skipped, so aging bounds the
   wait.

``on_step_done`` advances the computed tokens, commits newly completed pages to the prefix
cache (only pages whose KV the step has written, so a hit never maps unwritten KV), appends
sampled tokens and finishes requests (``max_new_tokens`` or a stop token).

A hit never covers a prompt's last page: ``KVCache.admit`` maps at most
``(num_tokens - 1) // page_size`` pages, so at least the last token is computed (its logits
give the next token) and it is written into a private block. A fully cached, page-aligned
prompt thus recomputes its last page (up to ``page_size`` tokens) rather than writing into a
shared page. A swapped-out request comes back the same way, with its non-hit pages swapped in.

Running short of memory degrades in steps: admission waits (watermark), running requests
are preempted, a new request is rejected when the queue already holds ``max_waiting`` or its
prompt needs more blocks than the pool has, and a lone running request that still cannot
grow (hard pins hold the rest of the pool) is stopped with a reason. Nothing raises for it.
"""

from __future__ import annotations

import collections
import math
import numbers
import time
from collections.abc import Callable, Mapping

from kvjax.serving.preemption import SwapSpace, choose_preemption
from kvjax.serving.prefetch import PrefetchPlanner
from kvjax.serving.request import Request, RequestStatus
from kvjax.serving.scheduler_config import SchedulerConfig, SchedulerStats
from kvjax.serving.step_plan import ScheduledSeq, StepPlan, pair_tokens
from kvjax.serving.wait_queue import WaitQueue, hit_rank
from kvjax.text.tokens import validate_tokens
from kvjax.tiers.kv_cache import KVCache, Lookup

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats"]

_RUNNING, _WAITING, _SWAPPED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED


class Scheduler:
    """Drives requests through a ``KVCache``; see the module docstring for one step.

    Protocol: ``plan = schedule()``, run the plan (``step_plan`` says in which order), then
    ``on_step_done(plan, tokens)``; ``add`` and ``cancel`` may be called at any time.
    ``clock`` returns seconds (default: the cache's clock).
    """

    def __init__(self, cache: KVCache, config: SchedulerConfig | None = None, *,
                 clock: Callable[[], float] | None = None):  # fmt: skip
        if config is not None and not isinstance(config, SchedulerConfig):  # a dict failed on its first field read
            raise ValueError(f"config={config!r} must be a SchedulerConfig (SchedulerConfig.from_dict builds one "
                             "from a mapping) or None")  # fmt: skip
        self.cache = cache
        self.config = SchedulerConfig() if config is None else config
        self.clock = clock or cache.clock or time.monotonic
        self.page_size = cache.page_size
        self.stats = SchedulerStats()
        self._requests: dict[str, Request] = {}  # live: waiting, swapped or running
        self._running: dict[str, Request] = {}  # admission order; the last is the next victim
        self._prefilling: dict[str, Request] = {}  # running requests still prefilling, same order
        self._fetching: dict[str, Request] = {}  # prefilling requests whose hit KV is in flight
        self._waiting = WaitQueue(self.config.aging_seconds)
        self._swap = SwapSpace(self.config.host_swap_blocks)
        self._refresh = collections.deque()  # waiting request ids, round robin for re-matching
        self._in_refresh: set[str] = set()  # ids in _refresh (each at most once)
        self._prefetch = PrefetchPlanner(self.page_size)
        self._rejected: dict[str, str] = {}  # rejected by add(), reported by the next plan
        self._waits_for_prefetch: str | None = None  # the lone decode this step left waiting for a prefetch
        self._in_flight: StepPlan | None = None
        self._step = 0

    # --- requests ---------------------------------------------------------------------------

    def add(self, request: Request) -> bool:
        """Queue ``request``; False if it is rejected (``finish_reason`` says why).

        Raises ValueError (nothing changed) for a request id already live, token ids outside
        the cache's vocabulary or an ``arrival_time`` that is not a finite number.
        """
        if not isinstance(request, Request):
            raise ValueError(f"request={request!r} must be a kvjax Request")
        if request.request_id in self._requests:
            raise ValueError(f"request_id={request.request_id!r} is already queued or running")
        if request.request_id in self._rejected:
            raise ValueError(f"request_id={request.request_id!r} was just rejected; its rejection is reported with "
                             "the next schedule(), reuse the id after that")  # fmt: skip
        if request.status is not _WAITING or request.num_output_tokens:
            raise ValueError(f"request {request.request_id!r} is {request.status.value}; expected a new request")
        validate_tokens(request.prompt_token_ids, self.cache.vocab_size)
        arrival = request.arrival_time
        if arrival is None:
            request.arrival_time = self.clock()
        elif isinstance(arrival, bool) or not isinstance(arrival, numbers.Real) or not math.isfinite(arrival):
            # it keys the waiting queue: a str raised there with the request half added, a NaN broke the order
            raise ValueError(f"request {request.request_id!r} has arrival_time={arrival!r}; expected None or "
                             "a finite number of seconds on the scheduler's clock")  # fmt: skip
        reason = self._admission_refusal(request)
        if reason is not None:
            request.status, request.finish_reason = RequestStatus.REJECTED, reason
            self._rejected[request.request_id] = reason
            self.stats.rejected += 1
            return False
        self._requests[request.request_id] = request
        self._note_match(request, self.cache.lookup(request.token_ids, request.namespace), urgent=False)
        self._waiting.push(request)
        self._queue_refresh(request.request_id)
        return True

    def cancel(self, request_id: str) -> bool:
        """Stop a live request and release what it holds; False if it is not live (done or unknown).

        Cancelling during a step is allowed: the step may still write the request's KV into the
        blocks it held, which no plan hands out before the next ``schedule()``; its sampled
        token, if reported, is ignored.
        """
        request = self._requests.get(request_id)
        if request is None:
            return False
        if request.status is _RUNNING:
            self._stop_running(request)
        else:
            self._waiting.remove(request_id)
        self._retire(request, RequestStatus.CANCELLED, "cancelled")
        self.stats.cancelled += 1
        return True

    def get(self, request_id: str) -> Request | None:
        """The live request with this id, or None."""
        return self._requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Queued requests, swapped ones included."""
        return len(self._waiting)

    @property
    def fetching(self) -> Mapping[str, Request]:
        """Running requests waiting for their cached prefix to arrive from host or disk
        (read-only by convention); no plan schedules them until it has."""
        return self._fetching

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # --- the step ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan the next step (see the module docstring). Raises RuntimeError if one is in flight."""
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight.step} is still in flight; call on_step_done first")
        self._swap.flush()
        self._waits_for_prefetch = None
        plan = StepPlan(self._step)
        plan.rejected, self._rejected = self._rejected, {}
        if self._fetching:
            self._land_fetches()
        self._schedule_decodes(plan)
        budget = self._schedule_prefills(plan, self.config.token_budget - plan.num_tokens)  # decodes + last tokens
        self._refresh_ranks()
        if not plan.preempted:  # memory ran short this step: admitting now would only churn
            self._admit(plan, budget)
        self._check_watermark(plan)  # evictions first: prefetch intents describe the pool after them
        self._emit_prefetch(plan)
        self._step += 1
        self.stats.steps += 1
        self._in_flight = plan
        return plan

    def on_step_done(self, plan: StepPlan, new_tokens: Mapping[str, int]) -> dict[str, str]:
        """Record a finished step: ``new_tokens`` maps each sampling request id to its token.

        Returns {request id: finish reason} for the requests that finished. Raises ValueError
        (nothing changed) for a plan that is not the one in flight, a missing or unexpected
        token, or a token id out of range.
        """
        if plan is not self._in_flight:
            raise ValueError(f"plan of step {plan.step} is not the step in flight")
        if not isinstance(new_tokens, Mapping):
            raise ValueError(f"new_tokens={new_tokens!r} must be a mapping of request id -> sampled token id")
        # validate everything before changing anything
        work = pair_tokens(plan, self._running, new_tokens, self.cache.vocab_size or 2**31)
        self._in_flight = None
        finished: dict[str, str] = {}
        prefilling, page_size, commit = self._prefilling, self.page_size, self.cache.commit
        for request, seq, token in work:
            new = seq.start + seq.num_tokens
            if new // page_size > request.num_computed_tokens // page_size:  # pages completed: hittable now
                commit(request.handle, request.token_buffer[: new - new % page_size])
            request.num_computed_tokens = new
            if token is not None and request.append_token(token):
                self._stop_running(request)
                self._retire(request, RequestStatus.FINISHED, request.finish_reason)
                self.stats.finished += 1
                finished[request.request_id] = request.finish_reason
            elif request.request_id in prefilling and not request.is_prefill:
                del prefilling[request.request_id]
        return finished

    def abort_step(self, plan: StepPlan) -> list[str]:
        """Forget ``plan``, whose block moves or model run failed: nothing of it counts (no
        page committed, no token appended; its requests run again next step), and a request
        whose KV it was swapping out or in recomputes instead (a move cut short leaves its
        slots or blocks unknown). Returns those requests' ids. ValueError for a plan that is
        not the one in flight.

        The stats count the step's swapped blocks no more (no copy of them is used), nor the
        admission of a request it was swapping in (it is admitted again, and counted then)."""
        if plan is not self._in_flight:
            raise ValueError(f"plan of step {plan.step} is not the step in flight")
        self._in_flight = None
        stats = self.stats
        stats.prefill_tokens -= sum(seq.num_tokens for seq in plan.prefills)  # scheduled again
        stats.decode_tokens -= len(plan.decodes)
        stats.swap_out_blocks -= len(plan.swap_out)
        stats.swap_in_blocks -= len(plan.swap_in)
        out_slots = {slot for _, slot in plan.swap_out}
        in_blocks = {block for _, block in plan.swap_in}
        redo = []
        for request in list(self._requests.values()):
            if request.status is _SWAPPED and out_slots.intersection(request.swap_slots):
                self._swap.release(request.swap_slots)
                request.swap_slots, request.status = [], _WAITING
            elif request.status is _RUNNING and in_blocks.intersection(request.handle.block_ids.tolist()):
                stats.admitted -= 1  # admitted by this plan (only an admission swaps in)
                stats.hit_tokens -= request.num_hit_tokens
                self._stop_running(request)
                request.status = _WAITING
                self._waiting.push(request, urgent=True)
            else:
                continue
            request.num_computed_tokens = 0  # generated tokens stay: the recompute prefills them too
            self._queue_refresh(request.request_id)
            redo.append(request.request_id)
        self.stats.aborted_steps += 1
        return redo

    # --- views and checks ----------------------------------------------------------------------

    @property
    def running(self) -> Mapping[str, Request]:
        """Running requests by id, in admission order (read-only by convention)."""
        return self._running

    @property
    def waiting(self) -> WaitQueue:
        """The waiting queue (read-only by convention)."""
        return self._waiting

    @property
    def in_flight(self) -> StepPlan | None:
        """The plan scheduled and not yet reported done."""
        return self._in_flight

    def check_invariants(self) -> None:
        """Raise RuntimeError unless the scheduler and its cache are consistent. Changes nothing.

        Every running request holds a live handle covering its computed tokens (plus, while a
        step is in flight, its scheduled ones); no request is both waiting and running; the
        queue is keyed by each request's current rank; swap slots partition the swap space;
        a plan in flight stays within the token budget and contains every running decode.
        """
        self.cache.check_invariants()
        self._waiting.check_invariants()
        self._swap.check_invariants([request.swap_slots for request in self._waiting])
        waiting_ids = {request.request_id for request in self._waiting}
        self._prefetch.check_invariants(waiting_ids)
        rotating = waiting_ids if self.config.rank_refresh_per_step else set()  # 0: no rotation at all
        if len(self._refresh) != len(self._in_refresh) or not rotating <= self._in_refresh or \
                (not self.config.rank_refresh_per_step and self._refresh):  # fmt: skip
            raise RuntimeError("the rank refresh rotation lost a waiting request or holds one twice")
        _check_scheduler(self, self._requests, self._prefilling)

    # --- helpers: decode, prefill, admission --------------------------------------------------

    def _schedule_decodes(self, plan: StepPlan) -> None:
        prefilling, fetching, decodes, page_size = self._prefilling, self._fetching, plan.decodes, self.page_size
        extend, append = self.cache.extend, decodes.append
        for request_id, request in list(self._running.items()):
            if request.status is not _RUNNING or request_id in prefilling or (fetching and request_id in fetching):
                continue  # preempted by an earlier decode of this loop, still prefilling, or fetching
            handle, num_tokens = request.handle, request.num_tokens
            if num_tokens > handle.num_tokens:  # reserve to the end of the page: one call per page
                missing = -(-num_tokens // page_size) * page_size - handle.num_tokens
                if not extend(handle, missing) and not self._make_room(request, missing, plan):
                    continue
            seq = ScheduledSeq(request_id, num_tokens - 1, 1, request.token_buffer, handle.block_ids, True)
            if num_tokens > request._num_prompt:  # noqa: SLF001 - the per-decode read of the prompt length
                append(seq)
            else:  # the prompt's last token, alone after a chunk or a hit: a one-token prefill
                plan.prefills.append(seq)
                self.stats.prefill_tokens += 1
        self.stats.decode_tokens += len(decodes)

    def _make_room(self, request: Request, missing: int, plan: StepPlan) -> bool:
        """Preempt from the back until ``request`` can grow by ``missing`` tokens; False if it lost."""
        while True:
            victim = next(reversed(self._running.values()))
            if victim is request and len(self._running) == 1:
                if self._prefetching_blocks():  # a prefetch lands soon and its blocks are cached then:
                    self._waits_for_prefetch = request.request_id  # it waits a step (nothing else
                    return False  # runs), it is not stopped
                allocator = self.cache.allocator
                own = len(request.handle.block_ids)
                pinned = allocator.num_blocks - allocator.num_free - self.cache.num_reclaimable - own
                reason = (f"stopped after {request.num_output_tokens} generated tokens: its {own} blocks "
                          f"and {pinned} pinned ones fill the {allocator.num_blocks}-block pool")  # fmt: skip
                self._stop_running(request)
                self._reject(request, reason, plan)
                return False
            self._preempt(victim, plan)
            if victim is request:
                return False
            if self.cache.extend(request.handle, missing):
                return True

    def _prefetching_blocks(self) -> int:
        """Device blocks held by prefetches in flight (a device index without tiers has none)."""
        return getattr(self.cache, "num_prefetching_blocks", 0)

    def _schedule_prefills(self, plan: StepPlan, budget: int) -> int:
        for request in self._prefilling.values():
            if budget <= 0:
                break
            if request.request_id not in self._fetching:
                budget -= self._schedule_chunk(request, plan, budget)
        return budget

    def _land_fetches(self) -> None:
        """Requests whose fetched prefix KV is in the pool run again; a fetch that fell short
        moves the start back to the last page that arrived (a recompute of the rest)."""
        short = False
        for request_id, request in list(self._fetching.items()):
            handle = request.handle
            if not self.cache.is_ready(handle):
                continue
            del self._fetching[request_id]
            lost = request.num_hit_tokens - handle.num_hit_tokens
            if lost > 0:
                request.num_hit_tokens = request.num_computed_tokens = handle.num_hit_tokens
                self.stats.hit_tokens -= lost
                short = True
        if short:  # a request may be prefilling again: keep the set in admission order
            self._prefilling = {rid: request for rid, request in self._running.items() if request.is_prefill}

    def _schedule_chunk(self, request: Request, plan: StepPlan, budget: int) -> int:
        start, num_tokens = request.num_computed_tokens, request.num_tokens
        count = min(num_tokens - start, self.config.max_prefill_chunk, budget)
        seq = ScheduledSeq(request.request_id, start, count, request.token_buffer, request.handle.block_ids,
                           start + count == num_tokens)  # fmt: skip
        if start + 1 == num_tokens and start >= request.num_prompt_tokens:  # a swapped-in request resuming its decode
            plan.decodes.append(seq)
            self.stats.decode_tokens += 1
        else:
            plan.prefills.append(seq)
            self.stats.prefill_tokens += count
        return count

    def _admit(self, plan: StepPlan, budget: int) -> None:
        cache, config, waiting = self.cache, self.config, self._waiting
        allocator = cache.allocator
        high = int(allocator.high_watermark * allocator.num_blocks)
        rekeyed: set[str] = set()
        while budget > 0 and len(self._running) < config.max_num_seqs:
            request = waiting.peek()
            if request is None:
                break
            lookup = cache.lookup(request.token_ids, request.namespace)
            urgent = waiting.is_urgent(request.request_id)
            if hit_rank(lookup.num_hit_blocks) != request.hit_rank and request.request_id not in rekeyed:
                rekeyed.add(request.request_id)  # its rank changed: let the queue re-decide
                self._note_match(request, lookup, urgent)
                continue
            num_pages = -(-request.num_tokens // self.page_size)
            num_hit = min(lookup.num_device_blocks, (request.num_tokens - 1) // self.page_size)
            held = allocator.num_blocks - allocator.num_free - cache.num_reclaimable
            # held after admission: its new blocks, and the hits no sequence holds yet (mapped,
            # they are no longer reclaimable: a long cached conversation is not free headroom)
            if self._running and held + num_pages - num_hit + lookup.num_reclaimable_hits(num_hit) > high:
                break  # high watermark: leave the headroom to running decodes
            handle = cache.admit(lookup, accept_lossy=request.accept_lossy)
            if handle is None:
                if not self._running and not self._prefetching_blocks():  # an empty pool cannot take it: pins hold the rest
                    waiting.pop()
                    self._reject(request, f"request {request.request_id!r} needs {num_pages - num_hit} free "
                                 f"blocks; pins leave too few of the pool's {allocator.num_blocks}", plan)  # fmt: skip
                    continue
                break
            waiting.pop()
            if self._start(request, handle, plan):
                budget -= self._schedule_chunk(request, plan, budget)

    def _start(self, request: Request, handle, plan: StepPlan) -> bool:
        """Bind an admitted request to its blocks; a swapped one gets its non-hit pages back.
        False while its hit KV is still being fetched (it waits in ``_fetching``)."""
        request.handle, request.status = handle, _RUNNING
        hit_tokens = request.num_hit_tokens = handle.num_hit_tokens
        self._running[request.request_id] = request
        slots = request.swap_slots
        if slots and hit_tokens < request.num_computed_tokens:
            first = hit_tokens // self.page_size  # hits are whole pages; swap in the rest
            plan.swap_in.extend(zip(slots[first:], handle.block_ids[first : len(slots)].tolist()))
            self.stats.swap_in_blocks += len(slots) - first
        else:
            request.num_computed_tokens = hit_tokens
        self._swap.release(slots)
        request.swap_slots = []
        if request.is_prefill:
            self._prefilling[request.request_id] = request
        self._prefetch.forget(request.request_id)
        self.stats.admitted += 1
        self.stats.hit_tokens += hit_tokens
        if self.cache.is_ready(handle):
            return True
        self._fetching[request.request_id] = request
        return False

    # --- helpers: preemption, retirement ------------------------------------------------------

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        cache = self.cache
        mode, reason = choose_preemption(self.config.preemption, cache.cost_model, cache.block_nbytes,
                                         victim.num_computed_tokens, self.page_size, self._swap.num_free)  # fmt: skip
        if victim.request_id in self._fetching:  # its pages are not all in the pool yet: nothing to swap
            mode, reason = "recompute", "preempted while its cached prefix was being fetched"
        if mode == "swap":
            num_pages = -(-victim.num_computed_tokens // self.page_size)
            victim.swap_slots = self._swap.allocate(num_pages)
            plan.swap_out.extend(zip(victim.handle.block_ids[:num_pages].tolist(), victim.swap_slots))
            self.stats.swap_out_blocks += num_pages
            self.stats.preempted_swap += 1
        else:
            self.stats.preempted_recompute += 1
        self._stop_running(victim)
        victim.status = _SWAPPED if mode == "swap" else _WAITING
        if mode != "swap":
            victim.num_computed_tokens = 0  # generated tokens stay: the recompute prefills them too
        victim.num_preemptions += 1
        self._waiting.push(victim, urgent=True)
        self._queue_refresh(victim.request_id)
        plan.preempted[victim.request_id] = reason

    def _stop_running(self, request: Request) -> None:
        """Release a running request's blocks (committed pages stay cached)."""
        self.cache.release(request.handle)
        request.handle = None
        del self._running[request.request_id]
        self._prefilling.pop(request.request_id, None)
        self._fetching.pop(request.request_id, None)

    def _reject(self, request: Request, reason: str, plan: StepPlan) -> None:
        self._retire(request, RequestStatus.REJECTED, reason)
        plan.rejected[request.request_id] = reason
        self.stats.rejected += 1

    def _retire(self, request: Request, status: RequestStatus, reason: str) -> None:
        request.status, request.finish_reason = status, reason
        self._swap.release(request.swap_slots)
        request.swap_slots = []
        del self._requests[request.request_id]
        self._prefetch.forget(request.request_id)

    def _admission_refusal(self, request: Request) -> str | None:
        num_pages = -(-request.num_prompt_tokens // self.page_size)
        num_blocks = self.cache.allocator.num_blocks
        if num_pages > num_blocks:
            return (f"prompt of {request.num_prompt_tokens} tokens needs {num_pages} blocks of "
                    f"{self.page_size} tokens; the device pool has {num_blocks}")  # fmt: skip
        if len(self._waiting) >= self.config.max_waiting:
            return (f"waiting queue is full ({len(self._waiting)} requests, max_waiting="
                    f"{self.config.max_waiting}); {len(self._running)} running")  # fmt: skip
        return None

    # --- helpers: ranks, prefetch, watermark ---------------------------------------------------

    def _note_match(self, request: Request, lookup: Lookup, urgent: bool) -> None:
        """Store a fresh lookup's rank (re-keying the queue) and host/disk hits to prefetch."""
        rank = hit_rank(lookup.num_hit_blocks)
        if rank != request.hit_rank:
            request.hit_rank = rank
            if request.request_id in self._waiting:
                self._waiting.push(request, urgent=urgent)
        self._prefetch.note(request.request_id, lookup, request.num_tokens)

    def _queue_refresh(self, request_id: str) -> None:
        if self.config.rank_refresh_per_step and request_id not in self._in_refresh:
            self._in_refresh.add(request_id)
            self._refresh.append(request_id)

    def _refresh_ranks(self) -> None:
        """Re-match up to ``rank_refresh_per_step`` waiting requests, in turn. Entries of
        requests admitted or gone leave the rotation as they come up, without using the quota,
        so the rotation holds waiting requests only, however fast requests come and go."""
        refresh, waiting, quota = self._refresh, self._waiting, self.config.rank_refresh_per_step
        for _ in range(len(refresh)):  # one turn of the rotation at most
            if not quota:
                return
            request_id = refresh.popleft()
            request = self._requests.get(request_id)
            if request is None or request_id not in waiting:
                self._in_refresh.discard(request_id)  # admitted or gone: queued again if it is requeued
                continue
            self._note_match(request, self.cache.lookup(request.token_ids, request.namespace),
                             waiting.is_urgent(request_id))  # fmt: skip
            refresh.append(request_id)
            quota -= 1

    def _emit_prefetch(self, plan: StepPlan) -> None:
        """Intents for the best waiting requests' host/disk pages, within the device room the
        high watermark leaves while requests run (as admission does: a prefetch in flight
        holds its blocks, and it must not take the headroom running decodes grow into). What
        does not fit waits for a later step. An extent already announced is announced again
        only when a prefetch of it would start something now (see ``prefetch``)."""
        if not (self._prefetch and self.config.prefetch_window):
            return
        planner, cache, waiting = self._prefetch, self.cache, self._waiting
        room = self._prefetch_room()
        for request in planner.noted(waiting.best(self.config.prefetch_window)):
            if room is not None and room <= 0:
                break
            # matched afresh: pages noted earlier may have reached the device (or left every tier) since
            request_id = request.request_id
            lookup = cache.lookup(request.token_ids, request.namespace)
            self._note_match(request, lookup, waiting.is_urgent(request_id))
            extent = planner.extent(request_id)
            if extent is None:
                continue
            first, count = extent
            held_hits = 0
            if room is not None:
                held_hits = lookup.num_reclaimable_hits(first)  # the prefetch's hold maps its device pages
                count = min(count, room - held_hits)
                if count <= 0:
                    continue
            # judged on the pages the intent would cover: disk pages past a cut are not its to restore
            if planner.announced(request_id) and not cache.num_prefetch_pages(lookup, num_pages=first + count):
                continue  # on its way, landed, or nothing a prefetch would start now
            if room is not None:
                room -= count + held_hits
            plan.prefetch.append(planner.intent(request, count))

    def _prefetch_room(self) -> int | None:
        """Device blocks prefetches may take now: what admission's high watermark leaves while
        requests run (blocks held by prefetches in flight count as held); None: nothing runs."""
        if not self._running:
            return None
        cache = self.cache
        allocator = cache.allocator
        held = allocator.num_blocks - allocator.num_free - cache.num_reclaimable
        return int(allocator.high_watermark * allocator.num_blocks) - held

    def _check_watermark(self, plan: StepPlan) -> None:
        allocator = self.cache.allocator
        if not allocator.above_high_watermark():
            return
        plan.evict_target = min(allocator.blocks_to_low_watermark(), self.cache.num_reclaimable)
        if self.config.evict_to_low_watermark and plan.evict_target:
            plan.evicted = self.cache.evict(plan.evict_target)


# --- invariant checks (Scheduler.check_invariants) ------------------------------------------


def _check_scheduler(scheduler: Scheduler, requests: Mapping[str, Request], prefilling: Mapping[str, Request]) -> None:
    """Raise RuntimeError unless the request sets, each request's state and the plan in flight agree.

    ``requests`` are the live requests, ``prefilling`` the running ones still prefilling.
    """
    running, waiting = scheduler.running, scheduler.waiting
    waiting_ids = {request.request_id for request in waiting}
    if running.keys() & waiting_ids:
        raise RuntimeError(f"requests both running and waiting: {sorted(running.keys() & waiting_ids)}")
    if requests.keys() != running.keys() | waiting_ids:
        raise RuntimeError(f"live requests {sorted(requests)} are not running + waiting "
                           f"{sorted(running)} + {sorted(waiting_ids)}")  # fmt: skip
    if len(running) > scheduler.config.max_num_seqs:
        raise RuntimeError(f"{len(running)} running requests > max_num_seqs={scheduler.config.max_num_seqs}")
    expected_prefilling = [rid for rid, request in running.items() if request.is_prefill]
    if list(prefilling) != expected_prefilling:
        raise RuntimeError(f"prefilling set {list(prefilling)} != running requests still prefilling "
                           f"{expected_prefilling}")  # fmt: skip
    plan = scheduler.in_flight
    scheduled = {} if plan is None else {seq.request_id: seq for seq in plan.decodes + plan.prefills}
    fetching = scheduler.fetching
    if not fetching.keys() <= running.keys() or fetching.keys() & scheduled.keys():
        raise RuntimeError(f"fetching requests {sorted(fetching)} must be running and unscheduled "
                           f"(running {sorted(running)}, scheduled {sorted(scheduled)})")  # fmt: skip
    for request_id, request in running.items():
        _check_running(scheduler, request, scheduled.get(request_id))
    for request in waiting:
        _check_waiting(scheduler, request)
    if plan is not None:
        _check_plan(scheduler, plan)


def _check_running(scheduler: Scheduler, request: Request, seq: ScheduledSeq | None) -> None:
    rid, handle = request.request_id, request.handle
    if request.status is not RequestStatus.RUNNING or handle is None or not handle.alive:
        raise RuntimeError(f"running request {rid!r} is {request.status.value} with handle {handle!r}")
    if request.swap_slots:
        raise RuntimeError(f"running request {rid!r} still holds swap slots {request.swap_slots}")
    if not 0 <= request.num_computed_tokens < request.num_tokens:
        raise RuntimeError(f"running request {rid!r} has {request.num_computed_tokens} computed tokens "
                           f"of {request.num_tokens}")  # fmt: skip
    needed = request.num_computed_tokens if seq is None else seq.start + seq.num_tokens
    if handle.num_tokens < needed or len(handle.block_ids) * scheduler.page_size < needed:
        raise RuntimeError(f"running request {rid!r} needs room for {needed} tokens; its handle has "
                           f"{handle.num_tokens} in {len(handle.block_ids)} blocks")  # fmt: skip
    if seq is None:
        # a lone decode that needs a block a prefetch in flight holds waits a step (``_make_room``)
        waits = rid == scheduler._waits_for_prefetch  # noqa: SLF001 - this module's
        if scheduler.in_flight is not None and not request.is_prefill and rid not in scheduler.fetching \
                and not waits:  # fmt: skip
            raise RuntimeError(f"running decode {rid!r} was skipped by step {scheduler.in_flight.step}")
        return
    if seq.start != request.num_computed_tokens or list(seq.block_table) != handle.block_table:
        raise RuntimeError(f"plan entry {seq!r} disagrees with request {rid!r} "
                           f"({request.num_computed_tokens} computed, blocks {handle.block_table})")  # fmt: skip
    if seq.samples != (seq.start + seq.num_tokens == request.num_tokens):
        raise RuntimeError(f"plan entry {seq!r} samples={seq.samples} for a request of {request.num_tokens} tokens")
    if list(seq.token_ids) != request.token_ids[seq.start : seq.start + seq.num_tokens].tolist():
        raise RuntimeError(f"plan entry {seq!r} carries the wrong input tokens")


def _check_waiting(scheduler: Scheduler, request: Request) -> None:
    rid = request.request_id
    if request.handle is not None:
        raise RuntimeError(f"waiting request {rid!r} still holds handle {request.handle!r}")
    pages = -(-request.num_computed_tokens // scheduler.page_size)
    if request.status is RequestStatus.SWAPPED:
        if pages == 0 or len(request.swap_slots) != pages or request.num_computed_tokens >= request.num_tokens:
            raise RuntimeError(f"swapped request {rid!r} has {len(request.swap_slots)} slots for "
                               f"{request.num_computed_tokens} computed tokens")  # fmt: skip
    elif request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.swap_slots:
        raise RuntimeError(f"queued request {rid!r} is {request.status.value} with "
                           f"{request.num_computed_tokens} computed tokens and slots {request.swap_slots}")  # fmt: skip


def _check_plan(scheduler: Scheduler, plan: StepPlan) -> None:
    if plan.num_tokens > scheduler.config.token_budget:
        raise RuntimeError(f"step {plan.step} schedules {plan.num_tokens} tokens > "
                           f"token_budget={scheduler.config.token_budget}")  # fmt: skip
    ids = [seq.request_id for seq in plan.decodes + plan.prefills]
    if len(set(ids)) != len(ids):
        raise RuntimeError(f"step {plan.step} schedules a request twice: {ids}")
    if any(seq.num_tokens != 1 for seq in plan.decodes) or any(seq.num_tokens < 1 for seq in plan.prefills):
        raise RuntimeError(f"step {plan.step} has a decode of != 1 token or an empty prefill chunk")
    if any(seq.num_tokens > scheduler.config.max_prefill_chunk for seq in plan.prefills):
        raise RuntimeError(f"step {plan.step} has a prefill chunk over max_prefill_chunk")
