"""Moving pages between the tiers for ``KVCache``: copies down, fetches up, progress.

Down (device -> host -> disk):

* ``offload(node, indices)`` copies device pages to host (write-through at commit);
  ``write_back(kept)`` copies the blocks of pages an eviction kept indexed with a HOST bit.
  The pool gather is issued at once, so the block may be reused right after; the page has
  its HOST bit from the start (a pending copy) so eviction keeps it indexed, and a fetch of
  it waits for the copy to finish.
* ``spill_host()`` copies host pages without a disk copy to disk when host memory passes its
  high watermark (and everything on ``flush``); they stay on host, now cheap to evict. When
  host room is needed before the background spill reached a victim, ``make_host_room``
  writes it to disk on the spot (back-pressure), so no page is lost for a slow writer.

Up (disk -> host -> device): ``start_fetch`` builds ``FetchJob``s for a ``Waiter`` (see
``kv_cache_fetch``), joining jobs already in flight for the same pages.

Blocks travel encoded by the cache's codec (``kvjax.tiers.block_codec``): the transfer engine's
gather encodes them, and a fetch's blocks are decoded here before they are scattered.

Completions are handled only in ``poll`` (the caller's thread): transfer workers resolve
futures, never touch the trie or the pool. ``poll`` returns the waiters whose fetches all
finished; the cache commits their pages (the mover never touches a sequence's handle
beyond scattering into its blocks). What the transfers did (latencies, failures, spills) is
added up in ``report`` for the cache to hand to its observer.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from kvjax.cache.trie_node import Node, Tier
from kvjax.tiers.block_codec import BlockCodec
from kvjax.tiers.fetch_jobs import FetchJob, Waiter, resolved_future
from kvjax.tiers.page_pool import PagePool
from kvjax.tiers.tier_index import TierIndex
from kvjax.tiers.transfer import Priority, TransferResult, move_batches, wait_any
from pallas_kernels.kv_format import QuantizedPages

__all__ = ["TierMover", "TierReport"]

_HOST, _DISK = int(Tier.HOST), int(Tier.DISK)


@dataclasses.dataclass(slots=True)
class TierReport:
    """What the tiers did since the last ``KVCache.poll``: fetch latencies (seconds) by the
    tier their slowest page came from, fetches that delivered fewer pages than planned, new
    disk errors (write, checksum, read), and blocks and bytes copied down each link."""

    fetch_seconds: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    fetch_failures: int = 0
    disk_errors: int = 0
    spilled: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # link -> (blocks, bytes)

    def add_spill(self, link: str, blocks: int, num_bytes: int) -> None:
        old = self.spilled.get(link, (0, 0))
        self.spilled[link] = (old[0] + blocks, old[1] + num_bytes)


class TierMover:
    """Submits transfers and applies their results; see the module docstring."""

    def __init__(self, trie, pool: PagePool, index: TierIndex, transfer, high_watermark: float,
                 low_watermark: float, codec: BlockCodec):  # fmt: skip
        self.trie, self.pool, self.index, self.transfer = trie, pool, index, transfer
        self.codec = codec
        self.block_nbytes = codec.block_nbytes  # bytes a block moves and takes below the device
        self.spill_high = int(high_watermark * index.host_capacity)
        self.spill_low = int(low_watermark * index.host_capacity)
        self.waiters: dict[int, Waiter] = {}  # seq_id -> waiter
        self.jobs: dict[bytes, tuple[FetchJob, int]] = {}  # key in flight -> (job, row)
        self.copies: dict[bytes, concurrent.futures.Future] = {}  # pending host copies
        self.live_jobs: dict[int, FetchJob] = {}  # id -> every job not finished
        self.spills: dict[int, list[bytes]] = {}  # id -> host keys of a host -> disk copy in flight
        self.counts = dict(offloaded=0, spilled=0, pressure_spilled=0, fetch_failures=0, disk_errors=0)
        self.report = TierReport()
        self.finished: list[Waiter] = []  # waiters whose fetches all ended, for the cache
        self._callbacks: list[tuple[concurrent.futures.Future, Callable]] = []
        self.applied = 0  # finished transfers applied so far (each may split or drop trie nodes)
        self._disk_errors_seen = 0

    # --- progress --------------------------------------------------------------------------

    def poll(self) -> list[Waiter]:
        """Apply every finished transfer (and what it unblocks) without waiting; return the
        waiters whose fetches all ended since the last call."""
        while self._callbacks:
            done, waiting = [], []
            for item in self._callbacks:
                (done if item[0].done() else waiting).append(item)
            if not done:
                break
            self._callbacks = waiting  # callbacks below may append to it
            self.applied += len(done)
            for future, callback in done:
                callback(future.result())
        finished, self.finished = self.finished, []
        return finished

    def wait_any(self, timeout: float) -> None:
        """Block until some transfer finishes or ``timeout`` seconds pass (one next in line on
        an idle link runs on this thread meanwhile: ``kvjax.tiers.transfer.wait_any``)."""
        futures = [future for future, _ in self._callbacks]
        if futures:
            wait_any(futures, timeout)

    @property
    def busy(self) -> bool:
        return bool(self._callbacks)

    def check_invariants(self, live_handles: dict) -> None:
        """Raise RuntimeError unless holds on host blocks equal the transfers reading them and
        every waiting sequence is live, uncommitted past its device hits, and its jobs exist.
        ``live_handles``: seq_id -> handle of the device index's live sequences."""
        holds = collections.Counter()
        for job in self.live_jobs.values():
            holds.update(job.held)
        for keys in self.spills.values():
            holds.update(keys)
        for key, entry in self.index.host_entries.items():
            if entry.busy != holds[key]:
                raise RuntimeError(f"host block {key.hex()[:8]} is read by {holds[key]} transfers "
                                   f"but held {entry.busy} times")  # fmt: skip
        for waiter in self.waiters.values():
            handle = waiter.handle
            if handle.alive and (handle._committed != waiter.first or live_handles.get(handle.seq_id) is not handle):
                raise RuntimeError(f"sequence {handle.seq_id} committed pages it is still fetching")
            if any(job.valid is None and id(job) not in self.live_jobs for job, *_ in waiter.segments):
                raise RuntimeError(f"sequence {handle.seq_id} waits for a job that is gone")

    # --- down: device -> host -> disk --------------------------------------------------------

    def offload(self, node: Node, indices: list[int]) -> int:
        """Start host copies of device pages ``indices`` of ``node`` that have none; return
        how many got one (the leading ones, as host room allows)."""
        keys = self.trie.page_keys(node)
        index = self.index
        todo = []
        for i in indices:
            entry = index.host_entries.get(keys[i])
            if entry is None:
                todo.append(i)
            elif entry.dropped and not entry.handed:  # its old page left the trie, the copy is still good
                index.add_host(keys[i], entry.namespace, node, i, ready=entry.ready)
        if not todo:
            return 0
        todo = todo[: self.make_host_room(len(todo), exclude=[keys[i] for i in todo])]
        if not todo:
            return 0
        namespace = self.trie.namespace_of(node).digest()
        for i in todo:
            index.add_host(keys[i], namespace, node, i, ready=False)
        self._copy_down([keys[i] for i in todo], node.blocks[todo], namespace)
        return len(todo)

    def write_back(self, kept: list[tuple[bytes, int]], exclude: list[bytes], fetching: list[bytes] = ()) -> None:
        """Host copies of the pages an eviction kept indexed with a HOST bit (``(key, old
        block)``), while their blocks still hold their KV. Pages host room cannot take (or
        that left the trie meanwhile) lose the bit again. ``exclude``: host copies to keep.

        ``fetching``: pages a fetch to the device has just started reading from host (the
        admission that made this eviction). Where host room runs short, a kept page takes
        the slot of one of them (``TierIndex.hand_over``), written once the fetch has read
        it: that copy is about to be a duplicate of a device page, and keeping it would cost
        an older page its place (device and host together then hold as many pages as one
        cache of their total size would)."""
        index, trie = self.index, self.trie
        short = len(kept) - (index.host_capacity - index.host_used)
        sources = self._slots_to_hand_over(fetching)[:short] if short > 0 and fetching else []
        promised = index.promised_dependents([key for key, _ in kept])  # a disk making room keeps their prefix
        try:
            fit = self.make_host_room(len(kept) - len(sources), exclude=exclude)
        finally:
            index.release_promised(promised)
        if fit + len(sources) < len(kept):  # less room than the eviction counted on: see _nearest_first
            kept = self._nearest_first(kept)
        by_namespace: dict[bytes, tuple[list[bytes], list[int], list]] = {}
        for row, (key, block) in enumerate(kept):
            located = trie.locate(key)
            if located is None:  # making room dropped the page (a host copy before it went)
                continue
            after = None
            # a page whose dropped copy is still in flight adopts its slot: no room or hand-over
            if (row >= fit or index.is_handed(key)) and not index.is_adoptable(key):
                if not sources or index.is_handed(key):
                    index.forget_dropped(trie.clear_tier(*located, Tier.HOST))
                    continue
                source, after = sources.pop()
            namespace = trie.namespace_of(located[0]).digest()
            if after is None:
                index.add_host(key, namespace, *located, ready=False)
            else:
                index.hand_over(source, key, namespace, *located)
            group = by_namespace.setdefault(namespace, ([], [], []))
            group[0].append(key)
            group[1].append(block)
            if after is not None:
                group[2].append(after)
        for namespace, (keys, blocks, after) in by_namespace.items():
            self._copy_down(keys, np.asarray(blocks), namespace, after=list({id(f): f for f in after}.values()))

    def _nearest_first(self, kept: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        """``kept`` pages nearest the root first, so the pages ``write_back`` has no room for
        are the deepest: a page is found only through its prefix, so losing a page loses every
        page after it too, copied or not (in eviction order, leaves come first and the room
        would go to them)."""
        depths = [self.trie.page_depth(key) for key, _ in kept]  # None: it left the trie (skipped): last
        order = sorted(range(len(kept)), key=lambda row: (depths[row] is None, depths[row] or 0))
        return [kept[row] for row in order]

    def _slots_to_hand_over(self, fetching: list[bytes]) -> list[tuple[bytes, object]]:
        """(key, its fetch's ``read``) of each page of ``fetching`` whose host copy only that
        fetch (and the admission's own hold) uses: its slot is free once the fetch read it."""
        spilling = {key for keys in self.spills.values() for key in keys}
        sources = []
        for key in fetching:
            entry, joined = self.index.host_state(key), self.jobs.get(key)
            if entry is None or key in spilling or joined is None or not joined[0].to_device:
                continue
            if entry.busy <= 2:  # the admission's hold and the job's
                sources.append((key, joined[0].read))
        return sources[::-1]  # pop() hands out the first pages first

    def _copy_down(self, keys: list[bytes], blocks: np.ndarray, namespace: bytes, after: list = ()) -> None:
        """Gather ``blocks`` from the pool now and copy them into the host slots of ``keys``
        (once every future of ``after`` is done: reads of those slots)."""
        for start, size in move_batches(len(keys), self.transfer.buckets):
            run_keys = keys[start : start + size]
            slots = [self.index.slot_of(key) for key in run_keys]
            future = self.transfer.offload(self.pool.kv_pages, blocks[start : start + size], slots,
                                           priority=Priority.SPILL, after=after)  # fmt: skip
            for key in run_keys:
                self.copies[key] = future
            self._on_done(future, lambda result, run_keys=run_keys, future=future:
                          self._copied_down(run_keys, result, future))  # fmt: skip

    def spill_host(self, everything: bool = False) -> None:
        """Copy host pages without a disk copy to disk, LRU first: above the high watermark,
        until at most the low watermark's worth lacks one (``everything``: all of them)."""
        index = self.index
        if index.disk is None or (not everything and (self.spills or index.host_used <= self.spill_high)):
            return
        want = len(index.undisked) - (0 if everything else self.spill_low)
        keys = []
        for key in index.undisked:
            if len(keys) >= want:
                break
            entry = index.host_entries[key]
            if entry.ready and not entry.busy:
                keys.append(key)
        if not keys:
            return
        index.hold_host(keys)
        trie = self.trie
        parents = [trie.parent_key(*trie.locate(key)) for key in keys]
        future = self.transfer.spill(keys, [index.host_entries[key].namespace for key in keys],
                                     [index.slot_of(key) for key in keys], parents,
                                     priority=Priority.SPILL)  # fmt: skip
        self.spills[id(keys)] = keys
        self._on_done(future, lambda result: self._spilled(self.spills.pop(id(keys)), result))

    def make_host_room(self, num_blocks: int, exclude: list[bytes] = ()) -> int:
        """``TierIndex.make_host_room``, but with a disk tier no page leaves host for lack of
        room before it is on disk: victims without a disk copy the background spill has not
        reached yet are written now, on this thread (back-pressure; counted as
        ``pressure_spilled``). A page still leaves every tier when the disk refuses it.

        The disk copies of the other victims are locked meanwhile: the room a spill makes on
        a full disk used to evict one of them (its page had a host copy then), and the host
        copy went next, never written anywhere: a page lost that neither tier chose to drop.
        Victims that lose their disk copy all the same (the disk had dropped it before its
        DISK bit was cleared) are written too. Victims whose page is on device keep neither
        copy locked: the page loses nothing with them, and locked, their disk blocks left a
        full disk only the prefixes of pages write-back is copying to evict."""
        index = self.index
        if index.disk is None:
            return index.make_host_room(num_blocks, exclude)
        locked: list[tuple[bytes, bytes]] = []
        tried: set[bytes] = set()
        try:
            while True:
                doomed, on_disk = index.room_victims(num_blocks, exclude)
                pinned, gone = self._lock_on_disk(on_disk)
                locked += pinned
                doomed = [key for key in doomed + gone if key not in tried]  # one a full disk refused is lost
                if not doomed:
                    break
                tried.update(doomed)
                self._spill_now(doomed)
            return index.make_host_room(num_blocks, exclude)
        finally:
            for key, namespace in locked:
                index.disk.unlock([key], namespace)

    def _lock_on_disk(self, keys: list[bytes]) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
        """Pin the disk blocks of host pages ``keys`` against eviction; returns (key,
        namespace) of each pinned, for ``unlock``, and the keys whose block the disk no
        longer holds: a spill's room took it (a background spill's too, finished on a worker
        thread, its DISK bit cleared only at the next ``poll``), so their host copy is the last."""
        index, locked, gone = self.index, [], []
        for key in keys:
            namespace = index.host_entries[key].namespace
            if index.disk.lock([key], namespace):
                locked.append((key, namespace))
            else:
                gone.append(key)
        return locked, gone

    def _spill_now(self, keys: list[bytes]) -> None:
        index, trie = self.index, self.trie
        index.hold_host(keys)
        parents = [trie.parent_key(*trie.locate(key)) for key in keys]
        future = self.transfer.spill(keys, [index.host_entries[key].namespace for key in keys],
                                     [index.slot_of(key) for key in keys], parents,
                                     priority=Priority.DEMAND, now=True)  # fmt: skip
        done = self._spilled(keys, future.result())
        self.counts["pressure_spilled"] += done

    # --- up: disk -> host -> device --------------------------------------------------------

    def hold(self, pages: list[bytes]) -> list[bytes]:
        """Keep the host copies of ``pages`` from eviction until ``unhold`` (a fetch being
        planned); returns the keys held, for ``unhold``."""
        held = [key for key in pages if self.index.host_state(key)]
        self.index.hold_host(held)
        return held

    def unhold(self, held: list[bytes]) -> None:
        for key in held:
            self.index.release_host(key)

    def start_fetch(self, waiter: Waiter, pages: list[bytes], namespace: bytes,
                    priority: Priority) -> int:  # fmt: skip
        """Bring ``pages`` into ``waiter``'s blocks; return how many of the leading pages will
        be fetched (the rest do not fit in host memory: recompute them)."""
        self.waiters[waiter.handle.seq_id] = waiter
        offset, covered = 0, len(pages)
        while offset < covered:
            joined = self.device_job(pages[offset])
            count = 1
            if joined is not None:
                job, row = joined
                if priority < job.priority:  # a request now waits on a prefetch: no longer behind others
                    self._promote(job, priority)
                while (offset + count < covered and row + count < len(job.keys)
                       and job.keys[row + count] == pages[offset + count]):  # fmt: skip
                    count += 1
            else:
                while offset + count < covered and self.device_job(pages[offset + count]) is None:
                    count += 1
                job, row = self._new_job(pages[offset : offset + count], namespace, priority, True), 0
                if len(job.keys) < count:  # host room ran out: recompute from there on
                    covered = offset + len(job.keys)
                    count = len(job.keys)
            if count:
                job.consumers.append((waiter, offset, row, count))
                waiter.segments.append((job, offset, row, count))
                waiter.outstanding += 1
            offset += count
        waiter.num_pages = covered
        waiter.from_disk = waiter.from_disk[:covered]
        if not waiter.outstanding:
            del self.waiters[waiter.handle.seq_id]
        return covered

    def restore_only(self, pages: list[bytes], namespace: bytes) -> None:
        """Prefetch without device room: restore disk-only ``pages`` into host memory."""
        pages = [key for key in pages if key not in self.jobs]
        if pages:
            self._new_job(pages, namespace, Priority.PREFETCH, False)

    # --- helpers: jobs -----------------------------------------------------------------------

    def _new_job(self, pages: list[bytes], namespace: bytes, priority: Priority,
                 to_device: bool) -> FetchJob:  # fmt: skip
        """A job for ``pages`` (none in flight); it may cover only a leading part of them."""
        index = self.index
        keys, disk_rows = [], []
        for key in pages:  # up to a page that is in no tier (it left the trie meanwhile)
            if index.host_state(key) is None:
                if index.disk_page(namespace, key) is None:
                    break
                disk_rows.append(len(keys))
            keys.append(key)
        fit = self.make_host_room(len(disk_rows), exclude=keys) if disk_rows else 0
        # Making room may have split trie nodes (or dropped pages): locate the pages only now.
        disk_pages = [index.disk_page(namespace, keys[row]) for row in disk_rows[:fit]]
        fit = next((i for i, located in enumerate(disk_pages) if located is None), fit)
        if fit < len(disk_rows):  # pages past the first one without host room are not fetched
            keys = keys[: disk_rows[fit]]
            disk_rows = disk_rows[:fit]
        from_disk = np.zeros(len(keys), bool)
        from_disk[disk_rows] = True
        job = FetchJob(namespace, keys, from_disk, priority, to_device, time.monotonic())
        self.live_jobs[id(job)] = job
        for row, key in enumerate(keys):
            self.jobs[key] = (job, row)
        if disk_rows:
            self._restore(job, [keys[row] for row in disk_rows], disk_pages[: len(disk_rows)])
        job.held = list(keys)
        index.hold_host(keys)
        prereqs = {id(f): f for f in (self.copies.get(key) for key in keys) if f is not None}
        job.transfers += prereqs.values()
        self.transfer.promote(job.transfers, priority)  # copies it waits on go at its priority (or above)
        for future in prereqs.values():
            job.prereqs += 1
            self._on_done(future, lambda result, job=job: self._prereq_done(job))
        if not prereqs:
            self._submit_fetch(job)
        return job

    def _restore(self, job: FetchJob, keys: list[bytes], pages: list[tuple[Node, int]]) -> None:
        for key, (node, index) in zip(keys, pages):
            self.index.add_host(key, job.namespace, node, index, ready=False)
        slots = [self.index.slot_of(key) for key in keys]
        future = self.transfer.restore(keys, job.namespace, slots, priority=job.priority)
        for key in keys:
            self.copies[key] = future
        self._on_done(future, lambda result: self._restored(keys, job.namespace, result, future))

    def _promote(self, job: FetchJob, priority: Priority) -> None:
        """Raise ``job`` and the transfers it waits on, started or not, to ``priority``."""
        job.priority = priority  # its fetches, submitted once its copies are in, go at it too
        job.transfers = [future for future in job.transfers if not future.done()]
        self.transfer.promote(job.transfers, priority)

    def device_job(self, key: bytes) -> tuple[FetchJob, int] | None:
        """The job bringing ``key`` to the device now, with its row, or None."""
        joined = self.jobs.get(key)
        return joined if joined is not None and joined[0].to_device else None

    def _prereq_done(self, job: FetchJob) -> None:
        job.prereqs -= 1
        if job.prereqs == 0:
            self._submit_fetch(job)

    def _submit_fetch(self, job: FetchJob) -> None:
        valid = 0
        for key in job.keys:
            entry = self.index.host_entries.get(key)  # its slot may be handed over: read it first
            if entry is None or entry.dropped or not entry.ready:
                break
            valid += 1
        if not job.to_device or valid == 0:  # at the next poll: never inside the job's creator
            self._on_done(resolved_future(), lambda _: self._finish(job, 0 if job.to_device else valid))
            return
        for start, size in move_batches(valid, self.transfer.buckets):
            slots = [self.index.slot_of(key) for key in job.keys[start : start + size]]
            future = self.transfer.fetch(slots, priority=job.priority)
            job.transfers.append(future)
            job.pending += 1
            self._on_done(future, lambda result, start=start: self._fetched(job, start, result))

    def _fetched(self, job: FetchJob, start: int, result: TransferResult) -> None:
        blocks = None if result.blocks is None else self.codec.decode(result.blocks)  # [rows, ...] padded
        job.chunks[start] = (result.num_blocks, blocks) if result.ok else None
        job.pending -= 1
        if job.pending:
            return
        self.report.fetch_seconds.append((job.tier, time.monotonic() - job.started))
        valid = 0
        for start in sorted(job.chunks):  # leading chunks that arrived
            if job.chunks[start] is None:
                break
            valid += job.chunks[start][0]
        self._finish(job, valid)

    def _finish(self, job: FetchJob, valid: int) -> None:
        job.valid = valid
        job.read.set_result(None)
        del self.live_jobs[id(job)]
        if valid < len(job.keys) and job.to_device:
            self.counts["fetch_failures"] += 1
            self.report.fetch_failures += 1
        for key in job.keys:
            if self.jobs.get(key, (None,))[0] is job:
                del self.jobs[key]
        for key in job.held:
            self.index.release_host(key)
        self._scatter(job)
        job.chunks = {}
        job.transfers = []  # their results hold the fetched blocks (device memory): not past the scatter
        for waiter, _, _, _ in job.consumers:
            waiter.outstanding -= 1
            if waiter.outstanding == 0:
                self._finalize(waiter)

    def _scatter(self, job: FetchJob) -> None:
        """Each arrived chunk into the blocks of every live consumer of its rows: one scatter
        of the whole padded chunk per consumer, the rows it does not take aimed at no block
        (id -1), so every scatter has its bucket's shape."""
        for start, chunk in job.chunks.items():
            if chunk is None or chunk[1] is None or start >= job.valid:
                continue
            blocks, end = chunk[1], start + chunk[0]
            for waiter, offset, row, count in job.consumers:
                low, high = max(row, start), min(row + count, end)
                if low >= high or not waiter.handle.alive:
                    continue
                first = waiter.first + offset + low - row
                ids = np.full(_rows(blocks), -1, np.int32)
                ids[low - start : high - start] = waiter.handle.block_ids[first : first + high - low]
                self.pool.scatter(ids, blocks)

    def _finalize(self, waiter: Waiter) -> None:
        del self.waiters[waiter.handle.seq_id]
        if waiter.handle.alive:
            self.finished.append(waiter)

    # --- helpers: copies down ----------------------------------------------------------------

    def _copied_down(self, keys: list[bytes], result: TransferResult, future) -> None:
        done = 0
        for key in keys:
            if self.copies.get(key) is not future:  # a later writer (a restore) adopted its entry:
                continue  # that one's end decides it (a failure here must not free the slot it writes)
            del self.copies[key]
            self.index.host_done(key, result.ok)
            done += result.ok
        self.counts["offloaded"] += done
        if done:
            self.report.add_spill("device_to_host", done, done * self.block_nbytes)

    def _restored(self, keys: list[bytes], namespace: bytes, result: TransferResult, future) -> None:
        restored = set(result.done_keys)
        for key in keys:
            if self.copies.get(key) is future:  # else a later writer's end decides the entry
                del self.copies[key]
                self.index.host_done(key, key in restored)
            if not self.index.disk.contains(key, namespace):  # corrupt or unreadable: gone
                self.index.forget_disk(key, namespace)
        self._count_disk_errors()

    def _spilled(self, keys: list[bytes], result: TransferResult) -> int:
        """The pages of a finished spill that reached disk get their DISK bit; returns how many."""
        index = self.index
        done = set(result.done_keys)
        for key in keys:
            entry = index.host_entries.get(key)
            located = None if entry is None or entry.dropped else self.trie.locate(key)
            # still there: another spill's room may have taken it since (reported before this add)
            if key in done and located is not None and index.disk.contains(key, entry.namespace):
                index.add_disk(key, entry.namespace, *located)
            index.release_host(key)
        self.counts["spilled"] += len(done)
        if done:
            self.report.add_spill("host_to_disk", len(done), len(done) * self.block_nbytes)
        index.reconcile_disk()
        self._count_disk_errors()
        return len(done)

    def _count_disk_errors(self) -> None:
        stats = self.index.disk.stats()
        errors = stats.write_errors + stats.corrupt_blocks + stats.read_errors
        if errors > self._disk_errors_seen:
            self.counts["disk_errors"] += errors - self._disk_errors_seen
            self.report.disk_errors += errors - self._disk_errors_seen
            self._disk_errors_seen = errors

    def _on_done(self, future: concurrent.futures.Future, callback: Callable) -> None:
        self._callbacks.append((future, callback))


def _rows(blocks) -> int:
    """Rows of a decoded batch (an array, or QuantizedPages of data and scales)."""
    return (blocks.data if isinstance(blocks, QuantizedPages) else blocks).shape[0]
