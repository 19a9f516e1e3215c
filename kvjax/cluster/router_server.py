"""The router's HTTP front: the nodes' OpenAI-compatible API, each request sent to one node.

Per request: parse and validate the body (``kvjax.cluster.openai_api``), tokenize the prompt
the way the nodes do (``ClusterInfo``: tokenizer, canonicalization, page size), compute the
chained block keys in the request's namespace (its tenant and ``cache_salt``, as the nodes key
its blocks: ``CompletionRequest.block_namespace``), look them up in the directory (one round
trip), choose a node (``RoutingPolicy``), and forward the body as it came while the request
is counted on the node (``Directory.add_load``, a second round trip overlapped with the
forward); a streamed answer is passed through chunk by chunk. The answer carries the
chosen node in the ``X-KVJax-Node`` header and why in ``X-KVJax-Route`` (the decision's reason
and the prefix blocks it holds). The router tokenizes text with the byte tokenizer only: when
the nodes use another, a text prompt is routed by load alone (``kvjax_router_untokenized_requests``
counts them); prompts sent as token ids keep their affinity.

When all of the router's connections to nodes are busy (1,000, none free for 30 s) a request
gets a 503 saying so, and no node is blamed or excluded for it.

A request that failed before its client got a token is routed again, the node excluded, up to
``max_attempts`` nodes: a node that cannot be reached, answers a 5xx (503: rejected, failed,
shutting down or taken over; 500: its engine failed), breaks off a non-streamed answer, or
whose stream breaks or fails (an error event) before its first event. The router reads a
stream's first event before it answers the client, so this holds for streams too. A 400 with
code ``node_capacity_exceeded`` (longer than that node's page pool holds) is tried on the other
nodes too, whose pools may be larger; the client gets that 400 if every node tried refuses it. A stream that
breaks after that is not retried (the client has text already): it ends with an error event
(``data: {"error": ...}``) and ``data: [DONE]``, and the router passes on only whole events,
never half of one. A client that leaves before its answer is complete closes the request to
the node, which then cancels it too (``kvjax.cluster.http_front``).

On SIGTERM the router drains (``kvjax.cluster.drain``, with ``DrainingServer``): ``/health``
answers 503 "draining" and new requests a 503 at once, while those in flight, streams
included, run to their end for the drain's grace period; the router exits once none is open.
A router has no record in the directory to leave: routers are interchangeable and nothing
chooses among them by the directory (a load balancer in front has its own list of them), so
the 503 of ``/health`` is what takes a draining router out of rotation.

Nothing is kept here that a restart would lose: the directory, the nodes' records and their
loads live in Redis; only the round-robin position and the cluster record (read again every
``CLUSTER_REFRESH_S``) are cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping

import anyio.to_thread
import httpx
import numpy as np
import prometheus_client
import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvjax.cache.block_keys import chained_block_keys
from kvjax.cluster.directory import ClusterInfo, Directory
from kvjax.cluster.drain import DEFAULT_GRACE_S, Drain
from kvjax.cluster.http_front import (
    DEFAULT_MAX_BODY_BYTES,
    IgnoredFields,
    answer_errors_as_openai,
    limit_request_bodies,
    unless_client_leaves,
)
from kvjax.cluster.openai_api import (
    NAMESPACE_HEADER,
    NODE_CAPACITY_EXCEEDED,
    CompletionRequest,
    RequestError,
    error_body,
    model_body,
    parse_completion_request,
    sse,
    unknown_model,
)
from kvjax.cluster.router import Decision, RoutingPolicy
from kvjax.text.canonicalize import canonicalize
from kvjax.text.tokens import validate_tokens

__all__ = ["RouterService", "create_router_app", "directory_down", "router_drain"]

_LOG = logging.getLogger(__name__)
CLUSTER_REFRESH_S = 5.0  # how old a router's copy of the cluster record may get
_MAX_CONNECTIONS = 1000  # to nodes, at once
_POOL_TIMEOUT_S = 30.0  # the longest a request waits for one of them
_ROUTES = "POST /v1/completions, GET /v1/models, GET /v1/models/{model}, GET /health, GET /metrics"
_EVENT_END = b"\n\n"  # ends a server-sent event (kvjax's nodes)
_CRLF_EVENT_END = b"\r\n\r\n"  # the same, with the CRLF line ends SSE allows too
_ERROR_EVENT = b'data: {"error"'  # how a node's stream that failed starts its event


class RouterService:
    """Routing decisions against ``directory`` with ``policy``; thread-safe."""

    def __init__(self, directory: Directory, policy: RoutingPolicy | None = None, *, max_attempts: int = 3,
                 cluster_refresh_s: float = CLUSTER_REFRESH_S):  # fmt: skip
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts!r} must be an int >= 1")
        if isinstance(cluster_refresh_s, bool) or not isinstance(cluster_refresh_s, (int, float)) \
                or not 0 <= cluster_refresh_s < math.inf:  # fmt: skip
            raise ValueError(f"cluster_refresh_s={cluster_refresh_s!r} must be a finite number of seconds >= 0")
        self.directory, self.policy, self.max_attempts = directory, policy or RoutingPolicy(), max_attempts
        self.cluster_refresh_s = float(cluster_refresh_s)
        self._cluster: ClusterInfo | None = None
        self._cluster_read_at = -math.inf  # time.monotonic() of the last read of the record
        self._lock = threading.Lock()
        self.registry = prometheus_client.CollectorRegistry()
        self.routed = prometheus_client.Counter("kvjax_router_requests", "Requests sent to a node, by reason",
                                                ["node", "reason"], registry=self.registry)  # fmt: skip
        self.decision_seconds = prometheus_client.Histogram(
            "kvjax_router_decision_seconds", "Tokenize, directory lookup, choice and load update",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2), registry=self.registry)  # fmt: skip
        self.untokenized = prometheus_client.Counter(
            "kvjax_router_untokenized_requests", "Text prompts routed by load alone: the nodes' tokenizer is not "
            "one the router knows, so it cannot find their cached prefixes (send token ids for affinity)",
            registry=self.registry)  # fmt: skip
        self.forward_errors = prometheus_client.Counter("kvjax_router_forward_errors",
                                                        "Nodes that failed a forwarded request before answering",
                                                        ["node"], registry=self.registry)  # fmt: skip
        self.ignored = IgnoredFields(self.registry, "kvjax_router")  # the node it forwards to counts them too

    def cluster(self) -> ClusterInfo:
        """The cluster record the nodes registered, read again once it is ``cluster_refresh_s``
        old: after Redis lost its data, nodes of another model (or page size) may register a new
        one, and a record kept for good answered 404 to the model served and keyed prompts with
        the old page size until the router restarted. A failed read keeps the last record."""
        with self._lock:
            now = time.monotonic()
            if self._cluster is None or now - self._cluster_read_at >= self.cluster_refresh_s:
                try:
                    found = self.directory.cluster_info()
                except redis.RedisError as error:
                    if self._cluster is None:
                        raise directory_down(self.directory, error) from None
                    found = None  # the lookup that follows says whether Redis is down
                if found is None and self._cluster is None:
                    raise RequestError(f"no node has registered under prefix {self.directory.prefix!r} yet",
                                       status=503, kind="server_error")  # fmt: skip
                self._cluster, self._cluster_read_at = found or self._cluster, now
            return self._cluster

    def prompt_tokens(self, request: CompletionRequest) -> np.ndarray | None:
        """The prompt's token ids, as the nodes compute them (int32; kept an array: turning
        4,096 ids into a list and back cost 0.15 ms of a decision); None for a text prompt when
        the nodes tokenize with a tokenizer the router does not know (only the byte one)."""
        if request.prompt is None:
            try:  # named as sent: np.asarray made [1, 2**63] float64
                return validate_tokens(request.prompt_tokens, None)
            except ValueError as error:
                raise RequestError(str(error), param="prompt") from None
        keying = self.cluster().text_keying()
        if keying is None:
            return None
        tokenizer, config = keying
        return tokenizer.encode(request.prompt if config is None else canonicalize(request.prompt, config).text)

    def decide(self, request: CompletionRequest, exclude: frozenset[str] = frozenset()) -> Decision:
        """Choose the node for ``request`` (blocking: one directory round trip).

        RequestError: 404 for another model, 400 for bad token ids, 503 when no node is live
        or the directory cannot be reached.
        """
        start = time.perf_counter()
        cluster = self.cluster()
        if request.model != cluster.model:
            raise unknown_model(request.model, cluster.model, "the cluster")
        namespace = request.block_namespace  # tenant and cache_salt: the keys the nodes publish
        tokens = self.prompt_tokens(request)
        if tokens is None:  # text the router cannot key: routed by load alone, with its bytes for its size
            keys, num_tokens = [], len(request.prompt.encode(errors="replace"))
            self.untokenized.inc()
        else:
            try:
                keys = chained_block_keys(tokens, cluster.page_size, namespace)
            except ValueError as error:
                raise RequestError(str(error), param="prompt") from None
            num_tokens = len(tokens)
        try:
            views = self.directory.lookup(namespace.digest(), keys)
        except redis.RedisError as error:
            raise directory_down(self.directory, error) from None
        try:
            decision = self.policy.choose(views, max(num_tokens, 1), cluster.page_size, exclude)
        except ValueError as error:
            raise RequestError(str(error), status=503, kind="server_error") from None
        self.routed.labels(decision.node_id, decision.reason).inc()
        self.decision_seconds.observe(time.perf_counter() - start)
        return decision

    def count(self, decision: Decision) -> None:
        """Add the routed request to its node's load now, before the node's own figures catch
        up (a second round trip; the HTTP front overlaps it with forwarding). A failure is
        logged only: the node's next write sets its load anyway."""
        try:
            self.directory.add_load(decision.node_id, 1, decision.uncached_tokens)
        except redis.RedisError as error:
            _LOG.warning("could not count a request on node %s: %s", decision.node_id, error)


