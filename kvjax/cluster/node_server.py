"""A serving node: one Engine behind an OpenAI-compatible HTTP API, publishing to the directory.

Endpoints: ``POST /v1/completions`` (streamed as server-sent events or not; see
``kvjax.cluster.openai_api`` for the fields and the ``namespace`` extension), ``GET
/v1/models`` and ``GET /v1/models/{model}``, ``GET /health`` (200 while the engine loop runs,
503 after it failed, while the node drains on its way out, or once a newer process took over
the node id) and ``GET /metrics`` (Prometheus text: the engine's metrics and the node's own).
A node whose id a newer process took over (its publisher says "superseded") answers every
completion with a 503 naming the takeover: the directory lists the newer one, and nothing may
be served by a node it no longer lists. Every error is an OpenAI error body
(``kvjax.cluster.http_front``). With remote fetch, ``POST /kv/offer`` and ``POST /kv/ack`` for
peers (``kvjax.cluster.remote_offers``).

The engine runs on its own thread (``kvjax.cluster.node_worker.EngineWorker``): handlers hand
it requests through a queue and read each request's events from an asyncio queue. A handler
with a ``RemoteFetcher`` first looks up which peer holds more of the prompt (a directory round
trip, on a worker thread) and hands that along; the engine thread decides fetch or recompute.
A client that leaves before its answer is complete cancels its request: the handler watches
for the disconnect while it waits (``kvjax.cluster.http_front``), a stream's response after
its first event.

Every completion is open in the app's ``NodeDrain`` until answered to the end: on SIGTERM the
node refuses new ones and gives those open a grace period (``kvjax.cluster.drain``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import anyio.to_thread
import numpy as np
import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.background import BackgroundTask

from kvjax.cluster.drain import NodeDrain
from kvjax.cluster.http_front import (
    DEFAULT_MAX_BODY_BYTES,
    ClientGone,
    IgnoredFields,
    answer_errors_as_openai,
    limit_request_bodies,
    unless_client_leaves,
)
from kvjax.cluster.node_worker import EngineWorker, cluster_info_of, start_worker
from kvjax.cluster.openai_api import (
    CompletionRequest,
    RequestError,
    TextStream,
    completion_body,
    error_body,
    model_body,
    parse_completion_request,
    sse,
    stream_chunk,
    unknown_model,
    usage_body,
)
from kvjax.cluster.publisher import describe_successor
from kvjax.cluster.remote_fetch import OUTCOMES, PeerHint, RemoteFetcher
from kvjax.cluster.remote_offers import OfferService
from kvjax.serving.engine import Engine
from kvjax.serving.engine_events import FinishEvent, TokenEvent

__all__ = ["EngineWorker", "cluster_info_of", "create_node_app", "start_worker"]

_LOG = logging.getLogger(__name__)
_ROUTES = "POST /v1/completions, GET /v1/models, GET /v1/models/{model}, GET /health, GET /metrics"


def create_node_app(worker: EngineWorker, model: str, node_id: str, offers: OfferService | None = None, *,
                    fault_control: bool = False, step_control: bool = False, drain: NodeDrain | None = None,
                    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:  # fmt: skip
    """The node's FastAPI app around a started ``worker``; ``offers``: serve ``/kv/offer``
    and ``/kv/ack`` to peers; ``fault_control``: also ``/kv/fault`` (fault tests);
    ``step_control``: also ``POST /test/steps`` (``{"steps": N}``: run N more engine steps, then
    hold every request; ``{"steps": null}``: run freely; ``EngineWorker.hold_steps``), for tests
    that act while requests are in flight; ``drain``: what a ``DrainingServer`` drains on
    SIGTERM (default: one of ``DEFAULT_GRACE_S``); ``max_body_bytes``: the largest request body
    taken, a larger one gets a 413 (``kvjax.cluster.http_front.limit_request_bodies``)."""
    app = FastAPI(title=f"kvjax node {node_id}")
    drain = drain if drain is not None else NodeDrain(node_id)
    registry = _node_metrics(worker, offers)
    ignored = IgnoredFields(registry, "kvjax_node")
    decode = worker.engine.tokenizer.decode
    engine = worker.engine

    answer_errors_as_openai(app, _ROUTES)
    limit_request_bodies(app, max_body_bytes)

    @app.post("/v1/completions")
    async def completions(http_request: Request):
        request = parse_completion_request(await http_request.body(), http_request.headers)
        ignored.note(request.ignored_fields)
        if request.model != model:
            raise unknown_model(request.model, model, "this node")
        refusal = _refusal(worker, node_id)
        if refusal is not None:
            raise refusal
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        hint = None
        if worker.remote is not None and request.remote_fetch:
            hint = await anyio.to_thread.run_sync(_find_peer, worker.remote, engine, request)

        def cut(error: RequestError) -> None:  # the drain's end: tell the waiting handler, stop the engine's work
            events.put_nowait(error)
            worker.cancel(request_id)

        drain.open(request_id, cut)  # a 503 while the node drains
        streaming = False
        try:
            worker.submit(request_id, request, lambda item: loop.call_soon_threadsafe(events.put_nowait, item), hint)
            # a stream waits for its first event only (the response watches its client after
            # that); a plain answer waits for the whole of it
            wait = _next_event(events) if request.stream else _finish_event(events)
            first = await unless_client_leaves(http_request.receive, wait)
            headers = {"x-kvjax-node": node_id}
            if request.stream:
                text = TextStream(decode, request.stop, request.min_tokens)  # cuts where the answer does
                chunks = _stream(worker, request_id, created, request, first, events, text, drain)
                streaming = True  # open until its last chunk went out, or its client left
                return StreamingResponse(chunks, media_type="text/event-stream", headers=headers,
                                         background=BackgroundTask(_close_on_loop, drain, request_id))  # fmt: skip
            finish = first
        except (asyncio.CancelledError, ClientGone):  # the client went away before the answer was complete
            worker.cancel(request_id)
            raise
        finally:
            if not streaming:
                drain.close(request_id)
        usage = _usage(finish, worker.take_remote_report(request_id))
        body = completion_body(request_id, model, created, finish.text or "", _finish_reason(finish), usage)
        return JSONResponse(body, headers=headers)

    if offers is not None:

        @app.post("/kv/offer")
        async def kv_offer(http_request: Request):
            try:
                body = await http_request.json()
                reply = await anyio.to_thread.run_sync(offers.offer, body)
            except PermissionError as error:
                return JSONResponse({"error": str(error)}, status_code=503)
            except TimeoutError as error:
                return JSONResponse({"error": str(error) or "timed out"}, status_code=504)
            except RuntimeError as error:
                if worker.alive:
                    raise  # a broken invariant: a 500 with its traceback
                return JSONResponse({"error": str(error)}, status_code=503)  # the engine failed
            except ValueError as error:
                return JSONResponse({"error": str(error)}, status_code=400)
            return JSONResponse(reply.to_json())

        @app.post("/kv/ack")
        async def kv_ack(http_request: Request):
            try:
                return {"acknowledged": offers.ack(await http_request.json())}
            except ValueError as error:
                return JSONResponse({"error": str(error)}, status_code=400)

    if offers is not None and fault_control:

        @app.post("/kv/fault")
        async def kv_fault(http_request: Request):
            try:
                return {"mode": offers.set_fault(await http_request.json())}
            except ValueError as error:
                return JSONResponse({"error": str(error)}, status_code=400)

    if step_control:

        @app.post("/test/steps")
        async def test_steps(http_request: Request):
            try:
                steps = (await http_request.json())["steps"]
                worker.hold_steps(steps)
            except (ValueError, KeyError, TypeError) as error:
                return JSONResponse(error_body(f"expected {{\"steps\": N or null}}: {error}"), status_code=400)
            return {"steps": steps}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_body(model)]}

    @app.get("/v1/models/{name:path}")  # a model id may hold slashes ("org/model")
    async def one_model(name: str):
        if name != model:
            raise unknown_model(name, model, "this node")
        return model_body(model)

    @app.get("/health")
    async def health():
        publisher = worker.publisher
        refusal = _refusal(worker, node_id)
        status = "failed" if not worker.alive else "superseded" if refusal is not None else \
            "draining" if drain.draining else "ok"  # fmt: skip
        body = {"status": status, "node_id": node_id, "model": model,
                "inflight": worker.load.inflight, "prefill_tokens": worker.load.prefill_tokens,
                "directory": None if publisher is None else publisher.status,
                "epoch": None if publisher is None else publisher.epoch}  # fmt: skip
        if refusal is not None:
            body["error"] = str(refusal)
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        text = worker.engine.metrics.prometheus_text() + prometheus_client.generate_latest(registry).decode()
        return Response(text, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    return app


async def _stream(worker: EngineWorker, request_id: str, created: int, request: CompletionRequest, first,
                  events: asyncio.Queue, text: TextStream, drain: NodeDrain):  # fmt: skip
    """The SSE chunks of one streamed request; a client that goes away cancels it; a failure
    (the engine's, or the node's shutdown cutting it) is an error event, then ``[DONE]``."""
    event, finished, with_usage = first, False, request.include_usage
    try:
        while True:
            if drain.cut is not None:  # at once, not after the tokens queued for a slow client
                event = drain.cut
            if isinstance(event, Exception):
                yield sse(error_body(str(event), kind="server_error"))
                break
            if isinstance(event, TokenEvent):
                delta = text.push(event.token_id)
                if delta:
                    yield sse(stream_chunk(request_id, request.model, created, delta, include_usage=with_usage))
            elif isinstance(event, FinishEvent):
                finished = True
                yield sse(stream_chunk(request_id, request.model, created, text.finish(event.text or ""),
                                       _finish_reason(event), include_usage=with_usage))  # fmt: skip
                if with_usage:
                    usage = _usage(event, worker.take_remote_report(request_id))
                    yield sse(stream_chunk(request_id, request.model, created, "", usage=usage))
                break
            event = await events.get()
        yield sse("[DONE]")
    finally:
        drain.close(request_id)
        if not finished:
            worker.cancel(request_id)


async def _next_event(events: asyncio.Queue):
    """The request's next event; RequestError if it is a failure."""
    event = await events.get()
    _raise_if_failed(event)
    return event


