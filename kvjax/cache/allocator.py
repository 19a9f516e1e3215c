"""Device block allocator: block ids, reference counts, the free queue and lazy reclaim.

Every device block is in exactly one of three states:

- referenced: refcount > 0 (held by running sequences); it may also be cached;
- cached-unreferenced: refcount == 0 but its KV is still indexed by the prefix cache, so a
  later request can still hit it (lazy reclaim: a freed block keeps its content);
- empty-free: refcount == 0, in the free queue, content discarded.

``allocate(n)`` hands out empty-free blocks first, in free-queue order (FIFO: the block freed
longest ago goes first), then asks the ``reclaimer`` (the prefix cache) to evict
cached-unreferenced blocks; the reclaimer's victim order is the eviction policy's order. The
allocation is all-or-nothing: when even reclaiming cannot supply ``n`` blocks it returns None
and changes nothing. Running out of blocks is a normal result, never an exception.

All per-block operations are vectorised over a batch of ids: O(1) per block, no Python loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

__all__ = ["BLOCK_DTYPE", "BlockAllocator", "Reclaimer", "fragmentation"]

BLOCK_DTYPE = np.dtype(np.intp)
"""Host-side block id arrays use the platform index type: numpy scatters and gathers with it
run about twice as fast as with int32. Ids are < 2**31, so block tables convert to the
device's int32 losslessly."""

_FREE = -1  # refcount value that marks an empty-free block


class Reclaimer(Protocol):
    """Source of cached-unreferenced blocks that ``allocate`` may evict (the prefix cache)."""

    @property
    def num_reclaimable(self) -> int:
        """Blocks ``reclaim`` can hand back right now (refcount 0, not pinned)."""
        ...

    def reclaim(self, num_blocks: int) -> list[np.ndarray]:
        """Evict exactly ``num_blocks`` blocks in policy order; return their ids (in runs)."""
        ...