def create_router_app(service: RouterService, *, connect_timeout_s: float = 2.0, read_timeout_s: float = 600.0,
                      drain: Drain | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:  # fmt: skip
    """The router's FastAPI app: ``/v1/completions``, ``/v1/models`` (and ``/v1/models/{model}``),
    ``/health``, ``/metrics``; every error an OpenAI error body (``kvjax.cluster.http_front``).
    ``drain``: what a ``DrainingServer`` drains on SIGTERM (default: one of ``router_drain()``).
    ``max_body_bytes``: the largest request body taken, a larger one gets a 413
    (``kvjax.cluster.http_front.limit_request_bodies``; the nodes have the same default).

    ``read_timeout_s``: the longest a node may stay silent while answering (its whole
    non-streamed answer, or between two chunks of a stream); past it the client gets a 504 and
    the request is not sent elsewhere (the node may still be working on it). ValueError for a
    timeout that is not a positive finite number of seconds."""
    for name, value in (("connect_timeout_s", connect_timeout_s), ("read_timeout_s", read_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name}={value!r} must be a positive finite number of seconds")
    timeout = httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=30.0, pool=_POOL_TIMEOUT_S)
    client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=_MAX_CONNECTIONS))
    drain = drain if drain is not None else router_drain()
    request_ids = itertools.count()

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        await client.aclose()

    app = FastAPI(title="kvjax router", lifespan=lifespan)

    answer_errors_as_openai(app, _ROUTES)
    limit_request_bodies(app, max_body_bytes)

    @app.post("/v1/completions")
    async def completions(http_request: Request):
        raw = await http_request.body()
        request = parse_completion_request(raw, http_request.headers)
        service.ignored.note(request.ignored_fields)
        request_id = str(next(request_ids))
        drain.open(request_id)  # a 503 while the router drains
        streaming = False
        try:
            # a client that leaves before the answer (or a stream's first event) closes the
            # request to its node, whose own watch then cancels the engine's work; so does a cut
            response = await unless_client_leaves(http_request.receive, drain.unless_cut(
                _forward(service, client, raw, http_request.headers, request, drain, request_id)))
            streaming = isinstance(response, StreamingResponse)  # open until its last chunk went out
            return response
        finally:
            if not streaming:
                drain.close(request_id)

    @app.get("/v1/models")
    async def models():
        cluster = await anyio.to_thread.run_sync(service.cluster)
        return {"object": "list", "data": [model_body(cluster.model)]}

    @app.get("/v1/models/{name:path}")  # a model id may hold slashes ("org/model")
    async def one_model(name: str):
        cluster = await anyio.to_thread.run_sync(service.cluster)
        if name != cluster.model:
            raise unknown_model(name, cluster.model, "the cluster")
        return model_body(cluster.model)

    @app.get("/health")
    async def health():
        """Readiness: 200 while the directory answers and lists a live node; 503 naming the
        directory's Redis while it cannot be reached (the router may start before Redis:
        it serves from the moment Redis answers, nothing to restart), 503 "draining" once it
        is shutting down."""
        address = service.directory.address
        if drain.draining:
            return JSONResponse({"status": "draining", "directory": address, "reason": drain.reason,
                                 "open_requests": drain.num_open}, status_code=503)  # fmt: skip
        try:
            nodes = await anyio.to_thread.run_sync(service.directory.live_nodes)
        except redis.RedisError as error:
            return JSONResponse({"status": "directory unreachable", "directory": address,
                                 "error": str(directory_down(service.directory, error))}, status_code=503)  # fmt: skip
        body = {"status": "ok" if nodes else "no live node", "directory": address,
                "strategy": service.policy.config.strategy,
                "nodes": {view.node_id: {"address": view.address, "epoch": view.epoch, "inflight": view.load.inflight,
                                         "prefill_tokens": view.load.prefill_tokens} for view in nodes}}  # fmt: skip
        return JSONResponse(body, status_code=200 if nodes else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus_client.generate_latest(service.registry),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)  # fmt: skip

    return app


