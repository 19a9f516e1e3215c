"""Doubles and a content model for the KVCache tests.

* ``ManualTransfer``: the TransferEngine API, but every transfer waits until the test
  completes (or fails) it, so a test decides what is in flight at each step. It locks and
  unlocks the tiers as the real engine does and copies with the real tiers.
* ``MemoryDisk``: the DiskTier API in memory, counted in blocks, evicting unlocked blocks
  (LRU) on its own when a write does not fit, as the real tier drops whole segments; a block
  can be corrupted so its next read is a miss and a metric.
* ``page_content(namespace, tokens, block_shape, dtype)``: the KV a model would write for the
  last page of ``tokens``: a deterministic function of the namespace and every token up to
  the page's end, so a block served for the wrong prefix or tenant shows.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import zlib

import jax.numpy as jnp
import numpy as np

import pallas_kernels
from kvjax.tiers.disk_tier import DiskRead
from kvjax.tiers.transfer import Link, TransferResult


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
    keys: tuple
    run: object  # () -> TransferResult
    release: object  # () -> None: undo the source locks
    future: concurrent.futures.Future


class ManualTransfer:
    """A transfer engine whose transfers run only when the test says (see module docstring)."""

    def __init__(self, host, disk=None, gather_blocks=pallas_kernels.gather_blocks):
        self.host, self.disk = host, disk
        self.gather_blocks = gather_blocks  # the cache's: it encodes blocks for the host tier
        self.pending: list[PendingTransfer] = []
        self.closed = False

    def offload(self, kv_pages, block_ids, keys, *, namespace, priority):
        blocks = self.gather_blocks(kv_pages, jnp.asarray(block_ids, jnp.int32))
        keys = tuple(keys)
        run = lambda: self._done(Link.DEVICE_TO_HOST, keys, self.host.put(keys, blocks, namespace=namespace))
        return self._queue(Link.DEVICE_TO_HOST, keys, run, lambda: None)

    def fetch(self, keys, *, priority):
        keys = tuple(keys)
        if not self.host.lock(keys):
            return _resolved(TransferResult(Link.HOST_TO_DEVICE, keys, ok=False, error="absent"))
        run = lambda: TransferResult(Link.HOST_TO_DEVICE, keys, ok=True, done_keys=keys,
                                     blocks=self.host.get(keys))  # fmt: skip
        return self._queue(Link.HOST_TO_DEVICE, keys, run, lambda: self.host.unlock(keys))

    def spill(self, keys, *, priority):
        keys = tuple(keys)
        locked = tuple(k for k in keys if self.host.lock([k]))
        run = lambda: self._done(Link.HOST_TO_DISK, keys, self._spill(locked))
        return self._queue(Link.HOST_TO_DISK, keys, run, lambda: self.host.unlock(locked))

    def restore(self, keys, *, namespace, priority):
        keys = tuple(keys)
        locked = tuple(k for k in keys if self.disk.lock([k], namespace))
        run = lambda: self._done(Link.DISK_TO_HOST, keys, self._restore(locked, namespace))
        return self._queue(Link.DISK_TO_HOST, keys, run, lambda: self.disk.unlock(locked, namespace))

    def complete(self, index: int, ok: bool = True) -> PendingTransfer:
        """Run (or, with ``ok=False``, fail) pending transfer ``index``; resolve its future."""
        job = self.pending.pop(index)
        try:
            result = job.run() if ok else TransferResult(job.link, job.keys, ok=False, error="injected")
        finally:
            job.release()
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

    def _queue(self, link, keys, run, release):
        future = concurrent.futures.Future()
        self.pending.append(PendingTransfer(link, keys, run, release, future))
        return future

    @staticmethod
    def _done(link, keys, done_keys) -> TransferResult:
        done = tuple(done_keys)
        return TransferResult(link, keys, ok=len(done) == len(keys), done_keys=done)

    def _spill(self, keys):
        if not keys:
            return []
        namespaces = [self.host.namespace_of(k) for k in keys]
        stored = set(self.disk.put(keys, self.host.get_host(keys), namespaces))
        return [k for k, ns in zip(keys, namespaces) if k in stored or self.disk.contains(k, ns)]

    def _restore(self, keys, namespace):
        read = self.disk.get(keys, namespace)
        hits = [k for k, hit in zip(keys, read.hits) if hit]
        self.host.put(hits, read.blocks[read.hits], namespace=namespace)
        return [k for k in hits if self.host.contains(k)]


@dataclasses.dataclass
class MemoryDiskStats:
    write_errors: int = 0
    corrupt_blocks: int = 0
    read_errors: int = 0
    evicted_blocks: int = 0


class MemoryDisk:
    """The DiskTier API in memory (see the module docstring); capacity in blocks."""

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

    @property
    def bytes_used(self) -> int:
        return len(self._blocks) * self.block_nbytes

    def __len__(self) -> int:
        return len(self._blocks)

    def contains(self, key, namespace) -> bool:
        return (namespace, key) in self._blocks

    def stats(self) -> MemoryDiskStats:
        return dataclasses.replace(self._stats)

    def put(self, keys, blocks, namespaces):
        if isinstance(namespaces, bytes):
            namespaces = [namespaces] * len(keys)
        stored = []
        for key, block, ns in zip(keys, np.asarray(blocks), namespaces):
            if (ns, key) in self._blocks:
                continue
            if len(self._blocks) >= self.capacity_blocks and not self._evict_one():
                break
            self._blocks[(ns, key)] = np.array(block)
            stored.append(key)
        return stored

    def get(self, keys, namespace) -> DiskRead:
        out = np.zeros((len(keys), *self.block_shape), self.dtype)
        hits = np.zeros(len(keys), bool)
        for i, key in enumerate(keys):
            if (namespace, key) in self._corrupt:
                self._corrupt.discard((namespace, key))
                self._blocks.pop((namespace, key), None)
                self._stats.corrupt_blocks += 1
            elif (namespace, key) in self._blocks:
                out[i] = self._blocks[(namespace, key)]
                self._blocks.move_to_end((namespace, key))
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
        return sum(self._blocks.pop((namespace, k), None) is not None for k in keys)

    def check_invariants(self) -> None:
        if len(self._blocks) > self.capacity_blocks or min(self._locks.values(), default=1) < 1:
            raise RuntimeError("memory disk over capacity or with a negative lock")

    def _evict_one(self) -> bool:
        for name in self._blocks:
            if not self._locks[name]:
                del self._blocks[name]
                self._stats.evicted_blocks += 1
                return True
        return False


def _resolved(result) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(result)
    return future