async def _finish_event(events: asyncio.Queue) -> FinishEvent:
    """The request's FinishEvent, its tokens skipped; RequestError for a failure."""
    event = None
    while not isinstance(event, FinishEvent):
        event = await _next_event(events)
    return event


def _refusal(worker: EngineWorker, node_id: str) -> RequestError | None:
    """Why the node takes no new request (its engine failed, or a newer process took over its
    id: the directory lists that one, so this one must not serve), or None."""
    if not worker.alive:
        return RequestError(f"node {node_id} cannot serve: {worker.error}", status=503, kind="server_error")
    publisher = worker.publisher
    if publisher is not None and publisher.status == "superseded":
        return RequestError(f"node {node_id} was taken over by a newer process of the same node id "
                            f"({describe_successor(publisher.successor)}; this process had epoch {publisher.epoch}) "
                            "and serves no more requests; stop it, or start it with another --node-id",
                            status=503, kind="server_error")  # fmt: skip
    return None


def _raise_if_failed(event) -> None:
    """A request error from the engine thread, or a rejection, as the HTTP error it becomes."""
    if isinstance(event, RequestError):
        raise event
    if isinstance(event, Exception):
        raise RequestError(str(event), status=500, kind="server_error")
    if isinstance(event, FinishEvent) and event.status == "rejected" and not len(event.output_token_ids):
        # no token computed (a full queue, say): another node, or this one later, may serve it
        raise RequestError(f"the engine rejected the request: {event.reason}", status=503, kind="server_error")