def router_drain(grace_s: float = DEFAULT_GRACE_S) -> Drain:
    """The router's drain: refused requests are sent to another router (ValueError for a bad
    ``grace_s``)."""
    return Drain("router", grace_s, elsewhere="send it to another router")


async def _forward(service: RouterService, client: httpx.AsyncClient, raw: bytes, headers: Mapping[str, str],
                   request: CompletionRequest, drain: Drain, request_id: str) -> Response:  # fmt: skip
    """Send the body to the chosen node; on a failure before it answered, to the next one. A
    stream stays open in ``drain`` as ``request_id`` until its last chunk went out."""
    forward_headers = {"content-type": "application/json"}
    if NAMESPACE_HEADER in headers:
        forward_headers[NAMESPACE_HEADER] = headers[NAMESPACE_HEADER]
    excluded: set[str] = set()
    failures, answers = [], []
    for _ in range(service.max_attempts):
        try:
            decision = await anyio.to_thread.run_sync(service.decide, request, frozenset(excluded))
        except RequestError as error:
            if not failures or error.status != 503:
                raise
            break  # every live node failed it (or the directory went since): their reasons say why
        counting = asyncio.ensure_future(anyio.to_thread.run_sync(service.count, decision))
        try:
            return await _send(client, decision, raw, forward_headers, request.stream, drain, request_id)
        except _NodeFailed as failure:
            failures.append(f"{decision.node_id}: {failure}")
            if failure.unreachable:
                service.forward_errors.labels(decision.node_id).inc()
            if failure.answer is not None:
                answers.append(failure.answer)
            excluded.add(decision.node_id)
        finally:
            await counting
    if answers and len(answers) == len(failures):  # every node tried is too small for it: its 400
        return answers[-1]
    raise RequestError(f"no node could serve the request ({len(failures)} tried: {'; '.join(failures)})",
                       status=503, kind="server_error")  # fmt: skip


