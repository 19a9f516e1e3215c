"""Transfer engine: moves KV blocks between device, host and disk off the serving thread.

Four links, each with its own queue and worker thread:

    device_to_host   offload: blocks gathered from the page pool into the host tier
    host_to_device   fetch:   host blocks copied to a device array the caller scatters
    host_to_disk     spill:   host blocks written to disk segments (queued spills coalesce)
    disk_to_host     restore: disk blocks read back into the host tier

Within a link, jobs run by priority (DEMAND < PREFETCH < SPILL), then in submission order. Each
link may have a byte budget (a token bucket): background jobs wait for tokens; a demand job
never waits and its bytes are charged to the bucket, so prefetch and spill cannot starve it.
A running job is not preempted: keep jobs small when demand latency matters.

Every submit returns a `concurrent.futures.Future` resolving to a `TransferResult`; failures
(absent keys, I/O errors, engine closed) resolve it with `ok=False`, never raise. While a job
is queued or running, its source blocks are locked in their tier (no eviction) and the
caller's `lock_hook(link, keys)` / `unlock_hook(link, keys, result)` bracket it, so a prefix
trie can lock its nodes too. Results are delivered only when the copy is complete.

The page pool never leaves the caller: `offload` gathers on the calling thread (an async
device op), and a fetch's result holds the blocks for the caller to scatter between steps.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import heapq
import itertools
import logging
import threading
import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

import pallas_kernels
from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.host_tier import HostTier
from kvjax.tiers.token_bucket import TokenBucket

__all__ = ["Link", "LinkBudget", "Priority", "TransferEngine", "TransferResult"]

_log = logging.getLogger(__name__)
_POLL_S = 0.05  # longest a waiting worker sleeps before re-reading the (injectable) clock


class Link(enum.Enum):
    DEVICE_TO_HOST = "device_to_host"
    HOST_TO_DEVICE = "host_to_device"
    HOST_TO_DISK = "host_to_disk"
    DISK_TO_HOST = "disk_to_host"


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
    """Outcome of one transfer; `ok` when every key reached the destination."""

    link: Link
    keys: tuple[bytes, ...]
    ok: bool
    done_keys: tuple[bytes, ...] = ()  # keys now held by the destination tier
    blocks: jax.Array | None = None  # host_to_device only: [n, *block_shape], ready
    error: str | None = None


@dataclasses.dataclass(slots=True)
class _Job:
    link: Link
    priority: Priority
    keys: tuple[bytes, ...]
    nbytes: int
    future: concurrent.futures.Future
    namespace: bytes = b""
    blocks: jax.Array | None = None  # device_to_host: the gathered blocks
    source_locked: tuple[bytes, ...] = ()  # keys locked in the source tier


Hook = Callable[[Link, tuple[bytes, ...]], None]
UnlockHook = Callable[[Link, tuple[bytes, ...], TransferResult], None]


class TransferEngine:
    """Queues, prioritises and runs block transfers; one worker thread per link.

    >>> host = HostTier((2, 2, 1, 4, 8), jnp.float32, capacity_bytes=1 << 16)
    >>> pool = jnp.ones((8, 2, 2, 1, 4, 8), jnp.float32)  # [num_blocks, *block_shape]
    >>> with TransferEngine(host) as engine:
    ...     engine.offload(pool, [3, 5], [b"k" * 16, b"l" * 16], namespace=b"ns").result(5).ok
    ...     engine.fetch([b"l" * 16]).result(5).blocks.shape
    True
    (1, 2, 2, 1, 4, 8)
    """

    def __init__(self, host_tier: HostTier, disk_tier: DiskTier | None = None, *,
                 gather_blocks: Callable | None = None, budgets: Mapping[Link, LinkBudget] = (),
                 clock: Callable[[], float] = time.monotonic, lock_hook: Hook | None = None,
                 unlock_hook: UnlockHook | None = None, paused: bool = False):
        """Args:
        gather_blocks: `(kv_pages, block_ids) -> [n, *block_shape]`, bit-exact; default
          `pallas_kernels.gather_blocks`.
        budgets: byte budget per link; links not named are unlimited.
        clock: seconds, for the budgets (tests inject a fake one).
        paused: start with workers idle until `resume()` (tests queue up work first).
        """
        self.host_tier = host_tier
        self.disk_tier = disk_tier
        self._gather = gather_blocks or pallas_kernels.gather_blocks
        self._buckets = {link: TokenBucket(b.rate_bytes_per_s, b.burst_bytes, clock)
                         for link, b in dict(budgets).items()}
        self._lock_hook, self._unlock_hook = lock_hook, unlock_hook
        self._cond = threading.Condition()
        self._queues: dict[Link, list] = {link: [] for link in Link}
        self._seq = itertools.count()
        self._paused, self._closed = paused, False
        self._running = {link: 0 for link in Link}
        self._counters = {link: {"jobs": 0, "failed": 0, "bytes": 0} for link in Link}
        self._workers = [threading.Thread(target=self._work, args=(link,), daemon=True,
                                          name=f"kvjax-{link.value}") for link in Link]
        for worker in self._workers:
            worker.start()

    # ---- submitting ----------------------------------------------------------------------

    def offload(self, kv_pages: jax.Array, block_ids: Sequence[int], keys: Sequence[bytes], *,
                namespace: bytes, priority: Priority = Priority.SPILL
                ) -> concurrent.futures.Future:
        """Copies pool blocks `block_ids` into the host tier under `keys` (device_to_host).

        The gather is issued here, so the pool may be updated (donated) right after return.
        """
        keys = tuple(keys)
        if len(block_ids) != len(keys):
            raise ValueError(f"{len(block_ids)=} must equal {len(keys)=}")
        job = self._job(Link.DEVICE_TO_HOST, priority, keys, namespace=namespace)
        try:
            job.blocks = self._gather(kv_pages, jnp.asarray(block_ids, jnp.int32))
        except Exception as err:  # noqa: BLE001 - resolve, never raise into the request
            return self._reject(job, f"gather failed: {err!r}")
        return self._submit(job)

    def fetch(self, keys: Sequence[bytes], *, priority: Priority = Priority.DEMAND
              ) -> concurrent.futures.Future:
        """Copies host blocks to the device (host_to_device); all keys or a failure."""
        job = self._job(Link.HOST_TO_DEVICE, priority, tuple(keys))
        if not self.host_tier.lock(job.keys):
            return self._reject(job, "not all keys are in the host tier")
        job.source_locked = job.keys
        return self._submit(job)

    def spill(self, keys: Sequence[bytes], *, priority: Priority = Priority.SPILL
              ) -> concurrent.futures.Future:
        """Writes host blocks to disk (host_to_disk); keys absent from the host are not done."""
        job = self._job(Link.HOST_TO_DISK, priority, tuple(keys))
        if self.disk_tier is None:
            return self._reject(job, "no disk tier")
        job.source_locked = tuple(k for k in job.keys if self.host_tier.lock([k]))
        return self._submit(job)

    def restore(self, keys: Sequence[bytes], *, namespace: bytes,
                priority: Priority = Priority.PREFETCH) -> concurrent.futures.Future:
        """Reads disk blocks of one namespace into the host tier (disk_to_host)."""
        job = self._job(Link.DISK_TO_HOST, priority, tuple(keys), namespace=namespace)
        if self.disk_tier is None:
            return self._reject(job, "no disk tier")
        job.source_locked = tuple(k for k in job.keys if self.disk_tier.lock([k], namespace))
        return self._submit(job)

    # ---- control -------------------------------------------------------------------------

    def pause(self) -> None:
        """Workers finish their current job and take no new one until `resume`."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no job is queued or running; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(self._queues.values()) or any(self._running.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, _POLL_S))
            return True

    def stats(self) -> dict[str, dict[str, int]]:
        """Per link: finished jobs, failed jobs, bytes delivered, jobs queued now."""
        with self._cond:
            return {link.value: {**self._counters[link], "queued": len(self._queues[link])}
                    for link in Link}

    def close(self, timeout: float = 10.0) -> None:
        """Lets running jobs finish, fails queued ones ("engine closed"), joins the workers."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending = [entry[-1] for queue in self._queues.values() for entry in queue]
            for queue in self._queues.values():
                queue.clear()
            self._cond.notify_all()
        for job in pending:
            self._finish(job, self._failure(job, "engine closed"))
        for worker in self._workers:
            worker.join(timeout)
            if worker.is_alive():
                _log.warning("transfer engine: %s did not stop within %.1f s", worker.name,
                             timeout)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- workers -------------------------------------------------------------------------

    def _work(self, link: Link) -> None:
        runners = {Link.DEVICE_TO_HOST: self._run_offload, Link.HOST_TO_DEVICE: self._run_fetch,
                   Link.HOST_TO_DISK: self._run_spill, Link.DISK_TO_HOST: self._run_restore}
        while True:
            jobs = self._next_jobs(link)
            if jobs is None:
                return
            try:
                results = runners[link](jobs)
            except Exception as err:  # noqa: BLE001 - a failed transfer is a result
                _log.warning("transfer engine: %s failed: %r", link.value, err)
                results = [self._failure(job, repr(err)) for job in jobs]
            for job, result in zip(jobs, results):
                self._finish(job, result)
            with self._cond:
                self._running[link] -= 1
                self._cond.notify_all()

    def _next_jobs(self, link: Link) -> list[_Job] | None:
        """Pops the next job (queued spills coalesce up to a segment); None when closed."""
        queue, bucket = self._queues[link], self._buckets.get(link)
        with self._cond:
            while True:
                if self._closed:
                    return None
                wait = None
                if queue and not self._paused:
                    wait = self._charge(bucket, queue[0][-1])
                    if wait == 0.0:
                        jobs = [heapq.heappop(queue)[-1]]
                        if link is Link.HOST_TO_DISK:
                            self._coalesce(queue, bucket, jobs)
                        self._running[link] += 1
                        return jobs
                # Idle: sleep until notified; short of tokens: re-read the clock soon.
                self._cond.wait(None if wait is None else min(wait, _POLL_S))

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
        stored = self.host_tier.put(job.keys, job.blocks, namespace=job.namespace)
        job.blocks = None  # frees the gathered device copy
        self.host_tier.wait_until_ready(stored)
        return [self._success(job, stored)]

    def _run_fetch(self, jobs: list[_Job]) -> list[TransferResult]:
        [job] = jobs
        blocks = self.host_tier.get(job.keys)
        if blocks is None:  # only if the host tier lost a locked block: a broken invariant
            return [self._failure(job, "host tier lost a locked block")]
        blocks.block_until_ready()
        return [dataclasses.replace(self._success(job, job.keys), blocks=blocks)]

    def _run_spill(self, jobs: list[_Job]) -> list[TransferResult]:
        keys = [key for job in jobs for key in job.source_locked]
        namespaces = [self.host_tier.namespace_of(key) for key in keys]
        blocks = self.host_tier.get_host(keys)
        stored = set(self.disk_tier.put(keys, blocks, namespaces)) if keys else set()
        stored |= {k for k, ns in zip(keys, namespaces) if self.disk_tier.contains(k, ns)}
        return [self._success(job, [k for k in job.source_locked if k in stored])
                for job in jobs]

    def _run_restore(self, jobs: list[_Job]) -> list[TransferResult]:
        [job] = jobs
        keys = list(job.source_locked)
        read = self.disk_tier.get(keys, job.namespace)
        hit_keys = [key for key, hit in zip(keys, read.hits) if hit]
        self.host_tier.put(hit_keys, read.blocks[read.hits], namespace=job.namespace)
        self.host_tier.wait_until_ready(hit_keys)
        return [self._success(job, [k for k in hit_keys if self.host_tier.contains(k)])]

    # ---- job lifetime --------------------------------------------------------------------

    def _job(self, link: Link, priority: Priority, keys: tuple[bytes, ...],
             namespace: bytes = b"") -> _Job:
        if not isinstance(priority, Priority):
            raise ValueError(f"{priority=} must be a Priority ({list(Priority)})")
        nbytes = len(keys) * self.host_tier.block_nbytes
        return _Job(link, priority, keys, nbytes, concurrent.futures.Future(), namespace)

    def _submit(self, job: _Job) -> concurrent.futures.Future:
        if self._lock_hook is not None:
            try:
                self._lock_hook(job.link, job.keys)
            except BaseException:  # the caller's hook failed: undo the tier locks, re-raise
                self._finish(job, self._failure(job, "lock hook failed"), hooks=False)
                raise
        with self._cond:
            if not self._closed:
                heapq.heappush(self._queues[job.link], (job.priority, next(self._seq), job))
                self._cond.notify_all()
                return job.future
        self._finish(job, self._failure(job, "engine closed"))
        return job.future

    def _reject(self, job: _Job, error: str) -> concurrent.futures.Future:
        self._finish(job, self._failure(job, error), hooks=False)
        return job.future

    def _finish(self, job: _Job, result: TransferResult, hooks: bool = True) -> None:
        """Releases the job's locks (tier, then the caller's hook), then resolves its future."""
        try:
            if job.link is Link.DISK_TO_HOST and job.source_locked:
                self.disk_tier.unlock(job.source_locked, job.namespace)
            elif job.source_locked:
                self.host_tier.unlock(job.source_locked)
            if hooks and self._unlock_hook is not None:
                self._unlock_hook(job.link, job.keys, result)
        except Exception as err:  # noqa: BLE001 - the transfer itself is done
            _log.error("transfer engine: releasing locks of %s failed: %r", job.link.value, err)
        with self._cond:
            counters = self._counters[job.link]
            counters["jobs"] += 1
            counters["failed"] += not result.ok
            counters["bytes"] += len(result.done_keys) * self.host_tier.block_nbytes
        job.future.set_result(result)

    @staticmethod
    def _success(job: _Job, done_keys) -> TransferResult:
        done = tuple(done_keys)
        return TransferResult(job.link, job.keys, ok=len(done) == len(job.keys), done_keys=done,
                              error=None if len(done) == len(job.keys) else "not all keys done")

    @staticmethod
    def _failure(job: _Job, error: str) -> TransferResult:
        return TransferResult(job.link, job.keys, ok=False, error=error)
