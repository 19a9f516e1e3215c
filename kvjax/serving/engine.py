"""The serving engine: the request path of the design, wired once.

``Engine.step()`` runs one step of the path::

    add_request: text --canonicalize (if on)--> tokens --Scheduler.add (match, queue)
    step:  KVCache.poll()                   finished host/disk transfers take effect
           Scheduler.schedule()             admission (cache.admit: longest match, allocate,
                                            start host/disk fetches), prefill chunks + decodes
                                            under the token budget; a request whose fetch is
                                            in flight waits while the others run
           swap_out, then swap_in           preempted KV to host slots and back (SwapStore)
           ModelRunner.run                  one jitted step on the page pool, sampled tokens
           Scheduler.on_step_done           commit full pages to the trie, finish requests
           -> TokenEvent / FinishEvent, metrics (EngineObserver)

The engine holds no policy: admission, batching and preemption are the scheduler's, what is
cached and evicted is the cache's, sampling is per request. Use it as::

    engine = Engine.from_preset("tiny")
    engine.add_request("r1", prompt="...", max_new_tokens=16, namespace="tenant-a")
    for event in engine.run():          # TokenEvent ..., FinishEvent ..., RunSummary
        ...
    print(engine.metrics.summary_table())
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from flax import nnx

from kvjax.config.checks import int_arg
from kvjax.metrics.compilations import compilations
from kvjax.metrics.registry import Metrics
from kvjax.serving.engine_config import EngineConfig
from kvjax.serving.engine_events import Event, FinishEvent, RunSummary, TokenEvent
from kvjax.serving.model_runner import ModelRunner
from kvjax.serving.observer import EngineObserver, RequestRecord
from kvjax.serving.preset import build_engine_parts
from kvjax.serving.request import Request
from kvjax.serving.sampling import GREEDY, SamplingParams
from kvjax.serving.scheduler import Scheduler
from kvjax.serving.scheduler_config import SchedulerConfig
from kvjax.serving.step_plan import StepPlan
from kvjax.serving.stop_strings import StopStrings, stop_checker
from kvjax.serving.swap_store import SwapStore
from kvjax.text.canonicalize import CanonicalizeConfig, template_fingerprint
from kvjax.text.canonicalize import canonicalize as canonicalize_text
from kvjax.text.tokenizer import ByteTokenizer, as_tokenizer
from kvjax.text.tokens import validate_tokens
from kvjax.tiers.page_pool import PagePool

__all__ = ["Engine"]

_log = logging.getLogger(__name__)
_FETCH_WAIT_SECONDS = 1.0  # a step with nothing to run but fetches in flight waits this long at most


class Engine:
    """Serves requests with ``model`` over ``cache`` (a ``KVCache``; its lower tiers may be empty).

    ``pool`` is the device page pool the model reads and writes; by default the cache's own
    (``cache.pool``). ``canonicalize``
    (a ``CanonicalizeConfig``; None: ``config.canonicalize`` decides, off by default) applies
    to text prompts. ``record_logits`` attaches each sampled position's logits to its
    TokenEvent. ``clock`` returns seconds.
    """

    def __init__(self, model: nnx.Module, cache, scheduler_config: SchedulerConfig | None = None,
                 config: EngineConfig | None = None, *, tokenizer=None,
                 canonicalize: CanonicalizeConfig | None = None, metrics: Metrics | None = None,
                 pool: PagePool | None = None, record_logits: bool = False,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        settings = (("scheduler_config", scheduler_config, SchedulerConfig), ("config", config, EngineConfig))
        for name, value, kind in settings:
            if value is not None and not isinstance(value, kind):  # a dict failed on its first field read ({}: ignored)
                raise ValueError(f"{name}={value!r} must be a {kind.__name__} ({kind.__name__}.from_dict builds one "
                                 "from a mapping) or None")  # fmt: skip
        self.model, self.cache = model, cache
        self.config = EngineConfig() if config is None else config
        self.scheduler_config = SchedulerConfig() if scheduler_config is None else scheduler_config
        self.pool = pool or cache.pool
        _check_compatible(model, cache, self.pool)
        vocab_size = model.cfg.vocab_size
        self.tokenizer = as_tokenizer(tokenizer if tokenizer is not None else ByteTokenizer(),
                                      vocab_size=vocab_size)
        if canonicalize is None and self.config.canonicalize:
            canonicalize = CanonicalizeConfig()
        self.canonicalize = canonicalize
        self.metrics = metrics if metrics is not None else Metrics(clock=clock)
        self.clock = clock
        self.record_logits = record_logits
        page_size, num_blocks = self.pool.config.page_size, self.pool.config.num_blocks
        self.max_model_len = self.config.max_model_len or num_blocks * page_size
        self.scheduler = Scheduler(cache, self.scheduler_config, clock=clock)
        self.runner = ModelRunner(model, self.pool, max_num_seqs=self.scheduler_config.max_num_seqs,
                                  token_budget=self.scheduler_config.token_budget,
                                  max_model_len=self.max_model_len,
                                  token_buckets=self.config.token_buckets, impl=self.config.impl)
        swap_slots = self.scheduler_config.host_swap_blocks
        self.swap_store = SwapStore(self.pool, swap_slots, cache.config.transfer_buckets) if swap_slots else None
        self.observer = EngineObserver(self.metrics, page_size, cache)
        # the gauges as they are from the start: the tiers the cache has read their occupancy
        # (0 before any step), those it lacks have no series (see kvjax.metrics.registry)
        self.observer.on_gauges(self.scheduler, cache)
        self._records: dict[str, RequestRecord] = {}
        self._pending: list[Event] = []  # events produced between steps (cancellations)
        self._num_added = 0
        self.num_generated_tokens = 0  # sampled tokens since construction
        self._counts = {"finished": 0, "cancelled": 0, "rejected": 0}

    @classmethod
    def from_preset(cls, preset: str = "tiny", **overrides) -> Engine:
        """Model, pool, cache, tiers and scheduler from a preset: a shipped name ("tiny") or the
        path of a TOML file (``kvjax.config.presets``).

        ``overrides`` (see ``kvjax.serving.preset.build_engine_parts``): ``weights`` (default: the
        preset's own, e.g. the tiny model's trained ones; "random"; or a weights path), ``seed``,
        and any ``Engine`` keyword argument. Compilation happens at the first step of each token
        bucket; call :meth:`warmup` to do it before timing requests.
        """
        return cls(**build_engine_parts(preset, **overrides))

    # --- requests --------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | None = None, *, tokens: Sequence[int] | None = None,
                    max_new_tokens: int = 16, sampling: SamplingParams | None = None,
                    namespace=None, stop_token_ids: Sequence[int] = (), stop: str | Sequence[str] = (),
                    min_tokens: int = 0, accept_lossy: bool | None = None) -> bool:  # fmt: skip
        """Queue a request given as text (``prompt``) or token ids (``tokens``).

        ``stop``: stop strings (one str, or several; see ``kvjax.serving.stop_strings``): the
        request ends with reason "stop" at the token whose decoded output first holds one, its
        FinishEvent text cut before the earliest (its output tokens keep them all); the
        tokenizer must decode. ``min_tokens``: neither ``stop_token_ids`` nor ``stop`` ends the
        request before it has generated that many tokens (at most ``max_new_tokens``).

        ``accept_lossy=False`` refuses cached KV that went through lossy offload compression
        (``KVCacheConfig.offload_quant``): those pages are recomputed (None: the cache's
        ``accept_lossy``). Returns False when the scheduler rejects it (the next ``step()``
        reports a FinishEvent with the reason). Raises ValueError, queuing nothing, for a duplicate id, both or neither
        of ``prompt``/``tokens``, token ids (prompt or stop ids) outside the model's vocabulary, or a request longer
        than ``max_model_len``.
        """
        if self.cache.closed:
            raise ValueError(f"request_id={request_id!r}: this engine is closed (close() was called); "
                             "build a new one to serve")
        if (prompt is None) == (tokens is None):
            raise ValueError("pass exactly one of prompt= (text) or tokens= (token ids)")
        if request_id in self._records:
            raise ValueError(f"request_id={request_id!r} is already queued or running")
        sampling = GREEDY if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling={sampling!r} must be a kvjax SamplingParams (or None: greedy)")
        changes, fingerprint = (), None
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
            if self.canonicalize is not None and self.canonicalize.enabled:
                result = canonicalize_text(prompt, self.canonicalize)
                prompt, changes = result.text, tuple(result.changes)
            tokens = self.tokenizer.encode(prompt)
            fingerprint = template_fingerprint(prompt, self.canonicalize, max_chars=self.config.template_chars)
        if accept_lossy is not None and not isinstance(accept_lossy, bool):
            raise ValueError(f"accept_lossy={accept_lossy!r} must be None or a bool")
        max_new_tokens = int_arg(max_new_tokens, "max_new_tokens", 1)
        stop_when = stop_checker(stop, self.tokenizer, min_tokens)  # ValueError for bad ones
        # the model's vocabulary: a cache may have none (or a larger one), and an id past the
        # model's embedding table was read as another token, silently
        tokens = validate_tokens(tokens, self.model.cfg.vocab_size)  # names a bad id with the vocabulary
        if len(tokens) + max_new_tokens > self.max_model_len:  # before the request's buffer is allocated
            raise ValueError(f"request {request_id!r} needs {len(tokens)} prompt + {max_new_tokens} "
                             f"new tokens; max_model_len={self.max_model_len}")  # fmt: skip
        request = Request(request_id, tokens, max_new_tokens, namespace, arrival_time=self.clock(),
                          stop_token_ids=stop_token_ids, sampling=sampling, accept_lossy=accept_lossy,
                          stop_when=stop_when, min_tokens=min_tokens)  # fmt: skip
        try:  # an id outside the vocabulary is never sampled: the request would run to max_new_tokens
            stop = sorted(request.stop_token_ids)
            validate_tokens(stop, self.model.cfg.vocab_size)
        except ValueError as error:
            raise ValueError(f"stop_token_ids (sorted) {stop}: {error}") from None
        seed = sampling.seed if sampling.seed is not None else (self.config.seed * 1_000_003 + self._num_added) % 2**32
        record = RequestRecord(request, sampling, seed, request.arrival_time, fingerprint, changes)
        accepted = self.scheduler.add(request)  # validates token ids; raises before anything is kept
        self._records[request_id] = record
        self._num_added += 1
        return accepted

    def prompt_tokens(self, prompt: str) -> np.ndarray:
        """The token ids ``add_request(prompt=...)`` serves for a text prompt (canonicalized
        first when canonicalization is on). Pure: safe from any thread."""
        if self.canonicalize is not None and self.canonicalize.enabled:
            prompt = canonicalize_text(prompt, self.canonicalize).text
        return np.asarray(self.tokenizer.encode(prompt), np.int32)

    def cancel(self, request_id: str) -> bool:
        """Stop a queued or running request; False if it is not live. Its FinishEvent
        (status "cancelled") comes with the next ``step()``."""
        if not self.scheduler.cancel(request_id):
            return False
        self._pending.append(self._finish(request_id, "cancelled"))
        # now: a step with no request left returns before it records anything, and the gauges
        # would go on counting the last requests cancelled
        self.observer.on_gauges(self.scheduler, self.cache)
        return True

    @property
    def has_unfinished(self) -> bool:
        """Requests still queued or running, or events not yet returned by ``step()``."""
        return bool(self._records) or bool(self._pending)

    # --- the loop --------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Run one step (see the module docstring); returns its events in order. ValueError
        once the engine is closed (its cache's tiers are gone)."""
        if self.cache.closed:
            raise ValueError("this engine is closed (close() was called); step needs an open engine")
        before = compilations()
        try:
            return self._step()
        finally:
            self._count_compilations(before)

    def _step(self) -> list[Event]:
        events, self._pending = self._pending, []
        if not self._records:
            return events
        tier_report = self.cache.poll()  # finished transfers take effect before the scheduler looks
        plan = self.scheduler.schedule()
        events += [self._finish(rid, "rejected") for rid in plan.rejected if rid in self._records]
        seqs = plan.sequences
        records = [self._records[seq.request_id] for seq in seqs]
        try:
            self._move_blocks(plan)
            if not seqs and (self.scheduler.fetching or self.cache.num_prefetching_blocks):
                self.cache.wait_any(_FETCH_WAIT_SECONDS)  # nothing runs until a transfer lands: wait for one
            admitted_at = self.clock()
            new_tokens, logits = self._run_model(seqs, records)
        except BaseException:  # the step counts for nothing: the engine steps on (its events go out next)
            self.scheduler.abort_step(plan)
            self.observer.on_step_effects(plan, self.scheduler, self.cache, tier_report)  # they happened all the same
            self._pending = events + self._pending
            raise
        self._note_admitted(records, admitted_at)  # once the step counts (an aborted one runs again)
        for seq in plan.prefills:
            self._records[seq.request_id].num_computed_tokens += seq.num_tokens
        finished = self.scheduler.on_step_done(plan, new_tokens)
        now = self.clock()
        for row, (record, seq) in enumerate(zip(records, seqs)):
            if seq.request_id in new_tokens:
                self.observer.on_token(record, now)
                events.append(TokenEvent(seq.request_id, new_tokens[seq.request_id],
                                         record.request.num_output_tokens - 1,
                                         None if logits is None else logits[row]))  # fmt: skip
        events += [self._finish(rid, "finished") for rid in finished]
        self.observer.on_step(plan, self.scheduler, self.cache, tier_report)
        self.cache.end_step()  # this step's block events go out now
        return events

    def run(self, *, summary: bool = True) -> Iterator[Event]:
        """Step until every request has ended, yielding events; then a RunSummary."""
        start, generated_before = self.clock(), self.num_generated_tokens
        while self.has_unfinished:
            yield from self.step()
        wall, generated = self.clock() - start, self.num_generated_tokens - generated_before
        if wall > 0:  # the throughput gauge too when no summary is asked for (it read 0 in tables)
            self.metrics.set("generated_tokens_per_second", generated / wall)
        if summary:
            yield self.summary(wall, generated)

    def finish(self) -> RunSummary:
        """Run every queued request to its end, dropping the events; return the summary."""
        events = list(self.run())
        return events[-1]

    def warmup(self) -> int:
        """Build every executable serving needs now: the model step for every token bucket,
        the sampler, tier moves and swaps for every transfer bucket. Returns how many were
        built (compiled, or loaded from the persistent compilation cache); serving builds none
        after this unless a batch outgrows the buckets (the ``compilations`` metric counts them)."""
        before = compilations()
        self.cache.warmup()
        if self.swap_store is not None:
            self.swap_store.warmup()
        self.runner.warmup()
        return self._count_compilations(before)

    def summary(self, wall_seconds: float, generated: int) -> RunSummary:
        """Snapshot the metrics, with the throughput of a run that generated ``generated``
        tokens in ``wall_seconds``."""
        if wall_seconds > 0:
            self.metrics.set("generated_tokens_per_second", generated / wall_seconds)
        return RunSummary(self.metrics.to_json(), self.metrics.summary_table(), self._counts["finished"],
                          self._counts["cancelled"], self._counts["rejected"], wall_seconds)  # fmt: skip

    def check_invariants(self) -> None:
        """RuntimeError unless the scheduler, the cache, the pool and the metrics agree."""
        self.scheduler.check_invariants()
        self.pool.check_invariants()
        self.metrics.check_invariants()
        live = {request.request_id for request in self.scheduler.waiting} | set(self.scheduler.running)
        if not live <= self._records.keys():
            raise RuntimeError(f"requests {sorted(live - self._records.keys())} are live without a record")

    def close(self) -> None:
        """Release the cache's resources (tier files, transfer threads); ``add_request`` and
        ``step`` refuse afterwards."""
        self.cache.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- helpers ---------------------------------------------------------------------------

    def _run_model(self, seqs, records) -> tuple[dict[str, int], np.ndarray | None]:
        if not seqs:
            return {}, None
        sampling = [(record.sampling, record.seed, record.request.num_output_tokens) for record in records]
        tokens, logits = self.runner.run(seqs, sampling, return_logits=self.record_logits)
        new_tokens = {seq.request_id: int(token) for seq, token in zip(seqs, tokens.tolist()) if seq.samples}
        self.num_generated_tokens += len(new_tokens)
        return new_tokens, logits

    def _move_blocks(self, plan: StepPlan) -> None:
        """Swaps (out before in, both before the step writes), prefetches, and, when
        ``config.spill_ahead`` and the cache has lower tiers, eviction to the low watermark
        (its write-back copies then run before the blocks are needed, at the cost of device
        hits on the evicted pages; without tiers eviction would only drop KV)."""
        if self.swap_store is not None:
            self.swap_store.swap_out(plan.swap_out)
            self.swap_store.swap_in(plan.swap_in)
        elif plan.swap_out or plan.swap_in:
            raise RuntimeError("the scheduler planned swaps but the engine has no swap store")
        for intent in plan.prefetch:
            self.cache.prefetch(intent.token_ids, intent.namespace)
        remaining = plan.evict_target - len(plan.evicted)  # the scheduler may have evicted them already
        if remaining > 0 and self.config.spill_ahead and self.cache.config.tiered:
            self.cache.evict(remaining)

    def _note_admitted(self, records: list[RequestRecord], now: float) -> None:
        """Record first runs (hits by tier, misses by cause) at ``now``, the step's start. The
        scheduler runs a request only once its fetched KV has landed, so its hits are final."""
        for record in records:
            if record.admitted is None:
                self.observer.on_admitted(record, now, self.cache.admission_report(record.request.handle))

    def _count_compilations(self, before: int) -> int:
        built = compilations() - before
        if built:
            self.metrics.inc("compilations", built)
        return built

    def _finish(self, request_id: str, status: str) -> FinishEvent:
        record = self._records.pop(request_id)
        request = record.request
        self.observer.on_finish(record)
        self._counts[status] += 1
        output = np.array(request.output_token_ids, copy=True)
        try:
            text = self.tokenizer.decode(output)
        except TypeError:  # a plugged-in tokenizer without decode
            text = None
        except Exception:  # the tokens are the answer: a plugged-in decode that fails must not stop the engine
            _log.exception("the tokenizer could not decode request %r's output; its text is None", request_id)
            text = None
        if text is not None and isinstance(request.stop_when, StopStrings):
            text = request.stop_when.answer(text)  # cut before the stop string that ended it, if one did
        return FinishEvent(
            request_id, status, request.finish_reason or status, request.prompt_token_ids.copy(), output, text,
            num_hit_tokens=sum(record.hit_tokens_by_tier.values()), hit_tokens_by_tier=record.hit_tokens_by_tier,
            miss_tokens_by_cause=record.miss_tokens_by_cause, num_computed_tokens=record.num_computed_tokens,
            num_preemptions=request.num_preemptions,
            ttft_seconds=None if record.first_token is None else record.first_token - record.arrival,
            request_seconds=None if record.last_token is None else record.last_token - record.arrival,
            canonical_changes=record.canonical_changes)  # fmt: skip


def _check_compatible(model, cache, pool: PagePool) -> None:
    cfg, pool_cfg = model.cfg, pool.config
    want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    have = (pool_cfg.num_layers, pool_cfg.num_kv_heads, pool_cfg.head_dim)
    if want != have:
        raise ValueError(f"pool (num_layers, num_kv_heads, head_dim)={have} must match the model's {want}")
    if (cache.page_size, cache.allocator.num_blocks) != (pool_cfg.page_size, pool_cfg.num_blocks):
        raise ValueError(f"cache (page_size, num_blocks)=({cache.page_size}, {cache.allocator.num_blocks}) "
                         f"must match the pool's ({pool_cfg.page_size}, {pool_cfg.num_blocks})")