class _NodeFailed(Exception):
    """A node gave no answer the client can have, and no token of it: unreachable, broke off
    before its first event, said 5xx, or its stream's first event is an error."""

    def __init__(self, message: str, unreachable: bool, answer: Response | None = None):
        super().__init__(message)
        self.unreachable = unreachable
        self.answer = answer  # the node's own answer, for the client if no node serves it


async def _send(client: httpx.AsyncClient, decision: Decision, raw: bytes, headers: dict[str, str],
                stream: bool, drain: Drain, request_id: str) -> Response:  # fmt: skip
    """The chosen node's answer, passed through (a 200 stream chunk by chunk, until the drain
    cuts it)."""
    url = f"{decision.node.address}/v1/completions"
    try:
        upstream = await client.send(client.build_request("POST", url, content=raw, headers=headers), stream=True)
    except httpx.ReadTimeout:
        raise _silent(decision, client) from None
    except httpx.PoolTimeout:  # the router's own connections are all busy: no node's fault, none would do better
        raise RequestError(f"the router is at its limit of connections to nodes ({_MAX_CONNECTIONS}, none free "
                           f"for {_POOL_TIMEOUT_S:g} s); retry later or add a router", status=503,
                           kind="server_error") from None  # fmt: skip
    except httpx.TransportError as error:
        raise _NodeFailed(type(error).__name__, unreachable=True) from None
    except httpx.InvalidURL as error:  # a node's record (its --advertise) that is no URL: it cannot be reached
        raise _NodeFailed(f"its address {decision.node.address!r} is no URL: {error}", unreachable=True) from None
    reply_headers = {"x-kvjax-node": decision.node_id,
                     "x-kvjax-route": f"{decision.reason}; prefix_blocks={decision.prefix_blocks}"}  # fmt: skip
    media_type = upstream.headers.get("content-type")
    if stream and upstream.status_code == 200:
        events = _whole_events(upstream.aiter_raw())
        try:
            first = await anext(events, b"")
        except httpx.ReadTimeout:
            await upstream.aclose()
            raise _silent(decision, client) from None
        except httpx.TransportError as error:
            await upstream.aclose()
            raise _NodeFailed(f"{type(error).__name__} before the stream's first event", unreachable=True) from None
        if not first or first.startswith(_ERROR_EVENT):
            await upstream.aclose()
            raise _NodeFailed(first.decode(errors="replace")[:200] or "an empty stream", unreachable=False)

        async def finished() -> None:  # a coroutine: on the event loop, where the drain's state lives
            drain.close(request_id)  # also where the relay never started (its client left first)
            await upstream.aclose()

        relay = _relay(first, drain.until_cut(events), decision, client, lambda: drain.close(request_id))
        return StreamingResponse(relay, media_type=media_type,
                                 headers=reply_headers, background=BackgroundTask(finished))  # fmt: skip
    try:
        body = await upstream.aread()
    except httpx.ReadTimeout:
        raise _silent(decision, client) from None
    except httpx.TransportError as error:
        raise _NodeFailed(f"{type(error).__name__} while answering", unreachable=True) from None
    finally:
        await upstream.aclose()
    if upstream.status_code >= 500:  # the client has nothing of it: another node may serve it
        raise _NodeFailed(f"{upstream.status_code} {_error_message(body)}", unreachable=False)
    answer = Response(body, status_code=upstream.status_code, headers=reply_headers, media_type=media_type)
    if upstream.status_code == 400 and _error_code(body) == NODE_CAPACITY_EXCEEDED:  # a larger pool may serve it
        raise _NodeFailed(f"400 {_error_message(body)}", unreachable=False, answer=answer)
    return answer


