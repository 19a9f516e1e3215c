"""Device block allocator: block ids, reference counts, the free queue and lazy reclaim.

Every device block is in exactly one of three states:

- referenced: refcount > 0 (held by running sequences); it may also be cached;
- cached-unreferenced: refcount == 0 but its KV is still indexed by the prefix trie, so a
  later request can still hit it (lazy reclaim: a freed block keeps its content);
- empty-free: refcount == 0, in the free queue, content discarded.

``allocate(n)`` hands out empty-free blocks in free-queue order (FIFO: the block freed
longest ago goes first, and blocks never handed out go before any freed one, lowest id
first). It is all-or-nothing: when fewer than ``n`` blocks are free it returns None and
changes nothing. Running out of blocks is a normal result, never an exception. The
allocator never evicts: the device index evicts cached-unreferenced blocks by its policy
and ``free``s them into the queue before it allocates (see ``kvjax.cache.device_index``),
so evicted blocks are handed out in eviction order, after the ones already free.

Memory grows with the blocks ever handed out, not with ``num_blocks``: ids never handed out
are one counter, and the per-block arrays grow geometrically as ids come into use, so a
replay may ask for a pool of 2**31 - 1 blocks and pay only for what its trace touches.

All per-block operations are vectorised over a batch of ids: O(1) per block, no Python loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvjax.config.checks import int_arg

__all__ = ["BLOCK_DTYPE", "BlockAllocator", "fragmentation"]

BLOCK_DTYPE = np.dtype(np.intp)
"""Host-side block id arrays use the platform index type: numpy scatters and gathers with it
run about twice as fast as with int32. Ids are < 2**31, so block tables convert to the
device's int32 losslessly."""

_FREE = -1  # refcount value that marks an empty-free block
_INITIAL_CAPACITY = 1024  # ids covered by the per-block arrays before they first grow


