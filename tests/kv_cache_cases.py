"""Doubles and a content model for the KVCache tests.

* ``ManualTransfer``: the TransferEngine API, but every transfer waits until the test
  completes (or fails) it, so a test decides what is in flight at each step. It pins disk
  segments as the real engine does and copies with a real (synchronous) engine.
* ``MemoryDisk``: the DiskTier API in memory, counted in blocks, evicting unlocked blocks on
  its own when a write does not fit, in the real tier's order (``VictimOrder``, each block a
  segment: blocks nothing depends on first, then least recently used); a block can be
  corrupted so its next read is a miss and a metric.
* ``page_content(namespace, tokens, block_shape, dtype)``: the KV a model would write for the
  last page of ``tokens``: a deterministic function of the namespace and every token up to
  the page's end, so a block served for the wrong prefix or tenant shows.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import zlib

import numpy as np

import pallas_kernels
from kvjax.cache.block_events import EventLog
from kvjax.tiers.disk_tier import DiskRead
from kvjax.tiers.disk_victims import VictimOrder
from kvjax.tiers.transfer import Link, TransferEngine, TransferResult


def serve_from_each_tier(cache, tokens, read, *, timeout: float = 30.0) -> dict:
    """Serves the cached prefix of ``tokens`` (two full pages) from the device, then from host
    only, then from disk only, checking where the match finds it each time; returns
    ``{tier: read(cache, tokens)}``. The cache must have host and disk tiers."""
    from kvjax.cache.trie_node import Tier

    served = {"device": read(cache, tokens)}
    cache.evict(8)  # the pages get host copies first (write-back), or have them already
    assert cache.match(tokens).tiers.tolist() == [Tier.HOST] * 2
    served["host"] = read(cache, tokens)
    cache.evict(8)
    assert cache.flush(timeout) and cache.evict_host(8) == 2
    assert cache.match(tokens).tiers.tolist() == [Tier.DISK] * 2
    served["disk"] = read(cache, tokens)
    cache.check_invariants()
    return served


def page_content(namespace: str, tokens, block_shape, dtype=np.float32) -> np.ndarray:
    seed = zlib.crc32(namespace.encode() + b"|" + np.asarray(tokens, np.int32).tobytes())
    values = (seed + np.arange(int(np.prod(block_shape)))) % 251 - 125  # exact in every dtype
    return values.astype(dtype).reshape(block_shape)


@dataclasses.dataclass
class PendingTransfer:
    link: Link
    run: object  # () -> TransferResult
    release: object  # () -> None: undo what the submit pinned
    future: concurrent.futures.Future
    priority: object = None  # the Priority it was submitted at, or raised to by ``promote``


class ManualTransfer:
    """A transfer engine whose transfers finish only when the test says (see module docstring).

    Each transfer runs through a real, synchronous TransferEngine when the test completes it;
    an offload's gather (and its copy) happens at submit, as the real engine gathers then.
    """

    def __init__(self, host, disk=None, gather_blocks=pallas_kernels.gather_blocks, buckets=(), synchronous=False,
                 direct_cpu_reads=False):
        self.host, self.disk = host, disk
        self.engine = TransferEngine(host, disk, gather_blocks=gather_blocks, buckets=buckets, synchronous=True)
        self.buckets = self.engine.buckets
        self.pending: list[PendingTransfer] = []
        self.closed = False

    def offload(self, kv_pages, block_ids, slots, *, priority, after=()):
        if not after:
            result = self.engine.offload(kv_pages, block_ids, slots, priority=priority).result()
            return self._queue(Link.DEVICE_TO_HOST, lambda: result, lambda: None, priority)
        # Gathered now; the slots are written at completion if the reads ``after`` finished
        # by then (the test completes those fetches). Completed before them, the copy fails
        # and never writes the slots (as the real engine's copy writes only once they are done).
        gate = concurrent.futures.Future()
        future = self.engine.offload(kv_pages, block_ids, slots, priority=priority, after=[gate])

        def run():
            if not all(read.done() for read in after):
                return TransferResult(Link.DEVICE_TO_HOST, 0, ok=False, error="completed before the reads of its slots")
            gate.set_result(None)
            return future.result()

        return self._queue(Link.DEVICE_TO_HOST, run, lambda: None, priority)

    def fetch(self, slots, *, priority):
        return self._queue(Link.HOST_TO_DEVICE, lambda: self.engine.fetch(slots, priority=priority).result(),
                           lambda: None, priority)  # fmt: skip

    def spill(self, keys, namespaces, slots, parents=None, *, priority, now=False):
        if now:  # the caller needs the slots at once: not up to the test
            return self.engine.spill(keys, namespaces, slots, parents, priority=priority)
        run = lambda: self.engine.spill(keys, namespaces, slots, parents, priority=priority).result()
        return self._queue(Link.HOST_TO_DISK, run, lambda: None, priority)

    def restore(self, keys, namespace, slots, *, priority):
        if not self.disk.lock(keys, namespace):  # pinned from submit to completion, as the real engine does
            return _resolved(TransferResult(Link.DISK_TO_HOST, len(keys), ok=False, error="not on disk"))
        run = lambda: self.engine.restore(keys, namespace, slots, priority=priority).result()
        return self._queue(Link.DISK_TO_HOST, run, lambda: self.disk.unlock(keys, namespace), priority)

    def promote(self, futures, priority) -> int:
        """Raise pending transfers of ``futures`` to ``priority`` (as the real engine raises queued jobs)."""
        ids = {id(future) for future in futures}
        raised = [job for job in self.pending if id(job.future) in ids and priority < job.priority]
        for job in raised:
            job.priority = priority
        return len(raised)

    def complete(self, index: int, ok: bool = True) -> PendingTransfer:
        """Run (or, with ``ok=False``, fail) pending transfer ``index``; resolve its future."""
        job = self.pending.pop(index)
        job.release()
        result = job.run() if ok else TransferResult(job.link, 0, ok=False, error="injected")
        job.future.set_result(result)
        return job

    def complete_all(self) -> None:
        while self.pending:
            self.complete(0)

    def close(self, timeout: float = 0.0) -> None:
        self.closed = True
        while self.pending:
            self.complete(0, ok=False)

    # --- helpers ---------------------------------------------------------------------------

    def _queue(self, link, run, release, priority):
        future = concurrent.futures.Future()
        self.pending.append(PendingTransfer(link, run, release, future, priority))
        return future


@dataclasses.dataclass
class MemoryDiskStats:
    write_errors: int = 0
    corrupt_blocks: int = 0
    read_errors: int = 0
    evicted_blocks: int = 0


class MemoryDisk:
    """The DiskTier API in memory (see the module docstring); capacity in blocks. It reports
    the blocks it stores and drops on ``events``, as the real tier does."""

    def __init__(self, block_shape, dtype, capacity_blocks: int):
        self.block_shape = tuple(block_shape)
        self.dtype = np.dtype(dtype)
        self.block_nbytes = int(np.prod(block_shape)) * self.dtype.itemsize
        self.blocks_per_segment = 4
        self.capacity_bytes = capacity_blocks * self.block_nbytes
        self.capacity_blocks = capacity_blocks
        self._blocks: collections.OrderedDict = collections.OrderedDict()  # (ns, key) -> array
        self._locks: collections.Counter = collections.Counter()
        self._corrupt: set = set()
        self._stats = MemoryDiskStats()
        self._order = VictimOrder()  # a block is a segment here
        self._dependents: collections.Counter = collections.Counter()
        self.refused_blocks = 0  # blocks a put did not store: no room, every other block locked
        self.events = EventLog()
        self.index_lock = threading.RLock()

    @property
    def bytes_used(self) -> int:
        return len(self._blocks) * self.block_nbytes

    def __len__(self) -> int:
        return len(self._blocks)

    def contains(self, key, namespace) -> bool:
        return (namespace, key) in self._blocks

    def take_dropped(self):
        return None  # no record kept: the caller asks about every block it holds

    def held_blocks(self):
        return list(self._blocks)

    def stats(self) -> MemoryDiskStats:
        return dataclasses.replace(self._stats)

    def put(self, keys, blocks, namespaces, parents=None):
        if isinstance(namespaces, bytes):
            namespaces = [namespaces] * len(keys)
        parents = [None] * len(keys) if parents is None else list(parents)
        held = [(ns, parent) for ns, parent in zip(namespaces, parents) if parent is not None]
        for block in held:  # the room the put makes never evicts its blocks' parents (as DiskTier's write)
            self._order.hold(block)
        # a put is one segment: the room it makes never evicts its own blocks, new or held already
        stored, written = [], {(ns, key) for key, ns in zip(keys, namespaces) if (ns, key) in self._blocks}
        for key, block, ns, parent in zip(keys, np.asarray(blocks), namespaces, parents):
            if (ns, key) in self._blocks:
                continue
            if len(self._blocks) >= self.capacity_blocks and not self._evict_one(keep=written):
                self.refused_blocks += sum((n, k) not in self._blocks for k, n in zip(keys, namespaces))
                break
            self._blocks[(ns, key)] = np.array(block)
            self._order.add_segment((ns, key))
            self._order.add_block((ns, key), (ns, key), None if parent is None else (ns, parent))
            self.events.record(ns, key, None, "disk", "stored")
            stored.append(key)
            written.add((ns, key))
        for block in held:
            self._order.release(block)
        return stored

    def get(self, keys, namespace) -> DiskRead:
        out = np.zeros((len(keys), *self.block_shape), self.dtype)
        hits = np.zeros(len(keys), bool)
        for i, key in enumerate(keys):
            if (namespace, key) in self._corrupt:
                self._corrupt.discard((namespace, key))
                self._remove((namespace, key))
                self._stats.corrupt_blocks += 1
            elif (namespace, key) in self._blocks:
                out[i] = self._blocks[(namespace, key)]
                self._order.touch((namespace, key))
                hits[i] = True
        return DiskRead(out, hits)

    def corrupt(self, key, namespace) -> None:
        self._corrupt.add((namespace, key))

    def lock(self, keys, namespace) -> bool:
        if not all((namespace, k) in self._blocks for k in keys):
            return False
        self._locks.update((namespace, k) for k in keys)
        return True

    def unlock(self, keys, namespace) -> None:
        for key in keys:
            self._locks[(namespace, key)] -= 1
            if self._locks[(namespace, key)] == 0:
                del self._locks[(namespace, key)]

    def discard(self, keys, namespace) -> int:
        return sum(self._remove((namespace, key)) for key in keys)

    def add_dependents(self, parents, namespace) -> None:
        for parent in parents:
            self._dependents[(namespace, parent)] += 1
            self._order.hold((namespace, parent))

    def remove_dependents(self, parents, namespace) -> None:
        for parent in parents:
            if not self._dependents[(namespace, parent)]:
                raise ValueError(f"key={parent.hex()} has no dependents to remove")
            self._dependents[(namespace, parent)] -= 1
            if not self._dependents[(namespace, parent)]:
                del self._dependents[(namespace, parent)]
            self._order.release((namespace, parent))

    def dependents(self) -> dict:
        return dict(self._dependents)

    def check_invariants(self) -> None:
        if len(self._blocks) > self.capacity_blocks or min(self._locks.values(), default=1) < 1:
            raise RuntimeError("memory disk over capacity or with a negative lock")
        self._order.check({block: block for block in self._blocks})

    def _remove(self, name) -> bool:
        if self._blocks.pop(name, None) is None:
            return False
        self._order.remove_block(name)
        self._order.remove_segment(name)
        self.events.record(*name, None, "disk", "removed")
        return True

    def _evict_one(self, keep=frozenset()) -> bool:
        name = self._order.victim(lambda name: not self._locks[name] and name not in keep)
        if name is None:
            return False
        self._remove(name)
        self._stats.evicted_blocks += 1
        return True


def _resolved(result) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(result)
    return future