class BlockAllocator:
    """Fixed pool of ``num_blocks`` device block ids with reference counts.

    Watermarks are fractions of the pool: ``occupancy`` counts every block that is not
    empty-free (referenced or holding cached KV). Above ``high_watermark`` the owner should
    evict or spill until ``blocks_to_low_watermark()`` reaches 0.
    """

    def __init__(self, num_blocks: int, *, high_watermark: float = 0.9, low_watermark: float = 0.7):
        if num_blocks <= 0 or num_blocks >= 2**31:
            raise ValueError(f"{num_blocks=} must be in [1, 2**31)")
        if not 0.0 <= low_watermark <= high_watermark <= 1.0:
            raise ValueError(
                f"watermarks must satisfy 0 <= {low_watermark=} <= {high_watermark=} <= 1"
            )
        self.num_blocks = num_blocks
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.reclaimer: Reclaimer | None = None
        self._refcount = np.full(num_blocks, _FREE, np.int32)  # [num_blocks]; -1: empty-free
        self._queue = np.arange(num_blocks, dtype=BLOCK_DTYPE)  # ring buffer, FIFO
        self._head = 0
        self._count = num_blocks
        self._scratch = np.zeros(num_blocks, np.int64)  # duplicate detection

    # --- allocation ------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> np.ndarray | None:
        """Return ``num_blocks`` ids with refcount 1, or None (nothing changed) if they do not fit."""
        parts = self.allocate_parts(num_blocks)
        return None if parts is None else np.concatenate([np.zeros(0, BLOCK_DTYPE)] + parts)

    def allocate_parts(self, num_blocks: int) -> list[np.ndarray] | None:
        """``allocate`` without joining the pieces (free-queue run, each reclaimed run): a
        caller that concatenates anyway (a block table) saves one pass over the ids."""
        if num_blocks < 0:
            raise ValueError(f"{num_blocks=} must be >= 0")
        from_queue = min(num_blocks, self._count)
        from_cache = num_blocks - from_queue
        if from_cache and (self.reclaimer is None or self.reclaimer.num_reclaimable < from_cache):
            return None
        parts = [self._pop(from_queue)] if from_queue else []
        if from_cache:
            reclaimed = self.reclaimer.reclaim(from_cache)
            if sum(len(part) for part in reclaimed) != from_cache:
                raise RuntimeError(f"reclaimer returned {reclaimed!r}; expected {from_cache} blocks")
            parts += reclaimed
        for part in parts:
            self._refcount[part] = 1
        return parts

    def free(self, blocks: Sequence[int] | np.ndarray | int, *, check: bool = True) -> None:
        """Discard the content of unreferenced blocks and append them to the free queue.

        Raises ValueError (nothing changed) if a block is out of range, repeated, still
        referenced or already free. ``check=False`` skips that validation for ids the caller
        got from this allocator and tracks itself (the prefix cache's hot path).
        """
        ids = self._ids(blocks) if check else blocks
        if check:
            self._require(self._refcount[ids] != _FREE, ids, "is already free")
            self._require(self._refcount[ids] == 0, ids, "is still referenced (refcount > 0)")
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
            self._require(self._refcount[ids] != _FREE, ids, "is free; allocate it before referencing it")
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
        self._require(self._refcount[ids] > 0, ids, "has refcount 0 (nothing to release)")
        self._refcount[ids] -= 1
        return ids[self._refcount[ids] == 0]

    # --- figures ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Empty-free blocks (in the free queue)."""
        return self._count

    @property
    def num_referenced(self) -> int:
        """Blocks with refcount > 0."""
        return int(np.count_nonzero(self._refcount > 0))

    @property
    def occupancy(self) -> float:
        """Fraction of the pool that is not empty-free (referenced or cached)."""
        return (self.num_blocks - self._count) / self.num_blocks

    def above_high_watermark(self) -> bool:
        return self.occupancy > self.high_watermark

    def blocks_to_low_watermark(self) -> int:
        """Blocks to evict or spill to bring occupancy down to the low watermark (0 if below)."""
        target = math.floor(self.low_watermark * self.num_blocks)
        return max(0, self.num_blocks - self._count - target)

    def refcount(self, block: int) -> int:
        """References to ``block`` (0 for a free block)."""
        return max(0, int(self._refcount[self._ids(block)[0]]))

    def refcounts(self) -> np.ndarray:
        """Copy of all refcounts, ``[num_blocks]`` (0 for free blocks)."""
        return np.maximum(self._refcount, 0)

    def free_queue(self) -> np.ndarray:
        """Copy of the free queue in allocation order (next block handed out first)."""
        return self._peek(self._count)

    def is_free(self, block: int) -> bool:
        """Whether ``block`` is empty-free (in the free queue)."""
        return bool(self._refcount[self._ids(block)[0]] == _FREE)

    def check_invariants(self) -> None:
        """Raise RuntimeError unless the free queue, the free flags and refcounts agree."""
        queue = self._peek(self._count)
        if len(np.unique(queue)) != len(queue):
            raise RuntimeError("free queue holds a block twice")
        flags = np.zeros(self.num_blocks, bool)
        flags[queue] = True
        if not np.array_equal(flags, self._refcount == _FREE):
            raise RuntimeError("free marks disagree with the free queue")
        if (self._refcount < _FREE).any():
            raise RuntimeError(f"negative refcount on blocks {np.flatnonzero(self._refcount < _FREE)}")

    # --- helpers ---------------------------------------------------------------------------

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
        order = np.arange(len(ids))
        self._scratch[ids] = order
        repeated = self._scratch[ids] != order
        if repeated.any():
            raise ValueError(f"block id {ids[repeated][0]} appears more than once in one call")
        return ids

    @staticmethod
    def _require(ok: np.ndarray, ids: np.ndarray, problem: str) -> None:
        if not ok.all():
            raise ValueError(f"block {ids[~ok][0]} {problem}")

    def _peek(self, count: int) -> np.ndarray:
        end = self._head + count
        if end <= self.num_blocks:
            return self._queue[self._head : end].copy()
        return np.concatenate((self._queue[self._head :], self._queue[: end - self.num_blocks]))

    def _pop(self, count: int) -> np.ndarray:
        blocks = self._peek(count)
        self._head = (self._head + count) % self.num_blocks
        self._count -= count
        return blocks

    def _push(self, blocks: np.ndarray) -> None:
        count = len(blocks)
        tail = (self._head + self._count) % self.num_blocks
        first = min(count, self.num_blocks - tail)
        self._queue[tail : tail + first] = blocks[:first]
        self._queue[: count - first] = blocks[first:]
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