def _finish_reason(event: FinishEvent) -> str:
    """The OpenAI finish reason. A request the engine stopped after some tokens (the pool could
    not grow it: ``check_fits`` refuses one that cannot fit alone, so pins or other requests
    held the rest) keeps its text and ends as "length", cut short like one at the context
    limit; why goes to the log (OpenAI clients know only "length" and "stop")."""
    if event.reason in ("length", "stop"):
        return event.reason
    if event.status == "rejected":
        _LOG.warning("request %s stopped after %d tokens: %s", event.request_id, len(event.output_token_ids),
                     event.reason)  # fmt: skip
    return "length"


def _usage(event: FinishEvent, remote: dict | None = None) -> dict:
    usage = usage_body(len(event.prompt_token_ids), len(event.output_token_ids), event.num_hit_tokens)
    if remote is not None:
        usage["kvjax_remote"] = remote
    return usage


def _find_peer(remote: RemoteFetcher, engine: Engine, request: CompletionRequest) -> PeerHint | None:
    """The handler's directory lookup (on a worker thread: one Redis round trip)."""
    tokens = engine.prompt_tokens(request.prompt) if request.prompt is not None else request.prompt_tokens
    try:
        return remote.find_peer(tokens, request.block_namespace)
    except ValueError:  # bad token ids: the engine thread refuses the request with the message
        return None

