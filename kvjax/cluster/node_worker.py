"""The engine's thread of a serving node: requests in, events out, block events to the directory.

The engine is single-threaded, so one thread (``EngineWorker``) owns it: HTTP handlers hand
it requests and cancellations through a queue, and it hands each request's events back to
that request's asyncio queue. After every step it closes the cache's batch of block events,
polls its subscription and passes the batches, with the node's load, to the directory
publisher's thread, so neither the HTTP loop nor the engine waits on Redis.

Load (what the router compares): requests accepted and not finished, and the prompt tokens
of those without a first token yet that the cache did not hold when they arrived.

Remote fetch (``kvjax.cluster.remote_fetch``, with a ``RemoteFetcher``): given a peer that
holds more of a prompt, the thread decides fetch or recompute when the request arrives; a
request whose pages are being pulled waits outside the engine until the pull ends (the engine
keeps stepping), then its verified pages join the cache and it is added; its usage reports
the fetch (``take_remote_report``). As the owner, the pages a peer asks for are read here,
between steps (``export``; ``kvjax.cluster.remote_offers``).

Learned reuse (with a publisher and the ``reuse`` eviction policy): once per heartbeat the
engine thread hands its policy's statistics to the publisher and merges the peers' statistics
the publisher read at its last heartbeat (``share_learned``), so each node's eviction order
uses what the whole cluster learned (``kvjax.cache.policies``, "Sharing what a cluster
learned").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from kvjax.cache.block_events import Subscription
from kvjax.cache.policies import ReusePolicy, ReuseStatistics
from kvjax.cluster.directory import ClusterInfo, Directory, NodeLoad
from kvjax.cluster.openai_api import CONTEXT_LENGTH_EXCEEDED, NODE_CAPACITY_EXCEEDED, CompletionRequest, RequestError
from kvjax.cluster.publisher import DirectoryPublisher
from kvjax.cluster.remote_fetch import FetchOutcome, FetchPlan, PeerHint, RemoteFetcher
from kvjax.cluster.remote_offers import OfferRequest
from kvjax.serving.engine import Engine
from kvjax.serving.engine_events import FinishEvent, TokenEvent
from kvjax.serving.sampling import SamplingParams
from kvjax.text.tokens import validate_tokens
from kvjax.tiers.kv_cache_remote import ExportedPages

__all__ = ["EngineWorker", "check_fits", "cluster_info_of", "share_learned", "start_worker"]

_LOG = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05  # how long an idle engine thread blocks on its queue before looking again
_RATE_WINDOW_S = 1.0  # the throughput gauge covers at least this much of the engine clock
_MAX_REPORTS = 4096  # remote-fetch reports kept for answers still to take them (oldest dropped)

Sink = Callable[[object], None]  # receives TokenEvent / FinishEvent / an exception


@dataclasses.dataclass(slots=True)
class _Parked:
    """A request waiting outside the engine for its remote fetch."""

    request: CompletionRequest
    tokens: np.ndarray
    plan: FetchPlan
    future: concurrent.futures.Future
    cancelled: bool = False  # its client went: the fetch still ends and counts, the request does not start


class EngineWorker:
    """Runs ``engine`` on its own thread; see the module docstring.

    ``publisher`` (optional) receives the batches of ``events`` (the cache's subscription,
    taken with the holdings the publisher started from) and the node's load after each step.
    ``remote`` (optional) fetches prefixes other nodes hold (see the module docstring).
    """

    def __init__(self, engine: Engine, publisher: DirectoryPublisher | None = None,
                 events: Subscription | None = None, remote: RemoteFetcher | None = None):  # fmt: skip
        if (publisher is None) != (events is None):
            raise ValueError("pass both a publisher and the cache's event subscription, or neither")
        self.engine, self.publisher, self.remote = engine, publisher, remote
        self._parked: dict[str, _Parked] = {}
        self._remote_reports: dict[str, dict] = {}
        self._events = events
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._prefill_tokens: dict[str, int] = {}  # requests without a first token yet
        self._load = NodeLoad()  # as of the engine thread's last step
        # requests handed over (submit) that the engine thread has not taken yet: counted in the
        # load at once, so that a node whose engine is slow or stuck does not look idle
        self._not_taken = 0
        self._not_taken_lock = threading.Lock()
        # the load last handed to the publisher (by submit or the engine thread; under the lock,
        # so that it is the publisher's too): what the engine thread compares its load with
        self._published_load: NodeLoad | None = None
        # what a request handed over once the engine thread ended is told at once (nobody takes
        # the queue any more); set with _not_taken_lock held, which submit and export hold to queue
        self._ended: Exception | None = None
        self._stop = threading.Event()
        self._next_share = 0.0  # monotonic s: next exchange of the policy's statistics
        self._steps_left: int | None = None  # engine steps it may run before it holds (hold_steps); None: no limit
        self._rate_mark = (engine.clock(), engine.num_generated_tokens)  # (engine clock s, tokens) of the last rate
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvjax-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread, then the publisher (which drops the node's record)."""
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        if self.publisher is not None:
            self.publisher.close()

    def leave_directory(self) -> None:
        """Drop the node's record now and stop publishing (a draining node: routers stop
        choosing it at once, not after its TTL); blocking, one Redis round trip."""
        if self.publisher is not None:
            self.publisher.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def load(self) -> NodeLoad:
        """In-flight requests (those handed over and not taken yet included) and prompt tokens
        without a first token yet."""
        load = self._load
        return NodeLoad(load.inflight + self._not_taken, load.prefill_tokens)

    def submit(self, request_id: str, request: CompletionRequest, sink: Sink, hint: PeerHint | None = None) -> None:
        """Queue a request; its events (or a ValueError from the engine) go to ``sink``.
        ``hint``: a peer holding more of its prompt (``RemoteFetcher.find_peer``). Once the
        engine thread ended (stopped, or failed) ``sink`` gets why at once; a request in flight
        when it ends gets it then."""
        with self._not_taken_lock:
            ended = self._ended
            if ended is None:
                self._not_taken += 1
                self._commands.put(("add", request_id, request, sink, hint))
        if ended is not None:
            sink(ended)
            return
        if self.publisher is not None:  # now, not after the engine's next step (which may never come)
            with self._not_taken_lock:
                self._published_load = self.load
                self.publisher.submit([], self._published_load)

    def cancel(self, request_id: str) -> None:
        self._commands.put(("cancel", request_id))

    def hold_steps(self, steps: int | None) -> None:
        """Let the engine run ``steps`` more steps, then hold every request where it is until
        the next call; None: run freely (the default). For tests that must act while requests
        are in flight, whatever the device's speed: while it holds, the engine thread still
        takes requests (counted in the load) and cancellations. Applied in order with
        ``submit``: a request submitted after this call runs under it. ValueError for a
        ``steps`` that is not an int >= 0 or None."""
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"steps={steps!r} must be an int >= 0, or null to run freely")
        self._commands.put(("steps", steps))

    def export(self, request: OfferRequest, deadline: float) -> ExportedPages:
        """Pages a peer asks for, read on the engine thread between steps (blocking);
        TimeoutError if ``deadline`` (monotonic seconds) passes first; RuntimeError at once
        once the engine thread is gone (nobody would answer: the ask held a server thread
        until its deadline, up to minutes)."""
        if not self.alive:
            raise RuntimeError(f"the engine failed: {self.error}" if self.error is not None
                               else "the engine thread is not running")  # fmt: skip
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._not_taken_lock:
            if self._ended is None:
                self._commands.put(("export", request, deadline, future))
            else:
                future.set_exception(RuntimeError(str(self._ended)))
        return future.result(timeout=max(0.0, deadline - time.monotonic()))

    def take_remote_report(self, request_id: str) -> dict | None:
        """What the remote fetch of a finished request did (``usage.kvjax_remote``), once."""
        return self._remote_reports.pop(request_id, None)

    # --- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        failure: Exception = RequestError("the node's engine stopped (the node is shutting down) before the request "
                                          "finished; send it to another node", status=503, kind="server_error")
        try:
            while not self._stop.is_set():
                self._take_commands(block=not self._may_step)
                if self._parked:
                    self._land_fetches()
                if self._may_step:
                    if self._steps_left is not None:
                        self._steps_left -= 1
                    for event in self.engine.step():  # a step ends its batch of block events
                        self._deliver(event)
                self._note_throughput()
                self._publish()
        except Exception as error:  # a broken engine: fail every request, report unhealthy
            _LOG.exception("engine loop failed")
            self.error = error
            failure = RuntimeError(f"the engine failed: {error}")
            if self.publisher is not None:  # leave the directory now: routers stop choosing this node
                self.publisher.close()
        finally:
            self._end(failure)

    def _end(self, failure: Exception) -> None:
        """Tell every request in hand, queued, or handed over from now on, ``failure``: nobody
        would answer them any more (their handlers waited until their clients gave up)."""
        with self._not_taken_lock:
            self._ended = failure
        for sink in self._sinks.values():  # parked requests' too
            sink(failure)
        self._sinks.clear()
        self._parked.clear()
        self._prefill_tokens.clear()
        self._load = NodeLoad()
        while True:  # requests queued meanwhile get the same answer
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                self._taken()
                command[3](failure)
            elif command[0] == "export" and command[3].set_running_or_notify_cancel():
                command[3].set_exception(RuntimeError(str(failure)))  # a 503 to the peer, not a bad ask

    @property
    def _may_step(self) -> bool:
        return self.engine.has_unfinished and self._steps_left != 0

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _taken(self) -> None:
        with self._not_taken_lock:
            self._not_taken -= 1

    def _handle(self, command: tuple) -> None:
        if command[0] == "add":
            _, request_id, request, sink, hint = command
            self._taken()  # in _sinks from here on, or answered
            try:
                self._add(request_id, request, hint)
            except RequestError as error:
                sink(error)
                return
            except ValueError as error:  # the engine's own checks, which check_fits runs first
                sink(RequestError(str(error)))
                return
            except Exception as error:
                sink(RuntimeError(f"the engine failed: {error}"))  # this request is in no list yet
                raise
            self._sinks[request_id] = sink
        elif command[0] == "cancel":
            self._remote_reports.pop(command[1], None)
            parked = self._parked.get(command[1])
            if parked is not None:  # its fetch still ends and counts (a hung peer is marked), unused
                parked.cancelled = True
                self._sinks.pop(command[1], None)
                self._prefill_tokens.pop(command[1], None)
            else:
                self.engine.cancel(command[1])
        elif command[0] == "steps":
            self._steps_left = command[1]
        elif command[0] == "export":
            _, request, deadline, future = command
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._export(request, deadline))
                except Exception as error:  # noqa: BLE001 - the asking peer gets it as an error
                    future.set_exception(error)

    def _add(self, request_id: str, request: CompletionRequest, hint: PeerHint | None) -> None:
        engine = self.engine
        namespace = request.block_namespace
        if request.prompt is not None:
            tokens = engine.prompt_tokens(request.prompt)
        else:
            try:
                tokens = validate_tokens(request.prompt_tokens, engine.cache.vocab_size)
            except ValueError as error:  # an id outside the vocabulary, named with its index
                raise RequestError(str(error), param="prompt") from None
        check_fits(engine, len(tokens), request.max_tokens)  # before a remote fetch, which would be wasted
        match = engine.cache.match(tokens, namespace)
        plan = None
        if hint is not None and self.remote is not None and request.remote_fetch:
            plan = self.remote.plan(hint, match.num_hit_blocks, len(tokens))
        if plan is None:
            self._start(request_id, request)
        else:
            future = self.remote.start(plan, tokens, namespace)
            self._parked[request_id] = _Parked(request, tokens, plan, future)
            future.add_done_callback(lambda _: self._commands.put(("wake",)))
        self._prefill_tokens[request_id] = len(tokens) - match.hit_tokens

    def _start(self, request_id: str, request: CompletionRequest) -> None:
        """Hand the request to the engine (ValueError for one it refuses)."""
        sampling = SamplingParams(request.temperature, request.top_k, request.seed)
        prompt = {"prompt": request.prompt} if request.prompt is not None else {"tokens": request.prompt_tokens}
        self.engine.add_request(request_id, **prompt, max_new_tokens=request.max_tokens, sampling=sampling,
                                namespace=request.block_namespace, stop=request.stop,
                                min_tokens=request.min_tokens)  # fmt: skip

    def _land_fetches(self) -> None:
        """Requests whose fetch ended: their verified pages join the cache, then the engine
        takes them."""
        for request_id, parked in list(self._parked.items()):
            if not parked.future.done():
                continue
            del self._parked[request_id]
            outcome = self.remote.finish(parked.plan, parked.future.result())
            imported = 0
            if outcome.blocks is not None:  # verified pages: cached even if their request went
                imported = self.engine.cache.import_pages(parked.tokens, parked.request.block_namespace,
                                                          parked.plan.first_page, outcome.blocks)  # fmt: skip
            if parked.cancelled:
                continue
            page_size = self.engine.pool.config.page_size
            if not parked.request.stream or parked.request.include_usage:  # its usage will carry it
                self._remote_reports[request_id] = _remote_report(outcome, imported * page_size, page_size)
                while len(self._remote_reports) > _MAX_REPORTS:  # answers that failed never took theirs
                    del self._remote_reports[next(iter(self._remote_reports))]
            try:
                self._start(request_id, parked.request)
            except ValueError as error:
                self._prefill_tokens.pop(request_id, None)
                self._remote_reports.pop(request_id, None)
                sink = self._sinks.pop(request_id, None)
                if sink is not None:
                    sink(RequestError(str(error)))

    def _export(self, request: OfferRequest, deadline: float) -> ExportedPages:
        if time.monotonic() >= deadline:
            raise TimeoutError("the asking peer's wait ended before the engine thread got to it")
        return self.engine.cache.export_pages(request.tokens, request.namespace, request.first_page,
                                              request.num_pages)  # fmt: skip

    def _deliver(self, event) -> None:
        if isinstance(event, TokenEvent):
            self._prefill_tokens.pop(event.request_id, None)
            sink = self._sinks.get(event.request_id)
        elif isinstance(event, FinishEvent):
            self._prefill_tokens.pop(event.request_id, None)
            sink = self._sinks.pop(event.request_id, None)
        else:
            return
        if sink is not None:
            sink(event)

    def _share_learned(self) -> None:
        now = time.monotonic()
        if now >= self._next_share:
            self._next_share = now + self.publisher.heartbeat_s
            share_learned(self.engine.cache.trie.policy, self.publisher)

    def _note_throughput(self) -> None:
        """``generated_tokens_per_second`` over the last ``_RATE_WINDOW_S`` or more (0 when
        idle): ``Engine.run`` sets it per run, and a node steps its engine itself."""
        engine, (then, before) = self.engine, self._rate_mark
        now = engine.clock()
        if now - then >= _RATE_WINDOW_S:
            generated = engine.num_generated_tokens
            engine.metrics.set("generated_tokens_per_second", (generated - before) / (now - then))
            self._rate_mark = (now, generated)

    def _publish(self) -> None:
        self._load = NodeLoad(len(self._sinks), sum(self._prefill_tokens.values()))
        if self.publisher is None:
            return
        self._share_learned()
        batches = self._events.poll()
        if self._events.lost_batches:  # fell behind: start again from the holdings
            self._events.close()
            self._events = self.engine.cache.subscribe()
            self.publisher.reset(self._events.initial.entries())
            batches = []
        # compared with what the publisher was last handed, not with this thread's last load:
        # submit hands it the load with a request not taken yet, and a request refused when
        # taken leaves this thread's load as it was, while the publisher (and each heartbeat)
        # went on writing the one more
        with self._not_taken_lock:
            load = self.load
            if batches or load != self._published_load:
                self.publisher.submit(batches, load)
                self._published_load = load


