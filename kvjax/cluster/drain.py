"""A server's graceful shutdown, nodes' and the router's alike: on SIGTERM (or Ctrl-C) it
drains, then exits.

What routers, load balancers and clients see, in order:

1. The server refuses new work at once: a node leaves the directory (routers stop choosing
   it); ``/health`` answers 503 "draining" (a readiness probe takes it out) and new
   completions get a 503 naming the shutdown (a router sends a node's to another node; a load
   balancer, a router's to another router).
2. Requests in flight run to their end, for at most ``grace_s`` seconds: a node's own, and
   those a router passes on (streams included, chunk by chunk as before).
3. Past it, or at a second signal, those still open are cut: a stream ends with an OpenAI
   error event (``data: {"error": ...}``, then ``data: [DONE]``), a non-streamed request gets
   a JSON 503, which a router retries on another node (its client has no token of it yet). A
   router's cut closes its requests to the nodes, which then cancel them too.
4. The HTTP server closes, a node's engine thread stops, and the process exits 0.

uvicorn alone gave in-flight requests 5 s and then cancelled them (a stream cut with no error
event, a non-streamed request a plain-text 500 that routers passed on), and it raised SIGTERM
again once stopped, which killed a node before it dropped its directory record.

How a handler takes part: ``open`` a request when it is accepted (the 503 while draining comes
from there) and ``close`` it once answered to the end. A node's handler hands ``open`` what a
cut does to its request (its events queue is told, its engine request cancelled); a router's
waits with ``unless_cut`` and relays a stream through ``until_cut``, which end at the cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio.to_thread
import uvicorn

from kvjax.cluster.openai_api import RequestError

__all__ = ["DEFAULT_GRACE_S", "Drain", "DrainingServer", "NodeDrain"]

DEFAULT_GRACE_S = 20.0
"""Seconds in-flight requests may run after SIGTERM: under Kubernetes' default 30 s before
SIGKILL, with room for the shutdown after it."""

_LOG = logging.getLogger(__name__)
T = TypeVar("T")
OnCut = Callable[[RequestError], None]


class Drain:
    """A server's open requests and, once it is asked to stop, its drain (see the module
    docstring). Every method runs on the HTTP server's event loop.

    ``who`` names the server in messages ("node n1", "router"); ``elsewhere`` tells a refused
    client where to go ("send it to another node").
    """

    def __init__(self, who: str, grace_s: float = DEFAULT_GRACE_S, *, elsewhere: str):
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not 0 <= grace_s < math.inf:
            raise ValueError(f"grace_s={grace_s!r} must be a finite number of seconds >= 0")
        self.who, self.grace_s, self.elsewhere = who, float(grace_s), elsewhere
        self.reason: str | None = None  # why it drains (e.g. "SIGTERM"); None while it serves
        self.cut: RequestError | None = None  # what requests still open were told when cut
        self._open: dict[str, OnCut | None] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._now = asyncio.Event()  # a second signal: cut without waiting out the grace
        self._was_cut = asyncio.Event()

    @property
    def draining(self) -> bool:
        return self.reason is not None

    @property
    def num_open(self) -> int:
        """Requests accepted and not answered to the end (a stream until its last chunk)."""
        return len(self._open)

    def open(self, request_id: str, on_cut: OnCut | None = None) -> None:
        """Count a request as open until ``close``; a cut calls ``on_cut`` with what the request
        is told (a handler waiting in ``unless_cut`` or ``until_cut`` needs none). RequestError
        (503) while the server drains."""
        if self.draining:
            raise RequestError(f"{self.who} is shutting down ({self.reason}) and takes no new requests; "
                               f"{self.elsewhere}", status=503, kind="server_error")  # fmt: skip
        self._open[request_id] = on_cut
        self._idle.clear()

    def close(self, request_id: str) -> None:
        """The request is answered (or its client left); idempotent."""
        self._open.pop(request_id, None)
        if not self._open:
            self._idle.set()

    def cut_now(self) -> None:
        """End the wait for open requests now (a second signal)."""
        self._now.set()

    async def unless_cut(self, work: Awaitable[T]) -> T:
        """``work``'s result, or the cut's RequestError (``work`` cancelled, its clean-up run)
        if the drain cuts the open requests first."""
        task = asyncio.ensure_future(work)
        cut = asyncio.ensure_future(self._was_cut.wait())
        try:
            await asyncio.wait((task, cut), return_when=asyncio.FIRST_COMPLETED)
        finally:  # the server itself may cancel the handler: nothing left running
            cut.cancel()
            if not task.done():
                task.cancel()
        if task.done():
            return task.result()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise self.cut

    async def until_cut(self, chunks: AsyncIterator[T]) -> AsyncIterator[T]:
        """``chunks`` as they come, until they end or the drain cuts the open requests: then
        the cut's RequestError (the wait for the next chunk cancelled)."""
        cut, following = asyncio.ensure_future(self._was_cut.wait()), None
        try:
            while True:
                following = asyncio.ensure_future(anext(chunks, _END))
                await asyncio.wait((following, cut), return_when=asyncio.FIRST_COMPLETED)
                if not following.done():
                    following.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await following
                    raise self.cut
                chunk = following.result()
                if chunk is _END:
                    return
                yield chunk
        finally:  # also when the consumer stops early: nothing left waiting on ``chunks``
            cut.cancel()
            if following is not None and not following.done():
                following.cancel()

    async def run(self, reason: str, leave: Callable[[], None] | None = None) -> None:
        """Drain: refuse new requests, ``leave`` (a node: the directory; a Redis round trip, on
        a worker thread), wait up to ``grace_s`` for open requests, then cut those still open."""
        self.reason = reason
        _LOG.warning("%s: %s: draining %d open request(s) for up to %g s", self.who, reason, len(self._open),
                     self.grace_s)  # fmt: skip
        if leave is not None:
            await anyio.to_thread.run_sync(leave)
        idle, now = asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._now.wait())
        try:
            await asyncio.wait([idle, now], timeout=self.grace_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            now.cancel()
        if self._open:
            why = "cut at a second signal" if self._now.is_set() else f"still open {self.grace_s:g} s after {reason}"
            self._cut(f"{self.who} shut down before the request finished ({why}); no more tokens come")

    def _cut(self, message: str) -> None:
        self.cut = RequestError(message, status=503, kind="server_error")
        _LOG.warning("%s: cutting %d open request(s)", self.who, len(self._open))
        self._was_cut.set()  # wakes the handlers waiting in unless_cut or until_cut
        for on_cut in self._open.values():
            if on_cut is not None:
                on_cut(self.cut)


class NodeDrain(Drain):
    """A node's drain: refused requests are sent to another node."""

    def __init__(self, node_id: str, grace_s: float = DEFAULT_GRACE_S):
        super().__init__(f"node {node_id}", grace_s, elsewhere="send it to another node")
        self.node_id = node_id


class DrainingServer(uvicorn.Server):
    """uvicorn's server with ``drain`` before its shutdown: the first SIGTERM or SIGINT starts
    the drain (``leave`` first, if given), a second one cuts what is open, a third one stops
    without waiting. The signal is not raised again once the server stopped (uvicorn does
    that), so the clean-up after ``serve`` runs and the process exits 0."""

    def __init__(self, config: uvicorn.Config, drain: Drain, leave: Callable[[], None] | None = None):
        super().__init__(config)
        self.drain, self.leave = drain, leave
        self.signals: list[int] = []
        self._drain_task: asyncio.Future | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # a signal handler: only record it, the event loop acts on it at its next tick
        self.signals.append(sig)
        if len(self.signals) >= 3:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.signals and self._drain_task is None:
            reason = signal.Signals(self.signals[0]).name
            self._drain_task = asyncio.ensure_future(self.drain.run(reason, self.leave))
        if len(self.signals) >= 2:
            self.drain.cut_now()
        if self._drain_task is not None and self._drain_task.done():
            if not self._drain_task.cancelled() and self._drain_task.exception() is not None:
                _LOG.error("%s: the drain failed", self.drain.who, exc_info=self._drain_task.exception())
            self.should_exit = True
        return await super().on_tick(counter)


_END = object()  # until_cut: the chunks ended