def _node_metrics(worker: EngineWorker, offers: OfferService | None) -> prometheus_client.CollectorRegistry:
    """The node's own series next to the engine's: load, directory publishing, remote fetch."""
    registry = prometheus_client.CollectorRegistry()
    registry.register(_NodeCollector(worker, offers))
    return registry


class _NodeCollector:
    """Reads the worker's load and the publisher's counters at scrape time."""

    _PUBLISHER = (("published_batches", "Block event batches folded into the directory"),
                  ("published_blocks", "Block entries written to the directory"),
                  ("resyncs", "Registrations that rewrote every held block"),
                  ("errors", "Directory writes that failed"))  # fmt: skip
    _TRANSFER_GAUGES = frozenset({"outstanding_offers"})  # of RemoteTransport.stats(); the rest are counts

    def __init__(self, worker: EngineWorker, offers: OfferService | None):
        self.worker, self.offers = worker, offers

    def collect(self):
        load = self.worker.load
        yield GaugeMetricFamily("kvjax_node_inflight_requests", "Requests accepted and not finished",
                                value=load.inflight)  # fmt: skip
        yield GaugeMetricFamily("kvjax_node_pending_prefill_tokens",
                                "Uncached prompt tokens of requests without a first token", value=load.prefill_tokens)
        publisher = self.worker.publisher
        if publisher is not None:
            for name, help_text in self._PUBLISHER:
                yield CounterMetricFamily(f"kvjax_node_directory_{name}", help_text, value=publisher.counters[name])
        remote = self.worker.remote
        if remote is not None:
            fetches = CounterMetricFamily("kvjax_node_remote_fetches", "Remote fetches by outcome", labels=["outcome"])
            for outcome in OUTCOMES:
                fetches.add_metric([outcome], remote.counters[outcome])
            yield fetches
            yield CounterMetricFamily("kvjax_node_remote_fetched_blocks", "Blocks pulled from peers and verified",
                                      value=remote.counters["fetched_blocks"])  # fmt: skip
            recent = list(remote.recent_seconds)
            if recent:
                quantiles = GaugeMetricFamily("kvjax_node_remote_fetch_seconds",
                                              "Seconds a request waited for its remote fetch (recent fetches)",
                                              labels=["quantile"])  # fmt: skip
                for q in (0.5, 0.99):
                    quantiles.add_metric([str(q)], float(np.quantile(recent, q)))
                yield quantiles
        if self.offers is not None:
            for name, value in self.offers.counters.items():
                yield CounterMetricFamily(f"kvjax_node_offer_{name}", f"Offers to peers: {name}", value=value)
            for name, value in self.offers.transport.stats().items():
                # every figure but the offers outstanding only grows: a counter (``_total``)
                family = GaugeMetricFamily if name in self._TRANSFER_GAUGES else CounterMetricFamily
                yield family(f"kvjax_node_transfer_{name}", f"Transfer server: {name}", value=value)


async def _close_on_loop(drain: NodeDrain, request_id: str) -> None:
    """``drain.close`` as a response's background task: a coroutine, so Starlette runs it on
    the event loop (a plain function would run on a worker thread, racing the drain's state)."""
    drain.close(request_id)
