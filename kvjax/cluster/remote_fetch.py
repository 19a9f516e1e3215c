"""A node's side of remote fetch as the requester: a prefix cached on another node serves here.

Per request, in three places:

1. the HTTP handler's thread, before the request reaches the engine (``find_peer``): one
   directory lookup of the prompt's block keys; the live peer (not suspect) holding the
   longest leading run, if it holds more than this node does;
2. the engine thread, when the request arrives there (``plan``): this node's own match
   (``KVCache.match``, every tier) and the cost model (``CostModel.remote_pages_to_fetch``)
   with the peer's measured link (``LinkEstimate``) decide how many pages past the local ones
   to pull rather than recompute; none, and the request goes straight to the engine. Else
   ``start`` queues the fetch on the transfer engine's remote link (DEMAND priority, a byte
   budget if the cache's engine has one) with a deadline of twice its expected seconds, and
   the request waits outside the engine (the others keep running);
3. the remote link's worker thread (the job): ask the peer for an offer over HTTP
   (``kvjax.cluster.remote_offers``), pull it (``RemoteTransport.pull``, abandoned at the
   deadline), check every key against this node's own chained keys of the prompt and every
   checksum, keep the leading run that passed, acknowledge the offer.

Back on the engine thread, ``finish`` turns the job into a ``FetchOutcome``: the verified
blocks, which the worker imports as host pages (``KVCache.import_pages``) before adding the
request, so the admission hits them like any host pages. Whatever went wrong, the request
goes on at once with what arrived (maybe nothing: a recompute), never later than its
deadline, and never with a block that failed a check.

A peer whose fetch timed out, failed, or sent a block that failed its check is suspect for
``suspect_s`` seconds: no fetch from it meanwhile. Only fetches that ended in time feed its
link estimate: a timeout measures nothing but the deadline, and counting it made the
estimate grow until the cost model never fetched from that peer again, so nothing could
bring it back down.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable

import httpx
import numpy as np

from kvjax.cache.block_keys import Namespace, as_namespace, chained_block_keys
from kvjax.cache.cost_model import CostModel
from kvjax.cluster.directory import Directory
from kvjax.cluster.remote_offers import OfferReply, OfferRequest
from kvjax.text.tokens import validate_tokens
from kvjax.tiers.kv_cache import KVCache
from kvjax.tiers.remote_transport import PullError, RemoteTransport, verified_blocks
from kvjax.tiers.transfer import PULL_ABANDONED, PULL_EXPIRED, Priority, TransferResult

__all__ = ["OUTCOMES", "FetchOutcome", "FetchPlan", "LinkEstimate", "PeerHealth", "PeerHint", "RemoteFetcher"]

OUTCOMES = ("ok", "partial", "empty", "timeout", "failed", "corrupt", "refused", "expired")
"""How a fetch ended: every page verified; some (a leading run) did; the peer offered none;
the deadline passed; the ask or the pull failed; a key or checksum did not match (nothing
from that block on is used); the peer answered 503; the deadline passed while the job was
still queued behind other fetches (not the peer's fault)."""
_SUSPICIOUS = ("timeout", "failed", "corrupt", "refused")
_RECENT = 1024  # fetch durations kept for the percentiles
_ASK_GRACE_S = 1.0  # past an ask's deadline, its thread stops waiting for the loop to cut it


@dataclasses.dataclass(frozen=True, slots=True)
class PeerHint:
    """The peer to ask: ``prefix_blocks`` leading blocks of the prompt it holds, against this
    node's ``own_blocks`` (both as the directory saw them)."""

    node_id: str
    address: str  # its HTTP base URL
    prefix_blocks: int
    own_blocks: int


class LinkEstimate:
    """One peer's link as measured: the ask's round trip (its offer included) and the pull
    bandwidth, exponentially weighted (``weight`` for each new sample), starting from the
    cost model's defaults. The latency a fetch is planned with is the smoothed one plus twice
    its mean deviation (as TCP sets its retransmission timer): a fetch's deadline is twice
    the expected time, and a link that jitters by more than its mean would otherwise time
    out on good peers and make them suspect."""

    def __init__(self, latency_s: float, bytes_per_s: float, weight: float = 0.25):
        self.smoothed_s, self.deviation_s = float(latency_s), float(latency_s) / 4
        self.bytes_per_s, self.weight = float(bytes_per_s), weight
        self.samples = 0

    @property
    def latency_s(self) -> float:
        return self.smoothed_s + 2 * self.deviation_s

    def observe(self, ask_s: float, pull_s: float, num_bytes: int) -> None:
        error = ask_s - self.smoothed_s
        self.smoothed_s += self.weight * error
        self.deviation_s += self.weight * (abs(error) - self.deviation_s)
        if num_bytes and pull_s > 0:
            self.bytes_per_s += self.weight * (num_bytes / pull_s - self.bytes_per_s)
        self.samples += 1


class PeerHealth:
    """Peers marked suspect, each until ``suspect_s`` seconds after its last failure."""

    def __init__(self, suspect_s: float, clock: Callable[[], float] = time.monotonic):
        if not suspect_s >= 0:
            raise ValueError(f"suspect_s={suspect_s!r} must be >= 0 seconds")
        self.suspect_s, self.clock = float(suspect_s), clock
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def mark(self, node_id: str) -> None:
        with self._lock:
            self._until[node_id] = self.clock() + self.suspect_s

    def is_suspect(self, node_id: str) -> bool:
        with self._lock:
            until = self._until.get(node_id)
            if until is not None and until <= self.clock():
                del self._until[node_id]
                until = None
            return until is not None


@dataclasses.dataclass(slots=True)
class FetchPlan:
    """One fetch: pages ``first_page .. first_page + num_pages - 1`` from ``peer``.

    ``expected_s``: its expected seconds by the link estimate; ``deadline``:
    ``time.monotonic()`` seconds it must end by (twice the expected time after ``started``).
    The job fills in the rest while it runs; the engine thread reads them once it is done.
    """

    peer: PeerHint
    first_page: int
    num_pages: int
    expected_s: float
    started: float
    deadline: float
    outcome: str = "failed"
    detail: str = ""
    ask_s: float = 0.0
    pull_s: float = 0.0
    tiers: tuple[str, ...] = ()  # where the peer read each offered page


@dataclasses.dataclass(frozen=True, slots=True)
class FetchOutcome:
    """A finished fetch, as the request reports it: ``blocks`` (``[n, *block_shape]`` in the
    codec's dtype, verified; None when nothing arrived), how it ended, how long the request
    waited for it and how long it was expected to take (seconds)."""

    plan: FetchPlan
    blocks: np.ndarray | None
    outcome: str
    waited_s: float

    @property
    def num_blocks(self) -> int:
        return 0 if self.blocks is None else len(self.blocks)


class RemoteFetcher:
    """The requester's side for one node (see the module docstring).

    ``cache``: the node's cache (its codec, host tier and transfer engine; fetches need a
    host tier); ``transport``: the node's transfer server; ``directory``: where peers are
    found; ``cost_model``: recompute and fetch costs (default the cache's).
    """

    def __init__(self, cache: KVCache, transport: RemoteTransport, directory: Directory, node_id: str, *,
                 cost_model: CostModel | None = None, suspect_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        if not cache.config.tiered or cache.transfer is None:
            raise ValueError("remote fetch needs a host tier: pulled pages join the cache as host pages")
        if cache.codec.lossy:
            raise ValueError(f"remote fetch needs a lossless codec; the cache's is {cache.codec.name}")
        self.cache, self.transport, self.directory, self.node_id = cache, transport, directory, node_id
        self.cost_model = cost_model or cache.cost_model
        self.page_size, self.codec = cache.page_size, cache.codec
        self.health = PeerHealth(suspect_s, clock)
        self.clock = clock
        self._links: dict[str, LinkEstimate] = {}
        self._http = httpx.Client(timeout=httpx.Timeout(5.0))
        self._acks = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvjax-offer-ack")
        # Asks run on one event loop: one cut at its deadline is cancelled there, which closes
        # its connection (httpx's timeout bounds each read, not the exchange: a thread reading a
        # peer's headers a byte at a time could not be let go, and a few such peers took every
        # ask thread, so asks to good peers timed out and made them suspect)
        self._loop = asyncio.new_event_loop()
        self._ask_http = httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="kvjax-offer-ask", daemon=True)
        self._loop_thread.start()
        self._closed = False
        self._lock = threading.Lock()
        self.counters = collections.Counter({outcome: 0 for outcome in OUTCOMES})
        self.counters.update(fetched_blocks=0, asked_blocks=0, lookups=0, lookup_errors=0)
        self.recent_seconds: collections.deque[float] = collections.deque(maxlen=_RECENT)

    # --- 1. the HTTP handler's thread ------------------------------------------------------

    def find_peer(self, tokens, namespace: Namespace | None) -> PeerHint | None:
        """The live, unsuspected peer holding the longest leading run of the prompt's
        blocks in ``namespace`` (the request's: tenant and salt; None: the default), if longer
        than this node's; None otherwise (or if the directory fails)."""
        if len(tokens) <= self.page_size:
            return None
        ns = as_namespace(namespace)
        keys = chained_block_keys(validate_tokens(tokens, None)[: len(tokens) - 1], self.page_size, ns)
        try:
            views = self.directory.lookup(ns.digest(), keys)
        except Exception:  # noqa: BLE001 - no directory, no fetch: the request recomputes
            self._count("lookup_errors")
            return None
        self._count("lookups")
        own = next((view.prefix_blocks for view in views if view.node_id == self.node_id), 0)
        peers = [view for view in views if view.node_id != self.node_id and view.prefix_blocks > own
                 and not self.health.is_suspect(view.node_id)]  # fmt: skip
        if not peers:
            return None
        best = max(peers, key=lambda view: (view.prefix_blocks, view.node_id))
        return PeerHint(best.node_id, best.address, best.prefix_blocks, own)

    # --- 2. the engine thread --------------------------------------------------------------

    def plan(self, hint: PeerHint, local_pages: int, num_tokens: int) -> FetchPlan | None:
        """How many pages past this node's ``local_pages`` to fetch from ``hint``'s peer for
        a prompt of ``num_tokens`` tokens; None to recompute them all."""
        if self.health.is_suspect(hint.node_id):
            return None
        usable = min(hint.prefix_blocks, (num_tokens - 1) // self.page_size, self.cache.tiers.host_capacity)
        link = self.link(hint.node_id)
        count = self.cost_model.remote_pages_to_fetch(local_pages, self.page_size, usable - local_pages,
                                                      self.codec.block_nbytes, latency_seconds=link.latency_s,
                                                      bytes_per_second=link.bytes_per_s)  # fmt: skip
        if count <= 0:
            return None
        expected = self.expected_seconds(hint.node_id, count)
        now = self.clock()
        return FetchPlan(hint, local_pages, count, expected, now, now + 2 * expected)

    def expected_seconds(self, node_id: str, num_pages: int) -> float:
        link = self.link(node_id)
        return self.cost_model.remote_seconds(num_pages, self.codec.block_nbytes, latency_seconds=link.latency_s,
                                              bytes_per_second=link.bytes_per_s)  # fmt: skip

    def start(self, plan: FetchPlan, tokens, namespace: Namespace | None) -> concurrent.futures.Future:
        """Queue ``plan`` on the remote link; the future resolves to its ``TransferResult``.
        ``namespace``: the request's (tenant and salt; None: the default): the peer offers,
        and this node accepts, only pages keyed under it."""
        namespace = as_namespace(namespace)
        prefix = np.asarray(tokens, np.int32)[: (plan.first_page + plan.num_pages) * self.page_size].copy()
        self._count("asked_blocks", plan.num_pages)
        return self.cache.transfer.pull_remote(lambda deadline: self._fetch(plan, prefix, namespace, deadline),
                                               plan.num_pages, self.codec.block_nbytes, deadline=plan.deadline,
                                               priority=Priority.DEMAND)  # fmt: skip

    def finish(self, plan: FetchPlan, result: TransferResult) -> FetchOutcome:
        """The outcome of a finished job: link estimate and peer health updated, counted."""
        waited = self.clock() - plan.started
        if result.ok:
            outcome, blocks = plan.outcome, result.blocks
        else:  # it never ran (queued past its deadline), ran past it (abandoned) or broke unexpectedly
            outcome, blocks = {PULL_EXPIRED: "expired", PULL_ABANDONED: "timeout"}.get(result.error, "failed"), None
            plan.detail = result.error if result.error in (PULL_EXPIRED, PULL_ABANDONED) else \
                plan.detail or result.error or ""  # fmt: skip
        if outcome in ("ok", "partial", "empty"):  # a timeout measures nothing: the peer is suspect instead
            self.link(plan.peer.node_id).observe(plan.ask_s, plan.pull_s, 0 if blocks is None else blocks.nbytes)
        if outcome in _SUSPICIOUS:  # "partial" and "empty": it evicted pages since it published them
            self.health.mark(plan.peer.node_id)
        with self._lock:
            self.counters[outcome] += 1
            self.counters["fetched_blocks"] += 0 if blocks is None else len(blocks)
            self.recent_seconds.append(waited)
        return FetchOutcome(plan, blocks, outcome, waited)

    def link(self, node_id: str) -> LinkEstimate:
        with self._lock:
            link = self._links.get(node_id)
            if link is None:
                model = self.cost_model
                link = self._links[node_id] = LinkEstimate(model.remote_latency_seconds, model.remote_bytes_per_second)
            return link

    def close(self) -> None:
        """Asks in flight end now (failed), as do any asked later: none waits out its deadline."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._acks.shutdown(wait=False)
        if self._loop.is_running():  # asks still open are cancelled with their connections
            closing = asyncio.run_coroutine_threadsafe(self._close_asks(), self._loop)
            with contextlib.suppress(Exception):
                closing.result(timeout=5.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=5.0)
        if not self._loop_thread.is_alive():
            self._loop.close()
        self._http.close()

    async def _close_asks(self) -> None:
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await self._ask_http.aclose()

    # --- 3. the remote link's worker thread ------------------------------------------------

    def _fetch(self, plan: FetchPlan, prefix: np.ndarray, ns: Namespace, deadline: float) -> np.ndarray | None:
        """Ask, pull, verify (see the module docstring); sets ``plan``'s outcome and timings
        and returns the verified blocks (None when none arrived)."""
        start = time.monotonic()
        request = OfferRequest(ns, prefix, plan.first_page, plan.num_pages, self.cache.page_identity,
                               self.codec.block_nbytes, max(0.0, deadline - start))  # fmt: skip
        try:
            reply = self._ask(plan.peer.address, request, deadline)
        except _AskFailed as failure:
            plan.outcome, plan.detail = failure.outcome, str(failure)
            return None
        plan.ask_s = time.monotonic() - start
        plan.tiers = reply.tiers
        if reply.num_pages == 0:
            plan.outcome, plan.detail = "empty", reply.reason
            return None
        if reply.num_pages > plan.num_pages or reply.block_nbytes != self.codec.block_nbytes:
            plan.outcome = "corrupt"
            plan.detail = f"offered {reply.num_pages} pages of {reply.block_nbytes} B for {plan.num_pages} asked"
            return None
        pulled_at = time.monotonic()
        try:
            payload = self.transport.pull(reply.address, reply.offer_id, reply.num_pages, reply.block_nbytes, deadline)
        except PullError as error:
            plan.outcome, plan.detail = error.reason, str(error)
            return None
        plan.pull_s = time.monotonic() - pulled_at
        self._acks.submit(self._ack, plan.peer.address, reply.offer_id)
        keys = chained_block_keys(prefix, self.page_size, ns)[plan.first_page : plan.first_page + reply.num_pages]
        good = verified_blocks(ns.digest(), keys, payload, reply.checksums) if list(reply.keys) == keys else 0
        if list(reply.keys) != keys:
            plan.detail = "the peer's keys are not this prompt's"
        if good < reply.num_pages:
            plan.outcome = "corrupt"
            plan.detail = plan.detail or f"block {plan.first_page + good} failed its checksum"
        else:
            plan.outcome = "ok" if reply.num_pages == plan.num_pages else "partial"
        if good == 0:
            return None
        return payload[:good].view(self.codec.dtype).reshape(good, *self.codec.block_shape)

    def _ask(self, address: str, request: OfferRequest, deadline: float) -> OfferReply:
        """The peer's offer, or _AskFailed by ``deadline``: the exchange runs on the ask loop
        and is cancelled there at the deadline, its connection closed."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _AskFailed("timeout", "no time left to ask")
        late = _AskFailed("timeout", f"{address} did not answer the ask within {remaining:.3f}s")
        closed = _AskFailed("failed", f"the ask to {address} was cut: this fetcher is closed")
        coroutine = self._exchange(address, request, deadline, late)
        try:
            with self._lock:  # not once close() began: its loop may stop before this ask would run
                if self._closed:
                    raise closed
                exchange = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        except _AskFailed:
            coroutine.close()
            raise
        # The loop cuts the ask at the deadline; this thread waits a little longer, and cancels it
        # itself only if the loop is too late for that (a busy loop): cancelled by both at once,
        # one loop turn apart, the ask's connection stayed open (see _exchange)
        try:
            return exchange.result(timeout=remaining + _ASK_GRACE_S)
        except concurrent.futures.TimeoutError:
            exchange.cancel()
            raise late from None
        except concurrent.futures.CancelledError:  # close() cancelled it
            raise closed from None

    async def _exchange(self, address: str, request: OfferRequest, deadline: float, late: _AskFailed) -> OfferReply:
        # The HTTP exchange runs in a task of its own that is cancelled once, however often this
        # one is: httpcore closes a cancelled request's connection in its cleanup, but a second
        # cancel during that cleanup (the deadline's and the asking thread's, a loop turn apart)
        # broke it off, and the connection stayed open in the pool with the peer still sending
        post = asyncio.ensure_future(self._ask_http.post(f"{address}/kv/offer", json=request.to_json(),
                                                         timeout=max(deadline - time.monotonic(), 1e-3)))  # fmt: skip
        try:
            # the whole exchange, headers and body, by the deadline (the loop's clock is time.monotonic)
            async with asyncio.timeout_at(deadline):
                response = await asyncio.shield(post)
        except BaseException as error:
            await _cancel_once(post)
            if isinstance(error, (TimeoutError, httpx.TimeoutException)):
                raise late from None
            # InvalidURL: a peer address that is no URL (no HTTPError); RuntimeError: a client close() shut meanwhile
            if isinstance(error, (httpx.HTTPError, httpx.InvalidURL, RuntimeError)):
                raise _AskFailed("failed", f"{address}: {type(error).__name__}: {error}") from None
            raise
        text = response.content[:200].decode(errors="replace")
        if response.status_code == 503:
            raise _AskFailed("refused", f"{address} refused: {text}")
        if response.status_code != 200:
            raise _AskFailed("failed", f"{address} answered {response.status_code}: {text}")
        try:
            return OfferReply.from_json(json.loads(response.content))
        except ValueError as error:  # json's errors are ValueErrors too
            raise _AskFailed("corrupt", f"{address}: {error}") from None

    def _ack(self, address: str, offer_id: int) -> None:
        try:
            self._http.post(f"{address}/kv/ack", json={"offer_id": offer_id}, timeout=2.0)
        except httpx.HTTPError:
            pass  # the peer reclaims the offer itself; it was pulled, so that wait is abandoned there

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount


async def _cancel_once(task: asyncio.Task) -> None:
    """Cancel ``task`` (if not done) and wait until it ended, whatever cancels the caller
    meanwhile: the caller's cancellation is raised once the task ended."""
    task.cancel()
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])  # a cancel of the caller ends this wait, not the task
        except asyncio.CancelledError:
            cancelled = True
    if not task.cancelled():
        task.exception()  # retrieved: asyncio logs an exception no one retrieved
    if cancelled:
        raise asyncio.CancelledError


class _AskFailed(Exception):
    def __init__(self, outcome: str, message: str):
        super().__init__(message)
        self.outcome = outcome
