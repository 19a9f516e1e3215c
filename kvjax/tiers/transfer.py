"""Transfer engine: moves KV blocks between device, host, disk and other processes off the
serving thread (small fetches excepted, see below).

Five links, each with its own queue and worker thread:

    device_to_host   offload: blocks gathered from the page pool into host slots
    host_to_device   fetch:   host slots copied to a device array the caller scatters
    host_to_disk     spill:   host slots written to disk segments (queued spills coalesce)
    disk_to_host     restore: disk blocks read back into host slots
    remote_to_host   pull:    another process's blocks, returned as a host array (the caller
                              verifies them and commits them; ``kvjax.cluster.remote_fetch``)

A small DEMAND fetch (``inline_fetch_bytes`` of padded rows, 1 MiB by default) into a pool on
the CPU, submitted while host_to_device has nothing queued or running, runs on the caller's
thread instead, done when ``fetch`` returns: its copy costs less than the hand-off to the
worker and back (a one-block fetch took 0.3-0.4 ms through the worker against 0.1 ms for the
copy itself). A prefetch always goes to the worker (nobody waits for it), and so does every
fetch onto an accelerator, where the copy is not measured yet and must not hold the serving
thread behind a step in flight.

A caller that waits on a queued job (``future.result()``, or ``wait_any`` as the serving loop
does when nothing can run until a fetch lands) runs it on its own thread when it is next in
line on an idle link and its budget pays for it now: the worker would run it next anyway, and
the caller, blocked either way, saves the two thread hand-offs (to the worker and back, about
0.15 ms each on CPU). Offloads, fetches and restores are helped so; spills (which coalesce)
and remote pulls (which own their deadlines) always run on their worker. A timeout passed to
``result`` then bounds only the wait that follows the helped run.

Within a link, jobs run one at a time by priority (DEMAND < PREFETCH < SPILL), then in
submission order, whichever thread runs them. ``promote`` raises the priority of jobs not
started yet (a request now waits on a prefetch or on the copy it needs). Each
link may have a byte budget (a token bucket): background jobs wait for tokens; a demand job
never waits and its bytes are charged to the bucket, so prefetch and spill cannot starve it.
A running job is not preempted: keep jobs small when demand latency matters.

Every submit returns a ``concurrent.futures.Future`` resolving to a ``TransferResult``;
failures (absent disk keys, I/O errors, engine closed) resolve it with ``ok=False``, never
raise. Results are delivered only when the copy is complete.

The engine moves bytes and nothing else: which slot holds which block, and that nothing
evicts a slot a transfer reads or writes, is the tier index's (``kvjax.tiers.tier_index``),
which holds those slots until the future resolves. The page pool never leaves the caller:
``offload`` gathers on the calling thread (an async device op), and a fetch's result holds
the blocks for the caller to scatter between steps.

Batch sizes. Offloads and fetches move ``rows`` blocks where ``rows`` is the batch padded to
a bucket (``transfer_buckets``): the device-side gather, encode, decode and scatter compile
once per bucket, never during serving once ``KVCache.warmup`` ran.

``synchronous=True`` runs every job on the caller's thread at submit (no workers): a replay
that moves no bytes gets the same bookkeeping without threads.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import functools
import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.host_pool import HostPool
from kvjax.tiers.token_bucket import TokenBucket

__all__ = ["PULL_ABANDONED", "PULL_EXPIRED", "Link", "LinkBudget", "Priority", "TransferEngine", "TransferResult",
           "bucket_rows", "move_batches", "wait_any"]

_log = logging.getLogger(__name__)
PULL_EXPIRED = "deadline passed while queued"  # a remote pull's error: it never ran
PULL_ABANDONED = "deadline passed while running; abandoned"  # it ran too long: the peer is slow or hung
_POLL_S = 0.05  # longest a waiting worker sleeps before re-reading the (injectable) clock


class Link(enum.Enum):
    DEVICE_TO_HOST = "device_to_host"
    HOST_TO_DEVICE = "host_to_device"
    HOST_TO_DISK = "host_to_disk"
    DISK_TO_HOST = "disk_to_host"
    REMOTE_TO_HOST = "remote_to_host"


class Priority(enum.IntEnum):
    DEMAND = 0  # a request waits on it
    PREFETCH = 1  # a request will probably want it
    SPILL = 2  # making room


@dataclasses.dataclass(frozen=True, slots=True)
class LinkBudget:
    rate_bytes_per_s: float
    burst_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class TransferResult:
    """Outcome of one transfer; ``ok`` when every block reached the destination."""

    link: Link
    num_blocks: int
    ok: bool
    done_keys: tuple[bytes, ...] = ()  # spill / restore: keys now held by the destination
    blocks: jax.Array | np.ndarray | None = None  # host_to_device: [rows, *block_shape], ready;
    # remote_to_host: what the pull returned (a host array)
    error: str | None = None
    seconds: float = 0.0  # remote_to_host: how long the pull ran (not counting its queueing)


def bucket_rows(num_blocks: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``num_blocks`` blocks (ValueError past the largest)."""
    for rows in buckets:
        if rows >= num_blocks:
            return rows
    raise ValueError(f"{num_blocks} blocks exceed the largest transfer bucket {buckets[-1]}; split the move")