class BlockAllocator:
    """Fixed pool of ``num_blocks`` device block ids with reference counts.

    Watermarks are fractions of the pool: ``occupancy`` counts every block that is not
    empty-free (referenced or holding cached KV). Above ``high_watermark`` the owner should
    evict or spill until ``blocks_to_low_watermark()`` reaches 0.
    """

    def __init__(self, num_blocks: int, *, high_watermark: float = 0.9, low_watermark: float = 0.7):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or not 1 <= num_blocks < 2**31:
            raise ValueError(f"{num_blocks=} must be in [1, 2**31)")
        if not 0.0 <= low_watermark <= high_watermark <= 1.0:
            raise ValueError(f"watermarks must satisfy 0 <= {low_watermark=} <= {high_watermark=} <= 1")
        self.num_blocks = int(num_blocks)
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self._fresh = 0  # ids >= _fresh were never handed out: free, ahead of the ring
        capacity = min(self.num_blocks, _INITIAL_CAPACITY)
        self._refcount = np.full(capacity, _FREE, np.int32)  # [capacity]; -1: empty-free
        self._ring = np.zeros(capacity, BLOCK_DTYPE)  # freed ids, FIFO from _head
        self._head = 0
        self._count = 0  # ids in the ring
        self._scratch = np.zeros(capacity, np.int64)  # duplicate detection

    # --- allocation ------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> np.ndarray | None:
        """Return ``num_blocks`` ids with refcount 1, or None (nothing changed) if fewer are free."""
        num_blocks = int_arg(num_blocks, "num_blocks")
        if num_blocks > self.num_free:
            return None
        from_fresh = min(num_blocks, self.num_blocks - self._fresh)
        if from_fresh == 0:  # the steady state: every id was handed out once, reuse the queue
            blocks = self._pop(num_blocks)
        else:
            blocks = np.arange(self._fresh, self._fresh + from_fresh, dtype=BLOCK_DTYPE)
            self._grow(self._fresh + from_fresh)
            self._fresh += from_fresh
            if num_blocks > from_fresh:
                blocks = np.concatenate((blocks, self._pop(num_blocks - from_fresh)))
        self._refcount[blocks] = 1
        return blocks

    def free(self, blocks: Sequence[int] | np.ndarray | int, *, check: bool = True) -> None:
        """Discard the content of unreferenced blocks and append them to the free queue.

        Raises ValueError (nothing changed) if a block is out of range, repeated, still
        referenced or already free. ``check=False`` skips that validation for ids the caller
        got from this allocator and tracks itself (the device index's hot path).
        """
        ids = self._ids(blocks) if check else blocks
        if check:
            self._require(self._refcounts_of(ids) != _FREE, ids, "is already free")
            self._require(self._refcounts_of(ids) == 0, ids, "is still referenced (refcount > 0)")
        self._refcount[ids] = _FREE
        self._push(ids)

    def free_held(self, blocks: np.ndarray) -> None:
        """Drop the only reference to each of ``blocks`` and free them in one step (trusted ids).

        For a sequence's private blocks (refcount exactly 1): one scatter instead of a
        decref followed by a free.
        """
        self._refcount[blocks] = _FREE
        self._push(blocks)

    def incref(self, blocks: Sequence[int] | np.ndarray | int, *, check: bool = True) -> None:
        """Add one reference to each block (a hit on a cached or shared block)."""
        ids = self._ids(blocks) if check else blocks
        if check:
            self._require(self._refcounts_of(ids) != _FREE, ids, "is free; allocate it before referencing it")
        self._refcount[ids] += 1

    def decref(self, blocks: Sequence[int] | np.ndarray | int, *, check: bool = True) -> np.ndarray | None:
        """Drop one reference from each block; return the ids whose refcount reached 0.

        Blocks reaching 0 are NOT freed: cached ones stay hittable until reclaimed; the caller
        frees the ones it does not cache. With ``check=False`` (trusted ids) returns None.
        """
        ids = self._ids(blocks) if check else blocks
        if not check:
            self._refcount[ids] -= 1
            return None
        self._require(self._refcounts_of(ids) > 0, ids, "has refcount 0 (nothing to release)")
        self._refcount[ids] -= 1
        return ids[self._refcount[ids] == 0]

    # --- figures ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Empty-free blocks (in the free queue)."""
        return self.num_blocks - self._fresh + self._count

    @property
    def num_used_ids(self) -> int:
        """Ids ever handed out: blocks ``>=`` this one have never held KV (all free)."""
        return self._fresh

    @property
    def num_referenced(self) -> int:
        """Blocks with refcount > 0."""
        return int(np.count_nonzero(self._refcount[: self._fresh] > 0))

    @property
    def occupancy(self) -> float:
        """Fraction of the pool that is not empty-free (referenced or cached)."""
        return (self.num_blocks - self.num_free) / self.num_blocks

    def above_high_watermark(self) -> bool:
        return self.occupancy > self.high_watermark

    def blocks_to_low_watermark(self) -> int:
        """Blocks to evict or spill to bring occupancy down to the low watermark (0 if below)."""
        target = math.floor(self.low_watermark * self.num_blocks + 1e-9)  # 0.29 * 100 is 28.999...96
        return max(0, self.num_blocks - self.num_free - target)

    def refcount(self, block: int) -> int:
        """References to ``block`` (0 for a free block)."""
        return max(0, int(self._refcounts_of(self._ids(block))[0]))

    def refcounts(self, num_ids: int | None = None) -> np.ndarray:
        """Copy of the refcounts of ids ``0 .. num_ids - 1`` (default: every block), 0 for free
        blocks. Ids from ``num_used_ids`` on were never handed out: their refcount is 0, so
        ``refcounts(num_used_ids)`` says everything without a ``[num_blocks]`` array."""
        num_ids = self.num_blocks if num_ids is None else num_ids
        counts = np.zeros(num_ids, np.int32)
        used = min(num_ids, self._fresh)
        counts[:used] = np.maximum(self._refcount[:used], 0)
        return counts

    def free_queue(self) -> np.ndarray:
        """Copy of the free queue in allocation order (next block handed out first)."""
        return np.concatenate((np.arange(self._fresh, self.num_blocks, dtype=BLOCK_DTYPE), self._peek(self._count)))

    def free_mask(self) -> np.ndarray:
        """bool ``[num_used_ids]``: which of the ids ever handed out are empty-free now."""
        return self._refcount[: self._fresh] == _FREE

    def is_free(self, block: int) -> bool:
        """Whether ``block`` is empty-free (in the free queue)."""
        return bool(self._refcounts_of(self._ids(block))[0] == _FREE)

    def check_invariants(self) -> None:
        """Raise RuntimeError unless the free queue, the free marks and refcounts agree."""
        queue = self._peek(self._count)
        if len(np.unique(queue)) != len(queue):
            raise RuntimeError("free queue holds a block twice")
        if len(queue) and queue.max() >= self._fresh:
            raise RuntimeError(f"free queue holds block {int(queue.max())}, never handed out (< {self._fresh})")
        flags = np.zeros(self._fresh, bool)
        flags[queue] = True
        if not np.array_equal(flags, self.free_mask()):
            raise RuntimeError("free marks disagree with the free queue")
        if (self._refcount[: self._fresh] < _FREE).any():
            bad = np.flatnonzero(self._refcount[: self._fresh] < _FREE)
            raise RuntimeError(f"negative refcount on blocks {bad}")
        if (self._refcount[self._fresh :] != _FREE).any():
            raise RuntimeError("a block never handed out has a refcount")

    # --- helpers ---------------------------------------------------------------------------

    def _refcounts_of(self, ids: np.ndarray) -> np.ndarray:
        """Refcounts of valid ``ids`` (ids never handed out read as free)."""
        counts = np.full(len(ids), _FREE, np.int32)
        used = ids < self._fresh
        counts[used] = self._refcount[ids[used]]
        return counts

    def _ids(self, blocks: Sequence[int] | np.ndarray | int) -> np.ndarray:
        ids = np.atleast_1d(np.asarray(blocks))
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"block ids must be a 1-D sequence of integers, got {blocks!r}")
        if ids.size == 0:
            return ids.astype(BLOCK_DTYPE)
        if ids.min() < 0 or ids.max() >= self.num_blocks:
            bad = ids[(ids < 0) | (ids >= self.num_blocks)][0]
            raise ValueError(f"block id {bad} is out of range; expected 0 <= id < {self.num_blocks}")
        ids = ids.astype(BLOCK_DTYPE)
        if ids.max() < len(self._scratch):  # the common case: one scatter, one gather
            order = np.arange(len(ids))
            self._scratch[ids] = order
            repeated = ids[self._scratch[ids] != order]
        else:  # an id the arrays do not cover yet (never handed out): sort instead
            unique, counts = np.unique(ids, return_counts=True)
            repeated = unique[counts > 1]
        if repeated.size:
            raise ValueError(f"block id {repeated[0]} appears more than once in one call")
        return ids

    @staticmethod
    def _require(ok: np.ndarray, ids: np.ndarray, problem: str) -> None:
        if not ok.all():
            raise ValueError(f"block {ids[~ok][0]} {problem}")

    def _grow(self, needed: int) -> None:
        """Make the per-block arrays cover ids ``< needed`` (geometric growth, at most num_blocks)."""
        capacity = len(self._refcount)
        if needed <= capacity:
            return
        new = min(self.num_blocks, max(needed, 2 * capacity))
        self._refcount = np.concatenate((self._refcount, np.full(new - capacity, _FREE, np.int32)))
        self._scratch = np.zeros(new, np.int64)
        ring = np.zeros(new, BLOCK_DTYPE)
        ring[: self._count] = self._peek(self._count)
        self._ring, self._head = ring, 0

    def _peek(self, count: int) -> np.ndarray:
        size = len(self._ring)
        end = self._head + count
        if end <= size:
            return self._ring[self._head : end].copy()
        return np.concatenate((self._ring[self._head :], self._ring[: end - size]))

    def _pop(self, count: int) -> np.ndarray:
        blocks = self._peek(count)
        self._head = (self._head + count) % len(self._ring)
        self._count -= count
        return blocks

    def _push(self, blocks: np.ndarray) -> None:
        count, size = len(blocks), len(self._ring)
        tail = (self._head + self._count) % size
        first = min(count, size - tail)
        self._ring[tail : tail + first] = blocks[:first]
        self._ring[: count - first] = blocks[first:]
        self._count += count


def fragmentation(
    seq_lens: Sequence[int] | np.ndarray, seq_num_blocks: Sequence[int] | np.ndarray, page_size: int
) -> float:
    """Fraction of allocated token slots that hold no token, over the given sequences.

    A sequence with ``seq_lens[i]`` tokens in ``seq_num_blocks[i]`` blocks leaves
    ``seq_num_blocks[i] * page_size - seq_lens[i]`` slots unused (its partly filled last
    page, plus blocks reserved ahead of decode). Returns 0.0 when nothing is allocated.
    """
    lens = np.asarray(seq_lens, np.int64)
    slots = np.asarray(seq_num_blocks, np.int64) * page_size
    if lens.shape != slots.shape:
        raise ValueError(f"seq_lens {lens.shape} and seq_num_blocks {slots.shape} must match")
    if (lens > slots).any() or (lens < 0).any():
        bad = int(np.flatnonzero((lens > slots) | (lens < 0))[0])
        raise ValueError(f"sequence {bad} has {lens[bad]} tokens for {slots[bad]} token slots")
    total = int(slots.sum())
    return 0.0 if total == 0 else float(total - lens.sum()) / total