def _error_code(body: bytes) -> str | None:
    """The ``code`` of an OpenAI error body (None if it is none)."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


def _error_message(body: bytes) -> str:
    """What a node's error answer says: the message of an OpenAI error body, else its text
    (a proxy's error page), cut to 300 characters."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    text = message if isinstance(message, str) else body.decode(errors="replace")
    return text if len(text) <= 300 else text[:297] + "..."


def _after_last_event(data: bytes) -> int:
    """Where the last whole event of ``data`` ends (0: none ends in it)."""
    return max((data.rfind(end) + len(end) for end in (_EVENT_END, _CRLF_EVENT_END) if end in data), default=0)


async def _whole_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``chunks`` regrouped into whole server-sent events (one or more each); what follows
    the last event when the stream ends cleanly comes last."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        end = _after_last_event(pending)
        if end:
            events, pending = pending[:end], pending[end:]
            yield events
    if pending:
        yield pending


async def _relay(first: bytes, events: AsyncIterator[bytes], decision: Decision, client: httpx.AsyncClient,
                 ended: Callable[[], None]) -> AsyncIterator[bytes]:  # fmt: skip
    """A started stream, passed on; if the node breaks it off, or the router's drain cuts it, an
    error event and ``[DONE]`` end it (not a cut connection: clients tell a failed stream from
    a finished one). ``ended`` is called once it ended, however."""
    try:
        yield first
        async for chunk in events:
            yield chunk
    except RequestError as cut:
        yield sse(cut.body())
        yield sse("[DONE]")
    except httpx.ReadTimeout:
        yield sse(_silent(decision, client).body())
        yield sse("[DONE]")
    except httpx.TransportError as error:
        message = f"node {decision.node_id} broke off the stream: {type(error).__name__}"
        yield sse(error_body(message, kind="server_error"))
        yield sse("[DONE]")
    finally:
        ended()


def _silent(decision: Decision, client: httpx.AsyncClient) -> RequestError:
    """A node that accepted the request and said nothing for the read timeout: a 504, not a
    retry (it may still be computing; sending the request again would double the work)."""
    return RequestError(f"node {decision.node_id} sent nothing for {client.timeout.read:g} s while answering",
                        status=504, kind="server_error")  # fmt: skip


def directory_down(directory: Directory, error: Exception) -> RequestError:
    """A 503 naming the directory's Redis and why it cannot be reached."""
    return RequestError(f"the directory at {directory.address} cannot be reached: {type(error).__name__}: {error}",
                        status=503, kind="server_error")  # fmt: skip