def move_batches(num_blocks: int, buckets: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, size)`` runs of at most the largest bucket covering ``num_blocks`` blocks
    (one run of all of them without buckets)."""
    step = buckets[-1] if buckets else max(num_blocks, 1)
    return [(start, min(step, num_blocks - start)) for start in range(0, num_blocks, step)]


def wait_any(futures: Sequence[concurrent.futures.Future], timeout: float) -> None:
    """Block until one of ``futures`` is done or ``timeout`` seconds pass; a transfer of them
    that is next in line on an idle link runs on this thread instead (module docstring).
    Futures of other origins are waited for as ``concurrent.futures.wait`` does."""
    for future in futures:
        help_wait = getattr(future, "help_wait", None)
        if help_wait is not None and not future.done() and help_wait():
            return
    concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)


_HELPED_LINKS = frozenset({Link.DEVICE_TO_HOST, Link.HOST_TO_DEVICE, Link.DISK_TO_HOST})


class _Future(concurrent.futures.Future):
    """A job's future: ``result()`` first runs the job on the waiting thread when the engine
    lets it (``TransferEngine._help``)."""

    def __init__(self):
        super().__init__()
        self.help_wait: Callable[[], bool] | None = None  # None once finished, or for jobs no waiter may run
        self.promote: Callable[[Priority], bool] | None = None  # TransferEngine._promote of its job; None once finished

    def result(self, timeout: float | None = None):
        help_wait = self.help_wait
        if help_wait is not None and not self.done():
            help_wait()
        return super().result(timeout)


@dataclasses.dataclass(slots=True)
class _Job:
    link: Link
    priority: Priority
    slots: np.ndarray  # host slots read or written
    nbytes: int
    future: concurrent.futures.Future
    keys: tuple[bytes, ...] = ()  # disk links: the blocks' keys
    namespaces: tuple[bytes, ...] = ()  # disk links: each key's namespace digest
    parents: tuple[bytes | None, ...] = ()  # spill: each block's parent key (disk manifests keep it)
    rows: int = 0  # fetch: the bucket the batch is padded to
    blocks: jax.Array | None = None  # device_to_host: the gathered (encoded) blocks
    pinned: bool = False  # disk_to_host: its disk segments are pinned until it finishes
    pull: Callable[[float], object] | None = None  # remote_to_host: (deadline) -> blocks
    deadline: float = 0.0  # remote_to_host: time.monotonic() seconds the pull must end by
    num_blocks: int = 0  # remote_to_host: blocks it brings
    started: bool = False  # remote_to_host: its pull began
    finished: bool = False  # its future resolved (a pull abandoned at its deadline may still return later)


class TransferEngine:
    """Queues, prioritises and runs block transfers; one worker thread per link.

    >>> host = HostPool((2, 2, 1, 4, 8), jnp.float32, num_slots=8)
    >>> pool = jnp.ones((8, 2, 2, 1, 4, 8), jnp.float32)  # [num_blocks, *block_shape]
    >>> with TransferEngine(host) as engine:
    ...     engine.offload(pool, [3, 5], [0, 1]).result(5).ok
    ...     engine.fetch([1]).result(5).blocks.shape
    True
    (1, 2, 2, 1, 4, 8)
    """

    def __init__(self, host: HostPool, disk_tier: DiskTier | None = None, *,
                 gather_blocks: Callable | None = None, budgets: Mapping[Link, LinkBudget] = (),
                 clock: Callable[[], float] = time.monotonic, buckets: Sequence[int] = (),
                 synchronous: bool = False, paused: bool = False, direct_cpu_reads: bool = False,
                 inline_fetch_bytes: int = 1 << 20):  # fmt: skip
        """Args:
        gather_blocks: ``(kv_pages, block_ids) -> [n, *block_shape]``, bit-exact, zero rows
          for negative ids; default ``pallas_kernels.gather_blocks``.
        budgets: byte budget per link; links not named are unlimited.
        clock: seconds, for the budgets (tests inject a fake one).
        buckets: ascending batch sizes offloads and fetches are padded to (empty: no padding).
        synchronous: run each job at submit on the caller's thread (no workers, no budgets).
        paused: workers take no job until ``resume()`` (queue work up first, then start).
        direct_cpu_reads: blocks are stored as the pool holds them (no codec) and
          ``gather_blocks`` is a plain gather: an offload from a pool on one CPU device (whose
          memory is host memory) then copies each block straight into its slot on the
          caller's thread, one copy where a gather and a copy would be two.
        inline_fetch_bytes: a DEMAND fetch of at most this many bytes (its padded rows) into a
          pool on the CPU runs on the caller's thread when host_to_device has nothing queued
          or running and its budget pays for it at once (charged then); 0: every fetch goes
          to the worker.
        """
        self.host = host
        self.disk_tier = disk_tier
        self.buckets = tuple(buckets)
        self.synchronous = synchronous
        self._gather = gather_blocks or pallas_kernels.gather_blocks
        self._direct_cpu_reads = direct_cpu_reads
        self.inline_fetch_bytes = inline_fetch_bytes if host.device_platform == "cpu" else 0
        self._buckets = {link: TokenBucket(b.rate_bytes_per_s, b.burst_bytes, clock)
                         for link, b in dict(budgets).items()}  # fmt: skip
        # One lock; each link's worker sleeps on its own condition, so a submit wakes only the
        # worker that runs it (not all five, each then contending for the lock and the GIL),
        # and wait_idle on another.
        self._lock = threading.Lock()
        self._wake = {link: threading.Condition(self._lock) for link in Link}
        self._idle = threading.Condition(self._lock)
        self._queues: dict[Link, list] = {link: [] for link in Link}
        self._seq = itertools.count()
        self._closed, self._paused = False, paused
        self._after_jobs: dict[int, _Job] = {}  # id -> job submitted with after= futures not all resolved yet
        # remote pulls' deadlines: (deadline, seq, job id) heap, the jobs not finished, their watcher
        self._deadlines: list[tuple[float, int, int]] = []
        self._deadline_jobs: dict[int, _Job] = {}
        self._deadline_wake = threading.Condition(self._lock)
        self._deadline_thread: threading.Thread | None = None
        self._running = {link: 0 for link in Link}
        self._counters = {link: {"jobs": 0, "failed": 0, "bytes": 0} for link in Link}
        self._runners = {Link.DEVICE_TO_HOST: self._run_offload, Link.HOST_TO_DEVICE: self._run_fetch,
                         Link.HOST_TO_DISK: self._run_spill, Link.DISK_TO_HOST: self._run_restore,
                         Link.REMOTE_TO_HOST: self._run_pull}  # fmt: skip
        self._workers = [] if synchronous else [
            threading.Thread(target=self._work, args=(link,), daemon=True, name=f"kvjax-{link.value}")
            for link in Link]  # fmt: skip
        for worker in self._workers:
            worker.start()

    # ---- submitting ----------------------------------------------------------------------

    def rows_for(self, num_blocks: int) -> int:
        """Rows a move of ``num_blocks`` blocks is padded to (its bucket)."""
        return bucket_rows(num_blocks, self.buckets) if self.buckets else num_blocks

    def offload(self, kv_pages, block_ids: Sequence[int], slots: Sequence[int], *,
                priority: Priority = Priority.SPILL,
                after: Sequence[concurrent.futures.Future] = ()) -> concurrent.futures.Future:  # fmt: skip
        """Copies pool blocks ``block_ids`` into host ``slots`` (device_to_host).

        The gather is issued here (padded to the batch's bucket), so the pool may be updated
        (donated) right after return. ``kv_pages`` None: no bytes move (a replay).
        ``after``: transfers that read ``slots`` still (fetches); the slots are written only
        once all of them finished, from a copy of the blocks gathered now.
        """
        slots = np.asarray(slots, np.intp)
        if len(block_ids) != len(slots):
            raise ValueError(f"{len(block_ids)=} must equal {len(slots)=}")
        job = self._job(Link.DEVICE_TO_HOST, priority, slots)
        pool_memory = self._cpu_pool_memory(kv_pages) if len(slots) and not after else None
        if pool_memory is not None:  # the pool is host memory: read it now, before it is donated
            self.host.write_rows(slots, pool_memory, np.asarray(block_ids, np.intp))
        elif kv_pages is not None and len(slots):
            ids = np.full(self.rows_for(len(slots)), -1, np.int32)
            ids[: len(slots)] = block_ids
            try:
                job.blocks = self._gather(kv_pages, jnp.asarray(ids))
                if isinstance(job.blocks, jax.Array):
                    # The copy down starts now, behind the gather, not when the worker asks
                    # for the bytes (on CPU the array is host memory already: nothing to do).
                    job.blocks.copy_to_host_async()
            except Exception as err:  # noqa: BLE001 - resolve, never raise into the request
                return self._reject(job, f"gather failed: {err!r}")
        if after:
            return self._submit_after(job, after)
        return self._submit(job)

    def _submit_after(self, job: _Job, after: Sequence[concurrent.futures.Future]) -> concurrent.futures.Future:
        """Submit ``job`` once every future of ``after`` is done (on the thread finishing
        the last one; at once if all are)."""
        waiting, lock = [len(after)], threading.Lock()
        with self._lock:
            closed = self._closed
            if not closed:
                self._after_jobs[id(job)] = job  # close() fails it if its futures have not resolved by then
        if closed:
            return self._reject(job, "engine closed")

        def one_done(_) -> None:
            with lock:
                waiting[0] -= 1
                last = waiting[0] == 0
            if last:
                with self._lock:
                    if self._after_jobs.pop(id(job), None) is None:  # close() failed it already
                        return
                self._submit(job)

        for future in after:
            future.add_done_callback(one_done)
        return job.future

    def _cpu_pool_memory(self, kv_pages) -> np.ndarray | None:
        """The pool's own memory as a read-only numpy view (no copy), when offloads may read
        it directly (``direct_cpu_reads``, a plain array on one CPU device stored as is)."""
        if not self._direct_cpu_reads or not isinstance(kv_pages, jax.Array) or not self.host.store_bytes:
            return None
        devices = kv_pages.devices()
        if len(devices) != 1 or next(iter(devices)).platform != "cpu":
            return None
        if kv_pages.dtype != self.host.dtype or tuple(kv_pages.shape[1:]) != self.host.block_shape:
            return None
        return np.asarray(kv_pages)  # waits for the step that wrote it

    def fetch(self, slots: Sequence[int], *, priority: Priority = Priority.DEMAND) -> concurrent.futures.Future:
        """Copies host ``slots`` to the device (host_to_device), padded to the batch's bucket."""
        job = self._job(Link.HOST_TO_DEVICE, priority, np.asarray(slots, np.intp))
        job.rows = self.rows_for(len(job.slots))
        inline = priority is Priority.DEMAND and job.rows * self.host.block_nbytes <= self.inline_fetch_bytes
        if inline and self._claim(job, queued=False):
            self._run_claimed(job.link, [job])
            return job.future
        return self._submit(job)

    def spill(self, keys: Sequence[bytes], namespaces: Sequence[bytes], slots: Sequence[int],
              parents: Sequence[bytes | None] | None = None, *, priority: Priority = Priority.SPILL,
              now: bool = False) -> concurrent.futures.Future:  # fmt: skip
        """Writes host ``slots`` to disk under ``keys`` (host_to_disk); ``done_keys`` says
        which the disk holds after it (a failed or rejected write leaves some out). ``now``:
        on the caller's thread, done when this returns (the slots are needed at once)."""
        job = self._job(Link.HOST_TO_DISK, priority, np.asarray(slots, np.intp))
        if self.disk_tier is None:
            return self._reject(job, "no disk tier")
        job.keys, job.namespaces = tuple(keys), tuple(namespaces)
        job.parents = tuple(parents) if parents is not None else (None,) * len(job.keys)
        if not len(job.keys) == len(job.namespaces) == len(job.parents) == len(job.slots):
            raise ValueError(f"spill of {len(job.slots)} slots needs as many keys, namespaces and parents")
        return self._run_now(job) if now else self._submit(job)

    def restore(self, keys: Sequence[bytes], namespace: bytes, slots: Sequence[int], *,
                priority: Priority = Priority.PREFETCH) -> concurrent.futures.Future:  # fmt: skip
        """Reads disk blocks of one namespace into host ``slots`` (disk_to_host); the disk
        segments holding them are pinned from now until the read."""
        job = self._job(Link.DISK_TO_HOST, priority, np.asarray(slots, np.intp))
        if self.disk_tier is None:
            return self._reject(job, "no disk tier")
        job.keys, job.namespaces = tuple(keys), (namespace,)
        if len(job.keys) != len(job.slots):
            raise ValueError(f"restore of {len(job.keys)} keys into {len(job.slots)} slots")
        if not self.disk_tier.lock(job.keys, namespace):
            return self._reject(job, "not all keys are on disk")
        job.pinned = True
        return self._submit(job)

    def pull_remote(self, pull: Callable[[float], object], num_blocks: int, block_nbytes: int, *, deadline: float,
                    priority: Priority = Priority.DEMAND) -> concurrent.futures.Future:  # fmt: skip
        """Run ``pull(deadline)`` on the remote_to_host link: another process's ``num_blocks``
        blocks of ``block_nbytes`` bytes (the byte budget's charge). ``deadline`` is
        ``time.monotonic()`` seconds; ``pull`` must return or raise by then (it owns the
        watchdog); a job still queued at its deadline fails without running. The result's
        ``blocks`` is what ``pull`` returned, ``seconds`` how long it ran; an exception
        resolves it with ``ok=False`` and the error."""
        if not callable(pull):
            raise ValueError(f"pull={pull!r} must be a callable (deadline) -> blocks")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} must be an int >= 1")
        if isinstance(block_nbytes, bool) or not isinstance(block_nbytes, int) or block_nbytes < 1:
            raise ValueError(f"block_nbytes={block_nbytes!r} must be an int >= 1")
        # NaN sat atop the watcher's heap for good (no later pull expired), inf killed it
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline):
            raise ValueError(f"deadline={deadline!r} must be a finite number of time.monotonic() seconds")
        if not isinstance(priority, Priority):
            raise ValueError(f"{priority=} must be a Priority ({list(Priority)})")
        job = _Job(Link.REMOTE_TO_HOST, priority, np.zeros(0, np.intp), num_blocks * block_nbytes,
                   _Future(), pull=pull, deadline=deadline, num_blocks=num_blocks)  # fmt: skip
        self._promotable(job)
        if not self.synchronous:  # nobody waits past the deadline, whatever runs ahead on the link
            self._watch_deadline(job)
        return self._submit(job)

    # ---- control -------------------------------------------------------------------------

    def resume(self) -> None:
        """Let the workers of an engine made with ``paused=True`` take jobs."""
        with self._lock:
            self._paused = False
            self._notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no job is queued or running; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while any(self._queues.values()) or any(self._running.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(min(remaining, _POLL_S))
            return True

    def stats(self) -> dict[str, dict[str, int]]:
        """Per link: finished jobs, failed jobs, bytes delivered, jobs queued now."""
        with self._lock:
            return {link.value: {**self._counters[link], "queued": len(self._queues[link])} for link in Link}

    def promote(self, futures: Sequence[concurrent.futures.Future], priority: Priority) -> int:
        """Raise the jobs of ``futures`` (this engine's) that have not started to ``priority``:
        queued ones move ahead within their link's queue, keeping submission order among equals
        (a DEMAND job then never waits for tokens); ones waiting for the futures they follow
        (``offload(after=...)``) are queued at it. Jobs already running or done, at that
        priority or above, and other futures are left as they are. Returns how many were raised."""
        if not isinstance(priority, Priority):
            raise ValueError(f"{priority=} must be a Priority ({list(Priority)})")
        raised = 0
        for future in futures:
            promote = getattr(future, "promote", None)
            raised += promote is not None and promote(priority)
        return raised

    def close(self, timeout: float = 10.0) -> None:
        """Lets running jobs finish, fails queued ones ("engine closed"), joins the workers
        (a fetch running inline on a caller's thread finishes there; this does not wait for it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = [entry[-1] for queue in self._queues.values() for entry in queue]
            pending += self._after_jobs.values()  # offloads still waiting for the fetches they follow
            self._after_jobs.clear()
            for queue in self._queues.values():
                queue.clear()
            self._notify_all()
        for job in pending:
            self._finish(job, self._failure(job, "engine closed"))
        for worker in [*self._workers, *([self._deadline_thread] if self._deadline_thread else [])]:
            worker.join(timeout)
            if worker.is_alive():
                _log.warning("transfer engine: %s did not stop within %.1f s", worker.name, timeout)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- workers -------------------------------------------------------------------------

    def _notify_all(self) -> None:
        """Wake every worker, the deadline watcher and ``wait_idle`` (the lock held)."""
        for wake in self._wake.values():
            wake.notify_all()
        self._deadline_wake.notify_all()
        self._idle.notify_all()

    def _work(self, link: Link) -> None:
        while True:
            jobs = self._next_jobs(link)
            if jobs is None:
                return
            self._run_claimed(link, jobs)
            jobs = None  # holds no result (a fetch's staging buffer) while waiting for the next

    def _run_claimed(self, link: Link, jobs: list[_Job]) -> None:
        """Runs jobs that count as running on ``link`` (a worker's, or one on a caller's thread)."""
        try:
            self._run(link, jobs)
        finally:
            with self._lock:
                self._running[link] -= 1
                if self._queues[link]:  # its worker waited for this job to end
                    self._wake[link].notify()
                self._idle.notify_all()

    def _claim(self, job: _Job, *, queued: bool) -> bool:
        """Whether ``job`` may run on the caller's thread now: workers run, nothing runs on
        its link, the job is next in its queue (``queued``) or the queue is empty (a new
        job), and its budget pays for it without a wait (charged then). True takes it off
        the queue and counts it as running: ``_run_claimed`` must follow."""
        link, queue = job.link, self._queues[job.link]
        with self._lock:
            if self.synchronous or self._closed or self._paused or self._running[link]:
                return False
            if (queue[0][-1] if queue else None) is not (job if queued else None):
                return False
            if self._charge(self._buckets.get(link), job) != 0.0:
                return False
            if queued:
                heapq.heappop(queue)
            self._running[link] += 1
            return True

    def _help(self, job: _Job) -> bool:
        """Run queued ``job`` on the waiting caller's thread if ``_claim`` lets it; whether it ran."""
        if not self._claim(job, queued=True):
            return False
        self._run_claimed(job.link, [job])
        return True

    def _promote(self, job: _Job, priority: Priority) -> bool:
        """``promote`` of one job; whether it was raised."""
        with self._lock:
            if priority >= job.priority or job.future.done():
                return False
            queue = self._queues[job.link]
            at = next((i for i, entry in enumerate(queue) if entry[-1] is job), None)
            if at is None and id(job) not in self._after_jobs:
                return False  # running (or claimed by a waiting caller): too late
            job.priority = priority  # a job still waiting for its after= futures is queued at it
            if at is not None:
                queue[at] = (priority, queue[at][1], job)
                heapq.heapify(queue)
                self._wake[job.link].notify()  # its worker may be waiting for tokens for another
            return True

    def _watch_deadline(self, job: _Job) -> None:
        """Have ``job`` failed at its deadline unless it finished by then (one watcher thread
        for every pull, started with the first)."""
        with self._lock:
            if self._deadline_thread is None:
                self._deadline_thread = threading.Thread(target=self._watch_deadlines, daemon=True,
                                                         name="kvjax-pull-deadlines")  # fmt: skip
                self._deadline_thread.start()
            self._deadline_jobs[id(job)] = job
            heapq.heappush(self._deadlines, (job.deadline, next(self._seq), id(job)))
            if self._deadlines[0][2] == id(job):  # a new earliest deadline: the watcher sleeps too long
                self._deadline_wake.notify()

    def _watch_deadlines(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    if self._deadlines and self._deadlines[0][0] <= now:
                        job = self._deadline_jobs.pop(heapq.heappop(self._deadlines)[2], None)
                        if job is not None:
                            break  # else it finished in time
                        continue
                    # a far deadline's wait past TIMEOUT_MAX raised OverflowError, and the watcher died
                    self._deadline_wake.wait(min(self._deadlines[0][0] - now, threading.TIMEOUT_MAX)
                                             if self._deadlines else None)  # fmt: skip
            self._expire_pull(job)

    def _expire_pull(self, job: _Job) -> None:
        """A pull's deadline passed: fail it now, queued (taken off the queue) or running (its
        late result is dropped; the worker goes on once the pull returns)."""
        with self._lock:
            if job.finished:
                return
            queue = self._queues[job.link]
            at = next((i for i, entry in enumerate(queue) if entry[-1] is job), None)
            if at is not None:
                queue.pop(at)
                heapq.heapify(queue)
            started = job.started
        self._finish(job, self._failure(job, PULL_ABANDONED if started else PULL_EXPIRED))

    def _run(self, link: Link, jobs: list[_Job]) -> None:
        try:
            results = self._runners[link](jobs)
        except Exception as err:  # noqa: BLE001 - a failed transfer is a result
            _log.warning("transfer engine: %s failed: %r", link.value, err)
            results = [self._failure(job, repr(err)) for job in jobs]
        for job, result in zip(jobs, results):
            self._finish(job, result)

    def _next_jobs(self, link: Link) -> list[_Job] | None:
        """Pops the next job (queued spills coalesce up to a segment); None when closed."""
        queue, bucket, wake = self._queues[link], self._buckets.get(link), self._wake[link]
        with self._lock:
            while True:
                if self._closed:
                    return None
                wait = None
                if queue and not self._paused and not self._running[link]:
                    wait = self._charge(bucket, queue[0][-1])
                    if wait == 0.0:
                        jobs = [heapq.heappop(queue)[-1]]
                        if link is Link.HOST_TO_DISK:
                            self._coalesce(queue, bucket, jobs)
                        self._running[link] += 1
                        return jobs
                # Idle, or a caller runs a job of this link: sleep until notified; short of
                # tokens: re-read the clock soon.
                wake.wait(None if wait is None else min(wait, _POLL_S))

    def _coalesce(self, queue: list, bucket: TokenBucket | None, jobs: list[_Job]) -> None:
        limit = self.disk_tier.blocks_per_segment * self.disk_tier.block_nbytes
        total = jobs[0].nbytes
        while queue and total + queue[0][-1].nbytes <= limit:
            if self._charge(bucket, queue[0][-1]) != 0.0:
                break
            jobs.append(heapq.heappop(queue)[-1])
            total += jobs[-1].nbytes

    @staticmethod
    def _charge(bucket: TokenBucket | None, job: _Job) -> float:
        if bucket is None:
            return 0.0
        if job.priority == Priority.DEMAND:
            bucket.take(job.nbytes)
            return 0.0
        return bucket.try_take(job.nbytes)

    def _run_offload(self, jobs: list[_Job]) -> list[TransferResult]:
        [job] = jobs
        if job.blocks is not None:
            self.host.write(job.slots, job.blocks)
            job.blocks = None  # frees the gathered device copy
        return [self._success(job)]

    def _run_fetch(self, jobs: list[_Job]) -> list[TransferResult]:
        [job] = jobs
        blocks = self.host.to_device(job.slots, job.rows)
        if blocks is not None:
            blocks.block_until_ready()
        return [TransferResult(job.link, len(job.slots), ok=True, blocks=blocks)]

    def _run_spill(self, jobs: list[_Job]) -> list[TransferResult]:
        keys = [key for job in jobs for key in job.keys]
        namespaces = [ns for job in jobs for ns in job.namespaces]
        parents = [parent for job in jobs for parent in job.parents]
        slots = np.concatenate([job.slots for job in jobs])
        # Coalesced spills may name one block twice; one by one, the later would find it on
        # disk already. Write it once, from the first (a put refuses duplicates).
        first = {}
        for row, block in enumerate(zip(namespaces, keys)):
            first.setdefault(block, row)
        rows = list(first.values())
        if rows:
            self.disk_tier.put([keys[r] for r in rows], self.host.read(slots[rows]), [namespaces[r] for r in rows],
                               [parents[r] for r in rows])  # fmt: skip
        # Blocks written now and blocks the disk held already both count as done.
        return [self._success(job, [k for k, ns in zip(job.keys, job.namespaces) if self.disk_tier.contains(k, ns)])
                for job in jobs]  # fmt: skip

    def _run_restore(self, jobs: list[_Job]) -> list[TransferResult]:
        [job] = jobs
        read = self.disk_tier.get(list(job.keys), job.namespaces[0])
        self.host.write(job.slots[read.hits], read.blocks[read.hits])
        return [self._success(job, [key for key, hit in zip(job.keys, read.hits) if hit])]

    def _run_pull(self, jobs: list[_Job]) -> list[TransferResult]:
        [job] = jobs
        start = time.monotonic()
        with self._lock:
            job.started = not job.finished  # else failed at its deadline before it got here
        if not job.started or start >= job.deadline:
            return [self._failure(job, PULL_EXPIRED)]
        blocks = job.pull(job.deadline)
        return [TransferResult(job.link, job.num_blocks, ok=True, blocks=blocks, seconds=time.monotonic() - start)]

    # ---- job lifetime --------------------------------------------------------------------

    def _run_now(self, job: _Job) -> concurrent.futures.Future:
        if self._closed:
            self._finish(job, self._failure(job, "engine closed"))
        else:
            self._run(job.link, [job])
        return job.future

    def _job(self, link: Link, priority: Priority, slots: np.ndarray) -> _Job:
        if not isinstance(priority, Priority):
            raise ValueError(f"{priority=} must be a Priority ({list(Priority)})")
        if slots.ndim != 1 or (slots.size and (slots.min() < 0 or slots.max() >= self.host.num_slots)):
            raise ValueError(f"slots {slots.tolist()} must be host slots in [0, {self.host.num_slots})")
        job = _Job(link, priority, slots, len(slots) * self.host.block_nbytes, _Future())
        self._promotable(job)
        if link in _HELPED_LINKS and not self.synchronous:
            job.future.help_wait = functools.partial(self._help, job)
        return job

    def _promotable(self, job: _Job) -> None:
        if not self.synchronous:
            job.future.promote = functools.partial(self._promote, job)

    def _submit(self, job: _Job) -> concurrent.futures.Future:
        if self.synchronous:
            return self._run_now(job)
        with self._lock:
            if not self._closed:
                heapq.heappush(self._queues[job.link], (job.priority, next(self._seq), job))
                self._wake[job.link].notify()
                return job.future
        self._finish(job, self._failure(job, "engine closed"))
        return job.future

    def _reject(self, job: _Job, error: str) -> concurrent.futures.Future:
        self._finish(job, self._failure(job, error))
        return job.future

    def _finish(self, job: _Job, result: TransferResult) -> None:
        """Releases the disk segments a restore pinned, then resolves the job's future (once:
        a pull failed at its deadline is not finished again when it returns)."""
        with self._lock:
            if job.finished:
                return
            job.finished = True
            self._deadline_jobs.pop(id(job), None)  # a pull that ended in time: its heap entry lapses
        try:
            if job.pinned:
                self.disk_tier.unlock(job.keys, job.namespaces[0])
        except Exception as err:  # noqa: BLE001 - the transfer itself is done
            _log.error("transfer engine: releasing the disk pins of a restore failed: %r", err)
        done = len(result.done_keys) if job.link in (Link.HOST_TO_DISK, Link.DISK_TO_HOST) else len(job.slots)
        if isinstance(job.future, _Future):
            # nothing left to run or raise (and no cycle through the job)
            job.future.help_wait = job.future.promote = None
        with self._lock:
            counters = self._counters[job.link]
            counters["jobs"] += 1
            counters["failed"] += not result.ok
            if job.link is Link.REMOTE_TO_HOST:  # what arrived: a fetch that verified nothing returns None
                counters["bytes"] += getattr(result.blocks, "nbytes", 0) if result.ok else 0
            else:
                counters["bytes"] += (done if result.ok or job.keys else 0) * self.host.block_nbytes
        try:
            job.future.set_result(result)
        except concurrent.futures.InvalidStateError:  # its caller cancelled it: the worker goes on
            pass

    @staticmethod
    def _success(job: _Job, done_keys: Sequence[bytes] | None = None) -> TransferResult:
        if done_keys is None:  # offload / fetch: all or nothing
            return TransferResult(job.link, len(job.slots), ok=True)
        done = tuple(done_keys)
        ok = len(done) == len(job.keys)
        return TransferResult(job.link, len(job.slots), ok=ok, done_keys=done,
                              error=None if ok else "not all keys done")  # fmt: skip

    @staticmethod
    def _failure(job: _Job, error: str) -> TransferResult:
        return TransferResult(job.link, job.num_blocks or len(job.slots), ok=False, error=error)
