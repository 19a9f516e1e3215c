"""A node's graceful shutdown: on SIGTERM (or Ctrl-C) it drains, then exits.

What routers, load balancers and clients see, in order:

1. The node leaves the directory at once (routers stop choosing it), ``/health`` answers 503
   "draining" (a readiness probe takes it out) and new completions get a 503 naming the
   shutdown (a router sends them to another node).
2. Requests in flight run to their end, for at most ``grace_s`` seconds.
3. Past it, or at a second signal, those still open are cut: a stream ends with an OpenAI
   error event (``data: {"error": ...}``, then ``data: [DONE]``), a non-streamed request gets
   a JSON 503, which a router retries on another node (its client has no token of it yet).
4. The HTTP server closes, the engine thread stops, and the process exits 0.

uvicorn alone gave in-flight requests 5 s and then cancelled them (a stream cut with no error
event, a non-streamed request a plain-text 500 that routers passed on), and it raised SIGTERM
again once stopped, which killed the process before it dropped its directory record.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
from collections.abc import Callable

import anyio.to_thread
import uvicorn

from kvjax.cluster.openai_api import RequestError

__all__ = ["DEFAULT_GRACE_S", "DrainingServer", "NodeDrain"]

DEFAULT_GRACE_S = 20.0
"""Seconds in-flight requests may run after SIGTERM: under Kubernetes' default 30 s before
SIGKILL, with room for the shutdown after it."""

_LOG = logging.getLogger(__name__)


class NodeDrain:
    """The node's open completions and, once the node is asked to stop, its drain (see the
    module docstring). Every method runs on the HTTP server's event loop."""

    def __init__(self, node_id: str, grace_s: float = DEFAULT_GRACE_S):
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not 0 <= grace_s < math.inf:
            raise ValueError(f"grace_s={grace_s!r} must be a finite number of seconds >= 0")
        self.node_id, self.grace_s = node_id, float(grace_s)
        self.reason: str | None = None  # why the node drains (e.g. "SIGTERM"); None while it serves
        self.cut: RequestError | None = None  # what requests still open were told when cut
        self._open: dict[str, tuple[asyncio.Queue, Callable[[], None]]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._now = asyncio.Event()  # a second signal: cut without waiting out the grace

    @property
    def draining(self) -> bool:
        return self.reason is not None

    @property
    def num_open(self) -> int:
        """Completions accepted and not answered to the end (a stream until its last chunk)."""
        return len(self._open)

    def open(self, request_id: str, events: asyncio.Queue, cancel: Callable[[], None]) -> None:
        """Count a completion as open until ``close``; a cut puts its error on ``events`` and
        calls ``cancel``. RequestError (503) while the node drains."""
        if self.draining:
            raise RequestError(f"node {self.node_id} is shutting down ({self.reason}) and takes no new requests; "
                               "send it to another node", status=503, kind="server_error")  # fmt: skip
        self._open[request_id] = (events, cancel)
        self._idle.clear()

    def close(self, request_id: str) -> None:
        """The completion is answered (or its client left); idempotent."""
        self._open.pop(request_id, None)
        if not self._open:
            self._idle.set()

    def cut_now(self) -> None:
        """End the wait for open requests now (a second signal)."""
        self._now.set()

    async def run(self, reason: str, leave_directory: Callable[[], None]) -> None:
        """Drain: refuse new requests, leave the directory (a Redis round trip, on a worker
        thread), wait up to ``grace_s`` for open requests, then cut those still open."""
        self.reason = reason
        _LOG.warning("node %s: %s: draining %d open request(s) for up to %g s", self.node_id, reason,
                     len(self._open), self.grace_s)  # fmt: skip
        await anyio.to_thread.run_sync(leave_directory)
        idle, now = asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._now.wait())
        try:
            await asyncio.wait([idle, now], timeout=self.grace_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            now.cancel()
        if self._open:
            why = "cut at a second signal" if self._now.is_set() else f"still open {self.grace_s:g} s after {reason}"
            self._cut(f"node {self.node_id} shut down before the request finished ({why}); no more tokens come")

    def _cut(self, message: str) -> None:
        self.cut = RequestError(message, status=503, kind="server_error")
        _LOG.warning("node %s: cutting %d open request(s)", self.node_id, len(self._open))
        for events, cancel in self._open.values():
            events.put_nowait(self.cut)  # wakes a handler waiting for its next event
            cancel()


class DrainingServer(uvicorn.Server):
    """uvicorn's server with ``drain`` before its shutdown: the first SIGTERM or SIGINT starts
    the drain, a second one cuts what is open, a third one stops without waiting. The signal
    is not raised again once the server stopped (uvicorn does that), so the node's clean-up
    after ``serve`` runs and the process exits 0."""

    def __init__(self, config: uvicorn.Config, drain: NodeDrain, leave_directory: Callable[[], None]):
        super().__init__(config)
        self.drain, self.leave_directory = drain, leave_directory
        self.signals: list[int] = []
        self._drain_task: asyncio.Future | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # a signal handler: only record it, the event loop acts on it at its next tick
        self.signals.append(sig)
        if len(self.signals) >= 3:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.signals and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain.run(signal.Signals(self.signals[0]).name,
                                                                    self.leave_directory))  # fmt: skip
        if len(self.signals) >= 2:
            self.drain.cut_now()
        if self._drain_task is not None and self._drain_task.done():
            if not self._drain_task.cancelled() and self._drain_task.exception() is not None:
                _LOG.error("node %s: the drain failed", self.drain.node_id, exc_info=self._drain_task.exception())
            self.should_exit = True
        return await super().on_tick(counter)
