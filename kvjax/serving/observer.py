"""The engine's bookkeeping per request (times, hits, misses) and what it writes to Metrics.

The observer is the one writer of metrics: the cache reports (``AdmissionReport`` per
sequence, ``TierReport`` per step) and the observer records. Recorded, in seconds on the
engine's clock (``fetch_seconds`` excepted: the cache times its transfers on
``time.monotonic``, the engine clock's default, whatever clock the engine was given) or in
tokens / blocks:

* at a request's first step (its first admission, once a fetch of its cached prefix has
  landed: its hits are final then): ``queue_seconds``, so the fetch's wait counts as queueing
  (``fetch_seconds`` has the fetch alone); its prompt's hit tokens and blocks by
  tier (``hit_tokens`` / ``hit_blocks``) and the rest by cause (``miss_tokens`` /
  ``miss_blocks``, see ``kvjax.serving.miss_attribution``). A request re-admitted after a preemption
  is not looked up again: hit rates count each prompt once;
* per sampled token: ``ttft_seconds`` (arrival to first token) or ``inter_token_seconds``;
* at the end: ``request_seconds`` (arrival to its last token, for a request that sampled
  one: a cancelled request's time ends at its last token, not at the cancellation); its
  computed full pages and its template fingerprint are remembered for the miss attribution
  of later requests;
* per step: ``prefill_tokens`` and ``decode_tokens`` computed, ``preemptions``,
  ``rejections``, and (also at a cancellation) the gauges ``running_sequences``,
  ``queued_requests``, ``pool_occupancy_ratio`` per tier the cache has (device: the
  allocator's occupancy, blocks that are not empty-free / pool blocks, cached KV included, as
  its watermarks count them; host blocks; disk bytes; a tier it lacks has no series) and
  ``pool_fragmentation_ratio``; from the step's ``TierReport``: ``fetch_seconds`` by tier,
  ``fetch_failures``, ``disk_errors``, ``spilled_blocks`` / ``spilled_bytes`` by link. A step
  whose model run failed computed nothing, but the rest is recorded all the same: its
  preemptions and rejections stand, and its ``TierReport`` was taken from the cache, which
  reports each transfer once.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.metrics.registry import Metrics
from kvjax.serving.miss_attribution import MissAttributor
from kvjax.serving.request import Request
from kvjax.serving.sampling import SamplingParams
from kvjax.serving.scheduler import Scheduler
from kvjax.serving.step_plan import StepPlan
from kvjax.text.canonicalize import Change
from kvjax.tiers.kv_cache import AdmissionReport, KVCache, TierReport

__all__ = ["EngineObserver", "RequestRecord"]


@dataclasses.dataclass(slots=True, eq=False)
class RequestRecord:
    """What the engine keeps about one request until its FinishEvent is emitted."""

    request: Request
    sampling: SamplingParams
    seed: int  # u32 seed of sampled draws
    arrival: float  # seconds
    fingerprint: str | None = None  # template fingerprint of a text prompt
    canonical_changes: tuple[Change, ...] = ()
    admitted: float | None = None  # first admission
    first_token: float | None = None
    last_token: float | None = None
    hit_tokens_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    miss_tokens_by_cause: dict[str, int] = dataclasses.field(default_factory=dict)
    num_computed_tokens: int = 0  # prefill tokens the model computed for it


class EngineObserver:
    """Writes the engine's measurements into ``metrics``; see the module docstring."""

    def __init__(self, metrics: Metrics, page_size: int, cache: KVCache | None = None):
        self.metrics = metrics
        self.page_size = page_size
        self.attributor = MissAttributor(page_size)
        self.cache = cache  # asked about other namespaces' blocks this process never saw

    def on_admitted(self, record: RequestRecord, now: float, report: AdmissionReport) -> None:
        """First admission: queue time, hits by tier (the cache's report), misses by cause."""
        record.admitted = now
        hit_tokens_by_tier, refused_lossy_pages = report.hit_tokens, report.refused_lossy_pages
        request, metrics = record.request, self.metrics
        metrics.observe("queue_seconds", max(now - record.arrival, 0.0))
        prompt = request.prompt_token_ids
        num_hit = 0
        for tier, tokens in hit_tokens_by_tier.items():
            if tokens:
                metrics.record_hit(tier, tokens=tokens, blocks=tokens // self.page_size)
                num_hit += tokens
        record.hit_tokens_by_tier = {tier: n for tier, n in hit_tokens_by_tier.items() if n}
        elsewhere = None if self.cache is None else (
            lambda num_pages: self.cache.pages_in_other_namespaces(prompt, request.namespace, num_pages))
        causes = self.attributor.attribute(prompt, request.namespace, num_hit, record.fingerprint,
                                           refused_lossy_pages, elsewhere, report.recomputed_pages)  # fmt: skip
        for cause, (tokens, blocks) in causes.items():
            metrics.record_miss(cause, tokens=tokens, blocks=blocks)
        record.miss_tokens_by_cause = {cause: tokens for cause, (tokens, _) in causes.items()}

    def on_token(self, record: RequestRecord, now: float) -> None:
        if record.first_token is None:
            record.first_token = now
            self.metrics.observe("ttft_seconds", max(now - record.arrival, 0.0))
        else:
            self.metrics.observe("inter_token_seconds", max(now - record.last_token, 0.0))
        record.last_token = now

    def on_finish(self, record: RequestRecord) -> None:
        """A request ended (finished, cancelled or rejected)."""
        request = record.request
        if record.last_token is not None:  # to the last token: a cancellation may come much later
            self.metrics.observe("request_seconds", max(record.last_token - record.arrival, 0.0))
        if record.admitted is not None:
            # Remembered only now: a request admitted while this one still ran missed pages that
            # were in flight, not evicted.
            computed = request.token_ids[: request.num_computed_tokens]
            self.attributor.remember(np.asarray(computed), request.namespace, record.fingerprint)

    def on_step(self, plan: StepPlan, scheduler: Scheduler, cache: KVCache, tiers: TierReport) -> None:
        metrics = self.metrics
        prefill = sum(seq.num_tokens for seq in plan.prefills)
        if prefill:
            metrics.inc("prefill_tokens", prefill)
        if plan.decodes:
            metrics.inc("decode_tokens", len(plan.decodes))
        self.on_step_effects(plan, scheduler, cache, tiers)

    def on_step_effects(self, plan: StepPlan, scheduler: Scheduler, cache: KVCache, tiers: TierReport) -> None:
        """What a step did besides its model run, recorded whether or not the run failed:
        its preemptions and rejections stand (``Scheduler.abort_step`` undoes neither), and
        ``tiers`` was already taken from the cache (it reports each transfer once)."""
        metrics = self.metrics
        if plan.preempted:
            metrics.inc("preemptions", len(plan.preempted))
        if plan.rejected:
            metrics.inc("rejections", len(plan.rejected))
        self.on_gauges(scheduler, cache)
        for tier, seconds in tiers.fetch_seconds:
            metrics.observe("fetch_seconds", seconds, tier=tier)
        if tiers.fetch_failures:
            metrics.inc("fetch_failures", tiers.fetch_failures)
        if tiers.disk_errors:
            metrics.inc("disk_errors", tiers.disk_errors)
        for link, (blocks, num_bytes) in tiers.spilled.items():
            metrics.record_spill(link, blocks, num_bytes)

    def on_gauges(self, scheduler: Scheduler, cache: KVCache) -> None:
        """Running and queued requests, occupancy per tier and fragmentation, as they are now."""
        metrics = self.metrics
        metrics.set("running_sequences", scheduler.num_running)
        metrics.set("queued_requests", scheduler.num_waiting)
        for tier, ratio in cache.occupancy().items():
            metrics.set("pool_occupancy_ratio", ratio, tier=tier)
        metrics.set("pool_fragmentation_ratio", cache.fragmentation())