def share_learned(policy: object, publisher: DirectoryPublisher) -> bool:
    """Hand ``policy``'s statistics to ``publisher`` and merge the peers' it read last (a
    ``ReusePolicy`` only; peers' records that do not parse are skipped with a warning).
    True if a merge happened."""
    if not isinstance(policy, ReusePolicy):
        return False
    publisher.submit_learned(policy.statistics().as_dict())
    peers = publisher.take_peers_learned()
    if peers is None:
        return False
    merged = []
    for peer, fields in peers.items():
        try:
            merged.append(ReuseStatistics.from_dict(fields))
        except ValueError as error:
            _LOG.warning("peer %s published malformed reuse statistics: %s", peer, error)
    policy.merge_peer_statistics(merged)
    return True


def start_worker(engine: Engine, *, node_id: str, address: str, model: str,
                 directory: Directory | None = None, register_timeout_s: float = 10.0,
                 remote: RemoteFetcher | None = None) -> EngineWorker:  # fmt: skip
    """The engine's worker thread, started; with ``directory``, registered there first and
    publishing the cache's holdings and block events (ValueError / RuntimeError from
    ``DirectoryPublisher.start`` when it cannot register); ``remote``: fetch from peers."""
    publisher = events = None
    if directory is not None:
        events = engine.cache.subscribe()
        publisher = DirectoryPublisher(directory, node_id, address, cluster_info_of(engine, model),
                                       events.initial.entries())  # fmt: skip
        publisher.start(register_timeout_s)
    worker = EngineWorker(engine, publisher, events, remote)
    worker.start()
    return worker


