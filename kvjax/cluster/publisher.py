"""A node's side of the directory: registration, heartbeat and block events, on one thread.

The node's engine loop hands over each step's event batches and the node's load with
``submit`` and never waits on Redis. The publisher folds the events into its own copy of
what the node holds (block -> tier mask), and per wake-up writes what changed, the batches of
every step since the last write together, in one transaction (``Directory.write_blocks``).

Failures and what follows them:

* Redis unreachable, or a call that failed: the publisher keeps folding events in (its
  memory stays what the node holds, however long Redis is away; the blocks changed since
  their last successful write are remembered), logs it once, and retries after a wait that
  doubles per failure up to ``heartbeat_s``. When Redis answers again a heartbeat comes
  first: if it finds the same server and the node's record of this epoch (a timed-out
  command, a dropped connection: Redis lost nothing), the publisher writes the blocks changed
  since and goes on; otherwise it resyncs: it registers a new epoch and writes everything it
  holds (so nothing written under the old epoch, complete or not, is read again). A failure
  in the middle of a resync is followed by another resync. Blocks changed while Redis is
  away are remembered up to as many as a resync writes; past that it resyncs.
* Its record gone (it expired, or Redis restarted empty): the heartbeat says so; a resync,
  which is how a lost Redis is rebuilt from the nodes.
* Redis back with older data (restarted from a snapshot, or a replica took over) without any
  call failing: the heartbeat sees another server (``Directory.server_id``); a resync,
  or the writes the server lost would stay lost (blocks held and not listed, blocks listed
  and long gone).
* A newer epoch of the same node id registered (a second process claiming the id): this one
  stops writing (``status`` "superseded", ``successor`` the newer record as read then); the
  node stops serving (``kvjax.cluster.node_server``): the directory no longer lists it.
* The cache's subscription lost batches: the node calls ``reset`` with the cache's full
  holdings (a fresh ``KVCache.subscribe()``'s ``initial``), then a resync: the only case
  where events were lost (the publisher itself drops none).
* Closed (``close``): the node's record is dropped at once (``Directory.deregister``), whatever
  the publisher's state, and a registration the thread was still making when close gave up
  waiting for it is dropped by the thread itself; without Redis, close returns once its
  calls time out (the client's timeouts).

What the node's eviction policy learned (``submit_learned``: a JSON-safe mapping, e.g.
``ReuseStatistics.as_dict()``) is written at each heartbeat, and the peers' latest records
read back (``Directory.peers_learned``: live epochs only); ``take_peers_learned`` hands
them to the node's engine thread, which merges them into its policy.

Block entries carry a TTL; the heartbeat writes a slice of the held blocks again each time so
that every one is refreshed (and restored, if Redis lost it) twice per ``block_ttl_s`` and
entries nobody live holds expire.

Dropped first blocks: a block stored with no parent (a sequence's first page) that leaves the
node's last tier is written as a dropped mark with the time (``Directory.write_blocks``); the
publisher remembers the marks of the last ``block_ttl_s`` (at most ``_MAX_MARKS``, newest
kept) and writes them again under every new epoch, so a Redis blip or restart does not erase
where prefixes were last seen. First blocks among the holdings given at start or to ``reset``
are not known as such (holdings carry no parents) and are not marked when they leave.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence

import redis

from kvjax.cache.block_events import BlockEvent
from kvjax.cluster.directory import TIER_BITS, ClusterInfo, Directory, NodeLoad, NodeView

__all__ = ["DirectoryPublisher", "describe_successor"]

_LOG = logging.getLogger(__name__)
_FULL_PUBLISH_CHUNK = 2000  # blocks per transaction when writing everything (bounded latency)
_FIRST_RETRY_S = 0.1  # the wait after a failed call to Redis; it doubles per failure, up to heartbeat_s
_MAX_MARKS = 65536  # dropped first blocks remembered for a resync (the newest)
_CLOSE_WAIT_S = 5.0  # close waits this long for the thread's Redis call in progress
_Block = tuple[bytes, bytes]


class DirectoryPublisher:
    """Publishes one node's holdings and load into ``directory`` (see the module docstring).

    ``holdings``: what the cache holds when publishing starts, as ``(namespace, key, tier)``
    (``BlockIndex.entries()``); events submitted afterwards must follow it. ``heartbeat_s``
    defaults to a third of the directory's node TTL.
    """

    def __init__(self, directory: Directory, node_id: str, address: str, cluster: ClusterInfo,
                 holdings: Iterable[tuple[bytes, bytes, str]] = (), *,
                 heartbeat_s: float | None = None):  # fmt: skip
        self.directory, self.node_id, self.address, self.cluster = directory, node_id, address, cluster
        self.heartbeat_s = directory.node_ttl_s / 3 if heartbeat_s is None else float(heartbeat_s)
        if not 0 < self.heartbeat_s < directory.node_ttl_s:
            raise ValueError(f"heartbeat_s={heartbeat_s!r} must be > 0 and below node_ttl_s={directory.node_ttl_s}")
        self.epoch: int | None = None
        self.status = "starting"  # registered | disconnected | superseded | closed
        self.successor: NodeView | None = None  # the newer process of this id, once superseded
        self.last_error: str | None = None
        self.counters = {"published_batches": 0, "published_blocks": 0, "resyncs": 0, "errors": 0}
        self._holdings: dict[_Block, int] = {}
        self._first_blocks: set[_Block] = set()  # held blocks stored with no parent (a sequence's first)
        self._marks: dict[_Block, int] = {}  # first blocks dropped in the last block_ttl_s -> unix ms, oldest first
        self._fold_entries(holdings)
        self._lock = threading.Lock()
        self._pending: list[tuple[BlockEvent, ...]] = []
        self._pending_reset: list[tuple[bytes, bytes, str]] | None = None
        self._ended = False  # the thread stopped (closed, superseded, or the cluster record disagrees)
        self._load = NodeLoad()
        self._written_load: NodeLoad | None = None
        self._needs_resync = True
        self._unverified = False  # a call failed since: check Redis kept the node's state before writing on
        self._unwritten: set[_Block] = set()  # changed since their last successful write (or resync)
        self._latest_epoch: int | None = None  # registered last (self.epoch: once its blocks are written)
        self._close_lock = threading.Lock()
        self._closed = False
        self._leave_on_stop = False  # close deregisters: so does the thread, of an epoch it registers after
        self._server_id: str | None = None  # the Redis server the last resync wrote to
        self._refresh_queue: list[_Block] = []
        self._refresh_count = 0  # blocks of the queue refreshed per heartbeat
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._registered = threading.Event()
        self._fatal: BaseException | None = None
        self._learned: dict | None = None  # the node's latest statistics, to write at the heartbeat
        self._peers_learned: dict[str, dict] | None = None  # read at the last heartbeat, not taken yet
        self._thread = threading.Thread(target=self._run, name=f"kvjax-publisher-{node_id}", daemon=True)

    # --- the node's calls (any thread) -----------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> int:
        """Start the thread and wait for the first registration; returns the epoch.

        ValueError if the cluster record disagrees (another model or page size);
        RuntimeError naming the last Redis error if registering took longer than
        ``timeout_s``. Either way the thread is stopped.
        """
        self._thread.start()
        self._registered.wait(timeout_s)
        if self._fatal is not None or self.epoch is None:
            self.close(deregister=False)
            if isinstance(self._fatal, ValueError):
                raise self._fatal
            raise RuntimeError(f"node {self.node_id!r} could not register in the directory within "
                               f"{timeout_s}s: {self.last_error}")  # fmt: skip
        return self.epoch

    def submit(self, batches: Sequence[tuple[BlockEvent, ...]], load: NodeLoad | None = None) -> None:
        """Queue a step's event batches (oldest first) and the node's current load; nothing
        once the publisher stopped."""
        with self._lock:
            if self._ended:  # nobody would take them: kept, they grew at every step
                return
            self._pending.extend(batches)
            if load is not None:
                self._load = load
        self._wake.set()

    def reset(self, holdings: Iterable[tuple[bytes, bytes, str]]) -> None:
        """Replace what the node holds (the cache's full holdings, after its subscription lost
        batches; batches submitted before this call are dropped) and publish it afresh."""
        with self._lock:
            if self._ended:
                return
            self._pending_reset = list(holdings)
            self._pending.clear()
        self._wake.set()

    def submit_learned(self, statistics: dict) -> None:
        """The node's latest learned statistics (JSON-safe), written at the next heartbeat."""
        with self._lock:
            self._learned = statistics

    def take_peers_learned(self) -> dict[str, dict] | None:
        """The peers' statistics read at the last heartbeat (node id -> mapping), once; None
        when nothing new was read since the last call."""
        with self._lock:
            peers, self._peers_learned = self._peers_learned, None
        return peers

    def close(self, deregister: bool = True) -> None:
        """Stop the thread; with ``deregister`` drop the node's record so routers stop
        choosing it now rather than after its TTL, whatever the publisher's state (a failed
        call leaves the record in place). Best effort: without Redis it gives up after the
        client's timeouts. Once: a second call, or one from another thread at the same time,
        returns once the first is done."""
        with self._close_lock:
            if self._closed:
                return
            self._closed, self._leave_on_stop = True, deregister  # before the stop, which the thread reads after
            self._stop.set()
            self._wake.set()
            if self._thread.is_alive() and self._thread is not threading.current_thread():
                self._thread.join(timeout=_CLOSE_WAIT_S)
            # a thread still running registers no epoch after this read without dropping it itself (_resync)
            epoch = self._latest_epoch
            if deregister and epoch is not None and self.status != "superseded":
                self._leave(epoch)
            self.status = "closed"

    @property
    def num_blocks(self) -> int:
        """Blocks the node holds in at least one tier, as the publisher knows them."""
        return len(self._holdings)

    # --- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._publish_until_stopped()
        finally:
            with self._lock:
                self._ended = True
                self._pending, self._pending_reset = [], None

    def _publish_until_stopped(self) -> None:
        next_heartbeat = time.monotonic()
        retry_at, backoff = 0.0, 0.0  # after a failure: no call to Redis before retry_at
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_heartbeat - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                break
            load = self._drain()
            if time.monotonic() < retry_at:  # the events are folded in, their blocks in _unwritten
                continue
            try:
                if self._unverified and not self._needs_resync:
                    next_heartbeat = time.monotonic() + self.heartbeat_s
                    self._heartbeat(load)  # another server or no record of this epoch: a resync
                    self._unverified = False
                    if not self._needs_resync and self.status == "disconnected":
                        _LOG.info("node %s: the directory answers again and kept epoch %d; writing the %d blocks "
                                  "changed since", self.node_id, self.epoch, len(self._unwritten))  # fmt: skip
                        self.status, self.last_error = "registered", None
                if self.status != "superseded":
                    if self._needs_resync:
                        self._resync(load)
                    elif self._unwritten or load != self._written_load:
                        self._write_unwritten(load)
                    if time.monotonic() >= next_heartbeat:
                        next_heartbeat = time.monotonic() + self.heartbeat_s
                        self._heartbeat(load)
                backoff = 0.0
            except ValueError as error:  # the cluster record disagrees: nothing to retry
                self._fatal, self.last_error, self.status = error, str(error), "disconnected"
                self._registered.set()
                return
            except redis.RedisError as error:
                self.counters["errors"] += 1
                self.last_error = f"{type(error).__name__}: {error}"
                if self.status != "disconnected":
                    _LOG.warning("node %s: directory write failed (%s); will retry", self.node_id, error)
                # what Redis kept is checked before anything else is written (or all of it is)
                self.status, self._unverified = "disconnected", True
                # each engine step wakes the thread: without a wait, one failed attempt per step
                backoff = min(self.heartbeat_s, max(_FIRST_RETRY_S, 2 * backoff))
                retry_at = next_heartbeat = time.monotonic() + backoff
            if self.status == "superseded":
                _LOG.error("node %s: a newer process registered the same id (%s); this one stops publishing and "
                           "serving", self.node_id, describe_successor(self.successor))  # fmt: skip
                return

    def _drain(self) -> NodeLoad:
        """Fold the queued events into the holdings (the changed blocks into ``_unwritten``,
        the first blocks among them that left the node into the marks, with the time); returns
        the load."""
        with self._lock:
            batches, self._pending = self._pending, []
            reset, self._pending_reset = self._pending_reset, None
            load = self._load
        if reset is not None:
            self._holdings.clear()
            # holdings carry no parents: the first blocks among them are not known, and are not
            # marked when they leave (a routing hint lost, nothing wrong)
            self._first_blocks.clear()
            self._fold_entries(reset)
            for block in self._holdings:  # held again: a mark written after its mask would hide it
                self._marks.pop(block, None)
            self._needs_resync = True
        changed: set[_Block] = set()
        for batch in batches:
            self.counters["published_batches"] += 1
            for event in batch:
                self._fold_event(event, changed)
        masks = {block: self._holdings.get(block, 0) for block in changed}
        now_ms = max(1, int(time.time() * 1000))
        dropped = {block: now_ms for block, mask in masks.items() if not mask and block in self._first_blocks}
        self._first_blocks.difference_update(dropped)
        marks = self._marks
        for block, mask in masks.items():
            if mask:
                marks.pop(block, None)  # held again: its entry is a mask now
        for block in dropped:
            marks.pop(block, None)
            marks[block] = now_ms  # newest last
        oldest = now_ms - self.directory.block_ttl_s * 1000
        while marks and (len(marks) > _MAX_MARKS or next(iter(marks.values())) < oldest):
            del marks[next(iter(marks))]
        self._unwritten.update(changed)
        if self._unverified and len(self._unwritten) > len(self._holdings) + len(marks):
            # while Redis is away: a resync writes no more, and the set stops growing
            self._needs_resync = True
            self._unwritten.clear()
        return load

    def _write_unwritten(self, load: NodeLoad) -> None:
        """Write the entries of the blocks changed since their last write (their masks now, or
        their marks), and the load, in one transaction."""
        masks = {block: self._holdings.get(block, 0) for block in self._unwritten}
        dropped = {block: self._marks[block] for block, mask in masks.items() if not mask and block in self._marks}
        self.directory.write_blocks(self.node_id, self.epoch, masks, load, dropped=dropped)
        self._unwritten = set()
        self._written_load = load
        self.counters["published_blocks"] += len(masks)

    def _fold_event(self, event: BlockEvent, changed: set[_Block]) -> None:
        bit = TIER_BITS[event.tier]
        if event.kind == "cleared":
            for block, mask in list(self._holdings.items()):
                if mask & bit:
                    changed.add(block)
                    self._set_mask(block, mask & ~bit)
            return
        block = (event.namespace, event.key)
        if event.parent is None and event.kind == "stored":
            self._first_blocks.add(block)
        mask = self._holdings.get(block, 0)
        self._set_mask(block, mask | bit if event.kind == "stored" else mask & ~bit)
        changed.add(block)

    def _fold_entries(self, entries: Iterable[tuple[bytes, bytes, str]]) -> None:
        for namespace, key, tier in entries:
            block = (namespace, key)
            self._holdings[block] = self._holdings.get(block, 0) | TIER_BITS[tier]

    def _set_mask(self, block: _Block, mask: int) -> None:
        if mask:
            self._holdings[block] = mask
        else:
            self._holdings.pop(block, None)

    def _resync(self, load: NodeLoad) -> None:
        """Register a new epoch and write everything held under it (unless closed meanwhile)."""
        server = self.directory.server_id()  # before: a server that restarts meanwhile is seen next time
        epoch = self._latest_epoch = self.directory.register(self.node_id, self.address, self.cluster)
        if self._stop.is_set():  # close may have read _latest_epoch before it changed: leave here too
            if self._leave_on_stop:
                self._leave(epoch)
            return
        items = list(self._holdings.items())
        for start in range(0, max(len(items), 1), _FULL_PUBLISH_CHUNK):
            if self._stop.is_set():  # closing: the rest is not worth the wait
                return
            chunk = dict(items[start : start + _FULL_PUBLISH_CHUNK])
            self.directory.write_blocks(self.node_id, epoch, chunk, load if start == 0 else None)
        marks = list(self._marks.items())  # written again under the new epoch
        for start in range(0, len(marks), _FULL_PUBLISH_CHUNK):
            chunk = dict(marks[start : start + _FULL_PUBLISH_CHUNK])
            self.directory.write_blocks(self.node_id, epoch, dict.fromkeys(chunk, 0), dropped=chunk)
        self.epoch, self._written_load, self._needs_resync = epoch, load, False
        self._unverified, self._unwritten = False, set()
        self._server_id = server
        self._refresh_queue = []
        self.counters["resyncs"] += 1
        self.counters["published_blocks"] += len(items)
        if self.status != "registered":
            _LOG.info("node %s: registered epoch %d with %d blocks", self.node_id, epoch, len(items))
        self.status, self.last_error = "registered", None
        self._registered.set()

    def _heartbeat(self, load: NodeLoad) -> None:
        server = self.directory.server_id()
        if server != self._server_id:  # first: a snapshot's record may hold an older epoch
            _LOG.warning("node %s: the directory's Redis is another server now (run id %s -> %s: restarted or "
                         "failed over, maybe with older data); re-registering", self.node_id, self._server_id, server)
            self._needs_resync = True
            self._wake.set()
            return
        status = self.directory.heartbeat(self.node_id, self.epoch, load)
        if status == "gone":
            _LOG.warning("node %s: its directory record is gone; re-registering", self.node_id)
            self._needs_resync = True
            self._wake.set()
            return
        if status == "superseded":
            self.successor = self._read_successor()  # before the status: readers of one expect the other
            self.status = "superseded"
            return
        self._written_load = load
        self._refresh_slice()
        with self._lock:
            learned = self._learned
        if learned is not None:
            self.directory.write_learned(self.node_id, self.epoch, learned)
            peers = self.directory.peers_learned(self.node_id)
            with self._lock:
                self._peers_learned = peers

    def _leave(self, epoch: int) -> None:
        try:
            self.directory.deregister(self.node_id, epoch)
        except redis.RedisError as error:
            _LOG.warning("node %s: deregister failed (its record expires within %s s): %s", self.node_id,
                         self.directory.node_ttl_s, error)  # fmt: skip

    def _read_successor(self) -> NodeView | None:
        """The record that superseded this node (None if it is gone too, or Redis fails: a
        RedisError here would make the thread register again and take the id back)."""
        try:
            return next((view for view in self.directory.live_nodes() if view.node_id == self.node_id), None)
        except redis.RedisError:
            return None

    def _refresh_slice(self) -> None:
        """Write the next slice of held blocks again, which extends their TTL (all of them every
        block_ttl_s / 2): an entry Redis lost meanwhile (a key evicted under memory pressure,
        or deleted) comes back, where extending the TTL alone left it lost."""
        if not self._refresh_queue:
            self._refresh_queue = list(self._holdings)
            rounds = max(1.0, self.directory.block_ttl_s / 2 / self.heartbeat_s)
            # sized by the queue, not the holdings now: after a mass eviction it still drains in time
            self._refresh_count = math.ceil(len(self._refresh_queue) / rounds)
        count = self._refresh_count
        # a block that left is not ours to write (its removal, or mark, was written already)
        held = {block: self._holdings[block] for block in self._refresh_queue[:count] if block in self._holdings}
        if held:
            self.directory.write_blocks(self.node_id, self.epoch, held)
        self._refresh_queue = self._refresh_queue[count:]  # once written: a failed write is tried again


def describe_successor(successor: NodeView | None) -> str:
    """The newer process of a node id, as messages name it."""
    if successor is None:
        return "which has left the directory since"
    return f"epoch {successor.epoch} at {successor.address}"