def check_fits(engine: Engine, num_prompt_tokens: int, max_tokens: int) -> None:
    """RequestError (400) naming the parameter to change for a request ``engine`` can never
    serve: an empty prompt, or a prompt and ``max_tokens`` longer than the longest sequence,
    which is ``max_model_len`` or, when that is smaller, what the page pool holds. A request
    the pool cannot hold alone would be rejected at admission (a 503, which a router retries
    on every node in vain) or stopped mid-generation, its tokens computed for nothing.

    The engine checks ``max_model_len`` too, but names the node's internal request id and
    not the parameter at fault."""
    if num_prompt_tokens == 0:
        raise RequestError("prompt is empty (0 tokens); expected at least one token", param="prompt")
    page_size, num_blocks = engine.pool.config.page_size, engine.pool.config.num_blocks
    limit, what, code = engine.max_model_len, f"max_model_len={engine.max_model_len}", CONTEXT_LENGTH_EXCEEDED
    if num_blocks * page_size < limit:  # this node's own limit: a router tries the others (NODE_CAPACITY_EXCEEDED)
        limit, what = num_blocks * page_size, (f"this node's page pool holds {num_blocks * page_size} tokens "
                                               f"({num_blocks} blocks of {page_size})")  # fmt: skip
        code = NODE_CAPACITY_EXCEEDED
    total = num_prompt_tokens + max_tokens
    if total <= limit:
        return
    needs = f"a prompt of {num_prompt_tokens} tokens + max_tokens={max_tokens} needs {total} tokens; {what}"
    if num_prompt_tokens >= limit:
        fix = (f"shorten the prompt to at most {limit - max_tokens} tokens" if max_tokens < limit
               else f"shorten the prompt and lower max_tokens to {limit} tokens together")  # fmt: skip
        raise RequestError(f"{needs}: {fix}", param="prompt", code=code)
    raise RequestError(f"{needs}: lower max_tokens to at most {limit - num_prompt_tokens}", param="max_tokens",
                       code=code)  # fmt: skip


def cluster_info_of(engine: Engine, model: str) -> ClusterInfo:
    """What a router needs to key prompts the way ``engine`` does."""
    return ClusterInfo.of(model, engine.pool.config.page_size, engine.tokenizer, engine.canonicalize)


def _remote_report(outcome: FetchOutcome, fetched_tokens: int, page_size: int) -> dict:
    """A fetch as the request's usage reports it (``kvjax_remote``): tokens asked for and
    fetched (verified and imported), seconds waited and expected."""
    plan = outcome.plan
    return {"peer": plan.peer.node_id, "outcome": outcome.outcome, "asked_tokens": plan.num_pages * page_size,
            "fetched_tokens": fetched_tokens, "wait_s": round(outcome.waited_s, 6),
            "expected_s": round(plan.expected_s, 6), "detail": plan.detail[:200]}  # fmt: skip
